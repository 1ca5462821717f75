"""Resuming a run from its newest complete checkpoint, and warm-starting weights.

Resume re-injects every participant's state through the trainer's
:class:`~pimm.engines.checkpoint.CheckpointManager`. When the process layout
changed (world size, data workers) the data position cannot be restored
exactly: the run continues from the same sample count with a warning that
says what is no longer exact.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pimm.engines.data import train_sampler
from pimm.utils import comm
from pimm.utils.errors import CheckpointError

__all__ = ["resume_training", "load_weights", "flatten_config", "describe_config_changes"]

# Config sections whose change between runs alters the training itself.
_RELEVANT = ("model", "optimizer", "scheduler", "data", "param_dicts", "batch_size", "grad_accum_steps", "seed",
             "clip_grad", "enable_amp", "amp_dtype", "train")


def flatten_config(cfg, prefix: str = "") -> dict[str, str]:
    """``{dotted.key: repr(value)}`` — strings only, so it loads with weights_only."""
    flat = {}
    items = cfg.items() if isinstance(cfg, dict) else enumerate(cfg)
    for key, value in items:
        path = f"{prefix}{key}"
        if isinstance(value, dict) or (isinstance(value, (list, tuple)) and any(isinstance(v, dict) for v in value)):
            flat.update(flatten_config(value, path + "."))
        else:
            flat[path] = repr(value)
    return flat


def describe_config_changes(saved: dict[str, str], current: dict[str, str], limit: int = 12) -> list[str]:
    changes = []
    for key in sorted(set(saved) | set(current)):
        if key.split(".")[0] not in _RELEVANT or saved.get(key) == current.get(key):
            continue
        changes.append(f"{key}: {saved.get(key, '<unset>')} -> {current.get(key, '<unset>')}")
    if len(changes) > limit:
        changes = changes[:limit] + [f"... and {len(changes) - limit} more"]
    return changes


def resume_training(trainer) -> bool:
    """Restore ``trainer`` from the newest complete checkpoint. False when there is none."""
    logger = trainer.logger
    manager = trainer.checkpointer
    loaded = manager.load_latest()
    if loaded is None:
        logger.info(f"resume=True but {manager.directory} holds no complete checkpoint: starting a fresh run")
        trainer.writer.rewind(0, 0)
        return False

    state = trainer.train_state
    new_layout = dict(world_size=state.world_size, batch_size_per_rank=state.batch_size_per_rank,
                      grad_accum_steps=state.grad_accum_steps, num_workers_per_rank=state.num_workers_per_rank)
    saved_state = loaded.common["train_state"]
    saved_meta = loaded.common.get("meta", {})
    changed_layout = {k: (saved_state.get(k), v) for k, v in new_layout.items() if saved_state.get(k) != v}

    skip = set()
    if changed_layout:
        skip.add("loader")
        if "world_size" in changed_layout:
            skip.add("rng")
        what = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed_layout.items())
        logger.warning(
            f"Resuming with a different layout ({what}): the run continues from the same sample count, but "
            "the data order inside this epoch"
            + (" and the per-rank random streams" if "rng" in skip else "")
            + " can no longer match the uninterrupted run exactly"
        )
    if saved_meta.get("total_steps") not in (None, trainer.iters_per_epoch * trainer.max_epoch):
        skip.add("scheduler")
        logger.warning(
            f"The schedule length changed ({saved_meta['total_steps']} -> "
            f"{trainer.iters_per_epoch * trainer.max_epoch} steps, e.g. a new `epoch` horizon): the LR schedule "
            "is rebuilt for the new length and continues from the saved step"
        )
    changes = describe_config_changes(saved_meta.get("config_flat", {}), flatten_config(trainer.cfg))
    if changes:
        logger.warning("Config differs from the checkpoint's in: " + "; ".join(changes))

    manager.restore(loaded, skip=skip)
    if "scheduler" in skip:
        saved_sched = loaded.common["scheduler"]
        trainer.scheduler.last_epoch = saved_sched.get("last_epoch", state.global_step)
        trainer.scheduler._step_count = saved_sched.get("_step_count", state.global_step + 1)

    if changed_layout:
        consumed = state.samples_seen_in_epoch()
        state.load_state_dict(new_layout)
        sampler = train_sampler(trainer.train_loader)
        if state.iter_in_epoch > 0 and sampler is not None:
            # Continue after the same number of samples, in the new layout's steps.
            sampler.set_epoch(state.epoch, consumed)
            remaining = len(trainer.train_loader) // state.grad_accum_steps
            state.iter_in_epoch = max(0, trainer.iters_per_epoch - remaining)
            trainer.resume_position(consumed)
        elif state.iter_in_epoch > 0:
            logger.warning("This loader cannot skip to a sample count: the interrupted epoch restarts")
            state.iter_in_epoch = 0
    logger.info(
        f"Resumed from {loaded.path.name}: {state.epoch} epoch(s) done, step {state.global_step}"
        + (f", {state.iter_in_epoch} step(s) into epoch {state.epoch + 1}" if state.iter_in_epoch else "")
    )
    return True


def _read_weights(path: Path) -> dict:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"weight={str(path)!r}: no such file") from None
    except Exception as err:
        raise CheckpointError(f"weight={str(path)!r} cannot be read as a torch weight file ({err.__class__.__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''})") from None
    if isinstance(obj, dict):
        for key in ("state_dict", "model"):
            if isinstance(obj.get(key), dict):
                return obj[key]
        if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            return obj
    raise CheckpointError(f"weight={str(path)!r} holds no model weights (expected a state_dict or a dict with "
                          "'state_dict' or 'model')")


def load_weights(model: torch.nn.Module, path: str | Path, key_map: list | tuple = (), logger=None) -> None:
    """Warm start: copy matching tensors from ``path`` into ``model``.

    ``key_map`` is a list of ``(old_prefix, new_prefix)`` pairs applied to the
    file's keys (a ``module.`` prefix is always stripped). Missing, unexpected
    and shape-mismatched keys are reported; if nothing matches it is an error."""
    path = Path(path)
    weights = _read_weights(path)
    renamed = {}
    for key, tensor in weights.items():
        if key.startswith("module."):
            key = key[len("module."):]
        for old, new in key_map:
            if key.startswith(old):
                key = new + key[len(old):]
                break
        renamed[key] = tensor
    own = model.state_dict()
    mismatched = [k for k, v in renamed.items() if k in own and own[k].shape != v.shape]
    usable = {k: v for k, v in renamed.items() if k in own and k not in mismatched}
    if not usable:
        raise CheckpointError(
            f"weight={str(path)!r} shares no parameter with {type(model).__name__} "
            f"(file keys look like {list(renamed)[:3]}, model keys like {list(own)[:3]}); "
            "set key_map on CheckpointLoader to rename prefixes"
        )
    result = model.load_state_dict(usable, strict=False)
    if logger is not None and comm.is_main_process():
        logger.info(f"Loaded {len(usable)}/{len(own)} tensors from {path}")
        if result.missing_keys:
            logger.warning(f"Missing keys (kept at initialisation): {', '.join(result.missing_keys[:20])}")
        unexpected = [k for k in renamed if k not in own]
        if unexpected:
            logger.warning(f"Unexpected keys (ignored): {', '.join(unexpected[:20])}")
        if mismatched:
            logger.warning(f"Shape-mismatched keys (skipped): {', '.join(mismatched[:20])}")
