"""Point Transformer V3 backbones ``PT-v3m1`` and ``PT-v3m2`` (Wu et al.,
CVPR 2024; m2 is the variant Sonata pre-trains), in plain PyTorch.

Pipeline: embedding -> serialization -> encoder stages (pooling, then
blocks of CPE + patch attention + MLP) -> decoder stages (un-pooling with
the encoder skip, then blocks). ``forward`` returns the finest
:class:`~pimm.models.ptv3.structure.Point` (``feat`` per input point); with
``enc_mode`` / ``cls_mode`` the coarsest one, whose ``pooling_parent`` chain
:class:`~pimm.models.segmentor_v2.DefaultSegmentorV2` walks back up.

Constructor options and the module tree are upstream's, so upstream configs
build unchanged and upstream state dicts load strictly. Options that need
code upstream gets from elsewhere (PDNorm, isolation features) are refused
with a one-line error naming the option.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.errors import ConfigError

from pimm.utils.domains import MAX_COUNT, Choice, Int, Keys, NonNeg, Positive, Real, Rule, Seq, Size, same_length

from .blocks import Block, PointModule, PointSequential, SubMConv3d
from .linear import Linear
from .pooling import GridPooling, GridUnpooling, SerializedPooling, SerializedUnpooling
from .serialization import ORDERS
from .structure import Point

__all__ = ["PointTransformerV3", "PointTransformerV3m2", "Embedding", "SonataEmbedding"]


class Embedding(PointModule):
    """PT-v3m1 stem: a 5^3 submanifold convolution, LayerNorm, GELU."""

    def __init__(self, in_channels: int, embed_channels: int, norm_layer=None, act_layer=None):
        super().__init__()
        self.stem = PointSequential(conv=SubMConv3d(in_channels, embed_channels, kernel_size=5, bias=False))
        if norm_layer is not None:
            self.stem.add(norm_layer(embed_channels), name="norm")
        if act_layer is not None:
            self.stem.add(act_layer(), name="act")

    def forward(self, point: Point) -> Point:
        return self.stem(point)


class SonataEmbedding(PointModule):
    """PT-v3m2 stem: Linear, LayerNorm, GELU (optional), optional mask token
    replacing the features of ``point.mask``."""

    def __init__(self, in_channels: int, embed_channels: int, norm_layer=None, act_layer=None,
                 mask_token: bool = False):
        super().__init__()
        self.stem = PointSequential(linear=Linear(in_channels, embed_channels))
        if norm_layer is not None:
            self.stem.add(norm_layer(embed_channels), name="norm")
        if act_layer is not None:
            self.stem.add(act_layer(), name="act")
        self.mask_token = nn.Parameter(torch.zeros(1, embed_channels)) if mask_token else None

    def forward(self, point: Point) -> Point:
        point = self.stem(point)
        if "mask" in point and self.mask_token is not None:
            point["feat"] = torch.where(point["mask"].unsqueeze(-1), self.mask_token.to(point["feat"].dtype),
                                        point["feat"])
        return point


def _check(name: str, values: Sequence, n: int, what: str) -> None:
    if len(values) != n:
        raise ConfigError(f"PT-v3: {name} has {len(values)} entries, {what} needs {n}")


# Points per attention patch; -1 (upstream's flash path): each event is one patch.
_PATCH_SIZES = Seq(Int(1, MAX_COUNT) | Choice(-1),
                   what="a list of patch sizes (points per attention patch >= 1, or -1: the whole event)")


def _whole_events_need_flash(a) -> bool:
    return a.enable_flash or -1 not in (*a.enc_patch_size, *a.dec_patch_size)


class _PTv3Base(PointModule):
    """Shared construction of both variants."""

    variant = ""
    domains = dict(in_channels=Size, order=Choice(*ORDERS) | Seq(Choice(*ORDERS), min_len=1), stride=Seq(Int(1, 16)),
                   enc_depths=Seq(Int(0, 64), min_len=1), enc_channels=Seq(Size), enc_num_head=Seq(Int(1, 1024)),
                   enc_patch_size=_PATCH_SIZES, dec_depths=Seq(Int(0, 64)), dec_channels=Seq(Size),
                   dec_num_head=Seq(Int(1, 1024)), dec_patch_size=_PATCH_SIZES,
                   mlp_ratio=Real(0, 64, lo_open=True), qk_scale=Positive | None, attn_drop=Real(0, 1, hi_open=True),
                   proj_drop=Real(0, 1, hi_open=True), drop_path=Real(0, 1, hi_open=True))
    domain_rules = (same_length("enc_depths", "enc_channels", "enc_num_head", "enc_patch_size", "stride",
                                offset=dict(stride=-1)),
                    same_length("enc_depths", "dec_depths", "dec_channels", "dec_num_head", "dec_patch_size",
                                offset=dict(dec_depths=-1, dec_channels=-1, dec_num_head=-1, dec_patch_size=-1),
                                when=lambda a: not getattr(a, "cls_mode", False) and not getattr(a, "enc_mode", False)),
                    Rule(_whole_events_need_flash, "enable_flash",
                         "True when a patch size is -1 (whole-event attention is upstream's flash path)"))

    @classmethod
    def masks_features(cls, args: dict) -> bool:
        """Whether this config replaces the features of a batch's masked points
        (``mask``) by a learned token: what Sonata's mask losses need."""
        return bool(args.get("mask_token", False))

    @property
    def has_mask_token(self) -> bool:
        return getattr(self.embedding, "mask_token", None) is not None

    def _check_options(self, order, stride, enc, dec, decoder: bool) -> None:
        orders = [order] if isinstance(order, str) else list(order)
        if not orders:
            raise ConfigError("PT-v3: order is empty; give at least one of " + str(list(ORDERS)))
        for o in orders:
            if o not in ORDERS:
                raise ConfigError(f"PT-v3: order={o!r} is not a serialization order; use one of {list(ORDERS)}")
        self.order = orders
        stages = len(enc[0][1])
        _check("stride", stride, stages - 1, f"enc_depths (len {stages})")
        for name, values in enc[1:]:
            _check(name, values, stages, f"enc_depths (len {stages})")
        if decoder:
            for name, values in dec:
                _check(name, values, stages - 1, f"enc_depths (len {stages}) minus one")
        self.num_stages = stages

    def _build(self, enc_depths, enc_channels, enc_num_head, enc_patch_size, dec_depths, dec_channels, dec_num_head,
               dec_patch_size, stride, drop_path, decoder: bool, pool_cls, unpool_cls, block_kwargs,
               enable_cpe_at=lambda i: True, shared=None, with_layer_scale_slots=False,
               block_options=lambda part, stage: {}):
        ln, act = nn.LayerNorm, nn.GELU
        enc_dp = [x.item() for x in torch.linspace(0, drop_path, sum(enc_depths))]
        self.enc = PointSequential()
        for s in range(self.num_stages):
            dp = enc_dp[sum(enc_depths[:s]):sum(enc_depths[:s + 1])]
            stage = PointSequential()
            if s > 0:
                # Upstream builds its poolings without the model's shuffle_orders: they always permute in
                # training (their default), whatever the model's flag says.
                stage.add(pool_cls(enc_channels[s - 1], enc_channels[s], stride=stride[s - 1], norm_layer=ln,
                                   act_layer=act), name="down")
            for i in range(enc_depths[s]):
                stage.add(Block(enc_channels[s], enc_num_head[s], enc_patch_size[s], drop_path=dp[i],
                                order_index=i % len(self.order), enable_cpe=enable_cpe_at(i) and self.enable_cpe,
                                shared_cpe_conv=shared[f"enc_stage{s}"] if shared is not None else None,
                                with_layer_scale_slots=with_layer_scale_slots, **block_kwargs,
                                **block_options("enc", s)), name=f"block{i}")
            if len(stage):
                self.enc.add(stage, name=f"enc{s}")
        if not decoder:
            return
        dec_dp = [x.item() for x in torch.linspace(0, drop_path, sum(dec_depths))]
        self.dec = PointSequential()
        channels = list(dec_channels) + [enc_channels[-1]]
        for s in reversed(range(self.num_stages - 1)):
            dp = dec_dp[sum(dec_depths[:s]):sum(dec_depths[:s + 1])][::-1]
            stage = PointSequential()
            stage.add(unpool_cls(channels[s + 1], enc_channels[s], channels[s], norm_layer=ln, act_layer=act,
                                 traceable=self.traceable), name="up")
            for i in range(dec_depths[s]):
                stage.add(Block(channels[s], dec_num_head[s], dec_patch_size[s], drop_path=dp[i],
                                order_index=i % len(self.order), enable_cpe=enable_cpe_at(i) and self.enable_cpe,
                                shared_cpe_conv=shared[f"dec_stage{s}"] if shared is not None else None,
                                with_layer_scale_slots=with_layer_scale_slots, **block_kwargs,
                                **block_options("dec", s)), name=f"block{i}")
            self.dec.add(stage, name=f"dec{s}")

    @staticmethod
    def _point(data_dict) -> Point:
        point = data_dict if isinstance(data_dict, Point) else Point(data_dict)
        if "offset" not in point:
            raise ConfigError("PT-v3: the batch has no offset (the collate function adds it)")
        point["offset"] = point["offset"].to(point["feat"].device)
        point["batch"] = point["batch"].to(point["feat"].device)
        point.ensure_grid_coord()
        return point


