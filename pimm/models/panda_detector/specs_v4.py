"""The configuration vocabulary of ``detector-v4`` (upstream's keyword format,
upstream's defaults), turned into one settings dict per label at build time.

v4 spreads a label's settings over the constructor: ``labels``, then
``num_queries`` / ``num_classes`` / ``stuff_classes`` / ``use_stuff_head`` /
``loss_weights`` / ``overlap`` (one value for every label, a list in label
order, or a dict by label), over ``label_configs[label]``, over the built-in
defaults of the labels ``particle`` and ``interaction``. ``query_heads`` is a
list (one label) or a dict by label. The result keeps upstream's dict keys
(``spec["stuff_classes"]``) and also reads as attributes (``spec.num_classes``,
``head.name``), the form pimm's panoptic evaluator reads.
"""

from __future__ import annotations

from copy import deepcopy

from pimm.utils.errors import ConfigError

__all__ = ["Settings", "normalize_query_heads", "fold_query_heads", "select", "build_label_specs", "LOSS_HEAD_KEYS",
           "RESERVED_OUTPUT_KEYS"]

# Upstream's built-in per-label defaults.
_LABEL_DEFAULTS = {
    "particle": dict(instance_key="instance_particle", segment_key="segment_particle",
                     segment_fallback_key="segment_pid", num_classes=6, stuff_classes=[5]),
    "interaction": dict(instance_key="instance_interaction", segment_key="segment_interaction", num_classes=2,
                        stuff_classes=[0]),
}
# Output keys the model fills itself: a head's pred_key may not take one.
RESERVED_OUTPUT_KEYS = frozenset({"pred_masks", "pred_logits", "seg_logits", "aux_outputs", "stuff_logits",
                                  "stuff_probs", "pred_regression", "filter_logits"})
# The head keys the instance loss reads (the rest shape the head itself).
LOSS_HEAD_KEYS = ("name", "kind", "pred_key", "target_key", "aggregation", "loss_weight", "criterion", "required",
                  "sentinel")
_AGGREGATIONS = {"continuous": ("mean", "first"), "categorical": ("mode", "first")}


