"""Runtime keys: the one source of their defaults, types and meanings.

Every config is read as: these defaults, then its ``_base_`` files, then the
file itself, then ``--options``, then each hook's ``modify_config``; only then
is it validated (:func:`validate_runtime`) and built. So a config without any
``_base_`` works, and the runtime base that ships in the package,
``pimm/configs/_base_/default_runtime.py`` (``_base_ =
"pimm://_base_/default_runtime.py"`` from any config), is generated from this
table (``python tools/write_default_runtime.py``; a test keeps the two equal).

A runtime key's value of the wrong type is bad input (exit 2 naming the key
and what it takes): ``resume="no"`` is a string, not False, and must never be
silently truthy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pimm.engines.optim.compile import DEFAULT_COMPILE, check_compile
from pimm.engines.loop.default_hooks import DEFAULT_HOOKS, check_default_hooks, fill_default_hooks
from pimm.engines.run.parallel import DEFAULT_PARALLEL, check_parallel
from pimm.engines.state.weight_source import check_weight_option
from pimm.engines.observe.wandb_options import WANDB_KEYS, check_wandb_keys
from pimm.utils.errors import ConfigError
from pimm.utils.extras import require
from pimm.engines.run.runtime_checks import (_bool, _int, _positive_number_or_none, _per_part, _choice, _path,  # noqa: F401
                                             _resume, _seed, _signals, _list_or_none, _patterns_or_none, _key_map,
                                             _hooks, _typed_dict, _unit_interval, _choice_or_none,
                                             _structured_logging, _dict_or_none)

__all__ = ["RUNTIME_KEYS", "RUNTIME_DEFAULTS", "DEFAULT_HOOKS", "apply_runtime_defaults", "validate_runtime",
           "render_default_runtime", "check_required", "apply_process_settings", "check_runtime_domains"]


@dataclass(frozen=True)
class RuntimeKey:
    """One runtime key of the engine: its ``name``, ``default``, ``check``
    (``check(key, value)`` returns the normalised value or raises a one-line
    ConfigError) and the ``doc`` line that ``configs/_base_/default_runtime.py``
    and the docs are generated from.
    """
    name: str
    default: Any
    check: Callable[[str, Any], Any]
    doc: str


RUNTIME_KEYS: tuple[RuntimeKey, ...] = (
    RuntimeKey("save_path", "exp/default", _path(), "the run directory (~ is expanded)"),
    RuntimeKey("seed", 0, _seed, "every RNG stream derives from it; None draws one and records it in config.py"),
    RuntimeKey("epoch", 1, _int(1), "absolute horizon: raising it and resuming extends a finished run"),
    RuntimeKey("batch_size", 16, _int(1), "global, split evenly across processes"),
    RuntimeKey("batch_size_val", None, _int(1, allow_none=True), "global; None = batch_size"),
    RuntimeKey("num_worker", 0, _int(0, high=1024), "global data-loading workers, split across processes"),
    RuntimeKey("resume", False, _resume,
               "continue from the newest complete checkpoint; 'allow_fresh' also starts fresh when none is usable; "
               "a checkpoint folder's path: continue from that one"),
    RuntimeKey("trust_checkpoint_code", False, _bool,
               "resume/fork: also load a checkpoint that holds more than data (one written before pimm saved plain "
               "states); unpickling it runs whatever code it names: only for checkpoints you trust"),
    RuntimeKey("validate_on_resume", False, _bool,
               "a resumed run evaluates its weights (val/* at the resumed step) before training continues"),
    RuntimeKey("scheduler_interval", 1, _int(1),
               "optimizer updates per scheduler step (the schedule's length is counted in scheduler steps)"),
    RuntimeKey("weight", None, check_weight_option,
               "warm-start weights: a .pth/.safetensors file, a run, checkpoint or export folder, or hf://org/name"),
    RuntimeKey("weight_key_map", None, _key_map,
               "warm start: [old_prefix, new_prefix] pairs renaming the weight file's keys"),
    RuntimeKey("evaluate", True, _bool, "run the evaluator hooks"),
    RuntimeKey("enable_amp", False, _bool, "mixed precision (autocast)"),
    RuntimeKey("amp_dtype", "bfloat16", _choice("bfloat16", "float16"), "'float16' needs CUDA (uses a GradScaler)"),
    RuntimeKey("clip_grad", None, _per_part(_positive_number_or_none, "clip_grad"),
               "max gradient norm (None: no clipping); several optimizers: one for all or dict(<part>=...)"),
    RuntimeKey("grad_accum_steps", 1, _int(1), "micro-batches per optimizer step"),
    RuntimeKey("log_grad_norm", False, _bool, "log train/grad_norm every step (always logged when clipping)"),
    RuntimeKey("gradient_checkpointing", None, _patterns_or_none,
               "recompute these submodules' activations in backward (fnmatch patterns, e.g. ['backbone.enc*'])"),
    RuntimeKey("use_wandb", False, _bool, "W&B run (WANDB_MODE=offline works without network)"),
    *(RuntimeKey(name, default, check, doc) for name, default, check, doc in WANDB_KEYS),
    RuntimeKey("enable_tensorboard", True, _bool, "TensorBoard event files under save_path/tensorboard"),
    RuntimeKey("preempt_signals", ["SIGTERM"], _signals,
               "signals that checkpoint and exit 75, e.g. ['SIGTERM', 'SIGUSR2'] for SLURM --signal"),
    RuntimeKey("param_dicts", None, _per_part(_list_or_none, "param_dicts"),
               "per-parameter-group options, see docs/engine.md; several optimizers: dict(<part>=[...])"),
    RuntimeKey("scheduler", None, _dict_or_none, "a dict(type=...) from SCHEDULERS; None: constant lr; several optimizers: dict(<part>=dict(type=...))"),
    RuntimeKey("batch_size_test", None, _int(1, allow_none=True), "global; None = batch_size_val, else batch_size"),
    RuntimeKey("eval_epoch", None, _int(1, allow_none=True),
               "evaluations in the run: every max(1, epoch // eval_epoch) epochs, the last always (None: every epoch)"),
    RuntimeKey("test_only", False, _bool, "tools/train.py scores `weight` on data.test instead of training"),
    RuntimeKey("test", None, _dict_or_none,
               "a dict(type=...) from TESTERS for tools/test.py (None: the evaluator hooks on data.test)"),
    RuntimeKey("iters_per_epoch", None, _int(1, allow_none=True),
               "steps (GRPO: rollouts) per epoch over an iterable training set; None: num_samples() // processes "
               "// batch per process"),
    RuntimeKey("mix_prob", 0.0, _unit_interval, "probability that the train collate mixes pairs of events"),
    RuntimeKey("matmul_precision", None, _choice_or_none("highest", "high", "medium"),
               "torch.set_float32_matmul_precision (None: leave torch's)"),
    RuntimeKey("deterministic", False, _bool, "deterministic algorithms (and no TF32, cuDNN benchmarking off)"),
    RuntimeKey("detect_anomaly", False, _bool, "run training under torch.autograd.detect_anomaly (slow)"),
    RuntimeKey("empty_cache", False, _bool, "torch.cuda.empty_cache() after every step (CUDA)"),
    RuntimeKey("empty_cache_per_epoch", False, _bool, "torch.cuda.empty_cache() after every epoch (CUDA)"),
    RuntimeKey("sync_bn", False, _bool, "BatchNorm -> SyncBatchNorm when distributed on CUDA"),
    RuntimeKey("find_unused_parameters", False, _bool, "passed to DDP (also a train option)"),
    RuntimeKey("parallel", DEFAULT_PARALLEL, check_parallel,
               "strategy 'ddp' (replicas) or 'fsdp' (FSDP2 sharding; options in docs/distributed.md)"),
    RuntimeKey("compile", DEFAULT_COMPILE, check_compile,
               "torch.compile the training model (enabled=True; mode/dynamic/fullgraph/backend as torch.compile's)"),
    RuntimeKey("prefetch_factor", None, _int(1, allow_none=True),
               "batches each data worker loads ahead (None: torch's default, 2)"),
    RuntimeKey("structured_logging", dict(enabled=False, trace_hooks=False, batch_stats_every=1,
                                          max_bytes=32 * 1024 * 1024, max_files=20, flush_every_s=1.0),
               _structured_logging, "per-rank step traces under save_path/trace/ (`pimm trace summarize RUN`)"),
    RuntimeKey("checkpoint_format", None, _choice_or_none("standard", "dcp", "legacy", "torch"),
               "accepted for upstream configs: pimm always writes its verified checkpoints/ layout"),
    RuntimeKey("train", dict(type="DefaultTrainer"), _typed_dict, "the trainer and its options"),
    RuntimeKey("default_hooks", DEFAULT_HOOKS, check_default_hooks,
               "the named runtime services every run gets; None switches one off (docs/hooks.md)"),
    RuntimeKey("hooks", [], _hooks, "the config's own hooks, added to default_hooks; a type in both: this list's "
               "entry is used (docs/hooks.md)"),
)

RUNTIME_DEFAULTS = {key.name: key.default for key in RUNTIME_KEYS}


def apply_runtime_defaults(cfg) -> None:
    """Fill in every runtime key the config leaves out (deep copies)."""
    import copy

    for key, value in RUNTIME_DEFAULTS.items():
        if key not in cfg:
            cfg[key] = copy.deepcopy(value)
    fill_default_hooks(cfg)  # also the names a config's own default_hooks leaves out


def check_runtime_domains(cfg) -> None:
    """Each runtime key's own domain (its ``check``), before any hook is built;
    :func:`validate_runtime` adds the relations between keys once hooks had their say."""
    for key in RUNTIME_KEYS:
        cfg[key.name] = key.check(key.name, cfg.get(key.name))


def validate_runtime(cfg, world_size: int) -> None:
    """Check every runtime key's type and range; normalise paths (``~``)."""
    check_wandb_keys(cfg)
    for key in RUNTIME_KEYS:
        cfg[key.name] = key.check(key.name, cfg.get(key.name))
    if cfg.batch_size % world_size:
        raise ConfigError(
            f"batch_size={cfg.batch_size} is the global batch and must be divisible by the "
            f"{world_size} processes; use a multiple of {world_size}"
        )
    if cfg.num_worker % world_size:
        raise ConfigError(f"num_worker={cfg.num_worker} is global and must be divisible by the {world_size} "
                          f"processes; use a multiple of {world_size}")
    if cfg.use_wandb:
        require("wandb", "wandb", "use_wandb=True")
    save_path = Path(cfg.save_path)
    if save_path.exists() and not save_path.is_dir():
        raise ConfigError(f"save_path={cfg.save_path!r} is a file, not a directory: choose another save_path")


