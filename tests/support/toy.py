"""Tiny registered components for engine tests (imported via ``custom_imports``).

They are deliberately random in every way that matters to exact resume:
data augmentation draws from the global numpy and torch RNGs, and the model
uses dropout.
"""

import numpy as np
import torch
from torch import nn

from pimm.engines import DATASETS, HOOKS, MODELS, TRAINERS, DefaultTrainer, HookBase
from pimm.utils import comm


@DATASETS.register_module(force=True)
class ToyDataset(torch.utils.data.Dataset):
    def __init__(self, num_samples=256, dim=8, seed=0, noise_aug=0.0):
        generator = torch.Generator().manual_seed(1234)  # one fixed task for all splits
        weights = torch.randn(dim, generator=generator)
        generator.manual_seed(seed)
        self.x = torch.randn(num_samples, dim, generator=generator)
        self.y = (self.x @ weights > 0).long()
        self.noise_aug = noise_aug

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        x = self.x[index]
        if self.noise_aug:
            x = x + self.noise_aug * torch.randn_like(x) + float(np.random.uniform(-0.01, 0.01))
        return {"x": x, "label": self.y[index]}


@MODELS.register_module(force=True)
class ToyMLP(nn.Module):
    def __init__(self, dim=8, hidden=32, dropout=0.0, num_classes=2):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, num_classes))

    def forward(self, batch):
        logits = self.net(batch["x"])
        out = {"cls_logits": logits}
        if "label" in batch:
            out["loss"] = nn.functional.cross_entropy(logits, batch["label"])
        return out


@HOOKS.register_module(force=True)
class RecordingHook(HookBase):
    """Appends ``(name, phase, epoch, global_step)`` to a shared class-level log and
    counts steps in its state (for hook-state round trips)."""

    events = []

    def __init__(self, name="rec"):
        self.name = name
        self.steps_seen = 0

    def before_train(self):
        self.events.append((self.name, "before_train", self.trainer.epoch, self.trainer.global_step))

    def before_epoch(self):
        self.events.append((self.name, "before_epoch", self.trainer.epoch, self.trainer.global_step))

    def before_step(self):
        self.events.append((self.name, "before_step", self.trainer.epoch, self.trainer.global_step))

    def after_step(self):
        self.steps_seen += 1
        self.events.append((self.name, "after_step", self.trainer.epoch, self.trainer.global_step))

    def after_epoch(self):
        self.events.append((self.name, "after_epoch", self.trainer.epoch, self.trainer.global_step))

    def after_train(self):
        self.events.append((self.name, "after_train", self.trainer.epoch, self.trainer.global_step))

    def state_dict(self):
        return {"steps_seen": self.steps_seen}

    def load_state_dict(self, state):
        self.steps_seen = state["steps_seen"]


@HOOKS.register_module(force=True)
class KillAtStep(HookBase):
    """SIGKILLs (or SIGTERMs) its own process after ``step`` — a crash at a chosen point.
    ``wait_for_commit``: first wait until the checkpoint being written in the
    background is committed, so which checkpoints exist does not depend on how
    fast the machine is."""

    priority = "LOWEST"

    def __init__(self, step, signal_name="SIGKILL", wait_for_commit=False):
        self.step, self.signal_name, self.wait_for_commit = step, signal_name, wait_for_commit

    def after_step(self):
        if self.trainer.global_step == self.step:
            import os
            import signal

            if self.wait_for_commit:
                self.trainer.checkpointer.wait()
            os.kill(os.getpid(), getattr(signal, self.signal_name))


@DATASETS.register_module(force=True)
class ToyStream(torch.utils.data.IterableDataset):
    """An endless, deterministic stream with its own resumable state: sample k
    is drawn from a generator seeded by k (single-process loading)."""

    def __init__(self, dim=8):
        self.dim, self.position = dim, 0
        self.weights = torch.randn(dim, generator=torch.Generator().manual_seed(1234))

    def __iter__(self):
        while True:
            x = torch.randn(self.dim, generator=torch.Generator().manual_seed(self.position))
            self.position += 1
            yield {"x": x, "label": (x @ self.weights > 0).long()}

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


@DATASETS.register_module(force=True)
class ToySizedStream(ToyStream):
    """The same stream, declaring how many samples make an epoch."""

    def __init__(self, dim=8, length=80):
        super().__init__(dim)
        self.length = length

    def num_samples(self):
        return self.length


@HOOKS.register_module(force=True)
class PhaseRecorder(HookBase):
    """Records every phase it sees, with the step, into a class-level list."""

    events = []

    def __init__(self, priority_probe=False):
        self.priority_probe = priority_probe

    def _add(self, phase, *extra):
        self.events.append((phase, self.trainer.global_step, *extra))

    def before_train(self):
        self._add("before_train")

    def after_backward(self):
        grads = [p.grad for p in self.trainer.model_without_ddp.parameters()]
        self._add("after_backward", all(g is not None for g in grads))

    def before_val(self, run):
        self._add("before_val", run.prefix)

    def after_val(self, metrics, run):
        self._add("after_val", tuple(sorted(metrics)))

    def before_save_checkpoint(self):
        self._add("before_save_checkpoint")

    def after_load_checkpoint(self):
        self._add("after_load_checkpoint")

    def on_exception(self, exc):
        self._add("on_exception", type(exc).__name__)

    def after_train(self):
        self._add("after_train", self.trainer.outcome)