class Settings(dict):
    """A dict whose keys also read as attributes (a missing one reads None)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self.get(name)


def _entries(value) -> list:
    """A list of head dicts from a list, one dict with ``name``, or ``{name: dict}``."""
    if value is None:
        return []
    if isinstance(value, dict):
        return [value] if "name" in value else [dict(cfg, name=name) for name, cfg in value.items()]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"detector-v4: query_heads must be a list of dict(name=..., ...), got {value!r}")
    return list(value)


def normalize_query_heads(heads) -> list[Settings]:
    """Every head with all of upstream's keys filled in: ``kind``
    ("continuous": ``dim``, ``aggregation`` mean|first, ``squeeze`` when dim
    is 1; "categorical": ``num_classes``, ``aggregation`` mode|first),
    ``pred_key`` (``pred_<name>``), ``target_key`` (name), ``loss_weight``,
    ``use_class_logits``, ``detach_class_logits``, ``required``, ``head_mlp``
    and the loss ``criterion``."""
    out, seen = [], set()
    for cfg in _entries(heads):
        if not isinstance(cfg, dict):
            raise ConfigError(f"detector-v4: a query head must be a dict(name=..., ...), got {cfg!r}")
        head = Settings(deepcopy(cfg))
        name = head.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"detector-v4: every query head needs a non-empty 'name', got {cfg!r}")
        if name in seen:
            raise ConfigError(f"detector-v4: query head name {name!r} repeats")
        seen.add(name)
        kind = head.setdefault("kind", "continuous")
        if kind not in _AGGREGATIONS:
            raise ConfigError(f"detector-v4: query head {name!r}: kind must be 'continuous' or 'categorical', "
                              f"got {kind!r}")
        head.setdefault("pred_key", f"pred_{name}")
        if head["pred_key"] in RESERVED_OUTPUT_KEYS:
            raise ConfigError(f"detector-v4: query head {name!r}: pred_key {head['pred_key']!r} is one of the "
                              f"model's own outputs; choose another")
        for key, default in (("target_key", name), ("loss_weight", 1.0), ("use_class_logits", False),
                             ("detach_class_logits", False), ("required", True), ("head_mlp", True)):
            head.setdefault(key, default)
        if kind == "continuous":
            head["dim"] = _positive(name, "dim", head.get("dim", head.get("out_dim", 1)))
            head.setdefault("aggregation", "mean")
            head.setdefault("squeeze", head["dim"] == 1)
            head.setdefault("criterion", dict(type="SmoothL1RegressionLoss", beta=1.0, reduction="mean"))
        else:
            if "num_classes" not in head:
                raise ConfigError(f"detector-v4: categorical query head {name!r} needs num_classes")
            head["num_classes"] = head["dim"] = _positive(name, "num_classes", head["num_classes"])
            head.setdefault("aggregation", "mode")
            head.setdefault("squeeze", False)
            head.setdefault("criterion", dict(type="CrossEntropyHeadLoss", reduction="mean"))
        # the decoder's view of the head (v5's QueryHead reads the same); upstream's v4 has no unit_normalize
        head.update(out_dim=head["dim"], squeezed=bool(head["squeeze"]), unit_normalize=False)
        if head["aggregation"] not in _AGGREGATIONS[kind]:
            raise ConfigError(f"detector-v4: {kind} query head {name!r}: aggregation must be "
                              f"{' or '.join(map(repr, _AGGREGATIONS[kind]))}, got {head['aggregation']!r}")
        out.append(head)
    return out


def _positive(name: str, key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"detector-v4: query head {name!r}: {key} must be an int >= 1, got {value!r}")
    return value


def fold_query_heads(label_configs: dict | None, labels: tuple, query_heads) -> dict:
    """``label_configs`` with a top-level ``query_heads`` (a dict by label, or
    the heads of the only label) folded in."""
    label_configs = deepcopy(label_configs or {})
    if not isinstance(label_configs, dict):
        raise ConfigError(f"detector-v4: label_configs must be a dict of label name -> settings, got "
                          f"{label_configs!r}")
    if query_heads is None:
        return label_configs
    if isinstance(query_heads, dict) and "name" not in query_heads and "kind" not in query_heads:
        for label, heads in query_heads.items():
            label_configs.setdefault(label, {})["query_heads"] = heads
        return label_configs
    if len(labels) != 1:
        raise ConfigError("detector-v4: with several labels, query_heads must be a dict of label name -> heads")
    label_configs.setdefault(labels[0], {})["query_heads"] = query_heads
    return label_configs


def select(value, labels: tuple, label: str, index: int, default=None, lists_of_lists: bool = False):
    """One label's value of a per-label argument: None -> ``default``; a dict
    -> by label; a list as long as ``labels`` -> by position (for
    ``stuff_classes``, only a list of lists); anything else: for every label."""
    if value is None:
        return default
    if isinstance(value, dict):
        return value.get(label, default)
    if isinstance(value, (list, tuple)) and len(value) == len(labels):
        if not lists_of_lists or all(isinstance(v, (list, tuple, set)) for v in value):
            return value[index]
    return value


def build_label_specs(labels: tuple, label_configs: dict, num_queries=None, num_classes=None, stuff_classes=None,
                      use_stuff_head=True, loss_weights=None, overlap=None) -> dict[str, Settings]:
    """One settings dict per label (module doc for the precedence)."""
    specs = {}
    for index, label in enumerate(labels):
        spec = Settings(deepcopy(_LABEL_DEFAULTS.get(label, {})))
        own = label_configs.get(label, {})
        if not isinstance(own, dict):
            raise ConfigError(f"detector-v4: label_configs.{label} must be a dict, got {own!r}")
        spec.update(deepcopy(own))
        queries = select(num_queries, labels, label, index, spec.get("num_queries", 32))
        classes = select(num_classes, labels, label, index, spec.get("num_classes"))
        for key, value in (("num_queries", queries), ("num_classes", classes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                hint = "; give num_classes or label_configs" if value is None else ""
                raise ConfigError(f"detector-v4: label {label!r}: {key} must be an int >= 1, got {value!r}{hint}")
        stuff = select(stuff_classes, labels, label, index, spec.get("stuff_classes", []), lists_of_lists=True)
        stuff = list(stuff or [])
        bad = [c for c in stuff if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < classes]
        if bad:
            raise ConfigError(f"detector-v4: label {label!r}: stuff_classes {bad} are not classes 0..{classes - 1}")
        spec.setdefault("instance_key", f"instance_{label}")
        spec.setdefault("segment_key", f"segment_{label}")
        spec.update(num_queries=queries, num_classes=classes, stuff_classes=stuff,
                    use_stuff_head=bool(select(use_stuff_head, labels, label, index, True)),
                    loss_weight=float(select(loss_weights, labels, label, index, 1.0)),
                    overlap=bool(select(overlap, labels, label, index, spec.get("overlap", False))),
                    query_heads=normalize_query_heads(spec.get("query_heads")))
        if spec["overlap"]:
            raise ConfigError(f"detector-v4: label {label!r}: overlap=True (overlapping instances from a membership "
                              "matrix) is not built in pimm; use overlap=False with per-point instance ids")
        specs[label] = spec
    return specs
