"""Models, plugged in through the ``MODELS`` registry."""

from pimm.engines.registries import MODELS

from . import (dino_segmentor, grpo, instance, instance_affinity, litept, lora, losses, mink_unet,  # noqa: F401
               panda_detector, pmt_grid, point_group, polarmae, ptv1, ptv2, ptv3, ring_cnn, ring_gan, segmentor_v2,
               segmentors, sonata, sparse_unet, spconv_unet, spconv_unet_pdnorm, upstream_hints, volt,
               wrappers)  # (register)

__all__ = ["MODELS"]
