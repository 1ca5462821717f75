"""Models, plugged in through the ``MODELS`` registry."""

from pimm.engines.registries import MODELS

from . import (grpo, instance, instance_affinity, losses, pmt_grid, ptv3, ring_cnn, ring_gan,  # noqa: F401
               segmentor_v2, segmentors, sonata, sparse_unet)  # (register)

__all__ = ["MODELS"]
