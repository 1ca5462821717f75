"""Runtime keys every config has, their defaults, and their validation.

``configs/_base_/default_runtime.py`` spells the same defaults out for users;
the engine fills in any key a config leaves out, so a minimal config works.
"""

from __future__ import annotations

from pathlib import Path

from pimm.utils.errors import ConfigError

__all__ = ["RUNTIME_DEFAULTS", "apply_runtime_defaults", "validate_runtime", "guard_save_path"]

RUNTIME_DEFAULTS = dict(
    save_path="exp/default",
    seed=0,
    epoch=1,
    batch_size=16,
    batch_size_val=None,  # None: same as batch_size
    num_worker=0,
    resume=False,
    weight=None,
    evaluate=True,
    enable_amp=False,
    amp_dtype="bfloat16",
    clip_grad=None,
    grad_accum_steps=1,
    use_wandb=False,
    wandb_project="pimm",
    enable_tensorboard=True,
    preempt_signals=["SIGTERM"],
    param_dicts=None,
    train=dict(type="DefaultTrainer"),
    hooks=[],
)


def apply_runtime_defaults(cfg) -> None:
    for key, value in RUNTIME_DEFAULTS.items():
        if key not in cfg:
            cfg[key] = value


def _positive_int(cfg, key: str, allow_zero: bool = False) -> None:
    value = cfg[key]
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        need = "a non-negative integer" if allow_zero else "a positive integer"
        raise ConfigError(f"{key}={value!r} is invalid: it must be {need}")


def validate_runtime(cfg, world_size: int) -> None:
    for key in ("epoch", "batch_size", "grad_accum_steps"):
        _positive_int(cfg, key)
    _positive_int(cfg, "num_worker", allow_zero=True)
    if cfg.batch_size_val is not None:
        _positive_int(cfg, "batch_size_val")
    if cfg.batch_size % world_size:
        raise ConfigError(
            f"batch_size={cfg.batch_size} is the global batch and must be divisible by the "
            f"{world_size} processes; use a multiple of {world_size}"
        )
    if cfg.amp_dtype not in ("float16", "bfloat16"):
        raise ConfigError(f"amp_dtype={cfg.amp_dtype!r} is invalid: use 'bfloat16' or 'float16'")
    if cfg.clip_grad is not None and (isinstance(cfg.clip_grad, bool) or not isinstance(cfg.clip_grad, (int, float))
                                      or cfg.clip_grad <= 0):
        raise ConfigError(f"clip_grad={cfg.clip_grad!r} is invalid: use a positive max-norm or None")
    if not isinstance(cfg.save_path, str) or not cfg.save_path:
        raise ConfigError(f"save_path={cfg.save_path!r} is invalid: give a directory path")
    if not isinstance(cfg.get("train"), dict) or "type" not in cfg.train:
        raise ConfigError("train must be a dict(type=...) naming a trainer, e.g. train = dict(type='DefaultTrainer')")
    if not isinstance(cfg.hooks, (list, tuple)):
        raise ConfigError(f"hooks must be a list of dict(type=...), got {type(cfg.hooks).__name__}")
    if cfg.weight is not None and not Path(cfg.weight).is_file():
        raise ConfigError(f"weight={cfg.weight!r}: no such file; give the path of a .pth checkpoint or None")


def guard_save_path(cfg) -> None:
    """Refuse to start a fresh run over an existing one (nothing a user made is lost)."""
    if cfg.resume:
        return
    root = Path(cfg.save_path)
    ckpt_dir = root / "checkpoints"
    has_ckpt = ckpt_dir.is_dir() and any(p.name.startswith("step") for p in ckpt_dir.iterdir())
    has_metrics = (root / "metrics.jsonl").is_file() and (root / "metrics.jsonl").stat().st_size > 0
    if has_ckpt or has_metrics:
        what = "checkpoints" if has_ckpt else "a metrics.jsonl"
        raise ConfigError(
            f"save_path {str(root)!r} already holds {what} of an earlier run; pass resume=True to continue it, "
            "or choose another save_path (nothing was changed)"
        )
