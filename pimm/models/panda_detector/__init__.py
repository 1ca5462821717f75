"""Upstream pimm's Panda panoptic detector (``detector-v5``, and its earlier
keyword formats ``detector-v4`` and ``detector-v3m2``): a point backbone, a shared masked-attention
query decoder over several label sets, Hungarian-matched instance losses and a
matrix-NMS panoptic fusion."""

from .detector import UnifiedDetector
from .detector_v3m2 import MultiLabelDetectorV3M2
from .detector_v4 import UnifiedDetectorV4
from .postprocess import matrix_nms, postprocess_batch, postprocess_event

__all__ = ["MultiLabelDetectorV3M2", "UnifiedDetector", "UnifiedDetectorV4", "matrix_nms", "postprocess_batch",
           "postprocess_event"]
