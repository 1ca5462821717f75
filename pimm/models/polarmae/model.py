"""``PoLAr-MAE`` (masked point modelling of LArTPC events; Young et al., 2025)
and ``PoLArMAE-SemSeg`` (its segmentation fine-tune), with upstream pimm's
arguments.

Pre-training: an event's points (xyz and energy) become tokens (groups of
nearby points around well-spread centres, :class:`~.tokens.PointGrouping`),
a fraction ``masking_ratio`` of the tokens is hidden, the encoder sees the
visible ones, a decoder with cross attention to them predicts each hidden
group's points (Chamfer loss on xyz, or xyz and energy with
``mae_prediction="full"``) and, from the hidden group's positions through an
order-aware mini-PointNet, each point's energy (MSE): "energy infilling".

Fine-tuning: every token is encoded; the mean of chosen layers'
(normalised) outputs is interpolated back to every point from its
``upsampling_k`` nearest token centres, optionally with the event's pooled
token features, and a point-wise head classifies it.

Tokenizer presets per (``arch``, ``voxel_size``) are upstream's (radius in
units of the normalised detector, 768 * sqrt(3) / 2 voxels);
``tokenizer_kwargs`` overrides any of them (small models on this CPU use
fewer groups).
"""

from __future__ import annotations

from math import sqrt
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.config_domains import answers_with
from pimm.utils.domains import (Bool, Choice, DictOf, Domain, Int, NonNeg, PosInt, Prob, Real, Registered, Seq, Size,
                                show)
from pimm.utils.errors import ConfigError

from ..losses.base import CriteriaFitLogits, build_criteria
from .tokens import PointGrouping, chamfer_distance, knn, masked_gather, packed_to_padded, padded_to_packed
from .transformer import (VIT_CONFIGS, LearnedPositionalEncoder, MaskedBatchNorm1d, MaskedMiniPointNet,
                          make_transformer, masked_layer_norm)

__all__ = ["PoLArMAE", "PoLArMAESemSeg", "TOKENIZER_PRESETS"]

_SCALE = 768 * sqrt(3) / 2


def _preset(groups, context, points, radius, upscale, overlap):
    return dict(num_groups=groups, context_length=context, group_max_points=points, group_radius=radius / _SCALE,
                group_upscale_points=upscale, overlap_factor=overlap)


TOKENIZER_PRESETS = {("vit_small", 5): _preset(2048, 512, 32, 5, 256, 0.72),
                     ("vit_small", 2.5): _preset(2048, 1024, 24, 2.5, 64, 0.75),
                     ("vit_small", 25): _preset(256, 128, 128, 25, 2048, 0.72),
                     ("vit_tiny", 5): _preset(2048, 512, 32, 5, 256, 0.72),
                     ("vit_tiny", 2.5): _preset(2048, 1024, 24, 2.5, 64, 0.75),
                     ("vit_base", 5): _preset(2048, 512, 32, 5, 256, 0.72)}
_ARCH = Choice(*VIT_CONFIGS)


class _Fields(Domain):
    """None, or a dict whose keys are some of ``fields``, each value in its own
    domain (an error names the inner key)."""

    def __init__(self, **fields):
        self.fields = fields
        self.what = "None or a dict of " + ", ".join(fields)

    def accepts(self, value):
        return value is None or isinstance(value, dict) and all(
            k in self.fields and self.fields[k].accepts(v) for k, v in value.items())

    def __call__(self, key, value):
        if value is None:
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={show(value)} is invalid: it takes {self.what}")
        for name, item in value.items():
            if name not in self.fields:
                raise ConfigError(f"{key}: unknown key {name!r}; it takes {', '.join(self.fields)}")
            self.fields[name](f"{key}.{name}", item)
        return value


_RATE = Real(0, 1, hi_open=True)
_TRANSFORMER = _Fields(embed_dim=Size, depth=Int(1, 256), num_heads=Int(1, 256), mlp_ratio=Real(0, 64, lo_open=True),
                       qkv_bias=Bool, drop_rate=_RATE, attn_drop_rate=_RATE, drop_path_rate=_RATE,
                       add_pos_at_every_layer=Bool, postnorm=Bool)
