"""Optimizers built from config, with per-parameter-group options.

A config names the optimizer (``optimizer = dict(type="AdamW", lr=1e-3,
weight_decay=0.05)``) and may add ``param_dicts``, a list of
``dict(keyword=..., <options>)`` entries that give some parameters their own
learning rate or weight decay (a smaller lr for a pretrained backbone, no decay
on biases, ...). Every trainable parameter goes to the *first* entry whose
keyword is a substring of its name; the rest form the ``default`` group.

Group order is fixed (default group first, then the entries in config order,
even when a group ends up empty) so that an optimizer ``state_dict`` saved by
one run loads into the optimizer rebuilt by the resumed run. Each group carries
a ``name`` key (the keyword, or ``"default"``) for logging.
"""

from __future__ import annotations

import difflib
import inspect
import logging
from typing import Any

import torch
from torch import nn

from pimm.engines.registries import OPTIMIZERS
from pimm.utils.domains import LR, Bool, Prob, Real, Rule, Seq
from pimm.utils.errors import ConfigError, RegistryError

__all__ = ["build_optimizer", "NO_DECAY_RULES"]

logger = logging.getLogger(__name__)

# torch's optimizers cannot carry a ``domains`` attribute of pimm's: their
# arguments' domains are declared here, at registration (bool options inferred).
_TORCH_OPTIM_DOMAINS = dict(lr=LR, weight_decay=Real(0, 10), eps=Real(0, 1, lo_open=True),
                            betas=Seq(Real(0, 1, hi_open=True), length=2), momentum=Real(0, 1, hi_open=True),
                            dampening=Prob, foreach=Bool | None, fused=Bool | None)
_TORCH_OPTIM_RULES = {torch.optim.SGD: (Rule(lambda a: not a.nesterov or (a.momentum > 0 and a.dampening == 0),
                                             "nesterov", "False unless momentum > 0 and dampening = 0"),)}
for _optim_cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
    _names = inspect.signature(_optim_cls).parameters
    OPTIMIZERS.register_module(module=_optim_cls, rules=_TORCH_OPTIM_RULES.get(_optim_cls, ()),
                               domains={k: v for k, v in _TORCH_OPTIM_DOMAINS.items() if k in _names})

# Keys of a ``param_dicts`` entry that this module interprets itself; every
# other key is a per-group optimizer option (weight_decay, momentum, betas...).
_ENTRY_KEYS = ("keyword", "lr", "lr_scale")


def _option_names(optim_cls: Any) -> set[str] | None:
    """Names the optimizer accepts as options, or ``None`` when it cannot be
    told (a constructor taking ``**kwargs``, or no introspectable signature)."""
    try:
        params = inspect.signature(optim_cls).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.name != "params"}


def _check_options(cfg: dict, options: set[str] | None, optim_name: str) -> None:
    if options is None:
        return
    unknown = sorted(set(cfg) - {"type"} - options)
    if unknown:
        hints = [difflib.get_close_matches(k, options, n=1) for k in unknown]
        hint = "; ".join(f"did you mean {h[0]!r} for {k!r}?" for k, h in zip(unknown, hints) if h)
        raise RegistryError(
            f"optimizer {optim_name}: unknown option{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}{'; ' + hint if hint else ''} "
            f"(valid: {', '.join(sorted(options))})"
        )


def _construct(optim_cls: Any, optim_name: str, groups: list[dict], cfg: dict) -> torch.optim.Optimizer:
    """Call the optimizer class. Done here rather than by ``OPTIMIZERS.build``
    so that a rejected value gives a one-line message: the registry's would
    quote the ``params`` argument, whose tensor reprs span several lines."""
    options = {k: v for k, v in cfg.items() if k != "type"}
    try:
        return optim_cls(groups, **options)
    except (ValueError, TypeError) as err:
        # torch optimizers validate values (lr < 0, betas out of range...) with
        # ValueError; a TypeError at this point is an option of the wrong type.
        raise ConfigError(f"optimizer {optim_name}({_describe(options)}): {err}") from err


