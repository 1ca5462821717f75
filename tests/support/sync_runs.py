"""The trainings of the host-sync check: 100 steps each of DefaultTrainer,
InsegTrainer and GRPOTrainer with the default hooks, an evaluator and a
checkpoint every 30 steps. ``tests/test_no_host_sync.py`` runs them on the CPU
under :class:`tests.support.sync_watch.SyncWatch`; ``bench/gpu_check.py`` runs
them on a GPU under ``torch.cuda.set_sync_debug_mode("error")``."""

from __future__ import annotations

from pathlib import Path

import pimm.cli
from pimm.engines.run.launch import build_trainer, load_config
from pimm.engines.observe.tracing import build_tracer
from pimm.engines.run.runtime import DEFAULT_HOOKS, apply_runtime_defaults, validate_runtime
from pimm.utils.config import Config
from tests.support.run import ROOT, write_toy_config

pimm.cli.register_all()

POINTWISE = 'dict(type="PointwiseInstanceModel", in_channels=1, num_classes=5)'
SPARSE = ('dict(type="PointGroupLite", num_classes=5, backbone=dict(type="SparseUNet", in_channels=1, '
          'channels=(8, 16), enc_blocks=(1, 1), dec_blocks=(1,)))')

INSEG = """
_base_ = {base!r}
custom_imports = ["tests.support.sync_models"]
save_path = {save!r}
epoch = 5
batch_size = 2
train = dict(type="InsegTrainer")
_t = [dict(type="LogTransform", key="energy"), dict(type="ToTensor"),
      dict(type="Collect", keys=("coord", "segment", "instance"), feat_keys=("energy",))]
_gen = dict(type="LArTPCSynthDataset", transform=_t, points_per_event=(100, 200))
data = dict(train=dict(_gen, num_events=40, split="train"), val=dict(_gen, num_events=4, split="val"))
model = {model}
optimizer = dict(type="AdamW", lr=0.002)
scheduler = dict(type="CosineWarmupLR", warmup_ratio=0.2)
hooks = {hooks!r}
"""


def default_hooks(*extra: dict, save_freq: int | None = 30) -> list[dict]:
    """The default hooks (CheckpointSaver saving every ``save_freq`` steps) plus ``extra`` before the saver."""
    hooks = [dict(h) for h in DEFAULT_HOOKS.values()]
    saver = next(h for h in hooks if h["type"] == "CheckpointSaver")
    saver["save_freq"] = save_freq
    return [h for h in hooks if h is not saver] + list(extra) + [saver]


def toy_trainer(directory: Path, *options: str, hooks: list[dict] | None = None):
    """DefaultTrainer on the toy task: 800 samples, batch 16, 2 epochs = 100 steps,
    gradient norm logged and clipped, ClsEvaluator every epoch."""
    hooks = default_hooks(dict(type="ClsEvaluator", num_classes=2)) if hooks is None else hooks
    extra = (f"hooks = {hooks!r}\nlog_grad_norm = True\nclip_grad = 1.0\n"
             'data = dict(train=dict(type="ToyDataset", num_samples=800, noise_aug=0.1), '
             'val=dict(type="ToyDataset", num_samples=64, seed=1))\n')
    config = write_toy_config(directory, directory / "run", extra)
    cfg, built = load_config(str(config), ["epoch=2", *options], world_size=1)
    return build_trainer(cfg, hooks=built)


def inseg_trainer(directory: Path, *options: str, model: str = POINTWISE):
    """InsegTrainer (its collate) on 40 LArTPC events, batch 2, 5 epochs = 100 steps,
    InsSegEvaluator every epoch; ``model``: a config dict as source."""
    config = directory / "inseg_cfg.py"
    config.write_text(INSEG.format(base=str(ROOT / "configs" / "_base_" / "default_runtime.py"),
                                   save=str(directory / "run"), model=model,
                                   hooks=default_hooks(dict(type="InsSegEvaluator", num_classes=5))))
    cfg, built = load_config(str(config), list(options), world_size=1)
    tracer = build_tracer(cfg.structured_logging, cfg.save_path, 0, 1)  # None unless structured_logging is on
    return build_trainer(cfg, hooks=built, tracer=tracer)


def grpo_trainer(directory: Path):
    """GRPOTrainer on the shipped track task: 50 rollouts of 8 events x 2 updates = 100 steps."""
    cfg = Config.fromfile(ROOT / "configs" / "grpo" / "tracks-grpo.py")
    apply_runtime_defaults(cfg)
    cfg.save_path = str(directory / "run")
    cfg.batch_size = 8
    cfg.data.train.num_events = 400
    cfg.hooks = default_hooks()
    cfg.train.update({"torch_threads": None})  # leave the calling process's threads alone
    validate_runtime(cfg, 1)
    return build_trainer(cfg)
