"""``detector-v5``: upstream pimm's panoptic particle detector, under its name
and keys.

A point backbone (PT-v3m2; with ``enc_mode=True`` every encoder level's
features are concatenated back onto the input points, ``full_in_channels``
wide) feeds a shared query decoder (:mod:`.decoder`); each entry of
``label_configs`` is one panoptic task with its own queries, classes, truth
keys, stuff head, query heads and loss (``FastUnifiedInstanceLoss``: Hungarian
matching of queries to true instances, focal + Dice mask losses, class and
query-head losses, deep supervision). An optional ``point_filter`` drops
points before the decoder's cross-attention. :meth:`UnifiedDetector.postprocess`
fuses one label's predictions into per-point instances (:mod:`.postprocess`).
The decoder is the one of ``detector-v4`` under upstream's parameter names,
so upstream's v5 checkpoints load strictly; pimm's own earlier v5
checkpoints, with other names, load too (:mod:`.legacy_v5`).

Training returns ``loss`` (the label losses times their ``loss_weight``, plus
each stuff head's BCE and the filter's) and the parts, as upstream:
``<label>_loss``, every component of the label's loss as ``<label>_<name>``,
``<label>_stuff_loss``, ``filter_loss``. Evaluation also returns the
predictions: for the ``eval_label`` (default: the last label) under
upstream's plain keys (``pred_masks``, ``pred_logits``, ``seg_logits``,
``stuff_probs``, ``pred_regression``, each head's ``pred_<name>``), for every
label as ``<label>_<key>`` and in ``outputs_by_label`` / ``*_by_label``, with
``point_counts``; and the losses when the batch has the truth.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pimm.engines.registries import MODELS
from pimm.models.losses import LOSSES
from pimm.models.segmentor_v2 import DefaultSegmentorV2
from pimm.utils.config_domains import ask_class
from pimm.utils.domains import Anything, ConfigRule, Int, Key, NonNeg, Prob, Real, Registered, Size, Weight
from pimm.utils.errors import ConfigError

from .decoder import QueryDecoder
from .legacy_v5 import upgrade_legacy_keys
from .postprocess import postprocess_batch
from .specs import (POINT_FILTER_DOMAINS, POSTPROCESS_DOMAINS, LabelSpec, LabelsDomain, PointFilterSpec,
                    PostprocessSpec, RecordOf, parse_record)

__all__ = ["UnifiedDetector"]

_POSTPROCESS = RecordOf(POSTPROCESS_DOMAINS, "the panoptic fusion settings dict(stuff_threshold=..., ...)")
_POINT_FILTER = RecordOf(POINT_FILTER_DOMAINS, "None or the point filter settings dict(type='stuff', ...)")


def _train_batch_keys(cfg: dict) -> tuple[set[str], str] | None:
    """The keys of a training event, when the last step of ``data.train``'s
    transform says them from its config (``Collect``), with that step's key."""
    train = cfg.get("data", {}).get("train") if isinstance(cfg.get("data"), dict) else None
    steps = train.get("transform") if isinstance(train, dict) else None
    if not isinstance(steps, (list, tuple)) or not steps:
        return None
    where = f"data.train.transform.{len(steps) - 1}"
    keys = ask_class(steps[-1], where, "collected_keys")
    return (set(keys), where) if keys is not None else None


class _TruthKeysInTheBatch(ConfigRule):
    """Every batch key a label trains on (its instance and segment keys, each
    required query head's target) is one the training data collects."""

    def __init__(self):
        super().__init__("label_configs")

    def check_config(self, args: dict, cfg: dict, where: str) -> None:
        found, labels = _train_batch_keys(cfg), args.get("label_configs")
        if found is None or not isinstance(labels, dict):
            return
        keys, step = found
        for label, spec in labels.items():
            wanted = [(f"{label}.{k}", spec.get(k), "") for k in ("instance_key", "segment_key")]
            for i, head in enumerate(spec.get("query_heads") or ()):
                if isinstance(head, dict) and head.get("required", True):
                    named = "target_key" if head.get("target_key") else "name"
                    wanted.append((f"{label}.query_heads.{i}.{named}", head.get(named),
                                   ", or set required=False on the head" + (" (its name is its target key)"
                                                                            if named == "name" else "")))
            for key, value, advice in wanted:
                if isinstance(value, str) and value not in keys:
                    raise ConfigError(f"{where}label_configs.{key}={value!r} is not a key of the training batch "
                                      f"({step} keeps {sorted(keys)}): add it to that Collect's keys{advice}")


def _column(t: torch.Tensor) -> torch.Tensor:
    return t.squeeze(1) if t.dim() == 2 and t.shape[1] == 1 else t


