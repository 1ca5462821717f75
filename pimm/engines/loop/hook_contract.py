"""What hooks written for upstream pimm read on ``self.trainer``, as views over
pimm's one metric channel (:mod:`pimm.engines.observe.metrics`), never a second one.

* ``trainer.writer.add_scalar / add_scalars`` publish into the channel
  (:class:`SummaryWriterCalls`): at the next flush the value reaches
  ``metrics.jsonl``, TensorBoard and W&B like any other record.
  ``add_image`` / ``add_histogram`` go to the dashboards (TensorBoard, W&B).
* ``trainer.storage`` (:class:`EventStorage`) accumulates per-epoch
  averages: ``put_scalar(name, value, n)``, ``history(name).avg / .total /
  .val / .latest / .count``; every history is cleared after each epoch's
  ``after_epoch`` hooks, as upstream does. Each value is also shared on the
  channel (``trainer.metrics.latest(name)``), not logged.
* ``trainer.comm_info["current_metric_value" / "current_metric_name" /
  "current_metric_greater_is_better"]``: a user evaluator's metric, taken by
  :class:`~pimm.engines.hooks.checkpoint.CheckpointSaver` after the step that
  published it and before it saves (:func:`take_published_metric`): it becomes the channel's best metric and
  decides ``model/model_best.pth`` and the best checkpoint kept.
* ``trainer.best_metric_value``: the channel's best value (``-inf`` / ``inf``
  before any, by direction).
* ``trainer.comm_info["iter_info"]``: text appended to the step's log line;
  emptied before each step.

A value these calls cannot use (a string as a scalar, a 3-element tensor as
``current_metric_value``, ``"False"`` as ``current_metric_greater_is_better``)
is refused at the call with one line naming the call, the tag or key and the
hook that made it (:class:`~pimm.utils.errors.UserError`), never a failure
deep inside a sink later.
"""

from __future__ import annotations

import math
import numbers
import weakref
from typing import Any

import numpy as np
import torch

from pimm.engines.hooks.base import calling_hook
from pimm.utils import comm
from pimm.utils.domains import show
from pimm.utils.errors import UserError

__all__ = ["ScalarHistory", "EventStorage", "SummaryWriterCalls", "UpstreamTrainerView", "CommInfo",
           "take_published_metric", "refuse_value"]


def refuse_value(call: str, value: Any, takes: str) -> UserError:
    """The one-line error for a value a hook handed to ``call`` that it cannot
    use, naming the hook making the call (when one is)."""
    hook = calling_hook()
    kind = f"a {type(value).__name__}" if not isinstance(value, (torch.Tensor, np.ndarray)) else \
        f"a {type(value).__name__} of shape {tuple(value.shape)}"
    return UserError(f"{hook + ': ' if hook else ''}{call} got {show(value)} ({kind}); it takes {takes}")


_NUMBER = "a number (an int, a float or a one-element tensor)"


