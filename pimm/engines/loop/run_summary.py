"""What a run says when it ends: the commands that continue, evaluate and plot
it, and the end-of-run summary (:func:`end_of_run_summary`).

The summary reads ``metrics.jsonl`` (every attempt of the run, so a resumed
run's best counts its earlier attempts too) for the trainer's headline metric
(:attr:`TrainerBase.headline_metric`: the training loss, GRPO's mean reward,
the GAN's statistics gap), and names the best checkpoint's metric when an
evaluator ranks checkpoints.

The commands are spelled the way this process was started: ``python
tools/train.py`` when it was, ``pimm train`` otherwise (the console script
and ``python -m pimm.cli.train`` alike); a run under torchrun is continued by
rerunning the same torchrun command with ``resume=True``.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import shlex
import sys
from pathlib import Path

from pimm.utils.files import read_jsonl

__all__ = ["resume_command", "test_command", "plot_command", "under_torchrun", "headline_values",
           "end_of_run_summary", "log_summary"]


def under_torchrun() -> bool:
    """Whether this process is a torchrun worker (``--num-gpus`` ranks are not)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def _tool(verb: str) -> str:
    """``python tools/<verb>.py`` when this process was started from tools/, else ``pimm <verb>``."""
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if argv0 is not None and argv0.parent.name == "tools" and argv0.suffix == ".py":
        return f"python {shlex.quote(str(argv0.with_name(f'{verb}.py')))}"
    return f"pimm {verb}"


def resume_command(save_path: str | Path, world_size: int = 1) -> str:
    """The command that continues the run in ``save_path`` exactly (same world size)."""
    if under_torchrun():
        return "the same torchrun command with --options resume=True"
    gpus = f" --num-gpus {world_size}" if world_size > 1 else ""
    return f"{_tool('train')} --resume {shlex.quote(str(save_path))}{gpus}"


def test_command(save_path: str | Path, checkpoint: str | None = None) -> str:
    """The command that evaluates the run on its test split: its best weights
    (``model/model_best.pth``), or those ``checkpoint`` names (``last``, a
    checkpoint folder), as ``pimm test --checkpoint`` takes it."""
    which = f" --checkpoint {shlex.quote(checkpoint)}" if checkpoint else ""
    return f"{_tool('test')} {shlex.quote(str(save_path))}{which}"


def _weights_to_test(save_path: Path, checkpoints: list) -> str | None:
    """What ``pimm test`` can evaluate in this run: "best" when ``model_best.pth``
    exists, else "last" for ``model_last.pth``, else the newest committed
    checkpoint folder; None when the run wrote no weights."""
    model_dir = save_path / "model"
    if (model_dir / "model_best.pth").is_file():
        return "best"
    if (model_dir / "model_last.pth").is_file():
        return "last"
    return str(checkpoints[-1]) if checkpoints else None


def plot_command(save_path: str | Path) -> str:
    """The command that draws the run's curves."""
    return f"pimm plot {shlex.quote(str(save_path))}"


def headline_values(save_path: str | Path, tag: str, mode: str) -> dict | None:
    """``{"last": (step, value), "best": (step, value)}`` of ``tag`` in the run's
    metrics.jsonl (``mode``: "min" or "max" says which is best), or None when
    the run never logged a finite value of it."""
    last = best = None
    for record in read_jsonl(Path(save_path) / "metrics.jsonl"):
        value, step = record.get(tag), record.get("step")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            continue
        last = (step, float(value))
        if best is None or (value > best[1] if mode == "max" else value < best[1]):
            best = (step, float(value))
    return None if last is None else {"last": last, "best": best}


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def end_of_run_summary(trainer, seconds: float) -> list[str]:
    """The lines a finished (or stopped) run prints on rank 0: its outcome and
    time, the headline metric's last and best values, the best checkpoint,
    where the checkpoints and dashboards are, and the commands that evaluate,
    plot and continue it."""
    save_path = Path(trainer.cfg.save_path).resolve()
    outcome = trainer.outcome if trainer.outcome != "stopped" else f"stopped: {trainer.control.describe()}"
    lines = [f"Run {outcome} at step {trainer.global_step} (epoch {trainer.train_state.epoch} of "
             f"{trainer.max_epoch}) after {datetime.timedelta(seconds=round(seconds))} in this attempt"]
    tag, mode = trainer.headline_metric
    values = headline_values(save_path, tag, mode)
    if values is not None:
        (last_step, last), (best_step, best) = values["last"], values["best"]
        lines.append(f"  {tag}: last {_fmt(last)} (step {last_step}), best {_fmt(best)} (step {best_step}; "
                     f"{'higher' if mode == 'max' else 'lower'} is better)")
    ranked = trainer.metrics.best
    model_dir = save_path / "model"
    if ranked.name is not None and ranked.value is not None:
        best_file = model_dir / "model_best.pth"
        where = f" -> {best_file}" if best_file.is_file() else ""
        lines.append(f"  best checkpoint: {ranked.name} {_fmt(ranked.value)} at step {ranked.step}{where}")
    checkpoints = trainer.checkpointer.committed() if getattr(trainer, "checkpointer", None) else []
    if checkpoints:
        lines.append(f"  checkpoints: {checkpoints[-1]} (newest of {len(checkpoints)} kept); weights in {model_dir}")
    dashboards = [f"metrics {save_path / 'metrics.jsonl'}"]
    writer = getattr(trainer, "writer", None)
    if writer is not None and getattr(writer, "enable_tensorboard", False):
        dashboards.append(f"tensorboard --logdir {shlex.quote(str(save_path / 'tensorboard'))}")
    if writer is not None and getattr(writer, "use_wandb", False) and writer.wandb_run_id:
        dashboards.append(f"W&B run {writer.wandb_run_id}")
    lines.append("  dashboards: " + "; ".join(dashboards))
    weights = _weights_to_test(save_path, checkpoints)
    if trainer.cfg.get("data", {}).get("test") is not None and weights is not None:
        lines.append(f"  evaluate: {test_command(save_path, None if weights == 'best' else weights)}")
    lines.append(f"  plot: {plot_command(save_path)}")
    resume = resume_command(save_path, trainer.world_size)
    if trainer.outcome == "completed":
        more = " (raise epoch)" if under_torchrun() else f" --options epoch={trainer.max_epoch * 2}"
        lines.append(f"  train longer: {resume}{more}")
    else:
        lines.append(f"  continue: {resume}")
    return lines


def log_summary(trainer, seconds: float) -> None:
    """Log :func:`end_of_run_summary` (rank 0, console and train.log); a run that
    trained is never failed by its summary."""
    logger = logging.getLogger("pimm")
    try:
        lines = end_of_run_summary(trainer, seconds)
    except Exception as err:  # noqa: BLE001
        logger.warning(f"The end-of-run summary could not be made: {type(err).__name__}: {err}")
        return
    logger.info("\n".join(lines))
