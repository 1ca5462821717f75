"""InformationWriter: flushes the metric channel every ``log_frequency`` steps
(and at each epoch end) and writes a log line.

The trainer publishes every step's scalars (``train/loss``, ``train/lr``,
the model's scalar outputs) as device tensors; the host transfer and the
cross-rank reduction happen here, once per ``log_frequency`` steps. The log
line shows the window's reductions (the mean loss over the window, not the
last step's), as TensorBoard and W&B do.
"""

from __future__ import annotations

import datetime
import math

from pimm.engines.hooks.base import HookBase
from pimm.engines.observe.metrics import is_number, reduce_values
from pimm.engines.registries import HOOKS
from pimm.utils.logger import fit_line
from pimm.utils.domains import Count, Int, PosInt
from pimm.utils.errors import ConfigError

__all__ = ["InformationWriter"]


@HOOKS.register_module()
class InformationWriter(HookBase):
    """Flush the metric channel and log a line every ``log_frequency`` steps
    and at each epoch end (see the module docstring).

    The line shows each ``train/*`` scalar reduced over the window since the
    previous flush by its own op (the loss: its mean), the same value the
    dashboards get for that window, and stays within ``max_width``
    characters: scalars that do not fit are counted, not shown (all of them
    are in ``metrics.jsonl``).

    Args:
        log_frequency: steps between flushes (each is a cross-rank collective).
        max_extras: at most this many other ``train/*`` scalars beside loss and lr.
        max_width: longest console line, in characters, the logger's time stamp
            included (at least 80).
        step_offset: upstream's shift of the logged steps, to continue a
            warm-started run's W&B x-axis where its parent left off: it sets
            the runtime key ``log_step_offset`` (every step W&B receives;
            ``metrics.jsonl`` and TensorBoard keep the run's own steps).
    """
    domains = dict(log_frequency=PosInt, max_extras=Count, max_width=Int(40, 10000), step_offset=Count)

    def __init__(self, log_frequency: int = 20, max_extras: int = 12, max_width: int = 160, step_offset: int = 0):
        for name, value, low in (("log_frequency", log_frequency, 1), ("max_extras", max_extras, 0),
                                 ("max_width", max_width, 80)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if isinstance(step_offset, bool) or not isinstance(step_offset, int) or step_offset < 0:
            raise ValueError(f"step_offset must be an integer >= 0, got {step_offset!r}")
        self.log_frequency = log_frequency
        self.max_extras = max_extras
        self.max_width = max_width
        self.step_offset = step_offset

    def modify_config(self, cfg) -> None:
        if not self.step_offset:
            return
        offset = cfg.get("log_step_offset") or 0
        if offset and offset != self.step_offset:
            raise ConfigError(f"InformationWriter(step_offset={self.step_offset}) contradicts log_step_offset={offset}"
                              " (both shift the steps W&B receives): set one of them")
        cfg["log_step_offset"] = self.step_offset

    def set_interval(self, log_frequency: int) -> None:
        """Flush and log every ``log_frequency`` steps from now on (live control)."""
        if isinstance(log_frequency, bool) or not isinstance(log_frequency, int) or log_frequency < 1:
            raise ValueError(f"log_frequency must be a positive integer, got {log_frequency!r}")
        self.log_frequency = log_frequency

    def after_step(self):
        trainer = self.trainer
        if trainer.global_step % self.log_frequency == 0 or trainer.iter == trainer.iters_per_epoch:
            self._flush_and_log()

    def _flush_and_log(self):
        trainer = self.trainer
        metrics = trainer.metrics
        records = metrics.flush()
        window = window_values(records, metrics, prefix="train/")
        if "train/loss" not in window:
            return
        eta = metrics.latest("time/eta", float("nan"))
        eta_text = str(datetime.timedelta(seconds=int(eta))) if not math.isnan(eta) else "-"
        head = (f"Train: [{trainer.epoch + 1}/{trainer.max_epoch}][{trainer.iter}/{trainer.iters_per_epoch}] "
                f"step {trainer.global_step} loss {window['train/loss']:.4f}")
        headline = getattr(trainer, "headline_metric", ("train/loss", "min"))[0]
        if headline != "train/loss":  # the trainer's headline metric: never cut from the line
            value = window.get(headline, metrics.latest(headline))  # a val/ metric: its latest evaluation
            if isinstance(value, (int, float)) and math.isfinite(value):
                head += f" {headline.removeprefix('train/')} {value:.4g}"
        if "train/lr" in window:
            head += f" lr {window['train/lr']:.3e}"
        tail = f"data {metrics.mean('time/data'):.3f}s step {metrics.mean('time/step'):.3f}s eta {eta_text}"
        extras = [f"{tag[6:]} {value:.4g}" for tag, value in window.items()
                  if tag not in ("train/loss", "train/lr", headline)]
        iter_info = str(trainer.comm_info.get("iter_info") or "").strip()  # upstream hooks' text for this line
        if iter_info:
            extras.insert(0, iter_info)
        trainer.logger.info(fit_line(head, extras, tail, self.max_width, self.max_extras))

    def after_epoch(self):
        self.trainer.metrics.flush()


def window_values(records: list[dict], metrics, prefix: str = "") -> dict[str, float]:
    """Each tag (starting with ``prefix``) of a flush's records reduced over the
    window by its op, the way the dashboards reduce it: dense series by their
    reduce op, other records by their last value; non-finite values skipped."""
    values: dict[str, list[float]] = {}
    for record in records:
        for tag, value in record.items():
            # float first: nearly every value is one (this runs for every value of every flush)
            if tag != "step" and tag != "epoch" and tag.startswith(prefix) and \
                    (math.isfinite(value) if value.__class__ is float else is_number(value)):
                found = values.get(tag)
                if found is None:
                    values[tag] = [value]
                else:
                    found.append(value)
    out = {}
    for tag, vals in values.items():
        dense, op = metrics.kind(tag)
        out[tag] = reduce_values(op if dense else "last", vals)
    return out

