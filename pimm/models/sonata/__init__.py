"""Sonata self-supervised pre-training (``Sonata-v1m1``); see :mod:`.model`."""

from .heads import PrototypeHead
from .model import Sonata

__all__ = ["Sonata", "PrototypeHead"]
