"""Upstream pimm's import path for the model registry: ``from pimm.models.builder
import MODELS, build_model``. ``MODELS`` is the registry the engine builds
``cfg.model`` from (:mod:`pimm.engines.registries`)."""

from pimm.engines.registries import MODELS

__all__ = ["MODELS", "build_model"]


def build_model(cfg: dict):
    """Build ``dict(type=..., **kwargs)`` from ``MODELS`` (a nested backbone, for example)."""
    return MODELS.build(cfg)