@MODELS.register_module("detector-v5")
class UnifiedDetector(nn.Module):
    """Backbone, shared query decoder, per-label losses and panoptic fusion (module doc)."""

    domains = dict(backbone=Registered("model"), label_configs=LabelsDomain(), postprocess=_POSTPROCESS,
                   full_in_channels=Size, hidden_channels=Size, num_heads=Int(1, 1024), eval_label=Key | None,
                   point_filter=_POINT_FILTER | None, filter_loss_weight=Weight,
                   depth=Int(1, 64), mlp_ratio=Real(0, 64, lo_open=True), qk_scale=Real(0, 1e3, lo_open=True) | None,
                   attn_drop=Prob, proj_drop=Prob, drop_path=Prob, layer_scale=NonNeg | None,
                   norm_layer=Anything("a normalisation layer class (default nn.LayerNorm)"),
                   act_layer=Anything("an activation class (default nn.GELU)"))
    domain_rules = (_TruthKeysInTheBatch(),)

    @classmethod
    def label_classes(cls, args: dict) -> dict[str, int]:
        """Label name -> its number of classes, for the evaluators of this model."""
        labels = args.get("label_configs")
        return {name: spec.get("num_classes") for name, spec in labels.items() if isinstance(spec, dict)} \
            if isinstance(labels, dict) else {}

    def __init__(self, backbone: dict, label_configs: dict, postprocess: dict, full_in_channels: int,
                 hidden_channels: int, num_heads: int, eval_label: str | None = None, point_filter: Any = None,
                 filter_loss_weight: float = 1.0, depth: int = 3, mlp_ratio: float = 4.0, qkv_bias: bool = False,
                 qk_scale: float | None = None, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 drop_path: float = 0.0, layer_scale: float | None = None, norm_layer=nn.LayerNorm,
                 act_layer=nn.GELU, pre_norm: bool = True, enable_flash: bool = True,
                 upcast_attention: bool = False, upcast_softmax: bool = False, pos_emb: bool = True,
                 supervise_attn_mask: bool = True, mlp_point_proj: bool = False):
        super().__init__()
        if not isinstance(label_configs, dict) or not label_configs:
            raise ConfigError("detector-v5: label_configs must be a non-empty dict of label name -> settings")
        if hidden_channels % num_heads:
            raise ConfigError(f"detector-v5: hidden_channels={hidden_channels} must be divisible by "
                              f"num_heads={num_heads}")
        self.label_specs = {name: parse_record(LabelSpec, cfg, f"detector-v5: label_configs.{name}")
                            for name, cfg in label_configs.items()}
        self.labels = tuple(self.label_specs)
        self.eval_label = self.labels[-1] if eval_label is None else eval_label
        if self.eval_label not in self.label_specs:
            raise ConfigError(f"detector-v5: eval_label={eval_label!r} is not a label of label_configs "
                              f"({', '.join(self.labels)})")
        self.postprocess_cfg = parse_record(PostprocessSpec, postprocess or {}, "detector-v5: postprocess")
        self.point_filter_cfg = (None if point_filter is None else
                                 asdict(parse_record(PointFilterSpec, point_filter, "detector-v5: point_filter")))
        self.filter_loss_weight = float(filter_loss_weight)
        self.backbone = MODELS.build(backbone)
        declared = getattr(self.backbone, "out_channels", None)
        if isinstance(declared, int) and declared != full_in_channels:
            raise ConfigError(f"detector-v5: full_in_channels={full_in_channels} but the backbone "
                              f"{backbone.get('type')!r} gives {declared} channels per point after up-casting")
        # The criterion learns about the label's truth keys and heads from the label itself.
        self.criteria = nn.ModuleDict({
            name: LOSSES.build({**spec.criterion, "query_heads": [h.loss_config() for h in spec.query_heads],
                                "overlap": spec.overlap, "truth_label": spec.instance_key,
                                "segment_key": spec.segment_key})
            for name, spec in self.label_specs.items()})
        self.decoder = QueryDecoder(self.label_specs, full_in_channels, hidden_channels, num_heads, depth, mlp_ratio,
                                    qkv_bias, qk_scale, attn_drop, proj_drop, drop_path, layer_scale, norm_layer,
                                    act_layer, pre_norm, upcast_attention, pos_emb, mlp_point_proj,
                                    supervise_attn_mask, self.point_filter_cfg, owner="detector-v5")
        self.register_load_state_dict_pre_hook(_take_legacy_names)

    # -- pimm's earlier v5 checkpoints ------------------------------------------------------
    @staticmethod
    def upgrade_state_dict(state: dict) -> dict[str, list[str]]:
        """Rewrite, in place, a state dict of pimm's earlier v5 (other decoder
        names, :mod:`.legacy_v5`) into this model's names; returns {new
        parameter: the old ones it was made from}. The engine calls it before
        it checks a checkpoint against the model; ``load_state_dict`` does too."""
        return upgrade_legacy_keys(state)

    # -- annealing (AttentionMaskAnnealingHook) ------------------------------------------
    def update_anneal_step(self, step: int) -> None:
        """detector-v5 does not anneal its attention masks (upstream turns it
        off): the factor stays 1 whatever the step."""
        self.decoder.update_anneal_step(step)

    def anneal_factors(self) -> list[float]:
        return [block.get_anneal_factor() for block in self.decoder.blocks]

    # -- forward --------------------------------------------------------------------------
    def _stuff_loss(self, label: str, logits: torch.Tensor, input_dict: dict) -> torch.Tensor:
        segment = _column(input_dict[self.label_specs[label].segment_key]).to(logits.device)
        target = torch.zeros_like(logits)
        for cls in self.label_specs[label].stuff_classes:
            target[segment == int(cls)] = 1.0
        return F.binary_cross_entropy_with_logits(logits, target)

    def forward(self, input_dict: dict, return_point: bool = False) -> dict:
        feat, point = DefaultSegmentorV2.point_features(self.backbone(input_dict))
        coord = point["coord"] if point is not None and "coord" in point else input_dict["coord"]
        offset = point["offset"] if point is not None and "offset" in point else input_dict["offset"]
        filter_truth = self.label_specs[self.eval_label].segment_key
        gt_segment = input_dict.get(filter_truth) if self.point_filter_cfg and self.training else None
        outputs = self.decoder(feat, coord, offset, with_aux=self.training, gt_segment=gt_segment)
        filter_logits = outputs.pop("__filter_logits__", None)
        result, total = {}, None
        for label, spec in self.label_specs.items():
            prediction = outputs[label]
            has_truth = spec.instance_key in input_dict and spec.segment_key in input_dict
            if not has_truth:
                if self.training:
                    raise KeyError(f"detector-v5: label {label!r} trains on the batch keys {spec.instance_key!r} and "
                                   f"{spec.segment_key!r}; the batch has {sorted(input_dict)} (add them to Collect)")
                continue
            loss, details = self.criteria[label](prediction, input_dict)
            loss = loss * spec.loss_weight
            result[f"{label}_loss"] = loss.detach()
            result.update({f"{label}_{key}": value for key, value in details.items()})
            if "stuff_logits" in prediction:
                stuff = self._stuff_loss(label, prediction["stuff_logits"], input_dict)
                result[f"{label}_stuff_loss"] = stuff.detach()
                loss = loss + stuff
            total = loss if total is None else total + loss
        if filter_logits is not None and self.training and filter_truth in input_dict:
            loss = self.decoder.point_filter.loss(filter_logits, _column(input_dict[filter_truth]))
            if loss is not None:
                loss = self.filter_loss_weight * loss
                result["filter_loss"] = loss.detach()
                total = loss if total is None else total + loss
        if not self.training:
            self._add_predictions(result, outputs, offset)
        if return_point:
            result["point"] = point
        if total is not None:
            result["loss"] = total
        return result

    def _add_predictions(self, result: dict, outputs: dict, offset: torch.Tensor) -> None:
        for label, spec in self.label_specs.items():
            prediction = outputs[label]
            for key in ("seg_logits", "pred_logits", "pred_masks", "stuff_probs"):
                if key in prediction:
                    result[f"{label}_{key}"] = prediction[key]
            for head in spec.query_heads:
                result[f"{label}_{head.pred_key}"] = prediction[head.pred_key]
        primary, spec = outputs[self.eval_label], self.label_specs[self.eval_label]
        for key in ("seg_logits", "pred_logits", "pred_masks", "stuff_probs", "pred_regression"):
            result[key] = primary.get(key)
        for head in spec.query_heads:
            result[head.pred_key] = primary[head.pred_key]
        result["outputs_by_label"] = outputs
        for key in ("seg_logits", "pred_logits", "pred_masks"):
            result[f"{key}_by_label"] = {label: out[key] for label, out in outputs.items()}
        result["pred_regression_by_label"] = {label: out.get("pred_regression", {}) for label, out in outputs.items()}
        result["point_counts"] = torch.diff(offset.long(), prepend=offset.new_zeros(1))

    # -- panoptic fusion ---------------------------------------------------------------
    def postprocess(self, forward_output: dict, label: str | None = None, **overrides) -> dict:
        """Per-point instances of one label from an evaluation-mode ``forward``
        output; keyword overrides replace the ``postprocess`` settings for this
        call (e.g. an evaluator's own ``stuff_threshold``)."""
        label = self.eval_label if label is None else label
        if label not in self.label_specs:
            raise KeyError(f"detector-v5: no label {label!r}; labels are {', '.join(self.labels)}")
        options = {**self.postprocess_cfg.kwargs(), **overrides}
        prediction = forward_output["outputs_by_label"][label]
        return postprocess_batch(prediction["pred_masks"], prediction["pred_logits"], prediction.get("stuff_probs"),
                                 prediction.get("pred_regression"), forward_output.get("point_counts"),
                                 stuff_classes=self.label_specs[label].stuff_classes, **options)


def _take_legacy_names(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """``load_state_dict`` pre-hook: a state dict of pimm's earlier v5 loads too."""
    upgrade_legacy_keys(state_dict, prefix)
