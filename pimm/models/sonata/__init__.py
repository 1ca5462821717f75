"""Sonata self-supervised pre-training (``Sonata-v1m1`` and its one-teacher-head
variant ``Sonata-v1m2``); see :mod:`.model` and :mod:`.v1m2`."""

from .fusion import RepresentationFusion
from .heads import PrototypeHead
from .model import Sonata
from .v1m2 import SonataV1m2

__all__ = ["Sonata", "SonataV1m2", "PrototypeHead", "RepresentationFusion"]
