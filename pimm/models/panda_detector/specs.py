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
* :class:`PointFilterSpec`: the optional point selection before the
  decoder's cross-attention (:class:`pimm.models.panda_detector.decoder.PointFilter`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pimm.utils.domains import (Bool, Choice, Count, Domain, Int, Key, MAX_SIZE, Null, Prob, Real, Registered, Seq,
                                Weight, show)
from pimm.utils.errors import ConfigError

__all__ = ["QueryHead", "LabelSpec", "PostprocessSpec", "PointFilterSpec", "parse_record", "LOSS_HEAD_KEYS",
           "LabelsDomain", "RecordOf", "POSTPROCESS_DOMAINS", "POINT_FILTER_DOMAINS"]

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


@dataclass
class PointFilterSpec:
    """Which points the decoder attends to (upstream's PointFilterConfig)."""

    type: str = "stuff"  # a learned per-point head, or "energy_threshold"
    threshold: float = 0.5
    drop_classes: list = field(default_factory=list)
    train_filter_use_gt: bool = False
    energy_channel: int = 0
    energy_threshold: float = 0.0

    def __post_init__(self):
        if self.type not in ("stuff", "energy_threshold"):
            raise ConfigError(f"point_filter: type must be 'stuff' or 'energy_threshold', got {self.type!r}")


# -- domains: checked on the resolved config, before anything is built -------------------
class RecordOf(Domain):
    """A dict whose known keys each take their own domain; a bad entry is
    named by its full key (``model.postprocess.mask_threshold``). Unknown keys
    are left to the constructor, which names them."""

    def __init__(self, fields: dict, what: str):
        self.fields, self.what = fields, what

    def accepts(self, value) -> bool:
        return isinstance(value, dict) and all(k not in self.fields or self.fields[k].accepts(v)
                                               for k, v in value.items())

    def __call__(self, key: str, value):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={show(value)} is invalid: it takes {self.what}")
        for name, entry in value.items():
            if name in self.fields:
                self.fields[name](f"{key}.{name}", entry)
        return value


class _Each(Domain):
    """A list whose entries each take ``inner``, named by index."""

    def __init__(self, inner: Domain, what: str):
        self.inner, self.what = inner, what

    def accepts(self, value) -> bool:
        return isinstance(value, (list, tuple)) and all(self.inner.accepts(v) for v in value)

    def __call__(self, key: str, value):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={show(value)} is invalid: it takes {self.what}")
        for i, entry in enumerate(value):
            self.inner(f"{key}.{i}", entry)
        return value


_OPTIONAL_BOOL = Bool | Null
HEAD_DOMAINS = dict(name=Key, kind=Choice("continuous", "categorical"), dim=Int(1, 4096),
                    num_classes=Int(2, MAX_SIZE) | Null, pred_key=Key | Null, target_key=Key | Null,
                    loss_weight=Weight, use_class_logits=Bool, detach_class_logits=Bool, required=Bool,
                    head_mlp=Bool, aggregation=Choice("mean", "first", "mode") | Null, squeeze=_OPTIONAL_BOOL,
                    criterion=Registered("loss") | Null, sentinel=Real(-1e9, 1e9) | Null, unit_normalize=Bool)
LABEL_DOMAINS = dict(num_queries=Int(1, 4096), num_classes=Int(1, MAX_SIZE), instance_key=Key, segment_key=Key,
                     criterion=Registered("loss"), stuff_classes=Seq(Count, what="a list of class ids"),
                     use_stuff_head=Bool, loss_weight=Weight, overlap=Bool,
                     query_heads=_Each(RecordOf(HEAD_DOMAINS, "a query head dict(name=..., ...)"),
                                       "a list of query head dicts"))
POSTPROCESS_DOMAINS = dict(stuff_threshold=Prob, mask_threshold=Prob, conf_threshold=Prob,
                           nms_kernel=Choice("gaussian", "linear"), nms_sigma=Real(0, 1e3), nms_pre=Int(-1, 10**6),
                           nms_max=Int(-1, 10**6), min_points=Count, fill_uncovered=Bool,
                           background_class_label=Int(-1, MAX_SIZE), dedup_iou=Prob | Null,
                           dedup_same_pid=_OPTIONAL_BOOL)
POINT_FILTER_DOMAINS = dict(type=Choice("stuff", "energy_threshold"), threshold=Prob,
                            drop_classes=Seq(Count, what="a list of class ids"), train_filter_use_gt=Bool,
                            energy_channel=Count, energy_threshold=Real(-1e9, 1e9))


class LabelsDomain(Domain):
    """``label_configs``: a non-empty dict of label name -> label settings."""

    what = "a non-empty dict of label name -> dict(num_queries=..., num_classes=..., ...)"

    def __init__(self):
        self.record = RecordOf(LABEL_DOMAINS, "a label's settings dict(num_queries=..., num_classes=..., ...)")

    def accepts(self, value) -> bool:
        return isinstance(value, dict) and bool(value) and all(
            Key.accepts(k) and self.record.accepts(v) for k, v in value.items())

    def __call__(self, key: str, value):
        if not isinstance(value, dict) or not value:
            raise ConfigError(f"{key}={show(value)} is invalid: it takes {self.what}")
        for label, settings in value.items():
            Key(f"{key} (a label name)", label)
            self.record(f"{key}.{label}", settings)
        return value
