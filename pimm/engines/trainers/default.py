"""DefaultTrainer: builds every component from the config and runs a plain
supervised step::

    batch -> model(batch) under autocast -> output["loss"] -> OptimStep

Each component comes from an overridable ``build_*`` method, and every piece
of state a checkpoint must hold is registered with :meth:`DefaultTrainer.track`
where it is built, so a new trainer overrides a builder or :meth:`run_step`,
tracks what it adds in one line, and never copies the optimizer step.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from pimm.engines.run import data as data_lib
from pimm.engines.run.data import batch_stats  # noqa: F401  (gan.py and plug-ins import it from here)
from pimm.engines.control import StopControl
from pimm.engines.hooks.base import HookBase
from pimm.engines.hooks.evaluator import EvaluatorBase
from pimm.engines.observe.metrics import MetricChannel
from pimm.engines.optim.oom_backoff import OOMBackoff
from pimm.engines.optim.step import OptimStep
from pimm.engines.run.parallel import check_shard_modules, parallel_config
from pimm.engines.registries import TRAINERS
from pimm.engines.hooks.memory import EmptyCache
from pimm.engines.run.runtime import apply_process_settings
from pimm.engines.state import CheckpointManager
from pimm.engines.loop.trainer_base import TrainerBase
from pimm.engines.trainers.builders import ComponentBuilders, no_autocast
from pimm.engines.trainers.checkpointing import Checkpointing
from pimm.engines.trainers.evaluation import Evaluation
from pimm.utils import comm
from pimm.utils.errors import ConfigError, UserError
from pimm.utils.logger import FILE_ONLY
from pimm.utils.rng import derive_seed, fork_rng, seed_all
from pimm.utils.domains import Anything, Bool, CollateFn, DictOf, PosInt

__all__ = ["DefaultTrainer"]


@TRAINERS.register_module()
class DefaultTrainer(Checkpointing, ComponentBuilders, Evaluation, TrainerBase):
    """Options (the keys of ``train = dict(type="DefaultTrainer", ...)``):

    collate_fn / val_collate_fn: a name in ``COLLATE_FNS`` or ``dict(type=name, **kwargs)``;
        default: the class's ``default_collate_fn``, else the data set's ``collate_fn``
        attribute, else ``COLLATE_FNS["fallback_collate_fn"]`` when registered, else torch's
        default collate.
    iters_per_epoch: epoch length for iterable data sets (map-style: derived).
    find_unused_parameters: passed to DDP.
    stop_check_every: steps between the cross-rank checks for pre-emption signals
        and stop requests when distributed (one tiny all-reduce each).
    oom_backoff: None (default), or ``dict(max_splits=N)``: redo a step that ran out
        of GPU memory with its batches split into halves, quarters, ... (single
        process; see :mod:`pimm.engines.optim.oom_backoff`).

    ``hooks``: the built hooks (the CLI builds them while preparing the
    config, so their ``modify_config`` runs first); None prepares the config
    here with :func:`pimm.engines.run.launch.prepare_config`, the CLI's order.
    ``__init__`` is its phases: :meth:`configure_process`,
    :meth:`build_components`, :meth:`register_state`, :meth:`wire_hooks`.
    Testing is :class:`pimm.engines.loop.testers.Tester`'s job, not a mode.
    """

    domains = dict(hooks=Anything("the built hooks, passed by the launcher"), collate_fn=CollateFn,
                   val_collate_fn=CollateFn, iters_per_epoch=PosInt | None, stop_check_every=PosInt,
                   tracer=Anything("built by the launcher"),
                   oom_backoff=Bool | DictOf(what="a dict like dict(max_splits=2)") | None)

    def __init__(self, cfg, hooks: list[HookBase] | None = None, collate_fn=None, val_collate_fn=None,
                 iters_per_epoch=None, find_unused_parameters: bool = False, stop_check_every: int = 10,
                 tracer=None, oom_backoff: dict | None = None):
        super().__init__()
        if isinstance(stop_check_every, bool) or not isinstance(stop_check_every, int) or stop_check_every < 1:
            raise ConfigError(f"train.stop_check_every={stop_check_every!r} must be a positive integer")
        if tracer is not None:
            self.tracer = tracer
        self.rank, self.world_size = comm.get_rank(), comm.get_world_size()
        if hooks is None:  # built from Python: the start-up order of the command line
            from pimm.engines.run.launch import prepare_config
            hooks = prepare_config(cfg, self.world_size)
        self.cfg = cfg
        self.options = dict(collate_fn=collate_fn, val_collate_fn=val_collate_fn, iters_per_epoch=iters_per_epoch,
                            find_unused_parameters=find_unused_parameters)
        self.evaluators = [h for h in hooks if isinstance(h, EvaluatorBase)]  # their split is checked with the loaders
        self.configure_process()
        self.build_components(oom_backoff, stop_check_every)
        self.register_state()
        self.wire_hooks(hooks)
        seed_all(derive_seed(cfg.seed, 1, self.rank))  # this rank's training stream

    # -- the phases of __init__ ------------------------------------------------
    def configure_process(self) -> None:
        """Process-wide settings and the sizes everything else is built with:
        torch settings from the config, the device, the parallel strategy,
        the per-rank batch, the checkpoint manager."""
        cfg = self.cfg
        apply_process_settings(cfg)
        self.parallel = parallel_config(cfg)
        self.device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                       else torch.device("cpu"))
        self.save_path = Path(cfg.save_path)
        self.max_epoch = cfg.epoch
        self.batch_size_per_rank = cfg.batch_size // self.world_size
        self.grad_accum_steps = cfg.grad_accum_steps
        self.checkpointer = CheckpointManager(self.save_path / "checkpoints", logger=self.logger)
        self.checkpointer.tracer = self.tracer
        self.checkpointer.trust_code = bool(cfg.get("trust_checkpoint_code", False))
        self.train_loader = None
        self._val_loader = self._test_loader = None
        self._data_iter = None
        self._last_saved_step: int | None = None
        self._first_forward = True

    def build_components(self, oom_backoff: dict | None = None, stop_check_every: int = 10) -> None:
        """Everything training runs on, each from its ``build_*`` method: the model
        (wrapped for DDP/FSDP), the training loader, the optimizer, scheduler and
        AMP scaler behind one :class:`OptimStep`, the writer and the metric
        channel, and the stop control."""
        cfg, tracer = self.cfg, self.tracer
        seed_all(derive_seed(cfg.seed, 0))  # identical model init on every rank
        with tracer.long_span("build_model"):
            self.model_without_ddp = self.build_model().to(self.device)
        self.autocast = self._build_autocast()
        if self.parallel.fsdp and self.world_size == 1:
            check_shard_modules(self.model_without_ddp, self.parallel)  # as shard_model does on several
            self.logger.info("parallel.strategy='fsdp' with one process: the model is not sharded; checkpoints "
                             "keep the sharded (Distributed Checkpoint) format")
        if not self.supports_compile and (cfg.get("compile") or {}).get("enabled"):
            raise ConfigError("compile: this trainer does not support torch.compile yet; set "
                              "compile=dict(enabled=False)")  # built through TRAINERS, the line names it
        self.model = self.wrap_model(self.model_without_ddp)
        with tracer.long_span("build_loaders"):
            self.train_loader = self.build_train_loader()
            self.iters_per_epoch = self._compute_iters_per_epoch()
            if self.evaluators and cfg.evaluate:
                self._check_eval_split("val")  # found now, before anything is written, not after the first epoch
        self.oom_backoff = OOMBackoff.from_option(oom_backoff, self.train_loader, self.world_size, self.logger)
        self.samples_per_step = self.batch_size_per_rank * self.world_size * self.grad_accum_steps
        with tracer.long_span("build_optimizer"):
            self.optim_parts = self.build_optim_parts()  # {} unless the optimizer config names model parts
            self.optim_steps = {name: part.step for name, part in self.optim_parts.items()}
            if self.optim_parts:
                self.optimizer = self.scheduler = self.scaler = self.optim_step = None
            else:
                self.optimizer = self.build_optimizer()
                self.scheduler = self.build_scheduler()
                self.scaler = self.build_scaler()
                self.optim_step = OptimStep(self.optimizer, scheduler=self.scheduler, scaler=self.scaler,
                                            clip_grad=cfg.clip_grad, model=self.model,
                                            track_grad_norm=cfg.log_grad_norm,
                                            scheduler_interval=cfg.get("scheduler_interval", 1))
        with tracer.long_span("build_writer"):
            self.writer = self.build_writer()
            if hasattr(self.writer, "sync_pending"):  # metrics.jsonl's fsync off the training thread
                self.writer.defer_fsync = True
                self.checkpointer.before_commit.append(self.writer.sync_pending)
        self.metrics = MetricChannel(sink=self.writer.write, tracer=tracer)
        self.writer.channel = self.metrics  # upstream's trainer.writer.add_scalar publishes here
        self.control = StopControl(cfg.preempt_signals, check_every=stop_check_every)

    def wire_hooks(self, hooks: list[HookBase]) -> None:
        """Register the hooks (with ``EmptyCache`` when the config asks for it): the
        evaluators declare their metrics' directions and the dispatch tables are
        built."""
        cfg = self.cfg
        if cfg.empty_cache or cfg.empty_cache_per_epoch:
            hooks = [*hooks, EmptyCache(per_step=cfg.empty_cache, per_epoch=cfg.empty_cache_per_epoch)]
        for evaluator in self.evaluators:
            evaluator.declare_metrics(self.metrics)
        with self.tracer.long_span("build_hooks"):
            self.register_hooks(hooks)
        if not hooks:
            self.logger.warning("no hooks (default_hooks = None, hooks = []): nothing will log the training loss, "
                                "evaluate or save checkpoints (keep the default_hooks, or list CheckpointSaver, "
                                "InformationWriter, ... to get them)")

    def register_hooks(self, hooks: list[HookBase]) -> None:
        """Register ``hooks`` (see :meth:`TrainerBase.register_hooks`); ``after_backward``
        hooks are wired into the optimizer step."""
        super().register_hooks(hooks)
        dispatch = self._dispatch["after_backward"]
        for optim_step in [getattr(self, "optim_step", None), *getattr(self, "optim_steps", {}).values()]:
            if optim_step is not None:
                optim_step.on_gradients = (lambda: self.call_hooks("after_backward")) if dispatch else None

    # -- the loop -----------------------------------------------------------
    _pending_start_sample = 0

    def resume_position(self, samples_in_epoch: int) -> None:
        """Make the next epoch start skip its first ``samples_in_epoch`` samples (global count)."""
        self._pending_start_sample = samples_in_epoch

    def start_epoch_data(self) -> None:
        """Start iterating the current epoch (from a resumed position if one is pending).
        A loader state restored from a checkpoint is applied by StatefulDataLoader here."""
        sampler = data_lib.train_sampler(self.train_loader)
        if sampler is not None:
            sampler.set_epoch(self.epoch, self._pending_start_sample)
        self._pending_start_sample = 0
        self.train_loader.generator.manual_seed(derive_seed(self.cfg.seed, self.rank, self.epoch, 2))
        self._data_iter = iter(self.train_loader)

    _validate_resumed = False

    def validate_resumed(self) -> dict:
        """``validate_on_resume``: evaluate the resumed weights before training
        continues, as an on-demand evaluation (``val/*`` at the resumed step; no
        best model, no early-stopping or evaluator state change, RNG forked), so
        the training that follows is bit-identical to a resume without it."""
        self.logger.info(f"validate_on_resume: evaluating the resumed weights at step {self.global_step}")
        with fork_rng():  # also covers building the validation loader; on_demand leaves last_step alone
            return self.validate(self.evaluators, kind="on_demand")

    def run_epoch(self) -> bool:
        if self._validate_resumed:
            self._validate_resumed = False
            self.validate_resumed()
        self.start_epoch_data()
        try:
            return super().run_epoch()
        finally:
            self._data_iter = None

    def next_batch(self):
        """The next training batch, on the device; the time it took is ``time/data``."""
        start = time.perf_counter()
        tracer = self.tracer
        traced = tracer.enabled  # off: no tracer call at all (each no-op call still costs one)
        if traced:
            t = tracer.now()
        try:
            batch = next(self._data_iter)
        except StopIteration:
            raise UserError(
                f"the training data ran out after {self.iter} of {self.iters_per_epoch} steps in epoch "
                f"{self.epoch + 1}; lower train.iters_per_epoch or fix the data set's length"
            ) from None
        if traced:
            t = tracer.complete("data_fetch", t)
        batch = self.to_device(batch)
        if traced:
            tracer.complete("batch_to_device", t)
        self._data_time += time.perf_counter() - start
        return batch

    _data_time = 0.0

    def forward(self, batch) -> dict:
        """The model's training forward pass (under autocast when AMP is on)."""
        if self._first_forward:
            return self._first_forward_checked(batch)
        if self.autocast is no_autocast:  # AMP off: no context to enter on every step
            return self.model(batch)
        with self.autocast():
            return self.model(batch)

    def _first_forward_checked(self, batch) -> dict:
        output = self.checked_first_forward(
            lambda: self.model(batch), "", "check the model config against the data (input channels, classes, batch "
            "keys)", "in training mode; its forward must return a dict with a scalar 'loss'")
        self._first_forward = False
        return output

    def checked_first_forward(self, call, what: str, hint: str, contract: str) -> dict:
        """``call()`` under autocast, for a first forward pass of this process: a
        failure there is almost always a model config that does not fit the data
        (channels, classes, keys), so it is one UserError line (``what`` names the
        pass, ``hint`` what to check) with the traceback in train.log; a result
        without a tensor ``loss`` is one line too (``contract`` says what is due)."""
        name = type(self.model_without_ddp).__name__
        try:
            with self.autocast():
                output = call()
        except (torch.OutOfMemoryError, UserError):
            raise  # not a model/data mismatch: the batch does not fit, or a named failure (compile)
        except Exception as err:
            self.logger.error(f"The model's first forward pass{what} failed", exc_info=True, extra=FILE_ONLY)
            detail = str(err).splitlines()[0] if str(err) else ""
            raise UserError(f"model {name} failed on the first training batch{what} ({type(err).__name__}: "
                            f"{detail}); {hint}; traceback in train.log") from err
        if not isinstance(output, dict) or not isinstance(output.get("loss"), torch.Tensor):
            raise UserError(f"model {name} returned no 'loss'{what} {contract}")
        return output

    def begin_step(self) -> dict:
        """Drop the previous step's batch and outputs before this forward pass (so
        their memory is reused instead of held through another step) and restart
        the step's data time; returns ``comm_info``."""
        info = self.comm_info
        # dict.update skips CommInfo's per-key check (for hooks' assignments; none of these keys is
        # checked): one C call instead of three Python ones, every step.
        dict.update(info, input_dict=None, model_output_dict=None, loss=None)
        self._data_time = 0.0
        return info

    def run_step(self) -> None:
        info = self.begin_step()
        accum = self.grad_accum_steps
        optim_step = self.optim_step
        step_loss = None
        tracer = self.tracer
        traced = tracer.enabled  # off: the step makes no tracer call at all
        kept = [] if self.oom_backoff is not None else None  # the step's batches, to redo them after an OOM
        sizes = []  # (points, events) of point-cloud batches, for train/avg_pts
        try:
            for micro in range(accum):
                batch = self.next_batch()
                sizes.append(data_lib.point_batch_size(batch))
                if kept is not None:
                    kept.append(batch)
                with optim_step.sync(last=micro == accum - 1):
                    if traced:
                        t = tracer.now()
                    output = self.forward(batch)
                    loss = output["loss"] / accum if accum > 1 else output["loss"]
                    if traced:
                        t = tracer.complete("forward", t)
                    optim_step.backward(loss)
                    if traced:
                        tracer.complete("backward", t)
                step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
        except torch.OutOfMemoryError as oom:
            if kept is None:
                raise
            output = loss = None  # the failed attempt's graph must not outlive it
            batch, output, step_loss = self.oom_backoff.redo_step(self, kept, oom)
        if sizes[0] is not None:  # point-cloud batches: train/avg_pts (no work for other data)
            avg_pts = data_lib.points_per_sample(sizes)
            if avg_pts is not None and isinstance(output, dict):
                output = {**output, "avg_pts": avg_pts}  # logged with the model's scalars, as upstream
        # Visible to after_backward hooks (called inside step()) and after_step hooks.
        dict.update(info, input_dict=batch, model_output_dict=output, loss=step_loss)  # see begin_step
        if traced:
            t = tracer.now()
            self.step_result = optim_step.step()
            tracer.complete("optimizer", t)
        else:
            self.step_result = optim_step.step()
        self.publish_step(step_loss, self.step_result, output)
        if traced and tracer.batch_stats_every and tracer.step % tracer.batch_stats_every == 0:
            tracer.counter("batch", **data_lib.batch_stats(batch, self.batch_size_per_rank * accum))

    def publish_step(self, loss: torch.Tensor, result, output: dict | None = None) -> None:
        """This step's scalars: ``train/loss``, ``train/lr`` (the rate the step used),
        ``train/grad_norm`` when computed, and the model's other scalar outputs."""
        scalars = {"train/loss": loss, "train/lr": result.lr}
        if result.grad_norm is not None:
            scalars["train/grad_norm"] = result.grad_norm
        if output:
            for key, value in output.items():
                if key != "loss" and isinstance(value, torch.Tensor) and value.ndim == 0:
                    scalars["train/" + key] = value.detach()
        self.metrics.publish(scalars, dense=True, step=self.train_state.global_step + 1)
        self.metrics.record("time/data", self._data_time)

    def train(self) -> None:
        if self.cfg.detect_anomaly:
            with torch.autograd.detect_anomaly():
                return super().train()
        return super().train()

    def report_failure(self, exc: BaseException) -> None:
        """The exception to TensorBoard text and the W&B summary (rank 0)."""
        if getattr(self, "writer", None) is None:
            return
        try:
            self.writer.record_exception(exc, self.global_step)
        except Exception as err:  # noqa: BLE001
            self.logger.error(f"The failure could not be written to the dashboards: {err}")

    def abort_saves(self) -> None:
        """A second Ctrl-C: the checkpoint being written is abandoned and its
        temporary folder removed; nothing new is committed."""
        checkpointer = getattr(self, "checkpointer", None)
        if checkpointer is not None:
            try:
                checkpointer.abort()
            except Exception as err:  # noqa: BLE001  (the abort is what gets reported)
                self.logger.error(f"Abandoning the checkpoint in flight failed: {err}")

    def close(self) -> None:
        checkpointer = getattr(self, "checkpointer", None)
        if checkpointer is not None and self.outcome == "failed":
            try:
                checkpointer.wait()  # a save of an earlier, good state still commits
            except Exception as err:  # noqa: BLE001  (the training failure is what gets reported)
                self.logger.error(f"The checkpoint being written when training failed was not committed: {err}")
        try:
            if getattr(self, "writer", None) is not None:
                if self.outcome in ("failed", "aborted") and comm.get_world_size() > 1:
                    self.metrics.discard()  # flushing is a collective other ranks may never join
                else:
                    try:
                        self.metrics.flush()
                    except Exception:  # noqa: BLE001  (a failure already on its way out must not be masked)
                        self.metrics.discard()
                self.writer.close()
        finally:
            self._data_iter = None
            for loader in (self.train_loader, self._val_loader, self._test_loader):
                if loader is not None:
                    data_lib.shutdown_loader(loader)
