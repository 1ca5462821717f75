"""``LoRAAdapter``: parameter-efficient fine-tuning of a built model by
low-rank adapters on chosen ``nn.Linear`` layers (upstream pimm's wrapper and
arguments).

The wrapped model is built from ``model``, every one of its parameters is
frozen, each ``nn.Linear`` whose dotted name equals an entry of
``target_modules`` or ends with ``"." + entry`` becomes a :class:`LoRALinear`
(``y = W0 x + b0 + (alpha / rank) B A x``, ``B`` zero at the start so the
adapted model computes exactly what the base model does), and parameters whose
name contains one of ``trainable_keywords`` (e.g. the task head) train again.

The adapted layers keep the base layer's ``weight``/``bias`` under their
original names, so a checkpoint of the plain model loads into the wrapped one
with the key prefix ``model.`` added (``CheckpointLoader(keywords="module.",
replacement="module.model.")``). :meth:`LoRAAdapter.merged_state_dict` folds
the adapters into the base weights and returns the plain model's state dict
(no ``lora_*`` keys, no ``model.`` prefix): it loads into the config without
the wrapper and computes the same outputs.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.config_domains import ask_class
from pimm.utils.domains import Int, Keys, MAX_REAL, Prob, Real, Registered
from pimm.utils.errors import ConfigError
import logging

__all__ = ["LoRALinear", "LoRAAdapter"]


class LoRALinear(nn.Linear):
    """A frozen ``nn.Linear`` plus a trainable low-rank update
    ``(alpha / rank) B (A dropout(x))``. It reuses the base layer's
    ``weight``/``bias`` Parameters (same names, frozen)."""

    def __init__(self, base: nn.Linear, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0):
        if int(rank) <= 0:
            raise ConfigError(f"LoRA rank must be > 0, got {rank}")
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None,
                         device=base.weight.device, dtype=base.weight.dtype)
        self.weight = base.weight
        self.weight.requires_grad_(False)
        if base.bias is not None:
            self.bias = base.bias
            self.bias.requires_grad_(False)
        self.rank = int(rank)
        self.scaling = float(alpha) / self.rank
        self.lora_dropout = nn.Dropout(dropout) if dropout and dropout > 0 else nn.Identity()
        self.lora_A = nn.Parameter(torch.empty(self.rank, base.in_features, device=base.weight.device,
                                               dtype=base.weight.dtype))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, self.rank, device=base.weight.device,
                                               dtype=base.weight.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + (self.lora_dropout(x) @ self.lora_A.t() @ self.lora_B.t()) * self.scaling

    def merged_weight(self) -> torch.Tensor:
        """``W0 + (alpha / rank) B A``: the weight of the equivalent plain layer."""
        return self.weight + self.scaling * (self.lora_B @ self.lora_A)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_rank={self.rank}, scaling={self.scaling:.3g}"


@MODELS.register_module()
class LoRAAdapter(nn.Module):
    """Freeze the model built from ``model`` and train low-rank adapters on its
    ``target_modules`` (plus the parameters named by ``trainable_keywords``).

    Args:
        model: config of the model to adapt (any registered model).
        rank: rank of every adapter (> 0).
        alpha: adapter scale numerator (the update is scaled by ``alpha / rank``).
        dropout: dropout on the adapter branch's input.
        target_modules: ``nn.Linear`` names to adapt: a layer matches an entry
            when its dotted name equals it or ends with ``"." + entry`` (so
            ``"attn.proj"`` matches ``...block0.attn.proj``, not
            ``...self_attn.proj``). Default: PT-v3's attention projections.
        trainable_keywords: base parameters whose dotted name contains one of
            these substrings train too (e.g. ``("seg_head",)``).

    Calls and unknown attributes pass through to the wrapped model
    (``self.model``).
    """

    domains = dict(model=Registered("model"), rank=Int(1, 4096), alpha=Real(0, MAX_REAL, lo_open=True),
                   dropout=Prob, target_modules=Keys, trainable_keywords=Keys)

    @classmethod
    def output_classes(cls, args: dict):
        """The adapted model's (its outputs pass through unchanged)."""
        return ask_class(args.get("model"), "model", "output_classes")

    def __init__(self, model: dict, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
                 target_modules: Sequence[str] = ("attn.qkv", "attn.proj"), trainable_keywords: Sequence[str] = ()):
        super().__init__()
        if not isinstance(model, dict):
            raise ConfigError(f"LoRAAdapter: model must be a dict(type=...) of the model to adapt, got {model!r}")
        if isinstance(target_modules, str) or isinstance(trainable_keywords, str):
            raise ConfigError("LoRAAdapter: target_modules and trainable_keywords are lists of names, not one string")
        self.model = MODELS.build(model)
        self.rank, self.alpha, self.dropout = int(rank), float(alpha), float(dropout)
        self.target_modules = tuple(target_modules)
        self.trainable_keywords = tuple(trainable_keywords)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.adapted = self._inject()
        if self.trainable_keywords:
            matched = False
            for name, p in self.model.named_parameters():
                if any(k in name for k in self.trainable_keywords):
                    p.requires_grad_(True)
                    matched = True
            if not matched:
                raise ConfigError(f"LoRAAdapter: no parameter of {model.get('type')!r} has a name containing any "
                                  f"of trainable_keywords={list(self.trainable_keywords)} (e.g. 'seg_head')")
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.parameters())
        logging.getLogger("pimm").info(f"LoRAAdapter: rank={self.rank} alpha={self.alpha:g}: adapted {len(self.adapted)} "
                          f"linear layers; trainable {trainable:,}/{total:,} parameters "
                          f"({100.0 * trainable / max(total, 1):.2f}%)")

    def _matches(self, name: str) -> bool:
        return any(name == t or name.endswith("." + t) for t in self.target_modules)

    def _inject(self) -> list[str]:
        targets = [name for name, m in self.model.named_modules() if isinstance(m, nn.Linear) and self._matches(name)]
        if not targets:
            linears = [name for name, m in self.model.named_modules() if isinstance(m, nn.Linear)]
            raise ConfigError(f"LoRAAdapter: no nn.Linear matches target_modules={list(self.target_modules)}; "
                              f"this model's linear layers: {', '.join(linears[:6]) or '(none)'}"
                              f"{' ...' if len(linears) > 6 else ''}")
        for name in targets:
            parent_name, _, child = name.rpartition(".")
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
            setattr(parent, child, LoRALinear(getattr(parent, child), self.rank, self.alpha, self.dropout))
        return targets

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "model":
                raise
            return getattr(self.model, name)

    @torch.no_grad()
    def merged_state_dict(self) -> dict[str, torch.Tensor]:
        """The wrapped model's state dict with every adapter folded into its
        base weight: the state of the plain (un-wrapped) model."""
        state = {}
        for key, value in self.model.state_dict().items():
            module_name, _, leaf = key.rpartition(".")
            if leaf in ("lora_A", "lora_B"):
                continue
            state[key] = value.clone()
        for name in self.adapted:
            layer = self.model.get_submodule(name)
            state[f"{name}.weight"] = layer.merged_weight().detach().clone()
        return state