def _check_group_values(optim_cls: Any, entries: list[dict], cfg: dict) -> None:
    """Let the optimizer validate each entry's overrides: torch checks option
    values (negative lr, betas >= 1, ...) only for the constructor defaults,
    so each entry is tried as the defaults of a throwaway optimizer."""
    base = {k: v for k, v in cfg.items() if k != "type"}
    for entry in entries:
        overrides = {k: v for k, v in entry.items() if k not in ("keyword", "lr_scale")}
        if not overrides:
            continue
        try:
            optim_cls([torch.zeros(1, requires_grad=True)], **{**base, **overrides})
        except (ValueError, TypeError) as err:
            raise ConfigError(f"param_dicts keyword {entry['keyword']!r} ({_describe(overrides)}): {err}") from err


def _describe(options: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in options.items()).replace("\n", " ")


def _validate_entries(param_dicts: Any, options: set[str] | None, optim_name: str) -> list[dict]:
    if param_dicts is None:
        return []
    if not isinstance(param_dicts, (list, tuple)):
        raise ConfigError(f"param_dicts must be a list of dict(keyword=..., ...), got {param_dicts!r}")
    entries: list[dict] = []
    seen: set[str] = set()
    for index, entry in enumerate(param_dicts):
        where = f"param_dicts[{index}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where} must be a dict(keyword=..., ...), got {entry!r}")
        keyword = entry.get("keyword")
        if not isinstance(keyword, str) or not keyword:
            raise ConfigError(
                f"{where} = {entry!r} needs a non-empty string 'keyword' "
                "(a substring of the parameter names it applies to)"
            )
        if keyword in seen:
            raise ConfigError(f"{where}: keyword {keyword!r} is listed twice; the second entry would never match")
        seen.add(keyword)
        if "lr" in entry and "lr_scale" in entry:
            raise ConfigError(f"{where} (keyword {keyword!r}) sets both 'lr' and 'lr_scale'; keep one")
        for key in ("lr", "lr_scale"):
            value = entry.get(key, 0.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{where} (keyword {keyword!r}): {key} must be a number >= 0, got {value!r}")
        if options is not None:
            unknown = sorted(set(entry) - set(_ENTRY_KEYS) - options)
            if unknown:
                raise ConfigError(
                    f"{where} (keyword {keyword!r}): {', '.join(map(repr, unknown))} "
                    f"{'is' if len(unknown) == 1 else 'are'} not an option of {optim_name}; "
                    f"valid: keyword, lr_scale, {', '.join(sorted(options))}"
                )
        entries.append(dict(entry))
    return entries


def build_optimizer(
    cfg: dict,
    model: nn.Module,
    param_dicts: list[dict] | None = None,
) -> torch.optim.Optimizer:
    """Build ``cfg["type"]`` from OPTIMIZERS over ``model``'s trainable parameters.

    ``param_dicts`` entries: ``keyword`` (required, substring of the parameter
    name, a leading ``module.`` from DDP ignored), then either ``lr`` (absolute
    group lr) or ``lr_scale`` (multiplies the base lr), plus any optimizer
    option to override for that group. ``cfg["no_weight_decay"]`` (a dict of
    :data:`NO_DECAY_RULES` flags; upstream's ``WeightDecayExclusion`` hook sets
    it) splits every group in two, its decayed parameters then the excluded
    ones (``weight_decay=0``), so the layout stays fixed across runs. Parameters with ``requires_grad=False``
    are left out. Raises :class:`ConfigError` for bad entries and
    :class:`RegistryError` for an unknown type or option.
    """
    if not isinstance(cfg, dict) or "type" not in cfg:
        raise ConfigError(f"optimizer must be a dict(type=..., lr=..., ...), got {cfg!r}")
    cfg = dict(cfg)
    no_decay = cfg.pop("no_weight_decay", None)
    if no_decay is not None:
        no_decay = _check_no_decay(no_decay)
    if "params" in cfg:
        raise ConfigError("optimizer.params is filled in from the model; remove it (use param_dicts for groups)")
    optim_cls = OPTIMIZERS.get(cfg["type"]) if isinstance(cfg["type"], str) else cfg["type"]
    optim_name = getattr(optim_cls, "__name__", str(cfg["type"]))
    options = _option_names(optim_cls)
    _check_options(cfg, options, optim_name)
    entries = _validate_entries(param_dicts, options, optim_name)

    named = [(name.removeprefix("module."), p) for name, p in model.named_parameters()]
    all_names = [name for name, _ in named]
    for entry in entries:
        if not any(entry["keyword"] in name for name in all_names):
            examples = ", ".join(all_names[:5]) + (", ..." if len(all_names) > 5 else "")
            raise ConfigError(
                f"param_dicts keyword {entry['keyword']!r} matches no parameter of the model "
                f"(parameters are named like: {examples or '(model has no parameters)'})"
            )

    trainable = [(name, p) for name, p in named if p.requires_grad]
    if not trainable:
        raise ConfigError("the model has no trainable parameters (all have requires_grad=False); nothing to optimize")

    buckets: list[list[nn.Parameter]] = [[] for _ in range(len(entries) + 1)]
    bucket_names: list[list[str]] = [[] for _ in range(len(entries) + 1)]
    for name, param in trainable:
        slot = next((i + 1 for i, e in enumerate(entries) if e["keyword"] in name), 0)
        buckets[slot].append(param)
        bucket_names[slot].append(name)

    groups: list[dict] = [{"params": buckets[0], "name": "default"}]
    lr_scales: dict[int, float] = {}
    for index, (entry, params) in enumerate(zip(entries, buckets[1:]), start=1):
        if not params:
            # Kept (empty) so group indices do not depend on which parameters
            # happen to be frozen or claimed by an earlier keyword.
            logger.warning(
                "param_dicts keyword %r gets no trainable parameter (frozen, or taken by an earlier keyword)",
                entry["keyword"],
            )
        group = {k: v for k, v in entry.items() if k not in ("keyword", "lr_scale")}
        group.update(params=params, name=entry["keyword"])
        if "lr_scale" in entry:
            lr_scales[index] = entry["lr_scale"]
        groups.append(group)

    if no_decay is not None:
        groups, lr_scales = _split_no_decay(groups, bucket_names, lr_scales, no_decay)
    optimizer = _construct(optim_cls, optim_name, groups, cfg)
    _check_group_values(optim_cls, entries, cfg)

    # lr_scale is resolved after construction so it also scales an optimizer's
    # own default lr when the config does not set one.
    base_lr = optimizer.defaults.get("lr")
    for index, scale in lr_scales.items():
        if base_lr is None:
            raise ConfigError(
                f"param_dicts keyword {groups[index]['name']!r} uses lr_scale, "
                f"but {optim_name} has no base lr to scale; set 'lr' instead"
            )
        optimizer.param_groups[index]["lr"] = base_lr * scale
    return optimizer


#: Rules of ``no_weight_decay``: which parameters get no weight decay.
NO_DECAY_RULES = {
    "bias": lambda name, p: name.endswith(".bias"),
    "norm": lambda name, p: "norm" in name.lower(),
    "gamma": lambda name, p: "gamma" in name.lower(),
    "token": lambda name, p: "token" in name.lower(),
    "ndim_1": lambda name, p: p.ndim == 1,
}


def _check_no_decay(rules: Any) -> tuple[str, ...]:
    if not isinstance(rules, dict) or set(rules) - set(NO_DECAY_RULES):
        raise ConfigError(f"optimizer no_weight_decay={rules!r}: give a dict of flags among {list(NO_DECAY_RULES)}")
    return tuple(k for k, on in rules.items() if on)


def _split_no_decay(groups: list[dict], names: list[list[str]], lr_scales: dict[int, float],
                    rules: tuple[str, ...]) -> tuple[list[dict], dict[int, float]]:
    """Each group becomes two (``<name>`` with ``apply_wd=True``, then
    ``<name>/no_decay`` with ``weight_decay=0`` and ``apply_wd=False``), both
    kept when empty so the group layout does not depend on the model."""
    out, scales = [], {}
    for index, (group, group_names) in enumerate(zip(groups, names)):
        decay, excluded = [], []
        for name, param in zip(group_names, group["params"]):
            (excluded if any(NO_DECAY_RULES[r](name, param) for r in rules) else decay).append(param)
        out.append({**group, "params": decay, "apply_wd": True})
        out.append({**group, "params": excluded, "name": f"{group['name']}/no_decay", "weight_decay": 0.0,
                    "apply_wd": False})
        if index in lr_scales:
            scales[2 * index] = scales[2 * index + 1] = lr_scales[index]
    return out, scales
