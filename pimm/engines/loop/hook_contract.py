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
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np
import torch

from pimm.utils import comm

__all__ = ["ScalarHistory", "EventStorage", "SummaryWriterCalls", "UpstreamTrainerView", "take_published_metric"]


def _host_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().reshape(()).item())
    return float(value)


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
        value = _host_float(value)
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
        self.channel.publish_local({tag: _host_float(value) for tag, value in scalars.items()},
                                   step=self._step(global_step))

    def add_image(self, tag: str, img_tensor: Any, global_step: int | None = None, walltime=None,
                  dataformats: str = "CHW") -> None:
        """An image to TensorBoard and W&B (``dataformats`` as TensorBoard's: CHW, HWC, HW)."""
        self.add_images({tag: _to_hwc_uint8(img_tensor, dataformats)}, self._step(global_step))

    def add_histogram(self, tag: str, values: Any, global_step: int | None = None, bins: Any = "tensorflow",
                      walltime=None, **_) -> None:
        """A histogram of ``values`` to TensorBoard and W&B (rank 0)."""
        if not self.logs_images:
            return
        self._open()
        step = self._step(global_step)
        array = values.detach().float().cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
        if self._tb is not None:
            self._tb.add_histogram(tag, array, step, bins=bins)
        if self._wandb_run is not None:
            import wandb

            self._wandb_run.log({tag: wandb.Histogram(array)}, step=step)


def _to_hwc_uint8(image: Any, dataformats: str) -> np.ndarray:
    array = image.detach().cpu().numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    dataformats = dataformats.upper()
    if dataformats == "HW":
        array = np.repeat(array[..., None], 3, axis=-1)
    elif dataformats == "CHW":
        array = np.transpose(array, (1, 2, 0))
    elif dataformats != "HWC":
        raise ValueError(f"add_image: dataformats must be 'CHW', 'HWC' or 'HW', got {dataformats!r}")
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
        best.value, best.step = _host_float(value), self.global_step


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
        published = (_host_float(info.pop("current_metric_value")), str(info.get("current_metric_name") or "metric"),
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
