"""``detector-v4``: upstream pimm's earlier Panda panoptic detector (upstream's
``UnifiedDetector`` of ``detector_v4.py``), with its keyword format, defaults,
state-dict names and output keys, so its configs build and its checkpoints
(Panda-Particle, Panda-Interaction) load strictly.

The same model as ``detector-v5`` (:mod:`.detector`) in its older spelling: a
point backbone (with ``enc_mode=True`` every encoder level is concatenated
back onto the points, ``full_in_channels`` wide), a shared query decoder over
several labels (:mod:`.decoder`, v5's), per-label losses (an instance loss in
``criteria`` becomes ``FastUnifiedInstanceLoss`` with the label's query heads)
plus a stuff-head BCE, and :meth:`UnifiedDetectorV4.postprocess`
(:mod:`.postprocess`, v5's). Per-label settings come as separate arguments
(:mod:`.specs_v4`); v4 also has an optional pre-attention ``point_filter``
and attention-mask annealing.

Outputs: training: ``loss``, per label ``<label>_loss``, the loss's
components as ``<label>_<name>``, ``<label>_stuff_loss`` and ``filter_loss``.
Evaluation adds the predictions: per label ``<label>_seg_logits`` /
``_pred_logits`` / ``_pred_masks`` / ``_pred_<head>`` / ``_stuff_probs``, the
``*_by_label`` maps, ``outputs_by_label``, the ``eval_label``'s under the
plain keys, and ``point_counts``; the losses too when the batch has the truth.
"""

from __future__ import annotations

from copy import deepcopy

import torch
import torch.nn.functional as F
from torch import nn

from pimm.engines.registries import MODELS
from pimm.models.losses import build_criteria
from pimm.models.segmentor_v2 import DefaultSegmentorV2
from pimm.utils.domains import (Anything, Bool, Choice, Count, DictOf, Int, Key, NonNeg, OneOf, Prob, Real, Registered,
                                Seq, Size, Weight)
from pimm.utils.errors import ConfigError

from .decoder import QueryDecoder
from .postprocess import postprocess_batch, select_label_outputs
from .specs_v4 import LOSS_HEAD_KEYS, build_label_specs, fold_query_heads

__all__ = ["UnifiedDetectorV4"]

# Upstream's instance-loss names; v4 trains every one of them as FastUnifiedInstanceLoss.
_INSTANCE_LOSSES = {"InstanceSegmentationLoss", "FastInstanceSegmentationLoss",
                    "FastInstanceSegmentationRegressionLoss", "FastUnifiedInstanceLoss"}
_LOSSES = Seq(Registered("loss"), what="a list of dict(type=...) losses")


def _per_label(item):
    """A per-label argument: one value for every label, a list in label order, or a dict by label."""
    return OneOf(item, Seq(item), DictOf(Key, item))


def _column(t: torch.Tensor) -> torch.Tensor:
    return t.squeeze(1) if t.dim() == 2 and t.shape[1] == 1 else t


