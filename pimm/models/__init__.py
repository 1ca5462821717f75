"""Models, plugged in through the ``MODELS`` registry."""

import sys

from pimm.engines.registries import MODELS

from . import (grpo, instance, instance_affinity, losses, ptv3, ring_cnn, ring_gan, segmentor_v2,  # noqa: F401
               segmentors, sparse_unet)  # (register)
from . import loss_builder

# Upstream's ``pimm.models.losses.builder``: losses is a module here, so the
# submodule is registered by name (see pimm/models/loss_builder.py).
sys.modules.setdefault(f"{__name__}.losses.builder", loss_builder)
losses.builder = loss_builder

__all__ = ["MODELS"]
