"""Sonata self-supervised pre-training (``Sonata-v1m1``); see :mod:`.model`."""

from pimm.engines.registries import MODELS

from .fusion import RepresentationFusion
from .heads import PrototypeHead
from .model import Sonata

__all__ = ["Sonata", "PrototypeHead", "RepresentationFusion"]

# Upstream also registers a "v1m2" (one teacher head shared by the losses) that
# none of its configs names; pimm builds only what upstream's configs use.
MODELS.add_hint("Sonata-v1m2", "Sonata-v1m1 (upstream's Sonata-v1m2 is used by none of upstream's configs and is "
                               "not shipped; docs/pretraining.md)")
