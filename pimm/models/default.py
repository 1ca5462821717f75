"""Upstream pimm's import path for its default task models: ``from pimm.models.default
import DefaultSegmentorV2`` (and ``DefaultSegmentor``)."""

from pimm.models.segmentor_v2 import DefaultSegmentorV2
from pimm.models.segmentors import DefaultSegmentor

__all__ = ["DefaultSegmentorV2", "DefaultSegmentor"]
