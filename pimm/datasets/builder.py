"""Upstream pimm's import path for the data set registry: ``from pimm.datasets.builder
import DATASETS, build_dataset``."""

from pimm.engines.registries import DATASETS

__all__ = ["DATASETS", "build_dataset"]


def build_dataset(cfg: dict):
    """Build ``dict(type=..., **kwargs)`` from ``DATASETS``."""
    return DATASETS.build(cfg)
