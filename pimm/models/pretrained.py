"""Where ``pimm.from_pretrained`` and ``pimm.save_pretrained`` used to live:
they are in :mod:`pimm.export` now (upstream pimm's module), and this name
still imports them."""

from pimm.export.configs import CONFIG_READ_NAMES, config_for_publishing
from pimm.export.loading import from_pretrained
from pimm.export.saving import EXPORT_CARD, EXPORT_CONFIG, EXPORT_WEIGHTS, save_pretrained

__all__ = ["from_pretrained", "save_pretrained", "EXPORT_WEIGHTS", "EXPORT_CONFIG", "EXPORT_CARD",
           "CONFIG_READ_NAMES", "config_for_publishing"]
