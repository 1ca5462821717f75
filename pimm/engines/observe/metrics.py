"""The metric channel: the one way trainers and hooks publish scalars and read
each other's.

::

    metrics = trainer.metrics
    metrics.publish({"train/loss": loss, "train/lr": lr}, dense=True)   # device tensors: no host sync
    metrics.publish({"train/reward_min": r}, reduce="min")              # reduced across ranks by min
    metrics.latest("val/mIoU")                                          # what another hook published
    metrics.mean("time/step")                                           # windowed host value (log lines)
    metrics.direction("val/loss")                                       # "min" | "max" | None
    metrics.best                                                        # BestMetric(name, mode, value, step)

Every ``publish`` makes one record at the current step. Host numbers are
kept as given (every rank publishes the same ones, or rank 0's are written).
Device tensors stay on the device until :meth:`MetricChannel.flush`, which
stacks them once per reduce op, moves them to the host in one transfer and
reduces them across ranks by their op (``mean``, ``sum``, ``min``, ``max``;
``last`` keeps rank 0's value). Flushing is a collective: every rank flushes
at the same points (the log cadence, evaluations, checkpoints, the end), and
the channel flushes by itself when ``max_pending`` records pile up, which
happens at the same step on every rank because records are published in
lockstep.

A metric's direction (is larger better?) is declared once, by whoever
defines the metric (an evaluator for ``val/<metric_name>``), and read by
everyone who ranks values: best-checkpoint selection, early stopping. The
best value itself lives here too and is saved in every checkpoint.

Non-finite values of a watched tag (``train/loss`` by default) raise
:class:`NonFiniteMetric` at the flush that first sees them, before anything
(a checkpoint included) is written from the broken state.

A trainer reserves the tag of its own per-step series that the console line
and the end-of-run summary report (:meth:`MetricChannel.reserve`:
``train/loss``, GRPO's ``train/reward_mean``): it is published once per step,
densely, by the trainer; anyone else publishing it (a hook's
``trainer.writer.add_scalar("train/loss", ...)``) is refused at the call
with one line naming the tag and the hook, so the run's reported loss is
always the trainer's.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from pimm.engines.hooks.base import calling_hook
from pimm.engines.loop.sync_points import host_sync
from pimm.utils import comm
from pimm.utils.errors import ConfigError, UserError

__all__ = ["MetricChannel", "BestMetric", "NonFiniteMetric", "REDUCE_OPS", "reduce_op_by_suffix", "reduce_values",
           "is_number"]

REDUCE_OPS = ("mean", "sum", "min", "max", "last")
DIRECTIONS = ("min", "max")


class NonFiniteMetric(FloatingPointError):
    """A watched scalar (the training loss) became NaN or infinite."""

    def __init__(self, step: int, tag: str, others: list[str]):
        self.step, self.tag, self.others = step, tag, others
        also = f" (also non-finite at that step: {', '.join(others)})" if others else ""
        super().__init__(
            f"{tag} is not finite at step {step}{also}; the run stops here and the last checkpoint before it is "
            "kept untouched. Lower the learning rate, enable clip_grad, or check the data; the NaNGuard hook can "
            "skip such steps instead"
        )


def reduce_op_by_suffix(name: str) -> str:
    """``*_min`` -> min, ``*_max`` -> max, ``*_sum`` -> sum, anything else -> mean."""
    for suffix in ("min", "max", "sum"):
        if name.endswith("_" + suffix):
            return suffix
    return "mean"


def reduce_values(op: str, values: list[float]) -> float:
    """One tag's values over a logging window reduced by its op (``mean``, ``sum``,
    ``min``, ``max``, ``last``): what the dashboards and the console line show."""
    if op == "last":
        return values[-1]
    if op in ("min", "max", "sum"):
        return {"min": min, "max": max, "sum": sum}[op](values)
    return sum(values) / len(values)


def is_number(value: Any) -> bool:
    """A finite int or float, not a bool: a value the dashboards and the log line show."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def tag_op(reduce: str | dict[str, str], tag: str) -> str:
    """The reduce op of ``tag`` in a record published with ``reduce``."""
    return reduce if isinstance(reduce, str) else reduce.get(tag, "mean")