@MODELS.register_module("PT-v3m1")
class PointTransformerV3(_PTv3Base):
    """PT-v3m1: sparse-conv stem, serialized pooling (see the module doc).

    ``forward(data_dict)`` takes ``feat``, ``offset`` and ``grid_coord`` (or
    ``coord`` + ``grid_size``) and returns a :class:`Point`; ``out_channels``
    is the width of its ``feat``.
    """

    domains = dict(pdnorm_conditions=Keys)

    def __init__(self, in_channels=6, order=("z", "z-trans"), stride=(2, 2, 2, 2), enc_depths=(2, 2, 2, 6, 2),
                 enc_channels=(32, 64, 128, 256, 512), enc_num_head=(2, 4, 8, 16, 32),
                 enc_patch_size=(48, 48, 48, 48, 48), dec_depths=(2, 2, 2, 2), dec_channels=(64, 64, 128, 256),
                 dec_num_head=(4, 4, 8, 16), dec_patch_size=(48, 48, 48, 48), mlp_ratio=4, qkv_bias=True,
                 qk_scale=None, attn_drop=0.0, proj_drop=0.0, drop_path=0.3, pre_norm=True, shuffle_orders=True,
                 enable_rpe=False, enable_flash=True, upcast_attention=False, upcast_softmax=False, cls_mode=False,
                 pdnorm_bn=False, pdnorm_ln=False, pdnorm_decouple=True, pdnorm_adaptive=False, pdnorm_affine=True,
                 pdnorm_conditions=("ScanNet", "S3DIS", "Structured3D")):
        super().__init__()
        for name, value in (("pdnorm_bn", pdnorm_bn), ("pdnorm_ln", pdnorm_ln)):
            if value:
                raise ConfigError(f"PT-v3m1: {name}=True (Point Prompt Training's PDNorm) is not supported; "
                                  "set it to False")
        self.cls_mode = bool(cls_mode)
        self.shuffle_orders, self.enable_cpe, self.traceable = shuffle_orders, True, False
        self._check_options(order, stride,
                            [("enc_depths", enc_depths), ("enc_channels", enc_channels),
                             ("enc_num_head", enc_num_head), ("enc_patch_size", enc_patch_size)],
                            [("dec_depths", dec_depths), ("dec_channels", dec_channels),
                             ("dec_num_head", dec_num_head), ("dec_patch_size", dec_patch_size)], not self.cls_mode)
        self.embedding = Embedding(in_channels, enc_channels[0], nn.LayerNorm, nn.GELU)
        block_kwargs = dict(mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, qk_scale=qk_scale, attn_drop=attn_drop,
                            proj_drop=proj_drop, pre_norm=pre_norm, enable_rpe=enable_rpe, enable_flash=enable_flash,
                            upcast_attention=upcast_attention, upcast_softmax=upcast_softmax)
        self._build(enc_depths, enc_channels, enc_num_head, enc_patch_size, dec_depths, dec_channels, dec_num_head,
                    dec_patch_size, stride, drop_path, not self.cls_mode, SerializedPooling, SerializedUnpooling,
                    block_kwargs)
        # cls_mode, like PT-v3m2's enc_mode: DefaultSegmentorV2 concatenates every level's features back up.
        self.out_channels = sum(enc_channels) if self.cls_mode else (list(dec_channels) + [enc_channels[-1]])[0]

    def forward(self, data_dict) -> Point:
        point = self._point(data_dict)
        point.serialization(order=self.order, shuffle_orders=self.shuffle_orders and self.training)
        point = self.embedding(point)
        point = self.enc(point)
        if not self.cls_mode:
            point = self.dec(point)
        return point


