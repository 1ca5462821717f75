"""Models, plugged in through the ``MODELS`` registry."""

from pimm.engines.registries import MODELS

from . import grpo, instance, instance_affinity, losses, ring_cnn, ring_gan, segmentors, sparse_unet  # noqa: F401  (register)

__all__ = ["MODELS"]
