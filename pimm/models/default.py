"""Upstream pimm's import path for its default task models: ``from pimm.models.default
import DefaultSegmentorV2`` (and ``DefaultSegmentor``, ``DefaultSegmentorV3``,
``DefaultInsSegmentor``, ``DefaultClassifier``)."""

from pimm.models.segmentor_v2 import DefaultSegmentorV2
from pimm.models.segmentors import DefaultSegmentor
from pimm.models.wrappers import DefaultClassifier, DefaultInsSegmentor, DefaultSegmentorV3

__all__ = ["DefaultSegmentorV2", "DefaultSegmentor", "DefaultSegmentorV3", "DefaultInsSegmentor", "DefaultClassifier"]
