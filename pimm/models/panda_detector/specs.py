"""The configuration vocabulary of ``detector-v5`` (upstream's keys, upstream's
meaning), parsed from config dicts into small typed records once, at build
time, so a misspelt key is one line naming it instead of a crash mid-step.

* :class:`QueryHead`: one extra prediction per query (momentum, vertex,
  is_primary, ...), continuous (``dim`` outputs) or categorical
  (``num_classes`` logits).
* :class:`LabelSpec`: one named task ("particle", "interaction"): its query
  count, classes, per-point truth keys, stuff classes and loss.
* :class:`PostprocessSpec`: thresholds and matrix-NMS settings of the
  panoptic fusion (:mod:`pimm.models.panda_detector.postprocess`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pimm.utils.errors import ConfigError

__all__ = ["QueryHead", "LabelSpec", "PostprocessSpec", "parse_record", "LOSS_HEAD_KEYS"]

# The query-head keys FastUnifiedInstanceLoss reads; the rest shape the head itself.
LOSS_HEAD_KEYS = ("name", "kind", "pred_key", "target_key", "aggregation", "loss_weight", "criterion", "required",
                  "sentinel")


def parse_record(cls, value: Any, where: str):
    """``cls(**value)`` with one ConfigError line for a non-dict or an unknown key."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a dict, got {value!r}")
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; it takes {', '.join(names)}")
    try:
        return cls(**value)
    except TypeError as err:  # a required key is missing
        raise ConfigError(f"{where}: {err}".replace("__init__() ", "")) from None


@dataclass
class QueryHead:
    """One per-query regression or classification head (upstream's QueryHeadConfig)."""

    name: str
    kind: str = "continuous"  # or "categorical"
    dim: int = 1
    num_classes: int | None = None
    pred_key: str | None = None
    target_key: str | None = None
    loss_weight: float = 1.0
    use_class_logits: bool = False  # feed the label's class logits to the head too
    detach_class_logits: bool = False
    required: bool = True
    head_mlp: bool = True  # a two-layer MLP (else one Linear)
    aggregation: str | None = None
    squeeze: bool | None = None  # drop a trailing size-1 dim (default: continuous dim == 1)
    criterion: dict | None = None
    sentinel: float | None = None  # target value meaning "no truth": dropped from the loss
    unit_normalize: bool = False  # L2-normalise the output (direction targets)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"query head: 'name' must be a non-empty string, got {self.name!r}")
        if self.kind not in ("continuous", "categorical"):
            raise ConfigError(f"query head {self.name!r}: kind must be 'continuous' or 'categorical', "
                              f"got {self.kind!r}")
        if self.kind == "categorical" and (not isinstance(self.num_classes, int) or self.num_classes < 2):
            raise ConfigError(f"query head {self.name!r}: a categorical head needs num_classes >= 2, "
                              f"got {self.num_classes!r}")
        if self.kind == "continuous" and (not isinstance(self.dim, int) or self.dim < 1):
            raise ConfigError(f"query head {self.name!r}: dim must be an int >= 1, got {self.dim!r}")
        if self.pred_key is None:
            self.pred_key = f"pred_{self.name}"

    @property
    def out_dim(self) -> int:
        return self.dim if self.kind == "continuous" else int(self.num_classes)

    @property
    def squeezed(self) -> bool:
        return (self.kind == "continuous" and self.dim == 1) if self.squeeze is None else bool(self.squeeze)

    def loss_config(self) -> dict:
        """The keys of this head that the instance loss reads (None: the loss's default)."""
        values = asdict(self)
        return {k: values[k] for k in LOSS_HEAD_KEYS if values.get(k) is not None}


@dataclass
class LabelSpec:
    """One named detector task (upstream's LabelConfig)."""

    num_queries: int
    num_classes: int
    instance_key: str
    segment_key: str
    criterion: dict
    stuff_classes: list = field(default_factory=list)
    use_stuff_head: bool = True
    loss_weight: float = 1.0
    overlap: bool = False
    query_heads: list = field(default_factory=list)

    def __post_init__(self):
        for key in ("num_queries", "num_classes"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"label_configs: {key} must be an int >= 1, got {value!r}")
        if not isinstance(self.criterion, dict) or "type" not in self.criterion:
            raise ConfigError(f"label_configs: criterion must be a dict(type=...), got {self.criterion!r}")
        bad = [c for c in self.stuff_classes if not isinstance(c, int) or not 0 <= c < self.num_classes]
        if bad:
            raise ConfigError(f"label_configs: stuff_classes {bad} are not classes 0..{self.num_classes - 1}")
        if self.overlap:
            raise ConfigError("label_configs: overlap=True (overlapping instances from a membership matrix) is not "
                              "built in pimm; use overlap=False with per-point instance ids")
        self.query_heads = [parse_record(QueryHead, h, "label_configs.query_heads[]") for h in self.query_heads]
        names = [h.name for h in self.query_heads]
        if len(set(names)) != len(names):
            raise ConfigError(f"label_configs: query head names repeat: {names}")


@dataclass
class PostprocessSpec:
    """Panoptic fusion settings (upstream's PostprocessConfig)."""

    stuff_threshold: float = 0.5
    mask_threshold: float = 0.5
    conf_threshold: float = 0.5
    nms_kernel: str = "gaussian"
    nms_sigma: float = 2.0
    nms_pre: int = -1
    nms_max: int = -1
    min_points: int = 20
    fill_uncovered: bool = True
    background_class_label: int = -1
    dedup_iou: float | None = None  # upstream keys kept for its configs; unused by its v5 fusion too
    dedup_same_pid: bool | None = None

    def __post_init__(self):
        if self.nms_kernel not in ("gaussian", "linear"):
            raise ConfigError(f"postprocess: nms_kernel must be 'gaussian' or 'linear', got {self.nms_kernel!r}")
        for key in ("stuff_threshold", "mask_threshold", "conf_threshold"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ConfigError(f"postprocess: {key} must be a number in [0, 1], got {value!r}")

    def kwargs(self) -> dict:
        values = asdict(self)
        values.pop("dedup_iou"), values.pop("dedup_same_pid")
        return values
