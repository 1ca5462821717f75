"""``PT-v3m8`` (also upstream's alias ``PT-v3m4``): PT-v3m2 with rotary
positions, a bottleneck CPE and optional QK-norm.

What differs from :class:`~pimm.models.ptv3.model.PointTransformerV3m2`
(everything else -- stem, grid pooling, layer scale, mask token, encoder-only
mode, freezing, initialization -- is m2's, so this is a thin subclass):

* attention: :class:`~pimm.models.ptv3.rope.RoPEAttention` (3D RoPE on the
  points' ``coord``; ``qk_norm``, ``rope_base``, ``rope_jitter``,
  ``rope_rescale``);
* CPE: :class:`BottleneckCPE`, ``Linear(C -> c)`` (skipped when ``c == C``),
  the 3^3 submanifold convolution at width ``c``, ``Linear(c -> C)``,
  LayerNorm, with ``c`` per stage from ``enc_cpe_channels`` /
  ``dec_cpe_channels`` (upstream's defaults: 96 everywhere);
* keys m2 has and m8 has not: ``cpe_shared_weight`` and ``full_attention``
  (upstream's m8 has no such arguments, so naming them is an error here too).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.domains import Positive, Seq, Size
from pimm.utils.errors import ConfigError

from .blocks import PointModule, SubMConv3d
from .linear import Linear
from .model import PointTransformerV3m2
from .rope import RoPEAttention

__all__ = ["BottleneckCPE", "PointTransformerV3m8"]


class BottleneckCPE(PointModule):
    """Conditional positional encoding through a narrower convolution:
    ``norm(up(conv(down(x))))`` (upstream's names ``down``, ``conv``, ``up``,
    ``norm``). The convolution costs ``27 c^2`` per voxel instead of ``27 C^2``."""

    def __init__(self, channels: int, cpe_channels: int):
        super().__init__()
        self.down = nn.Identity() if channels == cpe_channels else Linear(channels, cpe_channels)
        self.conv = SubMConv3d(cpe_channels, cpe_channels, 3, bias=True)
        self.up = Linear(cpe_channels, channels)
        self.norm = nn.LayerNorm(channels)

    def features(self, point, feat: torch.Tensor) -> torch.Tensor:
        """The CPE's output (the block adds it to ``feat``)."""
        low = self.down(feat)
        if self.up.in_features < self.up.out_features:
            # Narrow: folding ``up`` into the kernel would run it at 27 c C a voxel instead of 27 c^2 + c C.
            return self.norm(self.up(point.sparse_conv(self.conv, low)))
        return self.norm(point.sparse_conv(self.conv, low, then=self.up))


@MODELS.register_module(["PT-v3m8", "PT-v3m4"])
class PointTransformerV3m8(PointTransformerV3m2):
    """PT-v3m8 (see the module doc); upstream's constructor keys and defaults."""

    variant = "PT-v3m8"
    domains = dict(enc_cpe_channels=Seq(Size, min_len=1), dec_cpe_channels=Seq(Size), rope_base=Positive,
                   rope_jitter=Positive | None, rope_rescale=Positive | None)

    def __init__(self, in_channels=6, order=("z", "z-trans"), stride=(2, 2, 2, 2), enc_depths=(2, 2, 2, 6, 2),
                 enc_channels=(32, 64, 128, 256, 512), enc_num_head=(2, 4, 8, 16, 32),
                 enc_patch_size=(48, 48, 48, 48, 48), dec_depths=(2, 2, 2, 2), dec_channels=(64, 64, 128, 256),
                 dec_num_head=(4, 4, 8, 16), dec_patch_size=(48, 48, 48, 48), mlp_ratio=4, qk_norm=False,
                 qkv_bias=True, qk_scale=None, attn_drop=0.0, proj_drop=0.0, drop_path=0.3, layer_scale=None,
                 pre_norm=True, shuffle_orders=True, enable_rpe=False, enable_flash=True, enable_cpe=True,
                 upcast_attention=False, upcast_softmax=False, traceable=False, mask_token=False, enc_mode=False,
                 freeze_encoder=False, cpe_first_layer_only=False, enc_cpe_channels=(96, 96, 96, 96, 96),
                 dec_cpe_channels=(96, 96, 96, 96), embedding_act_layer=True, add_iso_features=False, iso_k=8,
                 iso_r=None, rope_base=10, rope_jitter=None, rope_rescale=None):
        stages = len(enc_depths)
        # Upstream reads entry s for stage s: longer tuples are fine (the defaults have 5), shorter ones are not.
        if len(enc_cpe_channels) < stages:
            raise ConfigError(f"PT-v3m8: enc_cpe_channels has {len(enc_cpe_channels)} entries, enc_depths "
                              f"(len {stages}) needs at least {stages}")
        if not enc_mode and len(dec_cpe_channels) < stages - 1:
            raise ConfigError(f"PT-v3m8: dec_cpe_channels has {len(dec_cpe_channels)} entries, the decoder "
                              f"(len(enc_depths) - 1 = {stages - 1} stages) needs at least {stages - 1}")
        # m2's constructor builds the blocks and asks _block_options for this variant's
        # pieces, so they are known before it runs (a plain attribute: no module or tensor).
        self._m8 = dict(cpe=dict(enc=tuple(enc_cpe_channels), dec=tuple(dec_cpe_channels)),
                        attn=dict(qk_norm=bool(qk_norm), rope_base=rope_base, rope_jitter=rope_jitter,
                                  rope_rescale=rope_rescale))
        super().__init__(in_channels=in_channels, order=order, stride=stride, enc_depths=enc_depths,
                         enc_channels=enc_channels, enc_num_head=enc_num_head, enc_patch_size=enc_patch_size,
                         dec_depths=dec_depths, dec_channels=dec_channels, dec_num_head=dec_num_head,
                         dec_patch_size=dec_patch_size, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, qk_scale=qk_scale,
                         attn_drop=attn_drop, proj_drop=proj_drop, drop_path=drop_path, layer_scale=layer_scale,
                         pre_norm=pre_norm, shuffle_orders=shuffle_orders, enable_rpe=enable_rpe,
                         enable_flash=enable_flash, enable_cpe=enable_cpe, upcast_attention=upcast_attention,
                         upcast_softmax=upcast_softmax, traceable=traceable, mask_token=mask_token,
                         enc_mode=enc_mode, freeze_encoder=freeze_encoder,
                         cpe_first_layer_only=cpe_first_layer_only, embedding_act_layer=embedding_act_layer,
                         add_iso_features=add_iso_features, iso_k=iso_k, iso_r=iso_r)

    def _block_options(self, part: str, stage: int) -> dict:
        return dict(cpe_factory=partial(BottleneckCPE, cpe_channels=self._m8["cpe"][part][stage]),
                    attn_cls=RoPEAttention, attn_options=self._m8["attn"])
