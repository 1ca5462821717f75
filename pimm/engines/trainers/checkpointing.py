"""The state side of :class:`~pimm.engines.trainers.default.DefaultTrainer`:
what a checkpoint holds (:meth:`~Checkpointing.register_state`,
:meth:`~Checkpointing.track`), restoring a run (resume or warm start), committing checkpoints, the
``model/*.pth`` files, and the end of training that saves after a stop.

A mixin, like :class:`~pimm.engines.trainers.evaluation.Evaluation`: it reads
the components the builders made (``checkpointer``, ``writer``, ``model``,
``train_state``...) and overrides :class:`~pimm.engines.loop.trainer_base.TrainerBase`'s
``restore`` / ``save_checkpoint`` / ``finish``.
"""

from __future__ import annotations

import time

import torch

from pimm.engines.run import data as data_lib
from pimm.engines.run.parallel import full_parameters, full_state_dict, is_sharded
from pimm.engines.state import atomic_torch_save, load_weights, restore_latest
from pimm.engines.state.participants import (HooksParticipant, LoaderParticipant, MetaParticipant, ModelParticipant,
                                             OptimizerParticipant, RNGParticipant, SchedulerParticipant,
                                             TrainStateParticipant)
from pimm.engines.state.restore import flatten_config
from pimm.engines.state.sharded import ShardedModelParticipant, ShardedOptimizerParticipant
from pimm.engines.optim.parts import part_participants
from pimm.engines.state.resume_from import is_checkpoint_choice, restore_from
from pimm.engines.loop.sync_points import host_sync
from pimm.utils import comm
from pimm.utils.errors import ConfigError

__all__ = ["Checkpointing"]