@HOOKS.register_module(force=True)
class StopAtStep(HookBase):
    """Asks the trainer to stop after ``step`` (a clean, requested stop)."""

    def __init__(self, step, agreed=True):
        self.step, self.agreed = step, agreed

    def after_step(self):
        if self.trainer.global_step == self.step:
            self.trainer.request_stop(f"StopAtStep({self.step})", agreed=self.agreed)


@HOOKS.register_module(force=True)
class RaiseAtStep(HookBase):
    """Raises after ``step`` (on ``rank`` only, when given)."""

    def __init__(self, step, rank=None):
        self.step, self.rank = step, rank

    def after_step(self):
        if self.trainer.global_step == self.step and self.rank in (None, comm.get_rank()):
            raise RuntimeError(f"boom at step {self.step} on rank {comm.get_rank()}")


@HOOKS.register_module(force=True)
class NaNAtStep(HookBase):
    """Poisons the model's weights after ``step``: the next losses are NaN."""

    def __init__(self, step):
        self.step = step

    def after_step(self):
        if self.trainer.global_step == self.step:
            with torch.no_grad():
                for p in self.trainer.model_without_ddp.parameters():
                    p.fill_(float("nan"))


class StepCounter:
    """A participant a trainer adds in one line; it notes on which ranks
    ``state_dict`` was called (every rank must call it: gathering can be a collective)."""

    def __init__(self, probe_dir=None):
        self.value, self.probe_dir = 0, probe_dir

    def state_dict(self):
        if self.probe_dir:
            import os

            with open(os.path.join(self.probe_dir, f"state_dict_calls.rank{comm.get_rank()}"), "a") as fh:
                fh.write(f"{self.value}\n")
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


@TRAINERS.register_module(force=True)
class TrackingTrainer(DefaultTrainer):
    def __init__(self, cfg, probe_dir=None, **options):
        super().__init__(cfg, **options)
        self.counter = StepCounter(probe_dir)
        self.track("counter", self.counter)

    def run_step(self):
        super().run_step()
        self.counter.value += 1


@HOOKS.register_module(force=True)
class RankValues(HookBase):
    """Publishes rank-dependent scalars with every reduce op (rank r publishes r + 1)."""

    def after_step(self):
        value = torch.tensor(float(comm.get_rank() + 1))
        ops = {"probe/mean": "mean", "probe/sum": "sum", "probe/min": "min", "probe/max": "max",
               "probe/last": "last"}
        self.trainer.metrics.publish({name: value for name in ops}, reduce=ops)


@DATASETS.register_module(force=True)
class SlowToyDataset(ToyDataset):
    """Takes ``build_seconds`` to build (SIGTERM while data sets are being built)."""

    def __init__(self, build_seconds=30.0, **kwargs):
        import pathlib
        import time

        marker = kwargs.pop("marker", None)
        if marker:
            pathlib.Path(marker).write_text("building")
        time.sleep(build_seconds)
        super().__init__(**kwargs)


@DATASETS.register_module(force=True)
class BrokenSampleDataset(ToyDataset):
    """Sample ``bad_index`` cannot be loaded (a corrupt event)."""

    def __init__(self, bad_index=5, **kwargs):
        super().__init__(**kwargs)
        self.bad_index = bad_index

    def __getitem__(self, index):
        if index == self.bad_index:
            raise ValueError(f"corrupt record at offset {index * 128}")
        return super().__getitem__(index)


@MODELS.register_module(force=True)
class HookedToyMLP(ToyMLP, HookBase):
    """A model that is also a hook (upstream's ModelHook forwards the phases to it)."""

    def __init__(self, **kwargs):
        ToyMLP.__init__(self, **kwargs)
        self.phases = []

    def before_train(self):
        self.phases.append(("before_train", self.trainer.global_step))

    def after_step(self):
        self.phases.append(("after_step", self.trainer.global_step))
        self.anomaly_mode = torch.is_anomaly_enabled()
# -- training-control hooks (EMA, early stopping, NaN guard) ---------------------------
from pimm.engines.hooks.evaluator import EvaluatorBase  # noqa: E402


@MODELS.register_module(force=True)
class ToyFlakyMLP(ToyMLP):
    """ToyMLP whose training loss is NaN on the given training forward calls
    (1-based, counted in this process; ``rank``: on that rank only)."""

    def __init__(self, nan_calls=(), rank=None, **kwargs):
        super().__init__(**kwargs)
        self.nan_calls, self.nan_rank, self.calls = set(nan_calls), rank, 0

    def forward(self, batch):
        out = super().forward(batch)
        if self.training and "loss" in out:
            self.calls += 1
            if self.calls in self.nan_calls and self.nan_rank in (None, comm.get_rank()):
                out["loss"] = out["loss"] * float("nan")
        return out