@MODELS.register_module("PT-v3m2")
class PointTransformerV3m2(_PTv3Base):
    """PT-v3m2 (Sonata's backbone): linear stem, grid pooling, optional
    layer scale, mask token, shared or first-layer-only CPE, encoder-only
    mode (see the module doc)."""

    variant = "PT-v3m2"
    domains = dict(layer_scale=NonNeg | None, iso_k=Int(1, 1024), iso_r=Positive | None)

    def __init__(self, in_channels=6, order=("z", "z-trans"), stride=(2, 2, 2, 2), enc_depths=(2, 2, 2, 6, 2),
                 enc_channels=(32, 64, 128, 256, 512), enc_num_head=(2, 4, 8, 16, 32),
                 enc_patch_size=(48, 48, 48, 48, 48), dec_depths=(2, 2, 2, 2), dec_channels=(64, 64, 128, 256),
                 dec_num_head=(4, 4, 8, 16), dec_patch_size=(48, 48, 48, 48), mlp_ratio=4, qkv_bias=True,
                 qk_scale=None, attn_drop=0.0, proj_drop=0.0, drop_path=0.3, layer_scale=None, pre_norm=True,
                 shuffle_orders=True, enable_rpe=False, enable_flash=True, enable_cpe=True, full_attention=False,
                 upcast_attention=False, upcast_softmax=False, traceable=False, mask_token=False, enc_mode=False,
                 freeze_encoder=False, cpe_first_layer_only=False, cpe_shared_weight=False,
                 embedding_act_layer=True, add_iso_features=False, iso_k=8, iso_r=None):
        super().__init__()
        if add_iso_features:
            raise ConfigError(f"{self.variant}: add_iso_features=True (kNN isolation features from pointops) is not "
                              "supported; set it to False")
        if full_attention:
            raise ConfigError("PT-v3m2: full_attention=True has no effect upstream; for whole-event attention set "
                              "enc_patch_size/dec_patch_size entries to -1 (with enable_flash=True)")
        self.enc_mode, self.freeze_encoder = bool(enc_mode), bool(freeze_encoder)
        self.shuffle_orders, self.enable_cpe, self.traceable = shuffle_orders, bool(enable_cpe), traceable
        self._check_options(order, stride,
                            [("enc_depths", enc_depths), ("enc_channels", enc_channels),
                             ("enc_num_head", enc_num_head), ("enc_patch_size", enc_patch_size)],
                            [("dec_depths", dec_depths), ("dec_channels", dec_channels),
                             ("dec_num_head", dec_num_head), ("dec_patch_size", dec_patch_size)], not self.enc_mode)
        self.embedding = SonataEmbedding(in_channels, enc_channels[0], nn.LayerNorm,
                                         nn.GELU if embedding_act_layer else None, mask_token)
        shared = None
        if cpe_shared_weight:
            self.shared_cpe_convs = nn.ModuleDict()
            for s in range(self.num_stages):
                self.shared_cpe_convs[f"enc_stage{s}"] = SubMConv3d(enc_channels[s], enc_channels[s], 3, bias=True)
            if not self.enc_mode:
                widths = list(dec_channels) + [enc_channels[-1]]
                for s in range(self.num_stages - 1):
                    self.shared_cpe_convs[f"dec_stage{s}"] = SubMConv3d(widths[s], widths[s], 3, bias=True)
            shared = self.shared_cpe_convs
        block_kwargs = dict(mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, qk_scale=qk_scale, attn_drop=attn_drop,
                            proj_drop=proj_drop, layer_scale=layer_scale, pre_norm=pre_norm, enable_rpe=enable_rpe,
                            enable_flash=enable_flash, upcast_attention=upcast_attention,
                            upcast_softmax=upcast_softmax)
        self._build(enc_depths, enc_channels, enc_num_head, enc_patch_size, dec_depths, dec_channels, dec_num_head,
                    dec_patch_size, stride, drop_path, not self.enc_mode, GridPooling, GridUnpooling, block_kwargs,
                    enable_cpe_at=(lambda i: i == 0) if cpe_first_layer_only else (lambda i: True), shared=shared,
                    with_layer_scale_slots=True, block_options=self._block_options)
        if self.freeze_encoder:
            for p in list(self.embedding.parameters()) + list(self.enc.parameters()):
                p.requires_grad = False
        self.apply(self._init_weights)
        # enc_mode: DefaultSegmentorV2 concatenates every level's features back up.
        self.out_channels = sum(enc_channels) if self.enc_mode else (list(dec_channels) + [enc_channels[-1]])[0]

    def _block_options(self, part: str, stage: int) -> dict:
        """Extra :class:`Block` arguments of a variant, per stage (PT-v3m8's CPE and attention)."""
        return {}

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, SubMConv3d)):
            nn.init.trunc_normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(self, data_dict) -> Point:
        point = self._point(data_dict)
        point = self.embedding(point)
        point.serialization(order=self.order, shuffle_orders=self.shuffle_orders and self.training)
        point = self.enc(point)
        if not self.enc_mode:
            point = self.dec(point)
        return point
