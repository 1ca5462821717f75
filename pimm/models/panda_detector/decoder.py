"""The shared query decoder of both detectors (``detector-v5``,
``detector-v4``) under upstream's names (``decoder.query_feat``,
``decoder.blocks.<i>``, ``decoder.cls_pred_by_label``, ``decoder.head_by_key``,
``decoder.stuff_head_by_label``, ``decoder.point_filter.head``), and its
optional pre-attention point filter.

Every label ("particle", "interaction", ...) owns a slice of one learned
query bank; all queries go through the same blocks, so labels share the
attention to the points, while class, stuff and query heads stay per label
(their output sizes differ). Points arrive packed (N, C) with the batch's
``offset`` and are padded per event for batched attention. Per label and
event the decoder returns the (Q, P_b) mask logits, the (Q, C+1) class logits
(last: "no object"), each query head's output and the per-point semantic
logits ``logsumexp_q(mask + class)`` (N, C), plus a stuff head's per-point
logits when the label has one.

A label spec reads as attributes (``num_queries``, ``num_classes``,
``use_stuff_head``, ``query_heads``; each head ``name``, ``out_dim``,
``squeezed``, ``head_mlp``, ``use_class_logits``, ``detach_class_logits``,
``unit_normalize``, ``pred_key``): v5's :class:`.specs.LabelSpec` and v4's
:class:`.specs_v4.Settings` both do.

``point_filter`` drops points before the cross-attention (``type="stuff"``:
a learned per-point head keeps ``sigmoid < threshold``, or the truth's
non-``drop_classes`` points while training with ``train_filter_use_gt``;
``"energy_threshold"``: keeps ``feat[:, energy_channel] > energy_threshold``);
the dropped points' mask logits are -1e4.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pimm.utils.errors import ConfigError

from .layers import MLP, Block

__all__ = ["PointFilter", "QueryDecoder", "pad_by_offset"]

_DROPPED = -1e4  # mask logit of a point the filter removed


def pad_by_offset(values: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Packed (N, ...) rows -> (B, P_max, ...) padded with zeros, the (B, P_max)
    validity mask and the per-event counts."""
    counts = torch.diff(offset.long(), prepend=offset.new_zeros(1)).tolist()
    width = max(counts) if counts else 0
    padded = values.new_zeros((len(counts), width) + values.shape[1:])
    valid = torch.zeros(len(counts), width, dtype=torch.bool, device=values.device)
    start = 0
    for b, n in enumerate(counts):
        padded[b, :n] = values[start:start + n]
        valid[b, :n] = True
        start += n
    return padded, valid, counts