@dataclass
class BestMetric:
    """The best value so far of the metric that selects ``model_best.pth``:
    its ``name``, ``mode`` (``"max"`` or ``"min"``, from the metric's declared
    direction), ``value`` and the ``step`` it was reached at. NaN is never better.
    """
    name: str | None = None
    mode: str | None = None
    value: float | None = None
    step: int | None = None

    def is_better(self, value: float) -> bool:
        """Whether ``value`` beats the best so far in this metric's direction (NaN never does)."""
        if value is None or math.isnan(value):
            return False
        if self.value is None:
            return True
        return value > self.value if self.mode == "max" else value < self.value


class MetricChannel:
    """The one typed channel hooks and trainers share scalars through.

    Values are published per step with a reduce op (:meth:`publish`,
    :meth:`put`), kept on the device, and reduced across ranks in one collective
    per op at :meth:`flush` (which every rank must call at the same points); the
    reduced records go to ``sink`` (the writer). Metric directions are declared
    once (:meth:`declare`) and shared by best-checkpoint selection and early
    stopping; the best value lives in ``best`` and is part of the checkpoint.

    Args:
        sink: called with the flushed records and their kinds (None: nowhere).
        max_pending: flush by itself once this many records are buffered.
        window: length of the per-tag windows that :meth:`mean` averages.
        watch_finite: tags whose non-finite value stops the run
            (:class:`NonFiniteMetric`).
        tracer: records each flush as a ``metric_sync`` span.
    """
    def __init__(self, sink: Callable[[list[dict], list[tuple]], None] | None = None, max_pending: int = 1000,
                 window: int = 20, watch_finite: tuple[str, ...] = ("train/loss",), tracer=None):
        self.sink = sink
        self.tracer = tracer
        self.max_pending = max_pending
        self.watch_finite = set(watch_finite)
        self.step, self.epoch = 0, 0  # set by the trainer at each step boundary
        self._pending: list[tuple[int, int, dict, Any, bool]] = []
        self._latest: dict[str, Any] = {}
        self._windows: dict[str, deque] = defaultdict(lambda: deque(maxlen=window))
        self._directions: dict[str, str] = {}
        self._kinds: dict[str, tuple[bool, str]] = {}  # tag -> (dense, reduce op), as last flushed
        self._reserved: tuple[str, str] | None = None  # (tag, owner) of the trainer's own series (reserve)
        self._reserved_step = -1  # the last step it was published at
        self.best = BestMetric()

    # -- publishing -----------------------------------------------------
    def publish(self, scalars: dict[str, Any], *, reduce: str | dict[str, str] = "mean", dense: bool = False,
                log: bool = True, step: int | None = None) -> None:
        """Record ``tag: value`` pairs at the current step (or ``step``).

        ``reduce`` is one op for all tags or a ``{tag: op}`` dict (missing tags:
        mean). ``dense=True`` marks a per-step series: every value goes to
        ``metrics.jsonl``; dashboards get each flushed window's reduction.
        ``log=False`` shares values with other hooks without writing them."""
        reserved = self._reserved
        if reserved is not None and reserved[0] in scalars:  # the trainer's own series: once per step, densely
            at = self.step if step is None else step
            if not dense or at <= self._reserved_step:
                self._refuse_reserved(at)
            self._reserved_step = at
        for name, value in scalars.items():
            if not isinstance(value, torch.Tensor):
                self._latest[name] = value
                self._windows[name].append(value)
        if log:
            self._pending.append((self.step if step is None else step, self.epoch, scalars, reduce, dense))
            if len(self._pending) >= self.max_pending:
                self.flush()

    def put(self, name: str, value: Any, *, reduce: str = "mean", log: bool = True) -> None:
        """One scalar; see :meth:`publish`."""
        self.publish({name: value}, reduce=reduce, log=log)

    def publish_local(self, scalars: dict[str, float], step: int | None = None) -> None:
        """Host values of this rank alone (upstream's ``trainer.writer.add_scalar``,
        called on rank 0 only): written as given at the next flush, and never a
        reason to flush by themselves (other ranks have no such record, and a
        flush is a collective)."""
        if self._reserved is not None and self._reserved[0] in scalars:
            self._refuse_reserved(self.step if step is None else step)
        for name, value in scalars.items():
            self._latest[name] = value
            self._windows[name].append(value)
        self._pending.append((self.step if step is None else step, self.epoch, dict(scalars), "last", False))

    def record(self, name: str, value: float) -> None:
        """A host number shared with other hooks, not logged (timings): the
        cheapest :meth:`put` for per-step values."""
        self._latest[name] = value
        self._windows[name].append(value)

    def reserve(self, tag: str, owner: str) -> None:
        """Reserve ``tag`` for ``owner``'s per-step series (the trainer's headline
        metric; one tag): from now on it is accepted only published densely, once
        per step, at increasing steps; any other publication is a UserError
        naming the hook that made it."""
        if self._reserved is None or self._reserved[0] != tag:
            self._reserved_step = -1
        self._reserved = (tag, owner)

    def _refuse_reserved(self, step: int):
        tag, owner = self._reserved
        hook = calling_hook()
        group, _, name = tag.partition("/")
        raise UserError(f"{hook or 'a second publisher'}: publishes {tag!r} (at step {step}), which is {owner}: its "
                        f"curve, the console line and the end-of-run summary report the trainer's value; publish "
                        f"yours under another name (an epoch average as '{group}_epoch/{name}')")

    # -- reading --------------------------------------------------------
    def latest(self, name: str, default: Any = None) -> Any:
        """The newest value of ``name``, reduced across ranks. Device tensors
        count once flushed (log cadence, evaluations, checkpoints)."""
        return self._latest.get(name, default)

    def mean(self, name: str, default: float = float("nan")) -> float:
        """Mean of the recent host values of ``name`` (a window of 20)."""
        values = self._windows.get(name)
        return sum(values) / len(values) if values else default

    def names(self) -> list[str]:
        """Every tag published so far (logged or not), sorted."""
        return sorted(self._latest)

    def kind(self, name: str) -> tuple[bool, str]:
        """``(dense, reduce op)`` of ``name`` as last flushed (``(False, "mean")`` if never)."""
        return self._kinds.get(name, (False, "mean"))

    # -- directions and the best value ------------------------------------
    def declare(self, name: str, mode: str) -> None:
        """Declare whether larger (``max``) or smaller (``min``) is better for ``name``."""
        if mode not in DIRECTIONS:
            raise ConfigError(f"metric {name!r}: mode must be 'min' or 'max', got {mode!r}")
        known = self._directions.get(name)
        if known is not None and known != mode:
            raise ConfigError(f"metric {name!r} is declared both {known!r} and {mode!r}: one metric has one direction")
        self._directions[name] = mode

    def resolve_direction(self, name: str, mode: str | None, who: str, hint: str = "") -> str:
        """The direction a hook ``who`` ranks ``name`` by: the declared one when
        ``mode`` is None, else ``mode``, which then declares it (one metric has one
        direction for everyone who ranks it). ConfigError, naming ``who``, when
        there is neither or the two disagree. ``hint`` ends the "no direction" line
        (what else the user could monitor)."""
        declared = self._directions.get(name)
        if mode is None:
            if declared is None:
                known = ", ".join(sorted(n for n in self._directions if n.split("/", 1)[0] == name.split("/", 1)[0]))
                raise ConfigError(f"{who}: metric {name!r} has no declared direction (declared: {known or 'none'}); "
                                  f"monitor one of those, or set mode='max' or mode='min'{hint}")
            return declared
        if declared is not None and declared != mode:
            raise ConfigError(f"{who}: mode={mode!r} contradicts {name!r}, which its evaluator declares "
                              f"{declared!r} (larger is {'better' if declared == 'max' else 'worse'}); drop mode= to "
                              "use the declared direction")
        self.declare(name, mode)
        return mode

    def declared(self) -> dict[str, str]:
        """Every declared metric name with its direction (a copy)."""
        return dict(self._directions)

    def direction(self, name: str) -> str | None:
        """``"min"`` or ``"max"`` as declared for ``name``, or None."""
        return self._directions.get(name)

    def track_best(self, name: str) -> None:
        """Make ``name`` (declared beforehand) the metric that selects the best model."""
        if name not in self._directions:
            raise ConfigError(f"best metric {name!r} has no declared direction")
        if self.best.name is None:
            self.best = BestMetric(name=name, mode=self._directions[name])
            restored = self._restored_best  # a metric first tracked after a resume (a user evaluator's)
            if restored.get("name") == name:
                self.best.value, self.best.step = restored.get("value"), restored.get("step")

    _restored_best: dict = {}

    def update_best(self, name: str, value: float, step: int) -> bool:
        """Record ``value`` of ``name`` if it is the tracked metric and beats the best; True when it does."""
        if name != self.best.name or not self.best.is_better(value):
            return False
        self.best.value, self.best.step = float(value), step
        return True

    def state_dict(self) -> dict:
        """The best value (name, mode, value, step)."""
        return {"best": dict(name=self.best.name, mode=self.best.mode, value=self.best.value, step=self.best.step)}

    def load_state_dict(self, state: dict) -> None:
        """Take back the best value (when it names the same metric)."""
        best = state.get("best") or {}
        self._restored_best = dict(best)
        if best.get("name") is not None and best["name"] == self.best.name:
            self.best.value, self.best.step = best.get("value"), best.get("step")

    # -- flushing -------------------------------------------------------
    def flush(self) -> list[dict]:
        """Reduce everything buffered and hand it to the sink (a collective).
        Returns the records, identical on every rank."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        t0 = self.tracer.now() if self.tracer is not None else 0
        with host_sync("metric flush"):  # the one host read of everything published since the last flush
            reduced = _reduce_tensors(pending)
        if self.tracer is not None:
            self.tracer.complete("metric_sync", t0)
        records, kinds = [], []
        latest, known = self._latest, self._kinds
        for (step, epoch, scalars, reduce, dense), values in zip(pending, reduced):
            record = {"step": step, "epoch": epoch, **scalars}
            if values is not None:  # the record's tensors, now host floats (same keys: the order stays)
                record.update(values)
                latest.update(values)
            if isinstance(reduce, str):
                kind = (dense, reduce)
                for tag in scalars:
                    known[tag] = kind
            else:
                for tag in scalars:
                    known[tag] = (dense, reduce.get(tag, "mean"))
            records.append(record)
            kinds.append((dense, reduce))
        if self.sink is not None:
            self.sink(records, kinds)  # written first (as null): the log shows where it went wrong
        self._check_finite(records)
        return records

    def discard(self) -> None:
        """Drop what is buffered (after a failure, when other ranks may never flush)."""
        self._pending.clear()

    def _check_finite(self, records: list[dict]) -> None:
        # Only the watched tags are looked up in each record (one dict lookup per record and
        # tag, at every flush); the record is scanned in full only once one of them is bad.
        watched = self.watch_finite
        if not watched:
            return
        isfinite = math.isfinite
        for record in records:
            for tag in watched:
                value = record.get(tag)
                if isinstance(value, float) and not isfinite(value):
                    bad = [name for name, v in record.items()
                           if isinstance(v, float) and not isfinite(v) and name not in ("step", "epoch")]
                    first = next(name for name in bad if name in watched)
                    raise NonFiniteMetric(record["step"], first, [name for name in bad if name != first])


def _reduce_tensors(pending: list) -> list[dict[str, float] | None]:
    """One stack, one host transfer and one collective per reduce op in use.
    Returns, for each pending record, its tensors' reduced values by tag (None
    when it has no tensor)."""
    by_op: dict[str, list[tuple[int, str, torch.Tensor]]] = {}
    for index, (_, _, scalars, reduce, _) in enumerate(pending):
        for tag, value in scalars.items():
            if isinstance(value, torch.Tensor):
                op = reduce if isinstance(reduce, str) else reduce.get(tag, "mean")
                items = by_op.get(op)
                if items is None:
                    by_op[op] = items = []
                items.append((index, tag, value))
    out: list[dict[str, float] | None] = [None] * len(pending)
    for op, items in by_op.items():
        if op not in REDUCE_OPS:
            raise ConfigError(f"metric {items[0][1]!r}: reduce must be one of {REDUCE_OPS}, got {op!r}")
        tensors = [t for _, _, t in items]
        if not any([t.ndim for t in tensors]):  # all 0-d, the usual case: one stack, no per-tensor reshape
            stacked = torch.stack(tensors).detach().float()
        else:
            stacked = torch.stack([t.detach().reshape(()).float() for t in tensors])
        if op != "last":
            stacked = comm.all_reduce(stacked, op=op)
        for (index, tag, _), value in zip(items, stacked.tolist()):
            values = out[index]
            if values is None:
                out[index] = values = {}
            values[tag] = value
    return out
