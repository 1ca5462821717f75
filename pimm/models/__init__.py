"""Models, plugged in through the ``MODELS`` registry."""

from pimm.engines.registries import MODELS

from . import grpo, instance, instance_affinity, losses, ptv3, ring_cnn, segmentor_v2, segmentors, sparse_unet  # noqa: F401  (register)

__all__ = ["MODELS"]
