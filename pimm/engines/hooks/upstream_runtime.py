"""Runtime hooks of upstream pimm's pre-training and fine-tuning configs
that know nothing about the model or the data: run naming, parameter
counts, weight-decay exclusion and schedule, dtype pinning, step-interval
checkpoints and gradient norms (resource use: :mod:`pimm.engines.hooks.resources`).

Scalars go through ``trainer.metrics`` (``metrics.jsonl``, TensorBoard,
W&B) under upstream's names (``params/wd``, ``grad_norm/total``).
"""

from __future__ import annotations

import functools
import math
import re

import torch
from torch import nn

from pimm.engines.hooks.base import HookBase
from pimm.engines.hooks.checkpoint import CheckpointSaver
from pimm.engines.registries import HOOKS
from pimm.utils.domains import Bool, Choice, Count, Key, Keys, Names, PosInt, Real, Seq, Text, as_domain, show
from pimm.utils.errors import ConfigError

__all__ = ["WandbNamer", "ParameterCounter", "WeightDecayExclusion", "WeightDecayScheduler", "DtypeOverrider",
           "CheckpointSaverIteration", "GradientNormLogger"]


def _frequency(value, who: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{who}: log_frequency={value!r} must be a positive integer")
    return value


def _patterns(key: str, value) -> object:
    """a regular expression or a list of them, like 'LayerNorm'"""
    items = [value] if isinstance(value, str) else value
    if isinstance(items, (list, tuple)) and all(isinstance(p, str) and p for p in items):
        try:
            for p in items:
                re.compile(p)
            return value
        except re.error as err:
            raise ConfigError(f"{key}={show(value)} is invalid: {err} (it takes {_patterns.__doc__})") from None
    raise ConfigError(f"{key}={show(value)} is invalid: it takes {_patterns.__doc__}")


_LOGGER_DOMAINS = dict(log_frequency=PosInt, prefix=Key)


def _due(trainer, every: int) -> bool:
    """True on the steps numbered ``every``, ``2 * every``, ... (1-based)."""
    return (trainer.global_step + 1) % every == 0


@HOOKS.register_module()
class WandbNamer(HookBase):
    """Set ``wandb_run_name`` from config values: the values of ``keys``
    (dotted paths, e.g. ``data.train.max_len``; missing or None ones are
    skipped) joined by ``sep``, then ``extra``. ``format_numbers`` writes
    1000000 as ``1M``. A ``wandb_run_name`` already set (in the config or
    with ``--options``) wins; upstream lets only the command line's win."""

    domains = dict(keys=Key | Keys, sep=Text(empty=True), extra=Text() | Seq(Text()) | None)

    def __init__(self, keys=(), sep: str = "-", format_numbers: bool = True, extra=None):
        self.keys = (keys,) if isinstance(keys, str) else tuple(keys)
        self.sep, self.format_numbers = str(sep), bool(format_numbers)
        self.extra = () if extra is None else (extra,) if isinstance(extra, str) else tuple(extra)

    @staticmethod
    def _lookup(cfg, path: str):
        value = cfg
        for part in path.split("."):
            if isinstance(value, dict) and part in value:
                value = value[part]
            else:
                return None
        return value

    def _format(self, value) -> str:
        if self.format_numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
            for size, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
                if abs(value) >= size:
                    return f"{value / size:.1f}".rstrip("0").rstrip(".") + suffix
            return str(int(value)) if float(value).is_integer() else str(value)
        return str(value)

    def name_for(self, cfg) -> str:
        """The run name this config gets."""
        parts = [self._format(v) for v in (self._lookup(cfg, k) for k in self.keys) if v is not None]
        return self.sep.join(parts + [str(e) for e in self.extra])

    def modify_config(self, cfg) -> None:
        self.named = None
        if cfg.get("wandb_run_name"):
            return
        name = self.name_for(cfg)
        if name:
            cfg["wandb_run_name"] = self.named = name

    def before_train(self) -> None:
        # The run's records hold the config as the hooks received it (a resume names the run again), so the
        # log is where the name this hook chose is written down.
        if getattr(self, "named", None):
            self.trainer.logger.info(f"WandbNamer: wandb_run_name={self.named!r}")


@HOOKS.register_module()
class ParameterCounter(HookBase):
    """Log the model's parameter count at start-up: total and trainable, then
    one line per top-level module (``show_details``: per parameter tensor;
    ``show_gradients``: whether it is trained), largest first when
    ``sort_by_params``, skipping entries under ``min_params``."""

    domains = dict(min_params=Count)

    def __init__(self, show_details: bool = True, show_gradients: bool = True, sort_by_params: bool = True,
                 min_params: int = 0):
        self.show_details, self.show_gradients = bool(show_details), bool(show_gradients)
        self.sort_by_params, self.min_params = bool(sort_by_params), int(min_params)

    @staticmethod
    def counts(model: nn.Module) -> dict[str, tuple[int, int]]:
        """``{child name: (parameters, trainable)}`` over the model's direct children
        (nested ``ModuleDict`` children such as ``student.backbone`` spelled out)."""
        out: dict[str, tuple[int, int]] = {}
        for name, param in model.named_parameters():
            parts = name.split(".")
            key = ".".join(parts[:2]) if len(parts) > 2 and isinstance(model.get_submodule(parts[0]),
                                                                       nn.ModuleDict) else parts[0]
            total, trained = out.get(key, (0, 0))
            out[key] = (total + param.numel(), trained + (param.numel() if param.requires_grad else 0))
        return out

    def before_train(self) -> None:
        model = self.trainer.model_without_ddp
        log = self.trainer.logger.info
        total = sum(p.numel() for p in model.parameters())
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        log(f"ParameterCounter: {total:,} parameters, {trained:,} trainable")
        if self.show_details:
            rows = [(name, p.numel(), p.requires_grad) for name, p in model.named_parameters()]
        else:
            rows = [(name, n, t > 0) for name, (n, t) in self.counts(model).items()]
        rows = [r for r in rows if r[1] >= self.min_params]
        if self.sort_by_params:
            rows.sort(key=lambda r: -r[1])
        for name, n, trains in rows:
            log(f"  {name}: {n:,}" + ((" (trained)" if trains else " (frozen)") if self.show_gradients else ""))


@HOOKS.register_module()
class WeightDecayExclusion(HookBase):
    """No weight decay on biases, norms, ``gamma`` (layer scale), tokens and
    1-D parameters (each rule switchable). Every optimizer group is split in
    two when the optimizer is built (``optimizer.no_weight_decay``, see
    :func:`pimm.engines.optim.build_optimizer`): its decayed parameters, then
    the excluded ones with ``weight_decay=0``; a list ``max_lr`` of the
    scheduler is widened to match (each group's value for both halves).
    Splitting at build time, not at ``before_train`` as upstream does, keeps
    the group layout the same for a resumed run."""

    def __init__(self, exclude_bias_from_wd: bool = True, exclude_norm_from_wd: bool = True,
                 exclude_gamma_from_wd: bool = True, exclude_token_from_wd: bool = True,
                 exclude_ndim_1_from_wd: bool = True):
        self.rules = dict(bias=bool(exclude_bias_from_wd), norm=bool(exclude_norm_from_wd),
                          gamma=bool(exclude_gamma_from_wd), token=bool(exclude_token_from_wd),
                          ndim_1=bool(exclude_ndim_1_from_wd))

    def modify_config(self, cfg) -> None:
        optimizer = cfg.get("optimizer")
        if not isinstance(optimizer, dict) or any(isinstance(v, dict) and "type" in v for v in optimizer.values()):
            raise ConfigError("WeightDecayExclusion needs one optimizer = dict(type=...); with several model parts "
                              "use param_dicts=[dict(keyword='bias', weight_decay=0.0), ...] per part")
        if optimizer.get("no_weight_decay") == self.rules:
            return  # a record written with this hook's change, replayed: applied already (max_lr widened)
        optimizer["no_weight_decay"] = dict(self.rules)
        scheduler = cfg.get("scheduler")
        if isinstance(scheduler, dict) and isinstance(scheduler.get("max_lr"), (list, tuple)):
            scheduler["max_lr"] = [v for v in scheduler["max_lr"] for _ in (0, 1)]

    def before_train(self) -> None:
        groups = self.trainer.optimizer.param_groups
        decayed = sum(len(g["params"]) for g in groups if g.get("apply_wd", True))
        excluded = sum(len(g["params"]) for g in groups if not g.get("apply_wd", True))
        self.trainer.logger.info(f"WeightDecayExclusion: {len(groups)} optimizer groups; {decayed} parameter tensors "
                                 f"with weight decay, {excluded} without")


@HOOKS.register_module()
class WeightDecayScheduler(HookBase):
    """Weight decay on a cosine from ``base_value`` to ``final_value`` over
    ``warmup_ratio`` x the run's steps (then held), set before every step on
    each optimizer group not excluded by :class:`WeightDecayExclusion`;
    logged as ``params/wd``. A function of the step, so a resume continues it."""

    priority = "HIGH"  # before the step's forward, after nothing that reads weight decay

    domains = dict(base_value=Real(0, 10), final_value=Real(0, 10), warmup_ratio=Real(0, 1, lo_open=True))

    def __init__(self, base_value: float = 0.04, final_value: float = 0.2, warmup_ratio: float = 1.0):
        if not warmup_ratio > 0:
            raise ConfigError(f"WeightDecayScheduler: warmup_ratio={warmup_ratio!r} must be positive")
        self.base_value, self.final_value, self.warmup_ratio = float(base_value), float(final_value), warmup_ratio

    def value(self, step: int, total_steps: int) -> float:
        """The weight decay at 0-based ``step`` of a ``total_steps`` run."""
        length = max(1, int(total_steps * self.warmup_ratio))
        if step >= length:
            return self.final_value
        return self.final_value + 0.5 * (self.base_value - self.final_value) * (1 + math.cos(math.pi * step / length))

    def before_step(self) -> None:
        trainer = self.trainer
        wd = self.value(trainer.global_step, trainer.iters_per_epoch * trainer.max_epoch)
        for group in trainer.optimizer.param_groups:
            if group.get("apply_wd", True):
                group["weight_decay"] = wd
        trainer.metrics.publish({"params/wd": wd}, step=trainer.global_step + 1)


@HOOKS.register_module()
class DtypeOverrider(HookBase):
    """Run chosen modules in ``dtype`` under mixed precision: those whose
    dotted name (``backbone.enc.0.norm``) matches one of ``patterns`` or whose
    class name matches one of ``class_patterns`` (regular expressions, searched).
    Their ``methods_to_override`` get their floating inputs cast to ``dtype``
    with autocast off; ``override_parameters`` casts their own parameters too.
    Upstream's guard for bfloat16 LayerNorms. With neither list given,
    ``class_patterns`` is ``("LayerNorm",)``; with ``patterns`` alone only
    names match (upstream's meaning).

    ``verbose`` logs each wrapped method and cast parameter; every
    ``check_interval`` steps the cast parameters are checked to still be in
    ``dtype`` (something that casts the model afterwards, ``model.half()``,
    would silently undo the pin): each one that is not is logged once."""

    _DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
               "float16": torch.float16}

    domains = dict(patterns=as_domain(_patterns) | None, class_patterns=as_domain(_patterns) | None,
                   dtype=Choice(*_DTYPES), methods_to_override=Key | Names, check_interval=PosInt)

    def __init__(self, patterns=None, class_patterns=None, dtype: str = "float32", override_parameters: bool = True,
                 methods_to_override=("forward",), verbose: bool = False, check_interval: int = 10):
        if dtype not in self._DTYPES:
            raise ConfigError(f"DtypeOverrider: dtype={dtype!r}; use one of {list(self._DTYPES)}")
        if class_patterns is None and not patterns:
            class_patterns = ("LayerNorm",)
        self.patterns, self.class_patterns = (
            [re.compile(p) for p in ((value,) if isinstance(value, str) else value or ())]
            for value in (patterns, class_patterns))
        self.dtype, self.override_parameters = self._DTYPES[dtype], bool(override_parameters)
        self.methods = (methods_to_override,) if isinstance(methods_to_override, str) else tuple(methods_to_override)
        if isinstance(check_interval, bool) or not isinstance(check_interval, int) or check_interval < 1:
            raise ConfigError(f"DtypeOverrider: check_interval={check_interval!r} must be a positive integer")
        self.verbose, self.check_interval = bool(verbose), check_interval
        self.wrapped = 0
        self.cast_parameters: list[tuple[str, nn.Parameter]] = []  # (dotted name, parameter) pinned to dtype
        self._reported: set[str] = set()

    def _cast(self, value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(self.dtype)
        return value

    def _wrap(self, method):
        @functools.wraps(method)
        def pinned(*args, **kwargs):
            device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
            with torch.autocast(device_type=device, enabled=False):
                return method(*[self._cast(a) for a in args], **{k: self._cast(v) for k, v in kwargs.items()})
        return pinned

    def matches(self, name: str, module: nn.Module) -> bool:
        """Whether the module at dotted ``name`` is pinned."""
        return any(p.search(name) for p in self.patterns) or \
            any(p.search(type(module).__name__) for p in self.class_patterns)

    def before_train(self) -> None:
        log = self.trainer.logger.info
        for name, module in self.trainer.model_without_ddp.named_modules():
            if not name or not self.matches(name, module):
                continue
            if self.override_parameters:
                for param_name, param in module.named_parameters(recurse=False):
                    if self.verbose and param.dtype != self.dtype:
                        log(f"DtypeOverrider: {name}.{param_name} {param.dtype} -> {self.dtype}")
                    self.cast_parameters.append((f"{name}.{param_name}", param))
                module.to(self.dtype)
            for method in self.methods:
                if self.verbose:
                    log(f"DtypeOverrider: {name}.{method} ({type(module).__name__}) runs in {self.dtype}")
                setattr(module, method, self._wrap(getattr(module, method)))
            self.wrapped += 1
        log(f"DtypeOverrider: {self.wrapped} module(s) run in {self.dtype}")

    def after_step(self) -> None:
        if not self.cast_parameters or self.trainer.global_step % self.check_interval:
            return
        for name, param in self.cast_parameters:
            if param.dtype != self.dtype and name not in self._reported:
                self._reported.add(name)
                self.trainer.logger.warning(f"DtypeOverrider: {name} is {param.dtype} at step "
                                            f"{self.trainer.global_step}, no longer {self.dtype}: something cast "
                                            "the model after before_train, undoing the pin")


@HOOKS.register_module()
class CheckpointSaverIteration(CheckpointSaver):
    """Upstream's step-interval saver: :class:`CheckpointSaver` with
    ``save_freq`` steps (the same resumable checkpoints).
    ``save_iter_checkpoints=True`` keeps every step's checkpoint (``keep_all``),
    ``False`` the rolling latest (the saver's retention); ``backend``, upstream's
    deprecated on-disk format selector, is accepted and changes nothing: pimm
    writes its own verified layout (as for ``checkpoint_format``)."""

    domains = dict(save_iter_checkpoints=Bool, backend=Choice("dcp", "torch") | None)

    def __init__(self, save_freq: int = 1000, save_iter_checkpoints: bool = False, backend: str | None = None,
                 **options):
        if save_iter_checkpoints:
            options.setdefault("keep_all", True)
        super().__init__(save_freq=save_freq, **options)


@HOOKS.register_module()
class GradientNormLogger(HookBase):
    """Every ``log_frequency`` steps: the total ``norm_type`` norm of the
    gradients (before clipping) as ``<prefix>/total``; ``log_per_layer``
    adds one per parameter (``<prefix>/layers/<name>``)."""

    domains = dict(norm_type=Real(0, 1000, lo_open=True) | Choice(math.inf), **_LOGGER_DOMAINS)

    def __init__(self, norm_type: float = 2.0, log_per_layer: bool = False, log_frequency: int = 1,
                 prefix: str = "grad_norm"):
        self.norm_type, self.log_per_layer = float(norm_type), bool(log_per_layer)
        self.log_frequency, self.prefix = _frequency(log_frequency, "GradientNormLogger"), prefix

    def after_backward(self) -> None:
        trainer = self.trainer
        if not _due(trainer, self.log_frequency):
            return
        named = [(n, p.grad) for n, p in trainer.model_without_ddp.named_parameters() if p.grad is not None]
        if not named:
            return
        scalars = {f"{self.prefix}/total": torch.nn.utils.get_total_norm([g for _, g in named], self.norm_type)}
        if self.log_per_layer:
            for name, grad in named:
                scalars[f"{self.prefix}/layers/{name.replace('.', '_')}"] = torch.linalg.vector_norm(
                    grad.float(), self.norm_type)
        trainer.metrics.publish({k: v.detach() for k, v in scalars.items()}, step=trainer.global_step + 1)
