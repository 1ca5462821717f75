"""The detector's shared query decoder and its per-label heads.

Every label ("particle", "interaction", ...) owns a slice of one learned
query bank; all queries go through the same decoder blocks, so labels share
the attention to the points, while class, stuff and extra query heads stay
per label (their output sizes differ). Points arrive packed (N, C) with the
batch's ``offset``; the decoder pads them per event for batched attention and
hands back, per label and event, the (Q, P_b) mask logits, the (Q, C+1) class
logits (last: "no object"), each query head's (Q, D) output, and the per-point
semantic logits ``logsumexp_q(mask + class)`` (N, C).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import MLP, DecoderBlock
from .specs import LabelSpec

__all__ = ["QueryDecoder", "pad_by_offset"]


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


class QueryDecoder(nn.Module):
    """Learned queries decoded against point features, heads per label."""

    def __init__(self, labels: dict[str, LabelSpec], full_in_channels: int, hidden_channels: int, num_heads: int,
                 depth: int = 3, mlp_ratio: float = 4.0, qkv_bias: bool = False, qk_scale: float | None = None,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, drop_path: float = 0.0,
                 layer_scale: float | None = None, norm_layer=nn.LayerNorm, act_layer=nn.GELU,
                 pre_norm: bool = True, upcast_attention: bool = False, pos_emb: bool = True,
                 mlp_point_proj: bool = False, supervise_attn_mask: bool = True):
        super().__init__()
        self.labels = labels
        self.slices, start = {}, 0
        for name, spec in labels.items():
            self.slices[name] = (start, start + spec.num_queries)
            start += spec.num_queries
        self.total_queries = start
        self.supervise_attn_mask = supervise_attn_mask
        self.query_feat = nn.Embedding(start, hidden_channels)
        self.query_embed = nn.Embedding(start, hidden_channels)
        self.pos_emb = (nn.Sequential(nn.Linear(3, hidden_channels), nn.GELU(),
                                      nn.Linear(hidden_channels, hidden_channels)) if pos_emb else None)
        # supervise_attn_mask: every block predicts masks (deep supervision) and
        # uses them as attention bias; otherwise only the last block predicts
        # the final masks and no block's attention is masked.
        self.blocks = nn.ModuleList(
            DecoderBlock(hidden_channels, num_heads, mlp_ratio, qkv_bias, qk_scale, attn_drop, proj_drop, drop_path,
                         layer_scale, norm_layer, act_layer, pre_norm, upcast_attention,
                         with_mask=supervise_attn_mask or i == depth - 1, use_mask_as_bias=supervise_attn_mask)
            for i in range(depth))
        self.final_norm = norm_layer(hidden_channels)
        self.full_point_proj = (MLP(full_in_channels, hidden_channels, hidden_channels) if mlp_point_proj
                           else nn.Linear(full_in_channels, hidden_channels))
        make_head = (lambda i, o: MLP(i, hidden_channels, o)) if mlp_point_proj else nn.Linear
        self.cls_pred_by_label = nn.ModuleDict({n: make_head(hidden_channels, s.num_classes + 1)
                                                for n, s in labels.items()})
        self.stuff_head_by_label = nn.ModuleDict({
            n: nn.Sequential(nn.Linear(full_in_channels, hidden_channels), nn.ReLU(), nn.Linear(hidden_channels, 1))
            for n, s in labels.items() if s.use_stuff_head})
        self.head_by_key = nn.ModuleDict()
        for name, spec in labels.items():
            for head in spec.query_heads:
                width = hidden_channels + (spec.num_classes if head.use_class_logits else 0)
                self.head_by_key[self.head_key(name, head.name)] = (
                    MLP(width, hidden_channels, head.out_dim) if head.head_mlp else nn.Linear(width, head.out_dim))
        self.apply(_init_linear)

    @staticmethod
    def head_key(label: str, name: str) -> str:
        return f"{label}__{name}".replace(".", "_").replace("/", "_")

    def set_anneal_factor(self, factor: float) -> None:
        for block in self.blocks:
            block.anneal_factor.fill_(float(factor))

    def anneal_factors(self) -> list[float]:
        return [float(block.anneal_factor) for block in self.blocks]

    # -- decoding ---------------------------------------------------------------
    def forward(self, feat: torch.Tensor, coord: torch.Tensor, offset: torch.Tensor, with_aux: bool) -> dict:
        """Packed up-cast features (N, full_in_channels) -> per-label predictions."""
        points, valid, counts = pad_by_offset(self.full_point_proj(feat), offset)
        pos_k = pad_by_offset(self.pos_emb(coord.to(points.dtype)), offset)[0] if self.pos_emb is not None else None
        batch = points.shape[0]
        queries = self.query_feat.weight.unsqueeze(0).expand(batch, -1, -1)
        pos_q = self.query_embed.weight.unsqueeze(0).expand(batch, -1, -1)
        layers = []  # (normed queries after the block, mask logits the block predicted)
        for block in self.blocks:
            queries, masks = block(queries, points, valid, pos_q, pos_k)
            layers.append((self.final_norm(queries), masks))
        final_q, final_masks = layers[-1]
        out = {name: self._predict(name, final_q, final_masks, counts) for name in self.labels}
        if with_aux and self.supervise_attn_mask:
            for name in self.labels:
                out[name]["aux_outputs"] = [self._predict(name, q, m, counts) for q, m in layers[:-1]]
        for name in self.stuff_head_by_label:
            logits = self.stuff_head_by_label[name](feat).squeeze(-1)
            out[name]["stuff_logits"], out[name]["stuff_probs"] = logits, logits.sigmoid()
        return out

    def _head_values(self, label: str, queries: torch.Tensor, classes: torch.Tensor) -> dict:
        spec, values = self.labels[label], {}
        for head in spec.query_heads:
            x = queries
            if head.use_class_logits:
                cls = classes[..., :spec.num_classes]
                x = torch.cat([x, cls.detach() if head.detach_class_logits else cls], dim=-1)
            y = self.head_by_key[self.head_key(label, head.name)](x)
            if head.unit_normalize:
                y = F.normalize(y, dim=-1, eps=1e-6)
            if head.squeezed and y.shape[-1] == 1:
                y = y.squeeze(-1)
            values[head.name] = (head, y)
        return values

    def _predict(self, label: str, queries: torch.Tensor, masks: torch.Tensor, counts: list[int]) -> dict:
        """One label's outputs from (B, Q_all, C) queries and (B, Q_all, P) masks."""
        first, last = self.slices[label]
        spec = self.labels[label]
        queries, masks = queries[:, first:last], masks[:, first:last]
        classes = self.cls_pred_by_label[label](queries)  # (B, Q, C+1)
        heads = self._head_values(label, queries, classes)
        event_masks = [masks[b, :, :n] for b, n in enumerate(counts)]
        event_classes = list(classes.unbind(0))
        # Per-point semantic logits: a soft vote of the queries, each weighted by
        # its mask logit, over the real classes ("no object" left out).
        semantic = [torch.logsumexp(m.transpose(0, 1).unsqueeze(-1) + c[:, :spec.num_classes].unsqueeze(0), dim=1)
                    for m, c in zip(event_masks, event_classes)]
        out = {"pred_masks": event_masks, "pred_logits": event_classes,
               "seg_logits": torch.cat(semantic, dim=0) if semantic else masks.new_zeros(0, spec.num_classes)}
        if heads:
            out["pred_regression"] = {}
            for head, values in heads.values():
                per_event = list(values.unbind(0))
                out[head.pred_key] = per_event
                out["pred_regression"][head.name] = per_event
        return out
