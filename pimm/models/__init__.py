"""Models, plugged in through the ``MODELS`` registry."""

from pimm.engines.registries import MODELS

from . import (grpo, instance, instance_affinity, lora, losses, panda_detector, pmt_grid, polarmae, ptv3,  # noqa: F401
               ring_cnn, ring_gan, segmentor_v2, segmentors, sonata, sparse_unet, upstream_hints, wrappers)  # (register)

__all__ = ["MODELS"]
