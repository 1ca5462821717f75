"""Upstream pimm's diagnostic hooks, with upstream's arguments and meaning:
``GarbageHandler`` (Python garbage collection on a step cadence),
``LogitEntropyLogger`` (entropy of a model output's softmax),
``RuntimeProfiler`` (a ``torch.profiler`` trace of the first steps) and
``AttentionMaskAnnealingHook`` (drives and logs a model's attention-mask
annealing, Panda's detector); and the
one-line answers for hook names upstream's configs use that nothing builds
(``RuntimeProfilerV2``, ``PreciseEvaluator``).

They change nothing a run computes: the profiler traces the run's own first
steps (upstream runs extra batches through the model before training, which
would move the data order and the RNG streams of an exactly resumable run).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import torch

from pimm.engines.hooks.base import HookBase
from pimm.engines.registries import HOOKS
from pimm.utils.domains import Choice, Count, Int, Key, PosInt, Real, Text
from pimm.utils.errors import ConfigError

__all__ = ["GarbageHandler", "LogitEntropyLogger", "RuntimeProfiler", "AttentionMaskAnnealingHook"]


def _positive_int(owner: str, key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{owner}: {key}={value!r} must be a positive integer")
    return value


@HOOKS.register_module()
class GarbageHandler(HookBase):
    """Collect Python garbage every ``interval`` steps of an epoch instead of
    whenever the interpreter decides (``disable_auto`` switches automatic
    collection off for the run; it is switched back on after training).
    ``empty_cache``: also give cached CUDA memory back at each collection.
    After training: one last collection (and, on CUDA, an emptied cache)."""

    domains = dict(interval=PosInt)

    def __init__(self, interval: int = 150, disable_auto: bool = True, empty_cache: bool = False):
        self.interval = _positive_int("GarbageHandler", "interval", interval)
        self.disable_auto, self.empty_cache = bool(disable_auto), bool(empty_cache)
        self.iter = 1
        self._was_enabled = gc.isenabled()

    def before_train(self):
        if self.disable_auto:
            self._was_enabled = gc.isenabled()
            gc.disable()
            self.trainer.logger.info("GarbageHandler: automatic garbage collection disabled; collecting every "
                                     f"{self.interval} steps")

    def before_epoch(self):
        self.iter = 1

    def after_step(self):
        if self.iter % self.interval == 0:
            gc.collect()
            if self.empty_cache and torch.cuda.is_available():
                torch.cuda.empty_cache()
        self.iter += 1

    def after_train(self):
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self.disable_auto and self._was_enabled:
            gc.enable()

    def state_dict(self):
        return {"iter": self.iter}

    def load_state_dict(self, state):
        self.iter = int(state.get("iter", 1))


@HOOKS.register_module()
class LogitEntropyLogger(HookBase):
    """Every ``log_frequency`` steps: the Shannon entropy of
    ``softmax(logits / T)`` over the last axis of the model output's
    ``logits_key`` (a step whose output lacks it logs nothing), logged as
    ``train_batch/<prefix>`` with ``<prefix>/temperature``; the epoch's mean
    as ``train/<prefix>``. ``T`` is the model's current ``teacher_temp``
    (Sonata's schedule; the model itself or a ``sonata`` submodule), else
    ``default_temperature``. ``reduction``: how the per-row entropies are
    reduced (``"none"``: their mean is logged; ``log_per_class`` adds the
    mean over rows of each column, ``train_batch/<prefix>_class_<i>``, for
    logits of more than two axes)."""

    domains = dict(logits_key=Key, log_frequency=PosInt, prefix=Key, reduction=Choice("mean", "sum", "none"),
                   default_temperature=Real(0, 1e3, lo_open=True))

    def __init__(self, logits_key: str = "teacher_logits", log_frequency: int = 1, prefix: str = "entropy",
                 reduction: str = "mean", log_per_class: bool = False, default_temperature: float = 0.07):
        if reduction not in ("mean", "sum", "none"):
            raise ConfigError(f"LogitEntropyLogger: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.logits_key, self.prefix, self.reduction = logits_key, prefix, reduction
        self.log_frequency = _positive_int("LogitEntropyLogger", "log_frequency", log_frequency)
        self.log_per_class = bool(log_per_class)
        self.default_temperature = float(default_temperature)
        self._sonata = None
        self._epoch_sum, self._epoch_count = 0.0, 0

    def before_train(self):
        model = self.trainer.model_without_ddp
        candidates = [model, getattr(model, "sonata", None), getattr(model, "model", None)]
        self._sonata = next((m for m in candidates if m is not None and hasattr(m, "teacher_temp")), None)
        if self._sonata is None:
            self.trainer.logger.info(f"LogitEntropyLogger: the model has no teacher_temp; entropy of "
                                     f"{self.logits_key!r} at temperature {self.default_temperature:g}")

    def temperature(self) -> float:
        """The model's current ``teacher_temp``, else ``default_temperature``."""
        return float(self._sonata.teacher_temp) if self._sonata is not None else self.default_temperature

    def entropy(self, logits: torch.Tensor) -> torch.Tensor:
        """Per-row entropies of ``softmax(logits / T)``, reduced by ``reduction``."""
        probs = torch.softmax(logits.detach().float() / self.temperature(), dim=-1)
        per_row = -(probs * torch.log(probs + 1e-10)).sum(dim=-1)
        if self.reduction == "mean":
            return per_row.mean()
        if self.reduction == "sum":
            return per_row.sum()
        return per_row

    def before_epoch(self):
        self._epoch_sum, self._epoch_count = 0.0, 0

    def after_step(self):
        trainer = self.trainer
        if trainer.global_step % self.log_frequency:  # after_step: global_step counts the steps done
            return
        output = trainer.comm_info.get("model_output_dict") or {}
        if self.logits_key not in output:
            return
        entropy = self.entropy(output[self.logits_key])
        temperature = self.temperature()
        output["temperature"] = temperature
        value = float(entropy.mean() if entropy.numel() > 1 else entropy)
        scalars = {f"train_batch/{self.prefix}": value, f"{self.prefix}/temperature": temperature}
        if self.log_per_class and self.reduction == "none" and entropy.dim() > 1:
            for i, column in enumerate(entropy.mean(dim=0).tolist()):
                scalars[f"train_batch/{self.prefix}_class_{i}"] = column
        trainer.metrics.publish_local(scalars, step=trainer.global_step)
        trainer.comm_info["iter_info"] = f"{trainer.comm_info.get('iter_info') or ''}{self.prefix}: {value:.4f} "
        self._epoch_sum += value
        self._epoch_count += 1

    def after_epoch(self):
        if self._epoch_count:
            self.trainer.metrics.publish_local({f"train/{self.prefix}": self._epoch_sum / self._epoch_count})

    def state_dict(self):
        return {"epoch_sum": self._epoch_sum, "epoch_count": self._epoch_count}

    def load_state_dict(self, state):
        self._epoch_sum, self._epoch_count = float(state["epoch_sum"]), int(state["epoch_count"])


@HOOKS.register_module()
class RuntimeProfiler(HookBase):
    """Trace the run's first ``warm_up + 1`` steps with ``torch.profiler``
    (CPU, and CUDA when there is one; shapes, memory and stacks recorded):
    a TensorBoard trace in ``<save_path>/logdir/``, the operators' table
    (``row_limit`` rows sorted by ``sort_by``; a CUDA column on a machine
    without CUDA sorts by ``cpu_time_total`` instead) in the log, and with
    ``memory=True`` on CUDA a memory snapshot
    ``<save_path>/memory_snapshot.pickle``. ``interrupt=True`` then stops the
    run (a final checkpoint, exit 0), as upstream exits after profiling.
    ``forward``/``backward``: upstream's switches for its own extra batches;
    here the traced steps are the run's own, which always do both."""

    priority = "VERY_HIGH"  # open the trace before the other hooks' before_step
    domains = dict(warm_up=Count, sort_by=Text("a torch.profiler table column, e.g. 'cuda_time_total'"),
                   row_limit=Int(1, 10_000))

    def __init__(self, forward: bool = True, backward: bool = True, interrupt: bool = False, warm_up: int = 2,
                 sort_by: str = "cuda_time_total", row_limit: int = 30, memory: bool = True):
        if isinstance(warm_up, bool) or not isinstance(warm_up, int) or warm_up < 0:
            raise ConfigError(f"RuntimeProfiler: warm_up={warm_up!r} must be an integer >= 0")
        self.forward, self.backward, self.interrupt = bool(forward), bool(backward), bool(interrupt)
        self.warm_up, self.sort_by, self.row_limit, self.memory = warm_up, sort_by, int(row_limit), bool(memory)
        self._prof = None
        self._steps_left = 0
        self.done = False

    def before_train(self):
        if self.done:  # a resumed run was profiled before
            return
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        save_path = Path(self.trainer.cfg.save_path)
        logdir = save_path / "logdir"
        logdir.mkdir(parents=True, exist_ok=True)
        cuda = torch.cuda.is_available()
        if self.memory and cuda:
            torch.cuda.memory._record_memory_history()
        steps = self.warm_up + 1
        self._steps_left = steps
        self._prof = profile(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
            on_trace_ready=tensorboard_trace_handler(str(logdir), use_gzip=True),
            schedule=schedule(wait=0, warmup=min(1, steps - 1), active=max(1, steps - 1), repeat=1),
            record_shapes=True, profile_memory=True, with_stack=True)
        self._prof.__enter__()
        self.trainer.logger.info(f"RuntimeProfiler: tracing the first {steps} steps into {logdir}")

    def after_step(self):
        if self._prof is None:
            return
        self._prof.step()
        self._steps_left -= 1
        if self._steps_left == 0:
            self._finish()

    def after_train(self):
        if self._prof is not None:  # training ended before the traced steps did
            self._finish()

    def _finish(self):
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.done = True
        cuda = torch.cuda.is_available()
        sort_by = self.sort_by if cuda or "cuda" not in self.sort_by else "cpu_time_total"
        try:
            table = prof.key_averages().table(sort_by=sort_by, row_limit=self.row_limit)
        except (KeyError, AttributeError, ValueError):
            table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=self.row_limit)
        self.trainer.logger.info("RuntimeProfiler:\n" + table)
        if self.memory and cuda:
            path = os.path.join(self.trainer.cfg.save_path, "memory_snapshot.pickle")
            torch.cuda.memory._dump_snapshot(path)
            torch.cuda.memory._record_memory_history(enabled=None)
            self.trainer.logger.info(f"RuntimeProfiler: CUDA memory snapshot in {path}")
        if self.interrupt:
            self.trainer.request_stop("RuntimeProfiler(interrupt=True): profiling done")

    def state_dict(self):
        return {"done": self.done}

    def load_state_dict(self, state):
        self.done = bool(state.get("done", False))


