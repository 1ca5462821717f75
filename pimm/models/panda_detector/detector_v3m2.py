"""``detector-v3m2``: upstream pimm's multi-label Panda detector before
``detector-v4`` (upstream's ``MultiLabelDetectorV3M2`` of ``detector_v3m2.py``),
with its arguments, defaults, state-dict names and output keys, so its
configs build and its checkpoints load strictly.

v4 grew out of it and kept its decoder: a point backbone (with
``enc_mode=True`` every encoder level is concatenated back onto the points,
``full_in_channels`` wide), one learned query bank sliced per label, masked
cross-attention blocks, a class head and (``use_stuff_head``, on by default
here) a point-wise stuff head per label. The decoder is pimm's shared one
(:mod:`.decoder`) without query heads or point filter -- then its weights
are v3m2's, name for name. What v3m2 lacks against v4: query heads, the
point filter, overlapping instances. Its own rules: ``num_queries`` is given
per label (no default from ``label_configs``), an instance loss named
``InstanceSegmentationLoss`` trains as ``FastInstanceSegmentationLoss``,
and ``train_filter_use_gt`` is refused.

Outputs: training: ``loss``, per label ``<label>_loss``, the loss's
components as ``<label>_<name>`` and ``<label>_stuff_loss``. Evaluation adds
per label ``<label>_seg_logits`` / ``_pred_logits`` / ``_pred_masks`` /
``_stuff_probs``, the ``*_by_label`` maps, ``outputs_by_label``, the
``eval_label``'s predictions under the plain keys and ``point_counts``; the
losses too when the batch has the truth. :meth:`MultiLabelDetectorV3M2.postprocess`
is v4's panoptic fusion (:mod:`.postprocess`).
"""

from __future__ import annotations

from copy import deepcopy

import torch
import torch.nn.functional as F
from torch import nn

from pimm.engines.registries import MODELS
from pimm.models.losses import build_criteria
from pimm.models.segmentor_v2 import DefaultSegmentorV2
from pimm.utils.domains import (Anything, Bool, Choice, Count, DictOf, Int, Key, NonNeg, OneOf, Prob, Real,
                                Registered, Seq, Size, Weight)
from pimm.utils.errors import ConfigError

from .decoder import QueryDecoder
from .postprocess import postprocess_batch, select_label_outputs
from .specs_v4 import _LABEL_DEFAULTS, Settings, select

__all__ = ["MultiLabelDetectorV3M2"]

_NAME = "detector-v3m2"
_LOSSES = Seq(Registered("loss"), what="a list of dict(type=...) losses")


def _per_label(item):
    """A per-label argument: one value for every label, a list in label order, or a dict by label."""
    return OneOf(item, Seq(item), DictOf(Key, item))


def _column(t: torch.Tensor) -> torch.Tensor:
    return t.squeeze(1) if t.dim() == 2 and t.shape[1] == 1 else t