@HOOKS.register_module(force=True)
class WeightsRecorder(HookBase):
    """After every step (after EMAHook's update), records ``(global_step, stepped,
    weights)`` into a class-level list."""

    priority = "LOWEST"
    records = []

    def after_step(self):
        weights = {k: v.detach().clone() for k, v in self.trainer.model_without_ddp.state_dict().items()}
        self.records.append((self.trainer.global_step, self.trainer.step_result.stepped, weights))


@HOOKS.register_module(force=True)
class ScriptedEvaluator(EvaluatorBase):
    """An evaluator whose ``score`` follows a script: the i-th evaluation of
    the trained weights (prefix ``val``) reports ``values[i]`` (the last value
    once the script runs out). Evaluations of other weights (EMA, right after)
    report the same value without advancing the script."""

    metric_name = "score"

    def __init__(self, values=(0.5,), greater_is_better=True, every_n_steps=None):
        super().__init__(every_n_steps=every_n_steps)
        self.values, self.greater_is_better, self.calls = list(values), greater_is_better, 0

    def reset(self):
        pass

    def process(self, input_dict, output_dict):
        pass

    def accumulators(self):
        return {}

    def before_val(self, run):
        self._prefix = run.prefix  # the evaluation compute() is about to score

    def compute(self, totals):
        if self._prefix == "val":
            self.calls += 1
        return {"score": float(self.values[min(self.calls, len(self.values)) - 1])}

    def state_dict(self):
        return {**super().state_dict(), "calls": self.calls}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.calls = state.get("calls", 0)
# -- hooks-b: live control, on-demand validation, OOM back-off -------------------------------------------


class _OOMInBackward(torch.autograd.Function):
    """Identity whose backward raises an out-of-memory error when told to."""

    @staticmethod
    def forward(ctx, x, fail):
        ctx.fail = fail
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.fail:
            raise torch.OutOfMemoryError("CUDA out of memory (injected in backward)")
        return grad, None


@MODELS.register_module(force=True)
class OOMToyMLP(ToyMLP):
    """ToyMLP that raises ``torch.OutOfMemoryError`` on training batches of more
    than ``max_samples`` samples, from its ``from_call``-th training forward on:
    in the forward (``fail_in="forward"``), or in the backward after the last
    layer's gradients were accumulated (``"backward"``). It records the size of
    every training batch it sees, and counts forwards that began while an
    activation of a failed attempt was still alive (``leaks``)."""

    def __init__(self, max_samples=None, fail_in="forward", from_call=0, **kwargs):
        super().__init__(**kwargs)
        self.max_samples, self.fail_in, self.from_call = max_samples, fail_in, from_call
        self.calls, self.sizes, self.leaks = 0, [], 0
        self._failed = []

    def forward(self, batch):
        if not self.training:
            return super().forward(batch)
        import weakref

        self.leaks += any(ref() is not None for ref in self._failed)
        size, call = len(batch["x"]), self.calls
        self.calls += 1
        self.sizes.append(size)
        too_big = self.max_samples is not None and size > self.max_samples and call >= self.from_call
        hidden = self.net[0](batch["x"])
        if too_big:
            self._failed.append(weakref.ref(hidden))
            if self.fail_in == "forward":
                raise torch.OutOfMemoryError("CUDA out of memory (injected in forward)")
        hidden = _OOMInBackward.apply(hidden, too_big and self.fail_in == "backward")
        logits = self.net[3](self.net[2](self.net[1](hidden)))
        return {"cls_logits": logits, "loss": nn.functional.cross_entropy(logits, batch["label"])}


@HOOKS.register_module(force=True)
class WriteFileAtStep(HookBase):
    """Rank 0 writes ``text`` to ``save_path/name`` after ``step`` (a user editing a file mid-run)."""

    priority = "HIGHEST"

    def __init__(self, step, name, text):
        self.step, self.name, self.text = step, name, text

    def after_step(self):
        if self.trainer.global_step == self.step and comm.is_main_process():
            import pathlib

            path = pathlib.Path(self.trainer.save_path) / self.name
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(self.text)
            tmp.replace(path)


@HOOKS.register_module(force=True)
class SignalAtStep(HookBase):
    """Sends ``signal_name`` to its own process after ``step`` (on ``rank`` only, when given)."""

    priority = "HIGHEST"

    def __init__(self, step, signal_name="SIGUSR1", rank=None):
        self.step, self.signal_name, self.rank = step, signal_name, rank

    def after_step(self):
        if self.trainer.global_step == self.step and self.rank in (None, comm.get_rank()):
            import os
            import signal

            os.kill(os.getpid(), getattr(signal, self.signal_name))


@HOOKS.register_module(force=True)
class LrProbe(HookBase):
    """Each rank writes the lr of its first param group at the end of training to ``save_path/lr.rank<r>``."""

    def after_train(self):
        import pathlib

        path = pathlib.Path(self.trainer.save_path) / f"lr.rank{comm.get_rank()}"
        path.write_text(repr(self.trainer.optimizer.param_groups[0]["lr"]))