HOOKS.add_hint("RuntimeProfilerV2", "upstream's configs name it but its source registers no such hook; use "
                                    "RuntimeProfiler (same arguments)")
HOOKS.add_hint("PreciseEvaluator", "upstream's configs name it but its source registers no such hook; use "
                                   "SemSegEvaluator (or the evaluator of your task, docs/hooks/evaluators.md)")


@HOOKS.register_module()
class AttentionMaskAnnealingHook(HookBase):
    """Tell the model the global step after every step
    (``model.update_anneal_step(step)``, and once before training, so a
    resumed run continues where it was) and every ``log_frequency`` steps log
    the mean of its decoder blocks' mask-bias factors
    (``model.anneal_factors()``: 1 full mask, 0 none) as ``<prefix>/average``
    (``log_per_layer``: also ``<prefix>/layer_<i>``). A model without
    ``update_anneal_step`` turns the hook off with one log line.
    ``detector-v5`` does not anneal (upstream turns it off), so its factors
    stay 1."""

    domains = dict(log_frequency=PosInt, prefix=Key)

    def __init__(self, log_frequency: int = 100, log_per_layer: bool = False, prefix: str = "anneal"):
        self.log_frequency = _positive_int("AttentionMaskAnnealingHook", "log_frequency", log_frequency)
        self.log_per_layer, self.prefix = bool(log_per_layer), prefix
        self._model = None

    def before_train(self):
        model = self.trainer.model_without_ddp
        if not hasattr(model, "update_anneal_step"):
            self.trainer.logger.info(f"AttentionMaskAnnealingHook: {type(model).__name__} has no "
                                     "update_anneal_step; nothing to anneal")
            return
        self._model = model
        model.update_anneal_step(int(self.trainer.global_step))

    def after_step(self):
        if self._model is None:
            return
        step = int(self.trainer.global_step)
        self._model.update_anneal_step(step)
        if step % self.log_frequency or not hasattr(self._model, "anneal_factors"):
            return
        factors = [float(f) for f in self._model.anneal_factors()]
        if not factors:
            return
        writer = self.trainer.writer
        writer.add_scalar(f"{self.prefix}/average", sum(factors) / len(factors), step)
        if self.log_per_layer:
            for i, factor in enumerate(factors):
                writer.add_scalar(f"{self.prefix}/layer_{i}", factor, step)