def label_specs(labels: tuple, label_configs, num_queries=32, num_classes=None, stuff_classes=None,
                use_stuff_head=True, loss_weights=None) -> dict[str, Settings]:
    """One settings dict per label: the per-label arguments (one value, a
    list in label order or a dict by label) over ``label_configs[label]``
    over the built-in ``particle`` / ``interaction`` defaults (v4's)."""
    label_configs = label_configs or {}
    if not isinstance(label_configs, dict):
        raise ConfigError(f"{_NAME}: label_configs must be a dict of label name -> settings, got {label_configs!r}")
    specs = {}
    for index, label in enumerate(labels):
        spec = Settings(deepcopy(_LABEL_DEFAULTS.get(label, {})))
        own = label_configs.get(label, {})
        if not isinstance(own, dict):
            raise ConfigError(f"{_NAME}: label_configs.{label} must be a dict, got {own!r}")
        spec.update(deepcopy(own))
        queries = select(num_queries, labels, label, index, None)
        classes = select(num_classes, labels, label, index, spec.get("num_classes"))
        for key, value in (("num_queries", queries), ("num_classes", classes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                hint = f"; give {key} (per label: a dict by label name)" if value is None else ""
                raise ConfigError(f"{_NAME}: label {label!r}: {key} must be an int >= 1, got {value!r}{hint}")
        stuff = list(select(stuff_classes, labels, label, index, spec.get("stuff_classes", []),
                            lists_of_lists=True) or [])
        bad = [c for c in stuff if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < classes]
        if bad:
            raise ConfigError(f"{_NAME}: label {label!r}: stuff_classes {bad} are not classes 0..{classes - 1}")
        spec.setdefault("instance_key", f"instance_{label}")
        spec.setdefault("segment_key", f"segment_{label}")
        spec.update(num_queries=queries, num_classes=classes, stuff_classes=stuff,
                    use_stuff_head=bool(select(use_stuff_head, labels, label, index, True)),
                    loss_weight=float(select(loss_weights, labels, label, index, 1.0)), query_heads=[])
        specs[label] = spec
    return specs


def _fast_instance_loss(cfg):
    """v3m2's loss rule: ``InstanceSegmentationLoss`` trains as ``FastInstanceSegmentationLoss``."""
    cfg = deepcopy(cfg)
    if isinstance(cfg, dict) and cfg.get("type") == "InstanceSegmentationLoss":
        cfg["type"] = "FastInstanceSegmentationLoss"
    return cfg


@MODELS.register_module(_NAME)
class MultiLabelDetectorV3M2(nn.Module):
    """Backbone, shared query decoder, per-label losses and panoptic fusion (module doc)."""

    domains = dict(
        full_in_channels=Size, hidden_channels=Size, num_heads=Int(1, 1024),
        labels=OneOf(Key, Seq(Key, min_len=1)), num_queries=_per_label(Int(1, 4096)) | None,
        num_classes=_per_label(Size) | None, label_configs=DictOf(Key, DictOf(Key)) | None,
        loss_weights=_per_label(Weight) | None, eval_label=Key | None, backbone=Registered("model"),
        criteria=_LOSSES | None, criteria_by_label=DictOf(Key, _LOSSES) | None, depth=Int(1, 64),
        mlp_ratio=Real(0, 64, lo_open=True), qk_scale=Real(0, 1e3, lo_open=True) | None, attn_drop=Prob,
        proj_drop=Prob, drop_path=Prob, layer_scale=NonNeg | None,
        norm_layer=Anything("a normalisation layer class (default nn.LayerNorm)"),
        act_layer=Anything("an activation class (default nn.GELU)"), attn_mask_anneal_steps=Count,
        attn_mask_warmup_steps=Count, attn_mask_progressive_delay=Count, query_type=Choice("learned"),
        use_stuff_head=_per_label(Bool),
        stuff_classes=OneOf(Seq(Count), Seq(Seq(Count)), DictOf(Key, Seq(Count))) | None,
        stuff_threshold=Prob, mask_threshold=Prob, conf_threshold=Prob, nms_kernel=Choice("gaussian", "linear"),
        nms_sigma=Real(0, 1e3), nms_pre=Int(-1, 10**6), nms_max=Int(-1, 10**6), min_points=Count)

    def __init__(self, full_in_channels: int, hidden_channels: int, num_heads: int, labels=("particle",),
                 num_queries=32, num_classes=None, label_configs=None, loss_weights=None, eval_label=None,
                 backbone=None, criteria=None, criteria_by_label=None, depth: int = 3, mlp_ratio: float = 4.0,
                 qkv_bias: bool = False, qk_scale=None, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 drop_path: float = 0.0, layer_scale=None, norm_layer=nn.LayerNorm, act_layer=nn.GELU,
                 pre_norm: bool = True, enable_flash: bool = True, upcast_attention: bool = False,
                 upcast_softmax: bool = False, pos_emb: bool = True, attn_mask_anneal: bool = False,
                 attn_mask_anneal_steps: int = 10000, attn_mask_warmup_steps: int = 0,
                 attn_mask_progressive: bool = False, attn_mask_progressive_delay: int = 0, query_type="learned",
                 use_stuff_head=True, stuff_classes=None, supervise_attn_mask: bool = True,
                 train_filter_use_gt: bool = False, mlp_point_proj: bool = False, stuff_threshold: float = 0.5,
                 mask_threshold: float = 0.5, conf_threshold: float = 0.5, nms_kernel: str = "gaussian",
                 nms_sigma: float = 2.0, nms_pre: int = -1, nms_max: int = -1, min_points: int = 2,
                 fill_uncovered: bool = False):
        super().__init__()
        # enable_flash / upcast_softmax pick upstream's CUDA kernels; pimm's attention is one SDPA path.
        self.labels = (labels,) if isinstance(labels, str) else tuple(labels)
        if not self.labels:
            raise ConfigError(f"{_NAME}: labels must name at least one label, e.g. ('particle',)")
        if query_type != "learned":
            raise ConfigError(f"{_NAME}: query_type must be 'learned' (the only kind upstream builds), "
                              f"got {query_type!r}")
        if train_filter_use_gt:
            raise ConfigError(f"{_NAME}: train_filter_use_gt=True is not supported (the labels share one batch of "
                              "queries, so no label's truth may filter the cross-attention); use the stuff losses "
                              "and the postprocess thresholds, or detector-v4's point_filter")
        if hidden_channels % num_heads:
            raise ConfigError(f"{_NAME}: hidden_channels={hidden_channels} must be divisible by num_heads={num_heads}")
        if backbone is None:
            raise ConfigError(f"{_NAME}: backbone is required, e.g. backbone=dict(type='PT-v3m2', ...)")
        self.label_specs = label_specs(self.labels, label_configs, num_queries, num_classes, stuff_classes,
                                       use_stuff_head, loss_weights)
        self.eval_label = eval_label or self.labels[-1]
        if self.eval_label not in self.label_specs:
            raise ConfigError(f"{_NAME}: eval_label={self.eval_label!r} is not one of labels {self.labels}")
        self.backbone = MODELS.build(backbone)
        declared = getattr(self.backbone, "out_channels", None)
        if isinstance(declared, int) and declared != full_in_channels:
            raise ConfigError(f"{_NAME}: full_in_channels={full_in_channels} but the backbone "
                              f"{backbone.get('type')!r} gives {declared} channels per point after up-casting")
        # Kept out of the state dict, as upstream's (a plain object there): its checkpoints hold no loss state.
        self.criteria_by_label = {}
        for label in self.labels:
            cfg = criteria_by_label[label] if criteria_by_label and label in criteria_by_label else criteria
            self.criteria_by_label[label] = None if cfg is None else build_criteria(
                [_fast_instance_loss(c) for c in cfg])
        self.decoder = QueryDecoder(self.label_specs, full_in_channels, hidden_channels, num_heads, depth, mlp_ratio,
                                    qkv_bias, qk_scale, attn_drop, proj_drop, drop_path, layer_scale, norm_layer,
                                    act_layer, pre_norm, upcast_attention, pos_emb, mlp_point_proj,
                                    supervise_attn_mask, None, owner=_NAME)
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
            specs = label_specs(labels, args.get("label_configs"), args.get("num_queries", 32),
                                args.get("num_classes"), args.get("stuff_classes"))
        except (ConfigError, TypeError, ValueError):
            return {}
        return {label: spec["num_classes"] for label, spec in specs.items()}

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
            raise ConfigError(f"{_NAME}: label {label!r} trains on the batch keys {keys[0]!r} and {keys[1]!r}; the "
                              f"batch lacks {missing} (add them to Collect)")
        return {**input_dict, "instance": input_dict[keys[0]], "segment": input_dict[keys[1]]}

    def _stuff_loss(self, label: str, logits: torch.Tensor, task_input: dict) -> torch.Tensor:
        segment = _column(task_input["segment"]).to(logits.device)
        target = torch.zeros_like(logits)
        for cls in self.label_specs[label]["stuff_classes"]:
            target[segment == int(cls)] = 1.0
        return F.binary_cross_entropy_with_logits(logits, target)

    def forward(self, input_dict: dict, return_point: bool = False, return_decoder: bool = False) -> dict:
        if return_decoder:
            raise ConfigError(f"{_NAME}: return_decoder=True (upstream's decoder internals) is not built in pimm; "
                              "the predictions are in the output's outputs_by_label")
        feat, point = DefaultSegmentorV2.point_features(self.backbone(input_dict))
        coord = point["coord"] if point is not None and "coord" in point else input_dict["coord"]
        offset = point["offset"] if point is not None and "offset" in point else input_dict["offset"]
        outputs = self.decoder(feat, coord, offset, with_aux=self.training)
        result, loss = {}, None
        for label, spec in self.label_specs.items():
            prediction = outputs[label]
            if not self.training:
                for key in ("seg_logits", "pred_logits", "pred_masks"):
                    result[f"{label}_{key}"] = prediction.get(key)
                if "stuff_probs" in prediction:
                    result[f"{label}_stuff_probs"] = prediction["stuff_probs"]
            has_truth = spec["instance_key"] in input_dict and self._segment_key(input_dict, spec) in input_dict
            if not (has_truth or self.training):
                continue
            task_input = self._task_input(input_dict, label)
            criterion = self.criteria_by_label[label]
            if criterion is None:
                if self.training:
                    raise ConfigError(f"{_NAME}: label {label!r} has no loss to train with; give "
                                      "criteria=[dict(type='FastInstanceSegmentationLoss', ...)]")
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
        primary = outputs[self.eval_label]
        for key in ("seg_logits", "pred_logits", "pred_masks", "stuff_probs"):
            result[key] = primary.get(key)
        result["point_counts"] = torch.diff(offset.long(), prepend=offset.new_zeros(1))

    def _annotate(self, point, outputs: dict, input_dict: dict) -> None:
        """``return_point``: the eval label's predictions and truth on the point, as upstream's."""
        primary, spec = outputs[self.eval_label], self.label_specs[self.eval_label]
        point.update(outputs=primary, outputs_by_label=outputs, pred_cls=primary["pred_logits"],
                     pred_masks=primary["pred_masks"], pred_logits=primary["seg_logits"])
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
            raise KeyError(f"{_NAME}: no label {label!r}; labels are {', '.join(self.labels)}")
        overrides = dict(stuff_threshold=stuff_threshold, mask_threshold=mask_threshold,
                         conf_threshold=conf_threshold, nms_kernel=nms_kernel, nms_sigma=nms_sigma, nms_pre=nms_pre,
                         nms_max=nms_max, min_points=min_points, background_class_label=background_class_label,
                         fill_uncovered=fill_uncovered)
        options = {**self.postprocess_cfg, **{k: v for k, v in overrides.items() if v is not None}}
        masks, logits, stuff, _, counts = select_label_outputs(forward_output, label)
        return postprocess_batch(masks, logits, stuff, None, counts,
                                 stuff_classes=self.label_specs[label]["stuff_classes"], **options)