class Checkpointing:
    """The checkpoint layout, restore, save and the model files of a trainer
    built by :class:`~pimm.engines.trainers.default.DefaultTrainer`."""

    def register_state(self) -> None:
        """The checkpoint layout: every participant, in restore order (see
        :class:`~pimm.engines.state.participants.Participant`). A trainer adds
        its own through :meth:`extra_state`; the hooks' states come last."""
        self.train_state.load_state_dict(dict(  # the layout this process runs with
            world_size=self.world_size, batch_size_per_rank=self.batch_size_per_rank,
            grad_accum_steps=self.grad_accum_steps, num_workers_per_rank=self.num_workers_per_rank))
        track = self.track
        fsdp = self.parallel.fsdp  # model and optimizers written by every rank through Distributed Checkpoint
        if fsdp:
            track("model", ShardedModelParticipant(self.model_without_ddp), scope="sharded")
        else:
            track("model", ModelParticipant(self.model_without_ddp))
        if self.optim_parts:  # optimizer/<part>, scheduler/<part>, scaler/<part> (pimm.engines.optim.parts)
            for name, participant, scope in part_participants(self.optim_parts, self.model_without_ddp, fsdp):
                track(name, participant, scope=scope)
        else:
            if fsdp:
                track("optimizer", ShardedOptimizerParticipant(self.model_without_ddp, self.optimizer,
                                                               self._scheduled_group_keys()), scope="sharded")
            else:
                track("optimizer", OptimizerParticipant(self.optimizer, self._scheduled_group_keys()))
            track("scheduler", SchedulerParticipant(self.scheduler))
            track("scaler", self.scaler)
            if self.optim_step.scheduler_interval > 1:  # where the next scheduler step falls
                track("optim_step", self.optim_step)
        track("train_state", TrainStateParticipant(self.train_state))
        track("metrics", self.metrics)
        track("writer", self.writer)
        track("meta", MetaParticipant(flatten_config(self.cfg), self.iters_per_epoch * self.max_epoch))
        track("rng", RNGParticipant(), scope="rank")
        track("loader", self.loader_participant(self), scope="rank")
        for name, participant, scope in self.extra_state():
            track(name, participant, scope=scope)
        track("hooks", HooksParticipant(self), scope="rank")

    def extra_state(self) -> list[tuple]:
        """``(name, participant, scope)`` of the state a trainer adds to the
        checkpoint (restored after the loader position, before the hooks); none here."""
        return []

    #: How the data position is saved and restored (a trainer that consumes
    #: batches at another rate than one per step overrides it).
    loader_participant = LoaderParticipant

    def track(self, name: str, participant, scope: str = "shared") -> None:
        """Save ``participant`` (a :class:`~pimm.engines.state.participants.Participant`,
        or anything with ``state_dict`` / ``load_state_dict``) in every checkpoint and
        restore it on resume. ``scope="rank"`` for state that differs between
        ranks, ``"sharded"`` for FSDP state written through Distributed Checkpoint."""
        self.checkpointer.register(name, participant, scope=scope)

    def restore(self) -> bool:
        """``resume``: every participant from the newest usable checkpoint;
        otherwise ``weight=``: copy matching weights into the model."""
        with host_sync("checkpoint"):  # before the first step; a restore reads states on the host
            return self._restore()

    def _restore(self) -> bool:
        cfg = self.cfg
        if cfg.resume and cfg.get("validate_on_resume") and not (self.evaluators and cfg.evaluate):
            raise ConfigError("validate_on_resume=True needs an evaluator hook and evaluate=True (add e.g. "
                              "dict(type='ClsEvaluator') to hooks, or drop validate_on_resume)")
        if cfg.resume:
            with self.tracer.long_span("checkpoint_load"):
                if is_checkpoint_choice(cfg.resume):
                    fresh_wandb_id = self.writer.wandb_run_id
                    context = restore_from(self.checkpointer, cfg.resume, self.world_size, flatten_config(cfg),
                                           self.logger)
                    if context.foreign:  # a fork: its own logs from the checkpoint's step, its own W&B run
                        self.writer.rewind(0, self.train_state.global_step)
                        self.writer.wandb_run_id = fresh_wandb_id
                else:
                    context = restore_latest(self.checkpointer, self.world_size, flatten_config(cfg), self.logger,
                                             allow_fresh=cfg.resume == "allow_fresh")
            if context is not None:
                self._validate_resumed = bool(cfg.get("validate_on_resume"))
                state = self.train_state
                self._last_saved_step = state.global_step
                if state.stop_reason:
                    self.logger.info(f"This run had stopped early at step {state.global_step} ({state.stop_reason}); "
                                     "resuming continues it")
                    state.stop_reason = None
                self.logger.info(
                    f"Resumed from {context.path.name}: {state.epoch} epoch(s) done, step {state.global_step}"
                    + (f", {state.iter_in_epoch} step(s) into epoch {state.epoch + 1}" if state.iter_in_epoch else "")
                )
                return True
            self.writer.rewind(0, 0)
        if cfg.weight:
            # CheckpointLoader(strict=True): every model tensor from the file and none left over.
            strict = any(getattr(h, "strict", False) is True for h in self.hooks)
            load_weights(self.model_without_ddp, cfg.weight, cfg.get("weight_key_map") or (), self.logger,
                         strict=strict, allow_unexpected=not strict)
            return True
        return False

    def save_checkpoint(self) -> None:
        """Commit a resumable checkpoint of this step and write ``model/model_last.pth``
        (a collective: every rank calls it at the same step)."""
        if self._last_saved_step == self.global_step:
            return
        with self.tracer.long_span("checkpoint_save"), host_sync("checkpoint"):  # states are copied to the host
            self._save_checkpoint()

    def _save_checkpoint(self) -> None:
        self._model_files = [("model_last.pth", self.model_file_payload())]
        self.call_hooks("before_save_checkpoint")  # a hook may add_model_file() here
        self.metrics.flush()  # the writer's offset must cover everything logged up to here
        best = self.metrics.best
        files = tuple((payload, self.save_path / "model" / name) for name, payload in self._model_files)
        self.checkpointer.save(self.global_step, self.train_state.epoch,
                               extra_manifest={"is_best": best.step is not None and best.step == self.global_step},
                               after_commit=files)
        self._model_files = []
        self._last_saved_step = self.global_step

    _snapshot_every: int | None = None

    def align_data_snapshots(self, every_n_steps: int | None) -> None:
        """Plan checkpoints every ``every_n_steps`` optimizer steps (CheckpointSaver
        calls it in ``before_train``): the loader of an iterable data set snapshots
        its state at that cadence, so such a checkpoint holds an exact data
        position. Several callers: the shortest interval wins. Map-style data sets
        resume from a sample count and need no snapshots."""
        if not every_n_steps or data_lib.train_sampler(self.train_loader) is not None:
            return  # the position is a sample count (LoaderParticipant), exact at any step
        if self._snapshot_every is None or every_n_steps < self._snapshot_every:
            self._snapshot_every = every_n_steps
            self.train_loader.snapshot_every_n_steps = every_n_steps * self.grad_accum_steps

    def add_model_file(self, name: str, model: torch.nn.Module) -> None:
        """From ``before_save_checkpoint``: also write ``model/<name>`` for ``model``
        (e.g. EMA weights) once this checkpoint is committed, off the training thread."""
        self._model_files.append((name, self.model_file_payload(model)))

    def model_file_payload(self, model: torch.nn.Module | None = None, **fields) -> dict:
        """The content of a ``model/*.pth`` file (collective-safe: every rank gathers the
        state dict; a sharded model's is gathered whole, kept by rank 0 only)."""
        model = self.model_without_ddp if model is None else model
        state = full_state_dict(model, keep=comm.is_main_process()) if is_sharded(model) else model.state_dict()
        return {"state_dict": state, "epoch": self.train_state.epoch, "global_step": self.global_step, **fields}

    def full_parameters(self, model: torch.nn.Module | None = None):
        """Context in which ``model`` (default: the trained one) holds its whole
        parameters on every rank: under FSDP each unit is gathered once (a
        collective), so any number of forward passes or other method calls run
        without collectives (evaluation, rollouts). A no-op otherwise."""
        trained = model is None or model is self.model_without_ddp
        return full_parameters(self.model if trained else model)

    def save_model_file(self, name: str, model: torch.nn.Module | None = None, **fields) -> None:
        """``model/<name>`` now: plain weights for inference and warm starts (every rank
        gathers, rank 0 writes)."""
        with host_sync("checkpoint"):  # the weights are copied to the host
            payload = self.model_file_payload(model, **fields)
        if comm.is_main_process():
            atomic_torch_save(payload, self.save_path / "model" / name)

    def finish(self, stopped: bool) -> None:
        """End of training: the final evaluation when due (not after a pre-emption
        or Ctrl-C); after a stop, a final checkpoint committed on every rank
        before any exits; then the metrics flushed and the last write waited for."""
        control = self.control
        # A pre-empted job has no time to spare, and Ctrl-C asks to end now.
        if self.cfg.evaluate and not control.preempted and not control.interrupted:
            due = [e for e in self.evaluators if getattr(e, "last_step", None) != self.global_step]
            if due and self.global_step > 0:
                self.validate(due, kind="final")
        if stopped:
            start = time.perf_counter()
            if control.preempted:
                self.logger.warning(f"Pre-empted by {control.describe().removeprefix('pre-empted by ')} at step "
                                    f"{self.global_step}: saving a checkpoint")
            elif control.interrupted:
                self.logger.warning(f"Interrupted by Ctrl-C at step {self.global_step}: saving a checkpoint")
            else:
                self.logger.warning(f"Stopping at step {self.global_step} ({self.control.describe()}): saving a "
                                    "checkpoint")
                self.train_state.stop_reason = self.control.describe()
            self.save_checkpoint()
            self.checkpointer.wait()  # committed before the process exits
            # Rank 0 commits after the others wrote their files: no rank reports the checkpoint
            # (and exits 75 / 130) before the commit, so a launcher that stops the remaining
            # workers once one has exited (torchrun) cannot cut the commit short.
            comm.synchronize()
            then = ("exiting with code 75 (rerun with resume=True to continue)" if control.preempted
                    else "exiting with code 130" if control.interrupted else "training stopped")
            self.logger.warning(f"Checkpoint committed in {time.perf_counter() - start:.1f}s; {then}")
        self.metrics.flush()
        self.checkpointer.wait()