_TOKENIZER = _Fields(num_groups=PosInt, context_length=PosInt, group_max_points=PosInt,
                     group_radius=Real(0, 1e6, lo_open=True), group_upscale_points=PosInt, overlap_factor=NonNeg,
                     rescale_by_group_radius=Bool | Real(0, 1e6, lo_open=True))


def _tokenizer(arch, voxel_size, overrides):
    cfg = dict(TOKENIZER_PRESETS.get((arch, voxel_size), TOKENIZER_PRESETS[("vit_small", 5)]))
    cfg.update(overrides or {})
    return PointGrouping(reduction_method="fps", **cfg)


def _embed(embedding, groups, point_mask, token_mask):
    """Embed the real tokens of (B, T, S, C) groups -> (B, T, D), zeros elsewhere."""
    flat = embedding(groups[token_mask], point_mask[token_mask].unsqueeze(1))
    tokens = groups.new_zeros(*token_mask.shape, flat.shape[-1])
    tokens[token_mask] = flat
    return tokens


def _take(x, idx):
    return masked_gather(x.reshape(*x.shape[:2], -1), idx).reshape(*idx.shape, *x.shape[2:])


def _random_split(counts: torch.Tensor, ratio: float):
    """Per event, a random ``ratio`` of its ``counts`` tokens to hide: indices
    and masks of the hidden and of the visible tokens."""
    width = int(counts.max())
    real = torch.arange(width, device=counts.device) < counts[:, None]
    order = torch.rand(len(counts), width, device=counts.device).masked_fill(~real, float("inf")).argsort(1)
    hidden = (ratio * counts).long()
    h_width, v_width = int(hidden.max()), int((counts - hidden).max())
    h_mask = torch.arange(h_width, device=counts.device) < hidden[:, None]
    v_pos = (hidden[:, None] + torch.arange(v_width, device=counts.device)).clamp(max=width - 1)
    v_mask = torch.arange(v_width, device=counts.device) < (counts - hidden)[:, None]
    return order[:, :h_width], h_mask, order.gather(1, v_pos), v_mask


