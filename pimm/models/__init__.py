"""Models, plugged in through the ``MODELS`` registry."""

from pimm.engines.registries import MODELS

from . import (grpo, instance, instance_affinity, lora, losses, ptv3, ring_cnn, ring_gan, segmentor_v2,  # noqa: F401
               segmentors, sonata, sparse_unet, upstream_hints, wrappers)  # (register)

__all__ = ["MODELS"]
