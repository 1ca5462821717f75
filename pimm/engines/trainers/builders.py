"""How :class:`~pimm.engines.trainers.default.DefaultTrainer` builds its
components from the config: model (and its DDP wrapper), data loaders,
optimizer, scheduler, AMP scaler and autocast, writer. Each is an
overridable ``build_*`` method, so a new trainer replaces one builder and
nothing else."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import IterableDataset, default_collate

from pimm.engines.run import data as data_lib
from pimm.engines.optim.compile import compile_model
from pimm.engines.optim.grad_checkpoint import apply_gradient_checkpointing
from pimm.engines.optim.optimizers import build_optimizer
from pimm.engines.optim.parts import build_optim_parts, model_parts, optimizer_parts
from pimm.engines.run.parallel import shard_model
from pimm.engines.registries import COLLATE_FNS, DATASETS, MODELS
from pimm.engines.optim.scheduler import build_scheduler
from pimm.engines.observe.wandb_options import wandb_init_options
from pimm.engines.observe.writers import MetricsWriter
from pimm.utils.config_dict import to_plain
from pimm.utils.errors import ConfigError

__all__ = ["ComponentBuilders", "no_autocast"]


class ComponentBuilders:
    """The ``build_*`` methods of DefaultTrainer and of the
    :class:`~pimm.engines.loop.testers.Tester` (a mixin: it reads ``self.cfg``,
    ``self.world_size``, ``self.rank``, ``self.device``, ``self.options``)."""

    #: The collate function when the config names none (``train.collate_fn`` /
    #: ``val_collate_fn``): a ``COLLATE_FNS`` name, or None for the data set's
    #: ``collate_fn`` attribute, else the ``fallback_collate_fn`` a domain
    #: package registers (pimm.datasets: point events concatenated, as
    #: upstream's trainer batches every data set), else torch's default collate.
    #: A class attribute, so the Tester of a trainer class collates as that trainer does.
    default_collate_fn: str | None = None

    def build_model(self) -> torch.nn.Module:
        """The model from ``cfg.model`` (SyncBatchNorm and gradient checkpointing as
        configured), on the CPU; the caller moves it to the device."""
        model = MODELS.build(self.cfg.model)
        if self.cfg.sync_bn and self.world_size > 1:
            if self.device.type == "cuda":
                model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
            else:
                self.logger.warning("sync_bn=True needs CUDA (SyncBatchNorm has no CPU kernel): BatchNorm stays "
                                    "per process")
        apply_gradient_checkpointing(model, self.cfg.get("gradient_checkpointing"), self.logger)
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.logger.info(f"Model {type(model).__name__}: {n_params:,} trainable parameters")
        return model

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the loss is computed through: DDP when distributed, or the
        model itself sharded in place under ``parallel.strategy='fsdp'``;
        wrapped by ``torch.compile`` when the ``compile`` key enables it."""
        if self.world_size == 1:
            wrapped = model
        elif self.parallel.fsdp:  # each optimizer part (a network of its own) is a sharding unit too
            parts = optimizer_parts(self.cfg.optimizer)
            wrapped = shard_model(model, self.parallel, self.device, self.world_size, self.logger,
                                  units=model_parts(model, parts).values() if parts else ())
        else:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            wrapped = DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=bool(
                self.options["find_unused_parameters"] or self.cfg.find_unused_parameters))
        # Compiled outermost; the model itself (checkpoints, EMA) stays the plain module.
        return compile_model(wrapped, self.cfg.get("compile"), type(model).__name__, self.logger)

    def to_device(self, batch):
        """``batch`` (a tensor or a dict of them; other values pass through) on the
        training device, copied asynchronously from pinned memory; a no-op on CPU."""
        if self.device.type == "cpu":
            return batch
        if isinstance(batch, dict):
            return {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                    for k, v in batch.items()}
        return batch.to(self.device, non_blocking=True)

    @property
    def num_workers_per_rank(self) -> int:
        """Data-loading workers of this process (``num_worker`` is global)."""
        return self.cfg.num_worker // self.world_size

    def _resolve_collate(self, spec, dataset):
        spec = self.default_collate_fn if spec is None else spec
        if spec is None:
            return getattr(dataset, "collate_fn", None) or COLLATE_FNS.find("fallback_collate_fn") or default_collate
        if spec == "default_collate":
            return default_collate
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
        """The resumable training loader over ``data.train`` (see :mod:`pimm.engines.run.data`)."""
        return self._make_train_loader(self._build_dataset("train"))

    def _make_train_loader(self, dataset, sampler=None):
        # Only iterable data sets resume from the loader's own snapshots (see
        # LoaderParticipant); they are taken at the checkpoint cadence, which
        # CheckpointSaver sets later (DefaultTrainer.align_data_snapshots).
        if not isinstance(dataset, IterableDataset) and len(dataset) == 0:
            raise ConfigError(f"data.train ({type(dataset).__name__}) is empty: nothing to train on")
        collate = self._resolve_collate(self.options["collate_fn"], dataset)
        if self.cfg.mix_prob:
            collate = _with_mix_prob(collate, self.cfg.mix_prob)
        return data_lib.build_train_loader(
            dataset, batch_size=self.batch_size_per_rank, num_workers=self.num_workers_per_rank,
            seed=self.cfg.seed, rank=self.rank, world_size=self.world_size, collate_fn=collate,
            pin_memory=self.device.type == "cuda", sampler=sampler,
            prefetch_factor=self.cfg.prefetch_factor,
        )

    def _build_eval_loader(self, split: str):
        dataset = self._build_dataset(split)
        batch_size = (self.cfg.batch_size_test if split == "test" else None) or self.cfg.batch_size_val \
            or self.cfg.batch_size
        spec = self.options["val_collate_fn"] or self.options["collate_fn"]
        return data_lib.build_eval_loader(
            dataset, batch_size=max(1, batch_size // self.world_size), num_workers=self.num_workers_per_rank,
            seed=self.cfg.seed, rank=self.rank, world_size=self.world_size,
            collate_fn=self._resolve_collate(spec, dataset), pin_memory=self.device.type == "cuda",
            prefetch_factor=self.cfg.prefetch_factor,
        )

    def _check_eval_split(self, split: str) -> None:
        names = ", ".join(type(e).__name__ for e in self.evaluators) or "the tester"
        data_cfg = self.cfg.get("data") or {}
        if data_cfg.get(split) is None:
            raise ConfigError(f"{names} evaluate(s) on data.{split}, which is not set: add data.{split} = "
                              f"dict(type=...), or evaluate=False to train without evaluation")
        loader = self.val_loader if split == "val" else self.test_loader
        dataset = loader.dataset
        if isinstance(dataset, data_lib.SeededDataset):  # name the user's data set, not the wrapper
            dataset = dataset.dataset
        if len(dataset) == 0:
            raise ConfigError(f"data.{split} ({type(dataset).__name__}) is empty: {names} would have nothing "
                              "to score")

    def build_val_loader(self):
        """The loader over ``data.val`` (built on first use)."""
        return self._build_eval_loader("val")

    def build_test_loader(self):
        """The loader over ``data.test`` (built on first use)."""
        return self._build_eval_loader("test")

    @property
    def val_loader(self):
        """The validation loader, built on first use."""
        if self._val_loader is None:
            self._val_loader = self.build_val_loader()
        return self._val_loader

    @property
    def test_loader(self):
        """The test loader, built on first use."""
        if self._test_loader is None:
            self._test_loader = self.build_test_loader()
        return self._test_loader

    def explicit_iters_per_epoch(self) -> int | None:
        """The epoch length the config sets: ``train.iters_per_epoch``, else the
        top-level ``iters_per_epoch`` (upstream's key) for iterable data; None: derived."""
        explicit, top = self.options["iters_per_epoch"], self.cfg.get("iters_per_epoch")
        if explicit is not None:
            if isinstance(explicit, bool) or not isinstance(explicit, int) or explicit <= 0:
                raise ConfigError(f"train.iters_per_epoch={explicit!r} must be a positive integer")
            if top is not None and top != explicit:
                raise ConfigError(f"iters_per_epoch={top} and train.iters_per_epoch={explicit} disagree: set one")
            return explicit
        return top if isinstance(self.train_loader.dataset, IterableDataset) else None

    def _compute_iters_per_epoch(self) -> int:
        dataset = self.train_loader.dataset
        explicit = self.explicit_iters_per_epoch()
        if explicit is not None:
            return explicit
        if isinstance(dataset, IterableDataset):
            batches = data_lib.stream_batches_per_rank(dataset, self.world_size, self.batch_size_per_rank)
        else:
            if self.cfg.get("iters_per_epoch") is not None:
                self.logger.warning(f"iters_per_epoch={self.cfg.iters_per_epoch} is ignored: the training set is "
                                    "map-style and an epoch is one pass over it (as upstream)")
            batches = len(self.train_loader)
        iters = self.iters_for_batches(batches)
        if iters <= 0:
            raise ConfigError(
                f"the training set gives {batches} batch(es) of {self.batch_size_per_rank} per process, fewer than "
                f"grad_accum_steps={self.grad_accum_steps}: lower batch_size or use more data"
            )
        return iters

    def iters_for_batches(self, batches: int) -> int:
        """Optimizer steps that ``batches`` training batches make."""
        return batches // self.grad_accum_steps

    #: Whether ``torch.compile`` may wrap the model (the ``compile`` key): False for a
    #: trainer whose step calls model methods that ``torch.compile`` does not wrap.
    supports_compile = True

    #: Whether this trainer's ``run_step`` uses ``self.optim_steps`` by name, so that
    #: the optimizer config may name model parts (see :mod:`pimm.engines.optim.parts`).
    supports_optimizer_parts = False

    def build_optim_parts(self) -> dict:
        """One :class:`~pimm.engines.optim.parts.OptimPart` per model part the
        optimizer config names (``optimizer = dict(gen=dict(type=...), disc=...)``),
        in the config's order; ``{}`` for the single-optimizer ``dict(type=...)``."""
        parts = optimizer_parts(self.cfg.optimizer)
        if not parts:
            return {}
        if not self.supports_optimizer_parts:
            raise ConfigError(f"optimizer names model parts ({', '.join(parts)}), but {type(self).__name__} steps "
                              "one optimizer: use a trainer that updates each part, e.g. train = "
                              "dict(type='GANTrainer'), or optimizer = dict(type=..., ...)")
        return build_optim_parts(self.cfg, self.model_without_ddp, self.model, self.iters_per_epoch * self.max_epoch,
                                 self.build_scaler, parts)

    def build_optimizer(self):
        """The optimizer from ``cfg.optimizer`` over the model's parameter groups (``param_dicts``)."""
        return build_optimizer(self.cfg.optimizer, self.model_without_ddp, self.cfg.get("param_dicts"))

    def build_scheduler(self):
        """The lr scheduler from ``cfg.scheduler`` (None: a constant lr), stepped once per optimizer step."""
        spec = self.cfg.scheduler if self.cfg.scheduler is not None else dict(type="ConstantLR")
        # scheduler_interval=N: the scheduler steps once every N updates, so the schedule has total // N steps.
        total = max(1, self.iters_per_epoch * self.max_epoch // self.cfg.get("scheduler_interval", 1))
        return build_scheduler(spec, self.optimizer, total_steps=total)

    def _scheduled_group_keys(self) -> tuple[str, ...]:
        """Group keys the scheduler sets per step (the lr, a cycled momentum)."""
        owned = getattr(self.scheduler, "_owned_group_keys", None)
        return ("lr", *({"betas", "momentum"} & set(owned() if owned else ())))

    def build_scaler(self):
        """The AMP GradScaler (enabled for ``amp_dtype='float16'`` only)."""
        enabled = self.cfg.enable_amp and self.cfg.amp_dtype == "float16"
        if enabled and self.device.type != "cuda":
            raise ConfigError("amp_dtype='float16' needs CUDA; on CPU use amp_dtype='bfloat16' or enable_amp=False")
        return torch.amp.GradScaler(self.device.type, enabled=enabled)

    def _build_autocast(self):
        if not self.cfg.enable_amp:
            return no_autocast
        dtype = getattr(torch, self.cfg.amp_dtype)
        return functools.partial(torch.autocast, device_type=self.device.type, dtype=dtype)

    def build_writer(self) -> MetricsWriter:
        """The metric sinks: metrics.jsonl, TensorBoard, W&B as configured."""
        cfg = self.cfg
        return MetricsWriter(
            self.save_path, enable_tensorboard=cfg.enable_tensorboard, use_wandb=cfg.use_wandb,
            wandb_init=wandb_init_options(cfg, self.save_path, config=to_plain(cfg)) if cfg.use_wandb else None,
            logger=self.logger,
        )

    def open_outputs(self) -> None:
        """Open the metric sinks (rank 0) before the first step, as a trainer's
        loggers are made before training: the event file, its writer thread and
        a W&B run then start outside the step loop, not at the first flush."""
        self.writer.open()


_NULL_CONTEXT = contextlib.nullcontext()  # stateless: one instance for every forward pass


def no_autocast():
    """``trainer.autocast()`` when AMP is off: a context that does nothing (the
    training forward skips even entering it, see ``DefaultTrainer.forward``)."""
    return _NULL_CONTEXT


def _with_mix_prob(collate, mix_prob: float):
    """The train collate with ``mix_prob`` (upstream's runtime key): only a collate
    that mixes events takes it; one that names a mixing variant as its ``mixing``
    attribute (the plain point collate: ``point_collate_fn``) is replaced by it."""
    import inspect

    target = collate.func if isinstance(collate, functools.partial) else collate
    mixing = getattr(target, "mixing", None)
    if mixing is not None:
        collate = functools.partial(mixing, **collate.keywords) if isinstance(collate, functools.partial) else mixing
        target = mixing
    try:
        takes = "mix_prob" in inspect.signature(target).parameters
    except (TypeError, ValueError):
        takes = False
    if not takes:
        raise ConfigError(f"mix_prob={mix_prob} needs a train collate function that mixes events, e.g. "
                          "train = dict(..., collate_fn='point_collate_fn'); "
                          f"{getattr(target, '__name__', target)!s} takes no mix_prob")
    return functools.partial(collate, mix_prob=mix_prob)