@MODELS.register_module("PoLAr-MAE")
class PoLArMAE(nn.Module):
    """Masked point modelling pre-training (module docstring).

    Args (upstream's): ``arch``/``decoder_arch`` (``vit_tiny``, ``vit_small``,
    ``vit_base``), ``num_channels`` (xyz + features; the input ``feat``),
    ``voxel_size`` (picks the tokenizer preset), ``masking_ratio``,
    ``masking_type`` (``"rand"``), ``transformer_kwargs`` and
    ``decoder_kwargs["transformer_kwargs"]`` (override the ViT preset: depth,
    widths, drop rates, ``add_pos_at_every_layer``, ``postnorm``),
    ``mae_prediction`` (``"full"``: xyz and energy in the Chamfer loss;
    ``"pos"``: xyz), ``loss_weights`` (``chamfer``, ``energy``),
    ``tokenizer_kwargs``, ``decoder_use_kv``, ``patch_encoder_kwargs``.

    Input: ``feat`` (N, num_channels) with xyz first and energy last, and
    ``offset``. Output: ``loss``, ``chamfer_loss``, ``energy_loss``,
    ``mask_ratio`` (hidden / all tokens), ``mean_points``, ``mean_groups``.
    """

    domains = dict(arch=_ARCH, decoder_arch=_ARCH, num_channels=Int(4, 64), voxel_size=Real(0, 1e3, lo_open=True),
                   masking_ratio=Real(0, 1, hi_open=True), masking_type=Choice("rand"),
                   decoder_kwargs=_Fields(transformer_kwargs=_TRANSFORMER), mae_prediction=Choice("full", "pos"),
                   loss_weights=DictOf(Choice("chamfer", "energy"), Real(0, 1e6)) | None,
                   transformer_kwargs=_TRANSFORMER, tokenizer_kwargs=_TOKENIZER, decoder_use_kv=Bool,
                   patch_encoder_kwargs=_Fields(feature_dim=Size, hidden1=Size, hidden2=Size,
                                                pos_enc_style=Choice("mlp", "original")))

    def __init__(self, arch="vit_small", num_channels=4, voxel_size=5, masking_ratio=0.6, masking_type="rand",
                 decoder_arch="vit_small", decoder_kwargs=None, mae_prediction="full", loss_weights=None,
                 transformer_kwargs=None, tokenizer_kwargs=None, decoder_use_kv=True, patch_encoder_kwargs=None):
        super().__init__()
        transformer_kwargs = dict(transformer_kwargs or {})
        dim = transformer_kwargs.get("embed_dim", VIT_CONFIGS[arch]["embed_dim"])
        self.masking_ratio, self.loss_weights = float(masking_ratio), dict(loss_weights or dict(chamfer=1.0,
                                                                                                 energy=1.0))
        self.mae_channels = 4 if mae_prediction == "full" else 3
        self.grouping = _tokenizer(arch, voxel_size, tokenizer_kwargs)
        points = self.grouping.group_max_points
        self.embedding = MaskedMiniPointNet(num_channels, dim)
        self.pos_embed = LearnedPositionalEncoder(dim)
        self.encoder = make_transformer(arch, **transformer_kwargs)
        decoder = dict((decoder_kwargs or {}).get("transformer_kwargs", {}))
        self.decoder = make_transformer(decoder_arch, use_kv=bool(decoder_use_kv), **{"embed_dim": dim, **decoder})
        self.mask_token = nn.Parameter(torch.zeros(dim))
        nn.init.trunc_normal_(self.mask_token, std=0.02, a=-0.02, b=0.02)
        self.increase_dim = nn.Conv1d(dim, self.mae_channels * points, 1)
        patch = dict(feature_dim=96, hidden1=64, hidden2=64, pos_enc_style="mlp", **(patch_encoder_kwargs or {}))
        self.equivariant_patch_encoder = MaskedMiniPointNet(3, patch["feature_dim"], patch["hidden1"],
                                                            patch["hidden2"], True, patch["pos_enc_style"])
        self.energy_decoder = nn.Conv1d(dim + patch["feature_dim"], points, 1)

    def forward(self, data_dict: dict) -> dict:
        points, lengths = packed_to_padded(data_dict["feat"].float(), data_dict["offset"])
        g = self.grouping(points, lengths)
        groups, centers, point_mask, token_mask = g["groups"], g["centers"], g["point_mask"], g["embedding_mask"]
        h_idx, h_mask, v_idx, v_mask = _random_split(token_mask.sum(1), self.masking_ratio)
        visible = _embed(self.embedding, _take(groups, v_idx), _take(point_mask, v_idx), v_mask)
        v_pos = self.pos_embed(_take(centers, v_idx))
        encoded = self.encoder(visible, v_pos, v_mask).last_hidden_state
        queries = self.mask_token.expand(*h_mask.shape, -1)
        decoded = self.decoder(queries, self.pos_embed(_take(centers, h_idx)), h_mask, kv=encoded, pos_kv=v_pos,
                               kv_mask=v_mask).last_hidden_state[h_mask]
        hidden_groups = _take(groups, h_idx)[h_mask]
        hidden_points = _take(point_mask, h_idx)[h_mask]
        counts = hidden_points.sum(-1)
        predicted = self.increase_dim(decoded.unsqueeze(-1)).reshape(len(decoded), -1, self.mae_channels)
        chamfer = chamfer_distance(predicted, hidden_groups[..., :self.mae_channels], counts)
        shape = self.equivariant_patch_encoder(hidden_groups[..., :3], hidden_points.unsqueeze(1))
        energy = self.energy_decoder(torch.cat([shape, decoded], 1).unsqueeze(-1)).squeeze(-1)
        energy_loss = F.mse_loss(energy[hidden_points], hidden_groups[hidden_points][:, -1])
        loss = self.loss_weights.get("chamfer", 1.0) * chamfer + self.loss_weights.get("energy", 1.0) * energy_loss
        return dict(loss=loss, chamfer_loss=chamfer.detach(), energy_loss=energy_loss.detach(),
                    mask_ratio=h_mask.sum() / token_mask.sum().clamp(min=1),
                    mean_points=lengths.float().mean(), mean_groups=token_mask.sum(1).float().mean())


