"""Upstream pimm's Panda panoptic detector (``detector-v5``, and its earlier
keyword format ``detector-v4``): a point backbone, a shared masked-attention
query decoder over several label sets, Hungarian-matched instance losses and a
matrix-NMS panoptic fusion."""

from .detector import UnifiedDetector
from .detector_v4 import UnifiedDetectorV4
from .postprocess import matrix_nms, postprocess_batch, postprocess_event

__all__ = ["UnifiedDetector", "UnifiedDetectorV4", "matrix_nms", "postprocess_batch", "postprocess_event"]
