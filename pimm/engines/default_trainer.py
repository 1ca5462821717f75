"""DefaultTrainer: builds every component from the config and runs a plain
supervised step (forward under autocast, backward, clip, step, schedule).

Each component comes from an overridable ``build_*`` method, so a new
trainer usually overrides one or two of them and nothing else.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import IterableDataset, default_collate

from pimm.engines import data as data_lib
from pimm.engines.checkpoint import CheckpointManager
from pimm.engines.optim import build_optimizer
from pimm.engines.preemption import PreemptionWatcher
from pimm.engines.hooks.base import build_hooks
from pimm.engines.hooks.evaluator import EvaluatorBase
from pimm.engines.participants import HooksParticipant, LoaderParticipant, MetaParticipant, RNGParticipant
from pimm.engines.resume import load_weights
from pimm.engines.registries import COLLATE_FNS, DATASETS, MODELS, TRAINERS
from pimm.engines.scheduler import build_scheduler
from pimm.engines.trainer_base import TrainerBase
from pimm.engines.writers import MetricsWriter
from pimm.utils import comm
from pimm.utils.errors import ConfigError, UserError
from pimm.utils.files import set_aside
from pimm.utils.rng import derive_seed, seed_all

__all__ = ["DefaultTrainer"]


@TRAINERS.register_module()
class DefaultTrainer(TrainerBase):
    """Options (the keys of ``train = dict(type="DefaultTrainer", ...)``):

    collate_fn / val_collate_fn: a name in ``COLLATE_FNS`` or ``dict(type=name, **kwargs)``;
        default: the data set's ``collate_fn`` attribute, else torch's default collate.
    iters_per_epoch: epoch length for iterable data sets (map-style: derived).
    find_unused_parameters: passed to DDP.
    preempt_check_every: steps between cross-rank pre-emption checks when distributed.
    """

    def __init__(self, cfg, collate_fn=None, val_collate_fn=None, iters_per_epoch=None,
                 find_unused_parameters=False, preempt_check_every=10, mode="train"):
        super().__init__()
        if mode not in ("train", "test"):
            raise ConfigError(f"trainer mode must be 'train' or 'test', got {mode!r}")
        self.cfg = cfg
        self.mode = mode
        self.rank, self.world_size = comm.get_rank(), comm.get_world_size()
        self.device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                       else torch.device("cpu"))
        self.save_path = Path(cfg.save_path)
        self.options = dict(collate_fn=collate_fn, val_collate_fn=val_collate_fn, iters_per_epoch=iters_per_epoch,
                            find_unused_parameters=find_unused_parameters)
        self.max_epoch = cfg.epoch
        self.batch_size_per_rank = cfg.batch_size // self.world_size
        self.grad_accum_steps = cfg.grad_accum_steps
        self.clip_grad = cfg.clip_grad

        hooks = build_hooks(cfg.hooks)
        for hook in hooks:
            hook.modify_config(cfg)
        if mode == "train" and (cfg.resume or cfg.weight) and not any(
                getattr(h, "restores_checkpoints", False) for h in hooks):
            raise ConfigError("resume=True / weight=... need a CheckpointLoader in hooks: add dict(type='CheckpointLoader')")

        seed_all(derive_seed(cfg.seed, 0))  # identical model init on every rank
        self.model_without_ddp = self.build_model().to(self.device)
        self.autocast = self._build_autocast()
        self.train_loader = None
        self._val_loader = self._test_loader = None
        self._data_iter = None
        if mode == "test":
            self.model = self.model_without_ddp
            self.register_hooks(hooks)
            return

        self.model = self._wrap_ddp(self.model_without_ddp)
        self._checkpoint_interval = min(
            [h.checkpoint_interval for h in hooks if getattr(h, "checkpoint_interval", None)] or [0]
        )
        self.train_loader = self.build_train_loader()
        self.iters_per_epoch = self._compute_iters_per_epoch()
        self.samples_per_step = self.batch_size_per_rank * self.world_size * self.grad_accum_steps
        self.optimizer = self.build_optimizer()
        self.scheduler = self.build_scheduler()
        self.scaler = self.build_scaler()
        self.writer = self.build_writer()
        self.preemption = PreemptionWatcher(cfg.preempt_signals, check_every=preempt_check_every)
        self.train_state.load_state_dict(dict(
            world_size=self.world_size, batch_size_per_rank=self.batch_size_per_rank,
            grad_accum_steps=self.grad_accum_steps, num_workers_per_rank=self.num_workers_per_rank))
        self.checkpointer = self.build_checkpointer()
        self.register_hooks(hooks)
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        seed_all(derive_seed(cfg.seed, 1, self.rank))  # this rank's training stream

    def test(self) -> dict:
        """Evaluate ``weight=`` on the test split with every evaluator hook; write
        ``save_path/test_metrics.json``."""
        evaluators = [h for h in self.hooks if isinstance(h, EvaluatorBase)]
        if not evaluators:
            raise ConfigError("tools/test.py needs an evaluator in hooks, e.g. dict(type='ClsEvaluator')")
        load_weights(self.model_without_ddp, self.cfg.weight, logger=self.logger)
        results = {}
        for evaluator in evaluators:
            metrics = evaluator.evaluate(self.test_loader)
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
            path.write_text(json.dumps({"weight": str(self.cfg.weight), "metrics": results}, indent=1))
            self.logger.info(f"Wrote {path}")
        return results

    # -- builders ---------------------------------------------------------
    def build_model(self) -> torch.nn.Module:
        model = MODELS.build(self.cfg.model)
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.logger.info(f"Model {type(model).__name__}: {n_params:,} trainable parameters")
        return model

    def _wrap_ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.world_size == 1:
            return model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids,
                                       find_unused_parameters=self.options["find_unused_parameters"])

    @property
    def num_workers_per_rank(self) -> int:
        return self.cfg.num_worker // self.world_size

    def _resolve_collate(self, spec, dataset):
        if spec is None:
            return getattr(dataset, "collate_fn", None) or default_collate
        if isinstance(spec, str):
            return COLLATE_FNS.get(spec)
        if isinstance(spec, dict):
            spec = dict(spec)
            return functools.partial(COLLATE_FNS.get(spec.pop("type")), **spec)
        if callable(spec):
            return spec
        raise ConfigError(f"collate_fn must be a registered name or dict(type=...), got {spec!r}")

    def _build_dataset(self, split: str):
        data_cfg = self.cfg.get("data") or {}
        if split not in data_cfg or data_cfg[split] is None:
            raise ConfigError(f"data.{split} is not set: add data = dict({split}=dict(type=..., ...))")
        return DATASETS.build(data_cfg[split])

    def build_train_loader(self):
        return self._make_train_loader(self._build_dataset("train"))

    def _make_train_loader(self, dataset, sampler=None):
        # Only iterable data sets resume from the loader's own snapshots (see
        # LoaderParticipant); take them at the checkpoint cadence, not per step.
        iterable = isinstance(dataset, IterableDataset)
        interval = self._checkpoint_interval * self.grad_accum_steps if iterable and self._checkpoint_interval else None
        return data_lib.build_train_loader(
            dataset, batch_size=self.batch_size_per_rank, num_workers=self.num_workers_per_rank,
            seed=self.cfg.seed, rank=self.rank, world_size=self.world_size,
            collate_fn=self._resolve_collate(self.options["collate_fn"], dataset),
            snapshot_every_n_steps=interval, pin_memory=self.device.type == "cuda", sampler=sampler,
        )

    def _build_eval_loader(self, split: str):
        dataset = self._build_dataset(split)
        batch_size = self.cfg.batch_size_val or self.cfg.batch_size
        spec = self.options["val_collate_fn"] or self.options["collate_fn"]
        return data_lib.build_eval_loader(
            dataset, batch_size=max(1, batch_size // self.world_size), num_workers=self.num_workers_per_rank,
            seed=self.cfg.seed, rank=self.rank, world_size=self.world_size,
            collate_fn=self._resolve_collate(spec, dataset), pin_memory=self.device.type == "cuda",
        )

    def build_val_loader(self):
        return self._build_eval_loader("val")

    def build_test_loader(self):
        return self._build_eval_loader("test")

    @property
    def val_loader(self):
        if self._val_loader is None:
            self._val_loader = self.build_val_loader()
        return self._val_loader

    @property
    def test_loader(self):
        if self._test_loader is None:
            self._test_loader = self.build_test_loader()
        return self._test_loader

    def _compute_iters_per_epoch(self) -> int:
        dataset = self.train_loader.dataset
        explicit = self.options["iters_per_epoch"]
        if explicit is not None:
            if isinstance(explicit, bool) or not isinstance(explicit, int) or explicit <= 0:
                raise ConfigError(f"train.iters_per_epoch={explicit!r} must be a positive integer")
            return explicit
        if isinstance(dataset, IterableDataset):
            if not hasattr(dataset, "num_samples"):
                raise ConfigError(
                    f"{type(dataset).__name__} is an iterable data set: set train.iters_per_epoch "
                    "or give the data set a num_samples() method"
                )
            batches = dataset.num_samples() // self.batch_size_per_rank
        else:
            batches = len(self.train_loader)
        iters = batches // self.grad_accum_steps
        if iters <= 0:
            raise ConfigError(
                f"the training set gives {batches} batch(es) of {self.batch_size_per_rank} per process, fewer than "
                f"grad_accum_steps={self.grad_accum_steps}: lower batch_size or use more data"
            )
        return iters

    def build_optimizer(self):
        return build_optimizer(self.cfg.optimizer, self.model_without_ddp, self.cfg.get("param_dicts"))

    def build_scheduler(self):
        return build_scheduler(self.cfg.scheduler, self.optimizer, total_steps=self.iters_per_epoch * self.max_epoch)

    def build_scaler(self):
        enabled = self.cfg.enable_amp and self.cfg.amp_dtype == "float16"
        if enabled and self.device.type != "cuda":
            raise ConfigError("amp_dtype='float16' needs CUDA; on CPU use amp_dtype='bfloat16' or enable_amp=False")
        return torch.amp.GradScaler(self.device.type, enabled=enabled)

    def _build_autocast(self):
        if not self.cfg.enable_amp:
            return contextlib.nullcontext
        dtype = getattr(torch, self.cfg.amp_dtype)
        return functools.partial(torch.autocast, device_type=self.device.type, dtype=dtype)

    def build_writer(self) -> MetricsWriter:
        cfg = self.cfg
        return MetricsWriter(
            self.save_path, enable_tensorboard=cfg.enable_tensorboard, use_wandb=cfg.use_wandb,
            wandb_init=dict(project=cfg.wandb_project, name=self.save_path.name, config=_plain(cfg)),
            logger=self.logger,
        )

    def build_checkpointer(self) -> CheckpointManager:
        manager = CheckpointManager(self.save_path / "checkpoints", logger=self.logger)
        manager.register("model", self.model_without_ddp)
        manager.register("optimizer", self.optimizer)
        manager.register("scheduler", self.scheduler)
        manager.register("scaler", self.scaler)
        manager.register("train_state", self.train_state)
        manager.register("writer", self.writer)
        manager.register("meta", MetaParticipant(self))
        manager.register("rng", RNGParticipant(), per_rank=True)
        manager.register("loader", LoaderParticipant(self), per_rank=True)
        manager.register("hooks", HooksParticipant(self), per_rank=True)
        return manager

    # -- the loop -----------------------------------------------------------
    def save_checkpoint(self) -> None:
        # Flushing is a collective (loss averaging); do it on every rank before
        # rank 0 alone collects the writer's state.
        self.writer.flush()
        best = self.train_state.best_step is not None and self.train_state.best_step == self.global_step
        self.checkpointer.save(self.global_step, self.train_state.epoch, extra_manifest={"is_best": best})

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

    def run_epoch(self) -> None:
        self.start_epoch_data()
        try:
            super().run_epoch()
        finally:
            self._data_iter = None

    def _next_batch(self):
        try:
            return next(self._data_iter)
        except StopIteration:
            raise UserError(
                f"the training data ran out after {self.iter} of {self.iters_per_epoch} steps in epoch "
                f"{self.epoch + 1}; lower train.iters_per_epoch or fix the data set's length"
            ) from None

    def _to_device(self, batch):
        if self.device.type == "cpu":
            return batch
        if isinstance(batch, dict):
            return {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                    for k, v in batch.items()}
        return batch.to(self.device, non_blocking=True)

    def run_step(self) -> None:
        info = self.comm_info
        # Drop the previous step's batch and outputs before this forward pass,
        # so their memory is reused instead of held through another step.
        info["input_dict"] = info["model_output_dict"] = info["loss"] = None
        accum = self.grad_accum_steps
        data_time = 0.0
        step_loss = None
        for micro in range(accum):
            start = time.perf_counter()
            batch = self._to_device(self._next_batch())
            data_time += time.perf_counter() - start
            if micro < accum - 1 and self.model is not self.model_without_ddp:
                with self.model.no_sync():  # gradients are all-reduced once, on the last micro-batch
                    output, loss = self._forward_backward(batch)
            else:
                output, loss = self._forward_backward(batch)
            step_loss = loss if step_loss is None else step_loss + loss
        if self.clip_grad is not None:
            if self.scaler.is_enabled():
                self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self._params, self.clip_grad)
        if self.scaler.is_enabled():
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        info["lr"] = self.optimizer.param_groups[0]["lr"]  # the rate this step used
        self.scheduler.step()
        info["input_dict"], info["model_output_dict"] = batch, output
        info["loss"], info["data_time"] = step_loss, data_time

    def _forward_backward(self, batch):
        if self.cfg.enable_amp:
            with self.autocast():
                output = self.model(batch)
        else:
            output = self.model(batch)
        try:
            loss = output["loss"]
        except (KeyError, TypeError, IndexError):
            raise UserError(f"model {type(self.model_without_ddp).__name__} returned no 'loss' in training mode; "
                            "its forward must return a dict with a scalar 'loss'") from None
        if self.grad_accum_steps > 1:
            loss = loss / self.grad_accum_steps
        if self.scaler.is_enabled():
            self.scaler.scale(loss).backward()
        else:
            loss.backward()
        return output, loss.detach()


    def close(self, flush: bool = True) -> None:
        try:
            super().close(flush)
        finally:
            self._data_iter = None
            for loader in (self.train_loader, self._val_loader, self._test_loader):
                if loader is not None:
                    data_lib.shutdown_loader(loader)


def _plain(cfg) -> dict:
    to_dict = getattr(cfg, "to_dict", None)
    return to_dict() if callable(to_dict) else dict(cfg)