class _Upsampling(nn.Module):
    """Token features -> every point: inverse-distance weights over the
    ``k`` nearest token centres, concatenated with the point's xyz, then MLP."""

    def __init__(self, in_channel, mlp, k=5):
        super().__init__()
        self.K = k
        self.mlp_convs = nn.ModuleList()
        self.mlp_bns = nn.ModuleList()
        last = in_channel + 3
        for width in mlp:
            self.mlp_convs.append(nn.Conv1d(last, width, 1, bias=False))
            self.mlp_bns.append(MaskedBatchNorm1d(width))
            last = width

    def forward(self, xyz, lengths, centers, center_lengths, features, point_mask):
        dist, idx = knn(xyz, lengths, centers, center_lengths, self.K)
        weight = 1.0 / (dist + torch.finfo(dist.dtype).eps)
        weight = weight / weight.sum(-1, keepdim=True)
        mixed = (masked_gather(features, idx) * weight.unsqueeze(-1)).sum(2)
        x = torch.cat([xyz, mixed], -1).transpose(1, 2)
        mask = point_mask.unsqueeze(1)
        for i, (conv, norm) in enumerate(zip(self.mlp_convs, self.mlp_bns)):
            x = norm(conv(x), mask)
            x = F.gelu(x) if i < len(self.mlp_convs) - 1 else x
        return x.transpose(1, 2)


