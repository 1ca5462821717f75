"""How :class:`~pimm.engines.trainers.default.DefaultTrainer` evaluates: the
validation that evaluator hooks ask for (with ``before_val`` / ``after_val``,
published metrics, event displays and the best model) and the scoring of the
test split (``tools/test.py``, ``FinalEvaluator``)."""

from __future__ import annotations

import json
import math
import time
import weakref

import torch

from pimm.engines.observe.eval_records import write_eval_record
from pimm.engines.hooks.base import EvalRun
from pimm.engines.registries import TESTERS
from pimm.engines.state import load_weights
from pimm.engines.loop.sync_points import host_sync
from pimm.utils import comm
from pimm.utils.errors import ConfigError
from pimm.utils.files import set_aside
from pimm.utils.logger import fit_line

__all__ = ["Evaluation", "TestScoring"]


class TestScoring:
    """Scoring weights on the test split, shared by DefaultTrainer (``FinalEvaluator``
    tests the best weights after training) and :class:`~pimm.engines.loop.testers.Tester`
    (``tools/test.py``). A mixin over ``cfg``, ``evaluators``, ``test_loader``,
    ``model_without_ddp``, ``full_parameters``, ``save_path``, ``logger``."""

    def test_evaluators(self) -> list:
        """What scores the test split: the config's tester (``test = dict(type=...)``
        from TESTERS) when it names one, else the evaluator hooks."""
        if self.cfg.get("test") is not None:
            tester = TESTERS.build(self.cfg.test)
            evaluator = tester.build_evaluator(self.cfg)
            evaluator.trainer = weakref.proxy(self)
            if tester.verbose:
                self.logger.info(f"Tester {type(tester).__name__} for save_path {self.save_path}; config:\n"
                                 f"{self.cfg.pretty_text}")
            return [evaluator]
        if not self.evaluators:
            raise ConfigError("testing needs an evaluator: add one to hooks (e.g. dict(type='SemSegEvaluator')) or "
                              "test = dict(type='SemSegTester')")
        return self.evaluators

    def test(self, weight=None) -> dict:
        """Score ``weight`` (a model file; None: the weights the model holds now) on
        the test split; the weights must fit the model exactly. Writes
        ``save_path/test_metrics.json`` (an earlier one is kept aside) and a
        record of this evaluation, ``save_path/eval/<UTC time>/test_metrics.json``
        and ``.csv`` (:mod:`pimm.engines.observe.eval_records`)."""
        with host_sync("evaluation"):  # evaluators read their results on the host
            return self._test(weight)

    def _test(self, weight) -> dict:
        evaluators = self.test_evaluators()
        if weight is not None:
            load_weights(self.model_without_ddp, weight, logger=self.logger, strict=True)
        results = {}
        for evaluator in evaluators:
            with self.full_parameters():
                metrics = evaluator.evaluate(self.test_loader, self.model_without_ddp)
            results[type(evaluator).__name__] = metrics
            summary = " ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))
            self.logger.info(f"Test {type(evaluator).__name__}: {summary}")
            table = evaluator.report(metrics)
            if table:
                self.logger.info(table)
        if comm.is_main_process():
            path = self.save_path / "test_metrics.json"
            set_aside(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            label = str(weight) if weight is not None else f"the weights at step {self.global_step}"
            payload = _json_finite({"weight": label, "metrics": results})
            # allow_nan=False: a NaN metric (an empty class) is null, never a bare NaN (invalid JSON).
            path.write_text(json.dumps(payload, indent=1, allow_nan=False))
            record = write_eval_record(self.save_path, payload, results)
            self.logger.info(f"Wrote {path} and {record}/test_metrics.json, .csv")
        return results


class Evaluation(TestScoring):
    """Validation and test methods of DefaultTrainer (a mixin over its state:
    ``evaluators``, ``metrics``, ``writer``, ``val_loader``, ``test_loader``, ...)."""

    @property
    def eval_model(self) -> torch.nn.Module:
        """The model evaluations run on (a hook may hand another, e.g. EMA weights)."""
        return self.model_without_ddp

    def validate(self, evaluators=None, model: torch.nn.Module | None = None, prefix: str = "val",
                 kind: str = "scheduled", weights: str = "trained") -> dict:
        """Evaluate ``model`` (default :attr:`eval_model`) on the validation split with
        ``evaluators`` (default: all), publish ``<prefix>/<name>`` scalars and
        dispatch ``before_val(run)`` / ``after_val(metrics, run)`` with the
        :class:`~pimm.engines.hooks.base.EvalRun` describing it. ``kind``:
        scheduled, final, on_demand (metrics only: no best model, no decision,
        no evaluator schedule moves); ``weights``: ``"trained"``, or the label of
        other weights a hook hands in (``"ema"``)."""
        evaluators = tuple(self.evaluators if evaluators is None else evaluators)
        model = self.eval_model if model is None else model
        run = EvalRun(kind=kind, prefix=prefix, step=self.global_step, model=model, evaluators=evaluators,
                      weights=weights)
        with self.tracer.long_span("evaluate", prefix=prefix, kind=kind), host_sync("evaluation"):
            return self._validate(run)

    def _validate(self, run: EvalRun) -> dict:
        self.call_hooks("before_val", run)
        prefix, model = run.prefix, run.model
        start = time.perf_counter()
        metrics, reports = {}, []
        shown = {}
        for evaluator in run.evaluators:
            with self.full_parameters(model):  # ranks may run unequal numbers of batches
                raw = evaluator.evaluate(self.val_loader, model,
                                         images=evaluator.log_images if self.writer.logs_images else 0)
            evaluator.mark_evaluated(run)
            shown.update({f"{prefix}_events/{type(evaluator).__name__}/{i}": image
                          for i, image in enumerate(evaluator.images)})
            metrics.update({f"{prefix}/{k}": v for k, v in raw.items()
                            if isinstance(v, (int, float)) and not isinstance(v, bool)})
            reports.append(evaluator.report(raw))
        self.metrics.publish(metrics)
        self.metrics.flush()
        self.writer.add_images(shown, self.global_step)
        self.logger.info(fit_line(f"Eval at step {self.global_step} ({time.perf_counter() - start:.1f}s):",
                                  [f"{k} {v:.4f}" for k, v in metrics.items()]))
        for table in reports:
            if table:
                self.logger.info(table)
        best = self.metrics.best
        counts = run.kind != "on_demand" and run.of_trained_weights
        if counts and best.name in metrics and self.metrics.update_best(best.name, metrics[best.name],
                                                                        self.global_step):
            self.save_model_file("model_best.pth", metric=best.value, metric_name=best.name)
            self.logger.info(f"New best {best.name}={best.value:.4f}: saved model/model_best.pth")
        self.call_hooks("after_val", metrics, run)
        return metrics


def _json_finite(value):
    """``value`` with every non-finite float (at any depth) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_finite(v) for v in value]
    return value