def _as_float(value: Any) -> float | None:
    """``value`` as a host float if it is one number, else None."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            return None
        return float(value.detach().reshape(()).float().item())
    if isinstance(value, np.ndarray):
        return float(value.reshape(())) if value.size == 1 and value.dtype.kind in "biuf" else None
    if isinstance(value, (numbers.Real, np.bool_)):
        return float(value)
    return None


def _host_float(value: Any, call: str) -> float:
    """``value`` as a host float, or the error naming ``call`` and the hook."""
    number = _as_float(value)
    if number is None:
        raise refuse_value(call, value, _NUMBER)
    return number


class ScalarHistory:
    """One name's values since the last reset: ``val`` (the newest, also
    ``latest``), ``total`` (sum of ``value * n``), ``count`` (sum of ``n``) and
    ``avg`` (``total / count``)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Forget every value."""
        self.val = 0.0
        self.avg = 0.0
        self.total = 0.0
        self.count = 0

    def update(self, value: float, n: int = 1) -> None:
        """Add ``n`` observations of ``value``."""
        self.val = value
        self.total += value * n
        self.count += n
        self.avg = self.total / self.count if self.count else 0.0

    @property
    def latest(self) -> float:
        """The newest value (upstream's ``val``)."""
        return self.val


class EventStorage:
    """``trainer.storage``: upstream's per-epoch accumulator (see the module docstring)."""

    def __init__(self, trainer):
        self._trainer = weakref.proxy(trainer) if not isinstance(trainer, weakref.ProxyTypes) else trainer
        self._histories: dict[str, ScalarHistory] = {}
        self._latest: dict[str, tuple[float, int]] = {}

    @property
    def iter(self) -> int:
        """The trainer's global step."""
        return self._trainer.global_step

    def put_scalar(self, name: str, value: Any, n: int = 1, smoothing_hint: bool = False) -> None:
        """Add ``n`` observations of ``value`` to ``history(name)``; the value is
        also shared on the metric channel (``trainer.metrics.latest(name)``)."""
        value = _host_float(value, f"trainer.storage.put_scalar({name!r}, ...)")
        self._histories.setdefault(name, ScalarHistory()).update(value, n)
        self._latest[name] = (value, self.iter)
        self._trainer.metrics.record(name, value)

    def put_scalars(self, *, smoothing_hint: bool = False, **scalars) -> None:
        """``put_scalar`` for each keyword."""
        for name, value in scalars.items():
            self.put_scalar(name, value, smoothing_hint=smoothing_hint)

    def history(self, name: str) -> ScalarHistory:
        """The history of ``name``; KeyError naming the known ones if nothing was put."""
        try:
            return self._histories[name]
        except KeyError:
            raise KeyError(f"trainer.storage has no history {name!r} (put_scalar({name!r}, ...) first; "
                           f"known: {', '.join(sorted(self._histories)) or 'none'})") from None

    def histories(self) -> dict[str, ScalarHistory]:
        """Every history by name."""
        return self._histories

    def latest(self) -> dict[str, tuple[float, int]]:
        """``{name: (newest value, global step it was put at)}``."""
        return dict(self._latest)

    def reset_history(self, name: str) -> None:
        """Clear one history (KeyError if unknown)."""
        self.history(name).reset()

    def reset_histories(self) -> None:
        """Clear every history (the trainer does it after each epoch's ``after_epoch`` hooks)."""
        for history in self._histories.values():
            history.reset()


class SummaryWriterCalls:
    """TensorBoard's ``SummaryWriter`` calls on :class:`~pimm.engines.observe.writers.MetricsWriter`
    (``trainer.writer``), for hooks written against upstream. Scalars go
    through the metric channel (``self.channel``, set by the trainer), so every
    sink writes them at the next flush; they are this rank's own host values
    (upstream calls them on rank 0 only), written as given."""

    channel = None  # the trainer's MetricChannel

    def _step(self, global_step) -> int:
        if global_step is not None:
            return int(global_step)
        return self.channel.step if self.channel is not None else self.last_step

    def add_scalar(self, tag: str, scalar_value: Any, global_step: int | None = None, walltime=None, **_) -> None:
        """Log ``tag`` = ``scalar_value`` at ``global_step`` (default: the current step)."""
        self.add_scalars_flat({tag: scalar_value}, global_step)

    def add_scalars(self, main_tag: str, tag_scalar_dict: dict, global_step: int | None = None, walltime=None) -> None:
        """Log ``main_tag/<key>`` for each entry of ``tag_scalar_dict``."""
        self.add_scalars_flat({f"{main_tag}/{key}": value for key, value in tag_scalar_dict.items()}, global_step)

    def add_scalars_flat(self, scalars: dict, global_step: int | None = None) -> None:
        """Publish ``{tag: value}`` at one step into the channel (rank-local host values)."""
        if self.channel is None:
            raise RuntimeError("trainer.writer.add_scalar: the writer is not attached to a metric channel")
        for tag in scalars:
            if not isinstance(tag, str) or not tag:
                raise refuse_value("trainer.writer.add_scalar(tag, ...)", tag, "a tag (a non-empty string)")
        self.channel.publish_local({tag: _host_float(value, f"trainer.writer.add_scalar({tag!r}, ...)")
                                    for tag, value in scalars.items()}, step=self._step(global_step))

    def add_image(self, tag: str, img_tensor: Any, global_step: int | None = None, walltime=None,
                  dataformats: str = "CHW") -> None:
        """An image to TensorBoard and W&B (``dataformats`` as TensorBoard's: CHW, HWC, HW)."""
        self.add_images({tag: _to_hwc_uint8(tag, img_tensor, dataformats)}, self._step(global_step))

    def add_histogram(self, tag: str, values: Any, global_step: int | None = None, bins: Any = "tensorflow",
                      walltime=None, **_) -> None:
        """A histogram of ``values`` to TensorBoard and W&B (rank 0)."""
        if not self.logs_images:
            return
        array = _histogram_values(tag, values)
        if array is None:  # only non-finite values: nothing to draw
            return
        self._open()
        step = self._step(global_step)
        if self._tb is not None:
            self._tb.add_histogram(tag, array, step, bins=bins)
        if self._wandb_run is not None:
            import wandb

            self._wandb_run.log({tag: wandb.Histogram(array)}, step=step)


def _numeric_array(value: Any) -> np.ndarray | None:
    """``value`` (a tensor, an array, nested lists) as a real numeric array, or None."""
    if isinstance(value, torch.Tensor):
        return None if value.is_complex() else value.detach().float().cpu().numpy()
    try:
        array = np.asarray(value)
    except (TypeError, ValueError):  # ragged lists
        return None
    return array if array.dtype.kind in "biuf" else None


def _histogram_values(tag: str, values: Any) -> np.ndarray | None:
    """The finite values of a histogram (None when there are none); the error
    naming the tag and the hook for values that are not numbers or are empty."""
    array = _numeric_array(values)
    if array is None or array.size == 0:
        raise refuse_value(f"trainer.writer.add_histogram({tag!r}, ...)", values,
                           "a non-empty tensor or array of numbers")
    array = array.reshape(-1).astype(np.float64)
    finite = array[np.isfinite(array)]
    return finite if finite.size else None


_IMAGE_SHAPES = {"HW": "(H, W)", "CHW": "(C, H, W) with C 1, 3 or 4", "HWC": "(H, W, C) with C 1, 3 or 4"}


def _to_hwc_uint8(tag: str, image: Any, dataformats: str) -> np.ndarray:
    call = f"trainer.writer.add_image({tag!r}, ...)"
    if not isinstance(dataformats, str) or dataformats.upper() not in _IMAGE_SHAPES:
        raise refuse_value(f"{call}: dataformats", dataformats, "'CHW', 'HWC' or 'HW'")
    dataformats = dataformats.upper()
    array = _numeric_array(image)
    channels = None if array is None or array.ndim != len(dataformats) else \
        array.shape[dataformats.index("C")] if "C" in dataformats else 1
    if array is None or channels not in (1, 3, 4) or array.size == 0:
        raise refuse_value(call, image, f"an image of numbers shaped {_IMAGE_SHAPES[dataformats]} "
                                        f"(dataformats={dataformats!r})")
    if dataformats == "HW":
        array = np.repeat(array[..., None], 3, axis=-1)
    elif dataformats == "CHW":
        array = np.transpose(array, (1, 2, 0))
    if array.shape[-1] == 1:
        array = np.repeat(array, 3, axis=-1)
    if array.dtype != np.uint8:
        array = np.clip(array * 255.0 if array.max() <= 1.0 else array, 0, 255).astype(np.uint8)
    return array


class UpstreamTrainerView:
    """Upstream's trainer attributes on :class:`~pimm.engines.loop.trainer_base.TrainerBase`:
    ``storage``, ``best_metric_value``, ``start_epoch`` (the epoch this process
    started training at: 0, or where a resume picked up)."""

    start_epoch = 0
    _storage: EventStorage | None = None

    @property
    def storage(self) -> EventStorage:
        """Upstream's per-epoch scalar accumulator (:class:`EventStorage`)."""
        if self._storage is None:
            self._storage = EventStorage(self)
        return self._storage

    def reset_epoch_histories(self) -> None:
        """Clear ``storage``'s histories (after each epoch's ``after_epoch`` hooks)."""
        if self._storage is not None:
            self._storage.reset_histories()

    @property
    def best_metric_value(self) -> float:
        """The best value so far of the metric that selects ``model_best.pth``;
        before any: ``-inf`` (larger is better or unknown) or ``inf``."""
        best = self.metrics.best
        if best.value is not None:
            return best.value
        return math.inf if best.mode == "min" else -math.inf

    @best_metric_value.setter
    def best_metric_value(self, value: float) -> None:
        best = self.metrics.best
        best.value, best.step = _host_float(value, "trainer.best_metric_value = ..."), self.global_step


def _check_metric_name(key: str, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise refuse_value(f"trainer.comm_info[{key!r}] = ...", value, "a metric name (a non-empty string)")


def _check_metric_value(key: str, value: Any) -> None:
    if _as_float(value) is None:
        raise refuse_value(f"trainer.comm_info[{key!r}] = ...", value, _NUMBER)


def _check_direction(key: str, value: Any) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise refuse_value(f"trainer.comm_info[{key!r}] = ...", value, "True or False")


#: The keys of upstream's evaluator contract and what each takes.
_PUBLISHED_KEYS = {"current_metric_value": _check_metric_value, "current_metric_name": _check_metric_name,
                   "current_metric_greater_is_better": _check_direction}


class CommInfo(dict):
    """``trainer.comm_info``: a plain dict, except that the keys of upstream's
    evaluator contract (``current_metric_value``, ``current_metric_name``,
    ``current_metric_greater_is_better``) are checked when a hook sets them, so
    a value that cannot rank checkpoints is refused at the assignment, naming
    the key and the hook (about 0.1 us per assignment of any key; the trainer's own
    per-step keys go through ``dict.update``, which skips the check)."""

    def __setitem__(self, key, value):
        if key in _PUBLISHED_KEYS:
            _PUBLISHED_KEYS[key](key, value)
        _store(self, key, value)


_store = dict.__setitem__  # a global, not dict.__setitem__ looked up at every assignment


def take_published_metric(trainer) -> bool:
    """Take a metric a user evaluator published in ``trainer.comm_info``
    (upstream's ``current_metric_value``, ``current_metric_name``,
    ``current_metric_greater_is_better``) before a checkpoint is saved: it is
    declared on the metric channel as ``val/<name>`` (a name with a ``/`` is
    kept as is), tracked as the best metric when nothing else is, and, when it
    beats the best, written to ``model/model_best.pth``. The value is consumed
    (one evaluation counts once). CheckpointSaver calls it after every step
    and before every save; when distributed only before saves (epoch ends and
    ``save_freq``), since it is then a collective (rank 0's value is used:
    upstream evaluators often publish on rank 0 only). True when it was a new
    best."""
    info = trainer.comm_info
    published = None
    if "current_metric_value" in info:
        published = (_host_float(info.pop("current_metric_value"), "trainer.comm_info['current_metric_value']"),
                     str(info.get("current_metric_name") or "metric"),
                     bool(info.get("current_metric_greater_is_better", True)))
    if comm.get_world_size() > 1:
        published = comm.broadcast_object(published)
    if published is None:
        return False
    value, name, greater = published
    tag = name if "/" in name else f"val/{name}"
    metrics = trainer.metrics
    metrics.declare(tag, "max" if greater else "min")
    if metrics.best.name is None:
        metrics.track_best(tag)
    if metrics.best.name != tag:
        if metrics.latest(tag) == value:  # an evaluation of pimm's own, already on the channel (SemSegEvaluator's)
            return False
        if not getattr(trainer, "_warned_published_metric", False):
            trainer.logger.warning(f"comm_info['current_metric_name']={name!r}: model_best.pth is already selected by "
                                   f"{metrics.best.name!r}; the published metric is not used for it")
            trainer._warned_published_metric = True
        return False
    if not metrics.update_best(tag, value, trainer.global_step):
        return False
    trainer.save_model_file("model_best.pth", metric=value, metric_name=tag)
    trainer.logger.info(f"New best {tag}={value:.4f} (published by an evaluator): saved model/model_best.pth")
    return True
