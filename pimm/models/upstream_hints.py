"""What to use instead of the models and losses upstream pimm registers that
pimm does not build: naming one in a config is one line saying so (the
registry's hint), never a bare "unknown type". A name that gets built later
is found first; its hint is then never shown."""

from __future__ import annotations

from pimm.engines.registries import MODELS

from .losses import LOSSES

__all__ = ["MODEL_HINTS", "LOSS_HINTS"]

MODEL_HINTS: dict[str, str] = {}  # every model upstream registers is built

LOSS_HINTS: dict[str, str] = {}  # every loss upstream registers is built

for _name, _hint in MODEL_HINTS.items():
    MODELS.add_hint(_name, _hint)
for _name, _hint in LOSS_HINTS.items():
    LOSSES.add_hint(_name, _hint)
