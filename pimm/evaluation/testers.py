"""The testers of upstream pimm's vocabulary (``test = dict(type=...)``), each
the matching evaluator run on ``data.test`` (see :mod:`pimm.engines.testers`).
Their options are the evaluator's, plus ``verbose``."""

from __future__ import annotations

from pimm.engines.registries import TESTERS
from pimm.engines.loop.testers import TesterBase

__all__ = ["SemSegTester", "InsSegTester", "InstanceSegTester", "ClsTester"]


@TESTERS.register_module()
class SemSegTester(TesterBase):
    """Semantic segmentation (``SemSegEvaluator``: ``ignore_index``, ``macro_ignore_class_ids``, ...)."""

    evaluator_type = "SemSegEvaluator"


@TESTERS.register_module()
class InsSegTester(TesterBase):
    """Instance segmentation (``InsSegEvaluator``)."""

    evaluator_type = "InsSegEvaluator"


@TESTERS.register_module()
class InstanceSegTester(TesterBase):
    """Upstream's tester of its panoptic detector (``InstanceSegmentationEvaluator``:
    ``class_names``, ``stuff_classes``, ``require_class_for_match``, ``labels``, ...)."""

    evaluator_type = "InstanceSegmentationEvaluator"


@TESTERS.register_module(["ClsTester", "ClsVoteTester"])
class ClsTester(TesterBase):
    """Classification (``ClsEvaluator``)."""

    evaluator_type = "ClsEvaluator"