class _SegmentationHead(nn.Module):
    def __init__(self, in_channels, dim, dropout, num_classes):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv1d(in_channels, dim, 1, bias=False), MaskedBatchNorm1d(dim)
        self.conv2, self.bn2 = nn.Conv1d(dim, dim // 2, 1, bias=False), MaskedBatchNorm1d(dim // 2)
        self.conv3, self.dropout = nn.Conv1d(dim // 2, num_classes, 1), nn.Dropout(dropout)

    def forward(self, x, point_mask):
        mask = point_mask.unsqueeze(1)
        x = self.dropout(F.relu(self.bn1(self.conv1(x), mask)))
        return self.conv3(F.relu(self.bn2(self.conv2(x), mask)))


@MODELS.register_module("PoLArMAE-SemSeg")
class PoLArMAESemSeg(nn.Module):
    """Point-wise classification on a PoLAr-MAE encoder (module docstring).

    Args (upstream's): ``num_classes``, ``arch``, ``voxel_size``,
    ``num_channels``, ``seg_head_fetch_layers`` (encoder blocks whose outputs
    are normalised and averaged; ``[]``: the last output),
    ``seg_head_combination_method`` (``"mean"``), ``seg_head_dim``,
    ``seg_head_dropout``, ``freeze_encoder`` (tokenizer, embedding, positions
    and encoder get no gradient and stay in eval mode),
    ``apply_encoder_postnorm``, ``condition_global_features`` (append the
    event's max- and mean-pooled token features), ``upsampling_k``,
    ``upsampling_dim`` (``None``: the encoder width), ``center`` and ``scale``
    (xyz -> ``(xyz - center) * scale`` inside the model), ``criteria``,
    ``transformer_kwargs``, ``tokenizer_kwargs``.

    Output: ``seg_logits`` (N, num_classes) and, with ``segment``, ``loss``
    (labels >= num_classes are ignored, as upstream).
    """

    domains = dict(num_classes=Size, arch=_ARCH, voxel_size=Real(0, 1e3, lo_open=True), num_channels=Int(4, 64),
                   seg_head_fetch_layers=Seq(Int(0, 63)), seg_head_combination_method=Choice("mean"),
                   seg_head_dim=Int(2, 1 << 16), seg_head_dropout=Prob, freeze_encoder=Bool,
                   apply_encoder_postnorm=Bool, condition_global_features=Bool, upsampling_k=Int(1, 64),
                   upsampling_dim=Size | None, center=Seq(Real(-1e9), length=3), scale=Real(0, 1e9, lo_open=True),
                   criteria=Seq(Registered("loss")) | None,
                   transformer_kwargs=_TRANSFORMER, tokenizer_kwargs=_TOKENIZER)
    output_classes = answers_with("num_classes")  # the columns of seg_logits
    domain_rules = (CriteriaFitLogits(),)

    def __init__(self, num_classes=5, arch="vit_small", voxel_size=5, num_channels=4,
                 seg_head_fetch_layers: Sequence[int] = (3, 7, 11), seg_head_combination_method="mean",
                 seg_head_dim=384, seg_head_dropout=0.5, freeze_encoder=False, apply_encoder_postnorm=True,
                 condition_global_features=False, upsampling_k=5, upsampling_dim=None,
                 center=(384.0, 384.0, 384.0), scale=1.0 / _SCALE, criteria=None, transformer_kwargs=None,
                 tokenizer_kwargs=None):
        super().__init__()
        transformer_kwargs = dict(transformer_kwargs or {})
        dim = transformer_kwargs.get("embed_dim", VIT_CONFIGS[arch]["embed_dim"])
        depth = transformer_kwargs.get("depth", VIT_CONFIGS[arch]["depth"])
        if any(layer >= depth for layer in seg_head_fetch_layers):
            raise ConfigError(f"PoLArMAE-SemSeg: seg_head_fetch_layers={list(seg_head_fetch_layers)} names a block "
                              f"past the encoder's {depth}; use indices 0..{depth - 1}")
        up = upsampling_dim or dim
        self.num_classes, self.fetch = int(num_classes), list(seg_head_fetch_layers)
        self.freeze_encoder, self.postnorm = bool(freeze_encoder), bool(apply_encoder_postnorm)
        self.global_features = bool(condition_global_features)
        self.register_buffer("center", torch.tensor(list(center), dtype=torch.float32))
        self.scale = float(scale)
        self.grouping = _tokenizer(arch, voxel_size, tokenizer_kwargs)
        self.embedding = MaskedMiniPointNet(num_channels, dim)
        self.pos_embed = LearnedPositionalEncoder(dim)
        self.encoder = make_transformer(arch, **transformer_kwargs)
        self.point_downcast = nn.Linear(dim, up) if up != dim else nn.Identity()
        self.upsampler = _Upsampling(up, [up, up], upsampling_k)
        self.seg_head = _SegmentationHead(up * 3 if self.global_features else up, seg_head_dim, seg_head_dropout,
                                          num_classes)
        self.criteria = build_criteria(criteria or [dict(type="CrossEntropyLoss", ignore_index=-1)], int(num_classes))
        if self.freeze_encoder:
            for module in self._encoder_parts():
                module.requires_grad_(False)

    def _encoder_parts(self):
        return (self.grouping, self.embedding, self.pos_embed, self.encoder)

    def train(self, mode: bool = True):
        super().train(mode)
        if self.freeze_encoder:  # its batch-norm statistics are the pre-trained ones
            for module in self._encoder_parts():
                module.eval()
        return self

    def forward(self, data_dict: dict) -> dict:
        points, lengths = packed_to_padded(data_dict["feat"].float(), data_dict["offset"])
        points = torch.cat([(points[..., :3] - self.center) * self.scale, points[..., 3:]], -1)
        g = self.grouping(points, lengths)
        token_mask = g["embedding_mask"]
        tokens = _embed(self.embedding, g["groups"], g["point_mask"], token_mask)
        out = self.encoder(tokens, self.pos_embed(g["centers"]), token_mask, return_hidden_states=bool(self.fetch),
                           final_norm=self.postnorm)
        if self.fetch:
            features = torch.stack([masked_layer_norm(out.hidden_states[i], token_mask) for i in self.fetch]).mean(0)
        else:
            features = out.last_hidden_state
        point_mask = torch.arange(points.shape[1], device=points.device) < lengths[:, None]
        per_point = self.upsampler(points[..., :3], lengths, g["centers"], token_mask.sum(1),
                                   self.point_downcast(features), point_mask)
        if self.global_features:
            real = token_mask.unsqueeze(-1)
            mean = (features * real).sum(1) / real.sum(1).clamp(min=1)
            top = features.masked_fill(~real, float("-inf")).max(1).values
            pooled = torch.cat([self.point_downcast(top), self.point_downcast(mean)], -1)
            per_point = torch.cat([per_point, pooled.unsqueeze(1).expand(-1, per_point.shape[1], -1)], -1)
        logits = self.seg_head(per_point.transpose(1, 2), point_mask).transpose(1, 2)
        result = dict(seg_logits=padded_to_packed(logits, lengths))
        if "segment" in data_dict:
            segment = data_dict["segment"].long()
            segment = segment.masked_fill(segment >= self.num_classes, -1)
            result["loss"] = self.criteria(result["seg_logits"], segment, offset=data_dict.get("offset"))
        return result