@MODELS.register_module("detector-v4")
class UnifiedDetectorV4(nn.Module):
    """Backbone, shared query decoder, per-label losses and panoptic fusion (module doc)."""

    domains = dict(
        full_in_channels=Size, hidden_channels=Size, num_heads=Int(1, 1024),
        labels=OneOf(Key, Seq(Key, min_len=1)), num_queries=_per_label(Int(1, 4096)) | None,
        num_classes=_per_label(Size) | None, label_configs=DictOf(Key, DictOf(Key)) | None,
        query_heads=Anything("a list of head dicts or a dict of label -> heads; checked when built"),
        overlap=_per_label(Bool) | None, point_filter=DictOf(Key) | None, filter_loss_weight=Weight,
        loss_weights=_per_label(Weight) | None, eval_label=Key | None, backbone=Registered("model"),
        criteria=_LOSSES | None, criteria_by_label=DictOf(Key, _LOSSES) | None, depth=Int(1, 64),
        mlp_ratio=Real(0, 64, lo_open=True), qk_scale=Real(0, 1e3, lo_open=True) | None, attn_drop=Prob,
        proj_drop=Prob, drop_path=Prob, layer_scale=NonNeg | None,
        norm_layer=Anything("a normalisation layer class (default nn.LayerNorm)"),
        act_layer=Anything("an activation class (default nn.GELU)"), attn_mask_anneal_steps=Count,
        attn_mask_warmup_steps=Count, attn_mask_progressive_delay=Count, query_type=Choice("learned"),
        stuff_classes=OneOf(Seq(Count), Seq(Seq(Count)), DictOf(Key, Seq(Count))) | None,
        use_stuff_head=_per_label(Bool), stuff_threshold=Prob, mask_threshold=Prob, conf_threshold=Prob,
        nms_kernel=Choice("gaussian", "linear"), nms_sigma=Real(0, 1e3), nms_pre=Int(-1, 10**6),
        nms_max=Int(-1, 10**6), min_points=Count)

    def __init__(self, full_in_channels: int, hidden_channels: int, num_heads: int, labels=("particle",),
                 num_queries=None, num_classes=None, label_configs=None, query_heads=None, overlap=None,
                 point_filter=None, filter_loss_weight: float = 1.0, loss_weights=None, eval_label=None,
                 backbone=None, criteria=None, criteria_by_label=None, depth: int = 3, mlp_ratio: float = 4.0,
                 qkv_bias: bool = False, qk_scale=None, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 drop_path: float = 0.0, layer_scale=None, norm_layer=nn.LayerNorm, act_layer=nn.GELU,
                 pre_norm: bool = True, enable_flash: bool = True, upcast_attention: bool = False,
                 upcast_softmax: bool = False, pos_emb: bool = True, attn_mask_anneal: bool = False,
                 attn_mask_anneal_steps: int = 10000, attn_mask_warmup_steps: int = 0,
                 attn_mask_progressive: bool = False, attn_mask_progressive_delay: int = 0, query_type="learned",
                 use_stuff_head=False, stuff_classes=None, supervise_attn_mask: bool = True,
                 mlp_point_proj: bool = False, stuff_threshold: float = 0.5, mask_threshold: float = 0.5,
                 conf_threshold: float = 0.5, nms_kernel: str = "gaussian", nms_sigma: float = 2.0,
                 nms_pre: int = -1, nms_max: int = -1, min_points: int = 2, fill_uncovered: bool = False):
        super().__init__()
        # enable_flash / upcast_softmax pick upstream's CUDA kernels; pimm's attention is one SDPA path.
        self.labels = (labels,) if isinstance(labels, str) else tuple(labels)
        if not self.labels:
            raise ConfigError("detector-v4: labels must name at least one label, e.g. ('particle',)")
        if query_type != "learned":
            raise ConfigError(f"detector-v4: query_type must be 'learned' (the only kind upstream builds), "
                              f"got {query_type!r}")
        if hidden_channels % num_heads:
            raise ConfigError(f"detector-v4: hidden_channels={hidden_channels} must be divisible by "
                              f"num_heads={num_heads}")
        if backbone is None:
            raise ConfigError("detector-v4: backbone is required, e.g. backbone=dict(type='PT-v3m2', ...)")
        self.label_specs = build_label_specs(self.labels, fold_query_heads(label_configs, self.labels, query_heads),
                                             num_queries, num_classes, stuff_classes, use_stuff_head, loss_weights,
                                             overlap)
        self.eval_label = eval_label or self.labels[-1]
        if self.eval_label not in self.label_specs:
            raise ConfigError(f"detector-v4: eval_label={self.eval_label!r} is not one of labels {self.labels}")
        self.point_filter_cfg = deepcopy(point_filter) if point_filter else None
        self.filter_loss_weight = float(filter_loss_weight)
        self.backbone = MODELS.build(backbone)
        declared = getattr(self.backbone, "out_channels", None)
        if isinstance(declared, int) and declared != full_in_channels:
            raise ConfigError(f"detector-v4: full_in_channels={full_in_channels} but the backbone "
                              f"{backbone.get('type')!r} gives {declared} channels per point after up-casting")
        # Kept out of the state dict, as upstream's (a plain object there): its checkpoints hold no loss state.
        self.criteria_by_label = {label: self._criterion(label, criteria, criteria_by_label) for label in self.labels}
        self.decoder = QueryDecoder(self.label_specs, full_in_channels, hidden_channels, num_heads, depth, mlp_ratio,
                                    qkv_bias, qk_scale, attn_drop, proj_drop, drop_path, layer_scale, norm_layer,
                                    act_layer, pre_norm, upcast_attention, pos_emb, mlp_point_proj,
                                    supervise_attn_mask, self.point_filter_cfg, owner="detector-v4")
        if attn_mask_anneal:
            self.decoder.set_attn_mask_anneal(True, attn_mask_anneal_steps, attn_mask_warmup_steps,
                                              attn_mask_progressive, attn_mask_progressive_delay)
        self.postprocess_cfg = dict(stuff_threshold=stuff_threshold, mask_threshold=mask_threshold,
                                    conf_threshold=conf_threshold, nms_kernel=nms_kernel, nms_sigma=nms_sigma,
                                    nms_pre=nms_pre, nms_max=nms_max, min_points=min_points,
                                    fill_uncovered=fill_uncovered)

    @classmethod
    def label_classes(cls, args: dict) -> dict[str, int]:
        """Label name -> its number of classes, for the evaluators of this
        model (empty when the arguments do not make labels; building says why)."""
        labels = args.get("labels", ("particle",))
        labels = (labels,) if isinstance(labels, str) else tuple(labels or ())
        try:
            specs = build_label_specs(labels, fold_query_heads(args.get("label_configs"), labels,
                                                               args.get("query_heads")),
                                      args.get("num_queries"), args.get("num_classes"), args.get("stuff_classes"))
        except (ConfigError, TypeError, ValueError):
            return {}
        return {label: spec["num_classes"] for label, spec in specs.items()}

    def _criterion(self, label: str, criteria, criteria_by_label):
        """The label's criteria; an instance loss becomes FastUnifiedInstanceLoss
        and learns the label's query heads (only the keys the loss reads)."""
        base = criteria_by_label[label] if criteria_by_label and label in criteria_by_label else criteria
        if base is None:
            return None
        spec = self.label_specs[label]
        configs = []
        for cfg in base:
            cfg = deepcopy(cfg)
            if isinstance(cfg, dict) and cfg.get("type") in _INSTANCE_LOSSES:
                legacy = cfg.pop("regression_targets", None)  # upstream's older spelling of the heads
                heads = cfg.get("query_heads", spec["query_heads"] or legacy)
                cfg.update(type="FastUnifiedInstanceLoss", overlap=cfg.get("overlap", spec["overlap"]),
                           query_heads=[{k: v for k, v in h.items() if k in LOSS_HEAD_KEYS} for h in heads or []])
            configs.append(cfg)
        return build_criteria(configs)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for criterion in self.criteria_by_label.values():
            if criterion is not None:
                criterion._apply(fn, recurse)
        return self

    # -- annealing (AttentionMaskAnnealingHook) -------------------------------------
    def update_anneal_step(self, step: int) -> None:
        self.decoder.update_anneal_step(step)

    def anneal_factors(self) -> list[float]:
        return [block.get_anneal_factor() for block in self.decoder.blocks]

    # -- forward ----------------------------------------------------------------------
    def _segment_key(self, input_dict: dict, spec) -> str:
        fallback = spec.get("segment_fallback_key")
        if spec["segment_key"] not in input_dict and fallback is not None and fallback in input_dict:
            return fallback
        return spec["segment_key"]

    def _task_input(self, input_dict: dict, label: str) -> dict:
        spec = self.label_specs[label]
        keys = (spec["instance_key"], self._segment_key(input_dict, spec))
        missing = [key for key in keys if key not in input_dict]
        if missing:
            raise ConfigError(f"detector-v4: label {label!r} trains on the batch keys {keys[0]!r} and {keys[1]!r}; "
                              f"the batch lacks {missing} (add them to Collect)")
        return {**input_dict, "instance": input_dict[keys[0]], "segment": input_dict[keys[1]]}

    def _stuff_loss(self, label: str, logits: torch.Tensor, task_input: dict) -> torch.Tensor:
        segment = _column(task_input["segment"]).to(logits.device)
        target = torch.zeros_like(logits)
        for cls in self.label_specs[label]["stuff_classes"]:
            target[segment == int(cls)] = 1.0
        return F.binary_cross_entropy_with_logits(logits, target)

    def _filter_loss(self, logits: torch.Tensor, input_dict: dict):
        key = self._segment_key(input_dict, self.label_specs[self.eval_label])
        loss = self.decoder.point_filter.loss(logits, input_dict[key]) if key in input_dict else None
        return None if loss is None else self.filter_loss_weight * loss

    def forward(self, input_dict: dict, return_point: bool = False) -> dict:
        feat, point = DefaultSegmentorV2.point_features(self.backbone(input_dict))
        coord = point["coord"] if point is not None and "coord" in point else input_dict["coord"]
        offset = point["offset"] if point is not None and "offset" in point else input_dict["offset"]
        gt_segment = None
        if self.point_filter_cfg and self.training:
            gt_segment = input_dict.get(self._segment_key(input_dict, self.label_specs[self.eval_label]))
        outputs = self.decoder(feat, coord, offset, with_aux=self.training, gt_segment=gt_segment)
        filter_logits = outputs.pop("__filter_logits__", None)
        result, loss = {}, None
        for label, spec in self.label_specs.items():
            prediction = outputs[label]
            if not self.training:
                for key in ("seg_logits", "pred_logits", "pred_masks"):
                    result[f"{label}_{key}"] = prediction.get(key)
                for head in spec["query_heads"]:
                    result[f"{label}_{head['pred_key']}"] = prediction[head["pred_key"]]
                if "stuff_probs" in prediction:
                    result[f"{label}_stuff_probs"] = prediction["stuff_probs"]
            has_truth = spec["instance_key"] in input_dict and self._segment_key(input_dict, spec) in input_dict
            if not (has_truth or self.training):
                continue
            task_input = self._task_input(input_dict, label)
            criterion = self.criteria_by_label[label]
            if criterion is None:
                if self.training:
                    raise ConfigError(f"detector-v4: label {label!r} has no loss to train with; give "
                                      "criteria=[dict(type='FastUnifiedInstanceLoss', ...)]")
                continue
            value = criterion(prediction, task_input)
            task_loss, components = value if isinstance(value, tuple) else (value, {})
            task_loss = task_loss * spec["loss_weight"]
            result[f"{label}_loss"] = task_loss
            result.update({f"{label}_{key}": v for key, v in components.items()})
            loss = task_loss if loss is None else loss + task_loss
            if spec["use_stuff_head"] and "stuff_logits" in prediction:
                stuff = self._stuff_loss(label, prediction["stuff_logits"], task_input)
                result[f"{label}_stuff_loss"] = stuff
                loss = loss + stuff
        if filter_logits is not None and self.training:
            filter_loss = self._filter_loss(filter_logits, input_dict)
            if filter_loss is not None:
                result["filter_loss"] = filter_loss
                loss = filter_loss if loss is None else loss + filter_loss
        if not self.training:
            self._add_predictions(result, outputs, offset)
        if return_point and point is not None:
            self._annotate(point, outputs, input_dict)
        if loss is not None:
            result["loss"] = loss
        if return_point:
            result["point"] = point
        return result

    def _add_predictions(self, result: dict, outputs: dict, offset: torch.Tensor) -> None:
        result["outputs_by_label"] = outputs
        for key in ("seg_logits", "pred_logits", "pred_masks"):
            result[f"{key}_by_label"] = {label: out[key] for label, out in outputs.items()}
        result["pred_regression_by_label"] = {label: out.get("pred_regression", {}) for label, out in outputs.items()}
        primary = outputs[self.eval_label]
        for key in ("seg_logits", "pred_logits", "pred_masks", "pred_regression"):
            result[key] = primary.get(key)
        for head in self.label_specs[self.eval_label]["query_heads"]:
            result[head["pred_key"]] = primary[head["pred_key"]]
        result["stuff_probs"] = primary.get("stuff_probs")
        result["point_counts"] = torch.diff(offset.long(), prepend=offset.new_zeros(1))

    def _annotate(self, point, outputs: dict, input_dict: dict) -> None:
        """``return_point``: the eval label's predictions and truth on the point, as upstream's."""
        primary, spec = outputs[self.eval_label], self.label_specs[self.eval_label]
        point.update(outputs=primary, outputs_by_label=outputs, pred_cls=primary["pred_logits"],
                     pred_masks=primary["pred_masks"], pred_logits=primary["seg_logits"],
                     pred_regression=primary.get("pred_regression"))
        if spec["instance_key"] in input_dict:
            point["instance"] = input_dict[spec["instance_key"]]
        if self._segment_key(input_dict, spec) in input_dict:
            point["segment"] = input_dict[self._segment_key(input_dict, spec)]

    # -- panoptic fusion ------------------------------------------------------------
    def postprocess(self, forward_output: dict, label: str | None = None, stuff_threshold: float | None = None,
                    mask_threshold: float | None = None, conf_threshold: float | None = None,
                    nms_kernel: str | None = None, nms_sigma: float | None = None, nms_pre: int | None = None,
                    nms_max: int | None = None, min_points: int | None = None,
                    background_class_label: int | None = None, fill_uncovered: bool | None = None) -> dict:
        """Per-point instances of one label (default ``eval_label``) from an
        evaluation ``forward`` output; a given keyword replaces the model's
        setting for this call."""
        label = label or self.eval_label
        if label not in self.label_specs:
            raise KeyError(f"detector-v4: no label {label!r}; labels are {', '.join(self.labels)}")
        overrides = dict(stuff_threshold=stuff_threshold, mask_threshold=mask_threshold,
                         conf_threshold=conf_threshold, nms_kernel=nms_kernel, nms_sigma=nms_sigma, nms_pre=nms_pre,
                         nms_max=nms_max, min_points=min_points, background_class_label=background_class_label,
                         fill_uncovered=fill_uncovered)
        options = {**self.postprocess_cfg, **{k: v for k, v in overrides.items() if v is not None}}
        masks, logits, stuff, regression, counts = select_label_outputs(forward_output, label)
        return postprocess_batch(masks, logits, stuff, regression, counts,
                                 stuff_classes=self.label_specs[label]["stuff_classes"], **options)