def apply_process_settings(cfg) -> None:
    """Process-wide torch settings the config asks for; the trainer applies them
    before it builds anything (model, loaders, optimizer).

    ``matmul_precision``: ``torch.set_float32_matmul_precision`` (``'highest'``,
    ``'high'``: TF32 on Ampere and later, ``'medium'``).

    ``deterministic=True``: ``torch.use_deterministic_algorithms(True)`` (an op
    without a deterministic implementation raises, naming itself), cuDNN
    deterministic with benchmarking off, no TF32 in float32 matmuls and cuDNN
    convolutions (it overrides ``matmul_precision``), and
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless the environment sets it: cuBLAS
    reads it when it creates its handle, at the process's first matmul on the
    GPU, which comes later (the launcher only selects the device and joins the
    process group). ``deterministic=False`` leaves torch's settings as found.
    """
    import torch

    if cfg.matmul_precision is not None:
        torch.set_float32_matmul_precision(cfg.matmul_precision)
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        # The same API as matmul_precision (torch warns when the legacy allow_tf32 flag and
        # the precision API are mixed for matmuls); cuDNN has only its flag.
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False


def check_required(cfg, mode: str) -> None:
    """The keys a run cannot do without, as one-line errors."""
    needed = ["model"] + (["optimizer"] if mode == "train" else [])
    for key in needed:
        if cfg.get(key) is None:
            example = {"model": "model = dict(type='SparseUNet', ...)",
                       "optimizer": "optimizer = dict(type='AdamW', lr=1e-3)"}[key]
            raise ConfigError(f"the config has no `{key}`: add e.g. {example}")
        if key == "optimizer":
            from pimm.engines.optim.parts import optimizer_parts

            if optimizer_parts(cfg[key]):  # one optimizer per model part, each dict(type=...)
                continue
        _typed_dict(key, cfg[key])
    split = "train" if mode == "train" else "test"
    data = cfg.get("data")
    if not isinstance(data, dict) or data.get(split) is None:
        raise ConfigError(f"the config has no data.{split}: add data = dict({split}=dict(type=..., ...))")