def _init_linear(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


class PointFilter(nn.Module):
    """Which points the decoder attends to (module doc); keeps at least one."""

    def __init__(self, type: str = "stuff", full_in_channels: int = 0, hidden_channels: int = 256,
                 threshold: float = 0.5, drop_classes=None, train_filter_use_gt: bool = False,
                 energy_channel: int = 0, energy_threshold: float = 0.0):
        super().__init__()
        if type not in ("stuff", "energy_threshold"):
            raise ValueError(f"point_filter type must be 'stuff' or 'energy_threshold', got {type!r}")
        self.type, self.threshold = type, float(threshold)
        self.drop_classes = [int(c) for c in drop_classes or []]
        self.train_filter_use_gt = bool(train_filter_use_gt)
        self.energy_channel, self.energy_threshold = int(energy_channel), float(energy_threshold)
        self.head = (nn.Sequential(nn.Linear(full_in_channels, hidden_channels), nn.ReLU(),
                                   nn.Linear(hidden_channels, 1)) if type == "stuff" else None)

    def forward(self, feat: torch.Tensor, gt_segment: torch.Tensor | None = None) -> tuple:
        """-> (keep (N,) bool, filter logits (N,) or None)."""
        logits = None
        if self.type == "stuff":
            logits = self.head(feat).squeeze(-1)
            if self.training and self.train_filter_use_gt and gt_segment is not None and self.drop_classes:
                segment = gt_segment.reshape(-1).to(feat.device)
                keep = ~torch.isin(segment, segment.new_tensor(self.drop_classes))
            else:
                keep = logits.sigmoid() < self.threshold
        else:
            keep = feat[:, self.energy_channel] > self.energy_threshold
        if not keep.any():  # the decoder needs a point to attend to
            keep = keep.clone()
            keep[0] = True
        return keep, logits

    def loss(self, logits: torch.Tensor, segment: torch.Tensor) -> torch.Tensor | None:
        """BCE of the learned filter's logits against "the point's true class
        is a drop class" (None without drop classes)."""
        if not self.drop_classes:
            return None
        segment = segment.reshape(-1).to(logits.device)
        target = torch.isin(segment, segment.new_tensor(self.drop_classes)).to(logits.dtype)
        return F.binary_cross_entropy_with_logits(logits, target)


class QueryDecoder(nn.Module):
    """Learned queries decoded against the points, heads per label (module doc)."""

    def __init__(self, label_specs: dict, full_in_channels: int, hidden_channels: int, num_heads: int,
                 depth: int = 3, mlp_ratio: float = 4.0, qkv_bias: bool = False, qk_scale: float | None = None,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, drop_path: float = 0.0,
                 layer_scale: float | None = None, norm_layer=nn.LayerNorm, act_layer=nn.GELU,
                 pre_norm: bool = True, upcast_attention: bool = False, pos_emb: bool = True,
                 mlp_point_proj: bool = False, supervise_attn_mask: bool = True, point_filter_cfg: dict | None = None,
                 owner: str = "detector"):
        super().__init__()
        self.label_specs, self.labels = label_specs, tuple(label_specs)
        self.query_slices, start = {}, 0
        for label, spec in label_specs.items():
            self.query_slices[label] = (start, start + spec.num_queries)
            start += spec.num_queries
        self.total_queries, self.supervise_attn_mask = start, supervise_attn_mask
        self.query_feat = nn.Embedding(start, hidden_channels)
        self.query_embed = nn.Embedding(start, hidden_channels)
        self.pos_emb = (nn.Sequential(nn.Linear(3, hidden_channels), nn.GELU(),
                                      nn.Linear(hidden_channels, hidden_channels)) if pos_emb else None)
        self.blocks = nn.ModuleList(
            Block(hidden_channels, num_heads, mlp_ratio, qkv_bias, qk_scale, attn_drop, proj_drop, drop_path,
                  layer_scale, norm_layer, act_layer, pre_norm, upcast_attention,
                  supervise_attn_mask=supervise_attn_mask, is_last_block=i == depth - 1)
            for i in range(depth))
        self.final_norm = norm_layer(hidden_channels)
        self.full_point_proj = (MLP(full_in_channels, hidden_channels, hidden_channels) if mlp_point_proj
                                else nn.Linear(full_in_channels, hidden_channels))
        self.cls_pred = nn.Identity()
        make_head = (lambda i, o: MLP(i, hidden_channels, o)) if mlp_point_proj else nn.Linear
        self.cls_pred_by_label = nn.ModuleDict({label: make_head(hidden_channels, spec.num_classes + 1)
                                                for label, spec in label_specs.items()})
        self.stuff_head_by_label = nn.ModuleDict({
            label: nn.Sequential(nn.Linear(full_in_channels, hidden_channels), nn.ReLU(),
                                 nn.Linear(hidden_channels, 1))
            for label, spec in label_specs.items() if spec.use_stuff_head})
        self.head_by_key = nn.ModuleDict()
        for label, spec in label_specs.items():
            for head in spec.query_heads:
                width = hidden_channels + (spec.num_classes if head.use_class_logits else 0)
                self.head_by_key[self.head_key(label, head.name)] = (
                    MLP(width, hidden_channels, head.out_dim) if head.head_mlp else nn.Linear(width, head.out_dim))
        self.point_filter = None
        if point_filter_cfg:
            cfg = dict(point_filter_cfg)
            cfg.setdefault("full_in_channels", full_in_channels)
            cfg.setdefault("hidden_channels", hidden_channels)
            try:
                self.point_filter = PointFilter(**cfg)
            except TypeError as err:  # an unknown or a missing argument
                raise ConfigError(f"{owner}: point_filter: {err}".replace("__init__() ", "")) from None
            except ValueError as err:
                raise ConfigError(f"{owner}: {err}") from None
        self.apply(_init_linear)

    @staticmethod
    def head_key(label: str, name: str) -> str:
        return f"{label}__{name}".replace(".", "_").replace("/", "_")

    # -- annealing ----------------------------------------------------------------
    def set_attn_mask_anneal(self, enable: bool, anneal_steps: int = 10000, warmup_steps: int = 0,
                             progressive: bool = False, progressive_delay: int = 0) -> None:
        """Anneal every block's mask bias; ``progressive``: block i starts
        ``i * progressive_delay`` steps later."""
        for i, block in enumerate(self.blocks):
            block.attn_mask_anneal, block.attn_mask_anneal_steps = enable, anneal_steps
            block.attn_mask_warmup_steps = warmup_steps + (i * progressive_delay if progressive else 0)

    def update_anneal_step(self, step: int) -> None:
        for block in self.blocks:
            block.set_anneal_step(step)

    # -- decoding -----------------------------------------------------------------
    def forward(self, feat: torch.Tensor, coord: torch.Tensor, offset: torch.Tensor, with_aux: bool,
                gt_segment: torch.Tensor | None = None) -> dict:
        """Up-cast point features (N, full_in_channels) -> {label: predictions}
        (and ``"__filter_logits__"`` with a learned point filter)."""
        counts = torch.diff(offset.long(), prepend=offset.new_zeros(1))
        keep, filter_logits = None, None
        dec_feat, dec_coord, dec_offset = feat, coord, offset
        if self.point_filter is not None:
            keep, filter_logits = self.point_filter(feat, gt_segment)
            batch = torch.repeat_interleave(torch.arange(len(counts), device=feat.device), counts)
            dec_feat, dec_coord = feat[keep], coord[keep]
            dec_offset = torch.bincount(batch[keep], minlength=len(counts)).cumsum(0)
        points, valid, _ = pad_by_offset(self.full_point_proj(dec_feat), dec_offset)
        pos_k = (pad_by_offset(self.pos_emb(dec_coord.to(points.dtype)), dec_offset)[0]
                 if self.pos_emb is not None else None)
        queries = self.query_feat.weight.unsqueeze(0).expand(points.shape[0], -1, -1)
        pos_q = self.query_embed.weight.unsqueeze(0).expand(points.shape[0], -1, -1)
        layers = []  # (normed queries after the block, the masks the block predicted)
        for block in self.blocks:
            queries, masks = block(queries, points, valid, pos_q, pos_k)
            layers.append((self.final_norm(queries), masks))
        counts = counts.tolist()
        unpad = self._unpad(valid, keep, counts)
        final_q, final_masks = layers[-1]
        out = {label: self._predict(label, final_q, unpad(final_masks), counts) for label in self.labels}
        if with_aux:
            for label in self.labels:
                aux = [self._predict(label, q, unpad(m), counts) for q, m in layers[:-1] if m is not None]
                if aux:
                    out[label]["aux_outputs"] = aux
        for label, head in self.stuff_head_by_label.items():
            logits = head(feat).squeeze(-1)
            out[label]["stuff_logits"], out[label]["stuff_probs"] = logits, logits.sigmoid()
        if filter_logits is not None:
            out["__filter_logits__"] = filter_logits
        return out

    @staticmethod
    def _unpad(valid: torch.Tensor, keep: torch.Tensor | None, counts: list[int]):
        """Padded (B, Q, P_max) mask logits -> one (Q, P_b) tensor per event
        over all its points (a filtered-out point: -1e4)."""
        def unpad(masks: torch.Tensor) -> list[torch.Tensor]:
            kept = [m[:, v] for m, v in zip(masks, valid)]
            if keep is None:
                return kept
            events, start = [], 0
            for m, n in zip(kept, counts):
                full = m.new_full((m.shape[0], n), _DROPPED)
                full[:, keep[start:start + n]] = m
                events.append(full)
                start += n
            return events
        return unpad

    def _head_values(self, label: str, queries: torch.Tensor, classes: torch.Tensor) -> dict:
        spec, values = self.label_specs[label], {}
        for head in spec.query_heads:
            x = queries
            if head.use_class_logits:
                cls = classes[..., :spec.num_classes]
                x = torch.cat([x, cls.detach() if head.detach_class_logits else cls], dim=-1)
            y = self.head_by_key[self.head_key(label, head.name)](x)
            if head.unit_normalize:  # a direction head: on the unit sphere, like its target
                y = F.normalize(y, dim=-1, eps=1e-6)
            if head.squeezed and y.shape[-1] == 1:
                y = y.squeeze(-1)
            values[head.name] = (head, y)
        return values

    def _predict(self, label: str, queries: torch.Tensor, masks: list[torch.Tensor], counts: list[int]) -> dict:
        """One label's outputs from (B, Q_all, C) queries and per-event (Q_all, P_b) masks."""
        first, last = self.query_slices[label]
        num_classes = self.label_specs[label].num_classes
        queries = queries[:, first:last]
        classes = self.cls_pred_by_label[label](queries)  # (B, Q, C+1)
        heads = self._head_values(label, queries, classes)
        event_masks = [m[first:last] for m in masks]
        event_classes = list(classes.unbind(0))
        # per-point class logits: the queries' vote, each weighted by its mask logit ("no object" left out)
        semantic = [torch.logsumexp(m.transpose(0, 1).unsqueeze(-1) + c[:, :num_classes].unsqueeze(0), dim=1)
                    if m.shape[0] else m.new_zeros(n, num_classes)
                    for m, c, n in zip(event_masks, event_classes, counts)]
        out = {"pred_masks": event_masks, "pred_logits": event_classes,
               "seg_logits": torch.cat(semantic) if semantic else queries.new_zeros(0, num_classes)}
        if heads:
            out["pred_regression"] = {}
            for name, (head, values) in heads.items():
                per_event = list(values.unbind(0))
                out["pred_regression"][name] = per_event
                out[head.pred_key] = per_event
        return out
