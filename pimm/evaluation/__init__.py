"""Evaluation: metric functions (``pimm.evaluation.metrics``) used by evaluators."""

from .metrics import (
    adjusted_rand_index,
    classification_scores,
    confusion_matrix,
    match_instances,
    match_instances_per_class,
    segmentation_scores,
)

__all__ = [
    "adjusted_rand_index",
    "classification_scores",
    "confusion_matrix",
    "match_instances",
    "match_instances_per_class",
    "segmentation_scores",
]

from .cls import ClsEvaluator  # noqa: E402  (registers the hook)

__all__ += ["ClsEvaluator"]

from .cluster_policy import ClusterPolicyEvaluator  # noqa: E402
from .inseg import InsSegEvaluator  # noqa: E402  (registers the HOOKS entry)
from .proposal import ProposalEvaluator  # noqa: E402
from .semseg import SemSegEvaluator  # noqa: E402

__all__ += ["ClusterPolicyEvaluator", "InsSegEvaluator", "ProposalEvaluator", "SemSegEvaluator"]

from .testers import ClsTester, InsSegTester, InstanceSegTester, SemSegTester  # noqa: E402  (registers TESTERS)

__all__ += ["ClsTester", "InsSegTester", "InstanceSegTester", "SemSegTester"]

from .ring_gan import RingGANEvaluator  # noqa: E402  (registers the HOOKS entry)

__all__ += ["RingGANEvaluator"]

from .pretrain import FeatureStdMonitor, PretrainEvaluator, PrototypeUsageLogger  # noqa: E402  (registers HOOKS)

__all__ += ["FeatureStdMonitor", "PretrainEvaluator", "PrototypeUsageLogger"]

from .push_to_hub import PushToHub  # noqa: E402  (registers the HOOKS entry)

__all__ += ["PushToHub"]

from .probes import EventLinearProbeEvaluator, OnlineLinearProbe  # noqa: E402  (registers the HOOKS entries)

__all__ += ["EventLinearProbeEvaluator", "OnlineLinearProbe"]

from .mae import MAEEvaluator  # noqa: E402  (registers the HOOKS entry)

__all__ += ["MAEEvaluator"]

from .panoptic import InstanceSegmentationEvaluator  # noqa: E402  (registers the HOOKS entry)

__all__ += ["InstanceSegmentationEvaluator"]