def render_default_runtime() -> str:
    """The text of ``pimm/configs/_base_/default_runtime.py``."""
    lines = [
        "# Runtime defaults shared by every pimm config. GENERATED from pimm/engines/run/runtime.py by",
        "# tools/write_default_runtime.py; a config without _base_ gets the same values from the",
        "# engine. Edit the table there, not this file. Any config names it as",
        "# _base_ = \"pimm://_base_/default_runtime.py\" (docs/config.md).",
        "",
    ]
    for key in RUNTIME_KEYS:
        if key.name in ("train", "default_hooks", "hooks"):
            continue
        lines.append(f"{key.name} = {key.default!r}  # {key.doc}")
    lines += ["", f"train = {_call_repr(RUNTIME_DEFAULTS['train'])}", "",
              "# The runtime services every run gets, by name: switch one off with None or change its",
              "# options here, in a config (default_hooks = dict(live_control=None)) or with --options",
              "# default_hooks.checkpoint.keep_last=5. `hooks` adds to them (docs/hooks.md).",
              "default_hooks = dict("]
    lines += [f"    {name}={_call_repr(hook)}," for name, hook in DEFAULT_HOOKS.items()]
    lines += [")", "", "hooks = []", ""]
    return "\n".join(lines)


def _call_repr(entry: dict) -> str:
    return "dict(" + ", ".join(f"{k}={v!r}" for k, v in entry.items()) + ")"
