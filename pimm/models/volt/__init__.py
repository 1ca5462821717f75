"""``Volt-v1m1`` and ``Volt-v1m2`` (upstream pimm's flat patch-token
transformers) in plain PyTorch; see :mod:`pimm.models.volt.model`."""

from .model import VoltBackbone, VoltBackboneV2

__all__ = ["VoltBackbone", "VoltBackboneV2"]
