"""Upstream pimm's semantic-segmentation configs (``configs/panda/semseg/*``),
test configs (``configs/tests/*``) and PT-v3m8 pre-training config
(``configs/panda/pretrain/...-smallmask-v3m8.py``), their text as upstream wrote it
(``tests/support/upstream_configs/``), train here through tools/train.py with
only ``data_root`` pointed at generated PILArNet files, the widths shrunk and
the run sized to a few steps by ``--options`` (about 20 s a config on 2 shared
cores, mostly process start-up and W&B's offline writer: marked slow).

Upstream's configs also name hooks and a transform that other issues bring
to pimm (``PENDING``). Until they land, each config that names one runs twice:

* unmodified: a strict xfail naming what is missing (the mark goes when it
  lands: the run then passes and the xfail turns into a failure);
* with only those hooks / transforms left out (a short config on top of the
  file): must pass now, so every other model, loss, data, transform,
  optimizer, scheduler and runtime key of the file is exercised.

A fast in-process test (not slow, about a second a config) builds the same
pieces from the same loaded config and takes two optimizer steps.

Upstream's panoptic detector configs (``configs/panda/panseg/detector-v5-*``)
get the same two checks on generated PILArNet v2 / v3 files that carry the
detector truth: in-process (loader, model with the widths shrunk, optimizer
with ``param_dicts``, a step, the panoptic fusion) and, slow, through
tools/train.py (``weight=None`` where the config names weights on the Hub).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pimm.datasets.lartpc import LArTPCSynthDataset
from pimm.datasets.pilarnet import write_pilarnet_h5
from pimm.utils.config import Config
from tests.support.inprocess import committed_steps, make_trainer, two_steps_in_process
from tests.support.run import ROOT, run_tool

CONFIGS = ROOT / "tests" / "support" / "upstream_configs"
PANDA = CONFIGS / "panda" / "semseg"
FFT, DEC, LIN, SCRATCH = (PANDA / f"semseg-pt-v3m2-pilarnet-ft-5cls-{v}.py" for v in ("fft", "dec", "lin", "scratch"))
TINY, TINY_CRASH = CONFIGS / "tests" / "tiny_semseg.py", CONFIGS / "tests" / "tiny_semseg_crash.py"
# Sonata-v1m1 over PT-v3m8 (RoPE, bottleneck CPE); the smallmask pre-training over PT-v3m2: test_sonata_train.py
PRETRAIN_M8 = CONFIGS / "panda" / "pretrain" / "pretrain-sonata-v1m1-pilarnet-smallmask-v3m8.py"

# Upstream hooks and transforms these configs name that pimm does not have
# yet, and the issue bringing each.
# (Sonata's issue #33 brought WandbNamer, WeightDecayExclusion, GradientNormLogger,
# DtypeOverrider and CenterShift: the panda configs now train unmodified.)
PENDING_HOOKS: dict[str, str] = {}
PENDING_TRANSFORMS: dict[str, str] = {}
PENDING = PENDING_HOOKS | PENDING_TRANSFORMS
NEEDS = {FFT: (), DEC: (), SCRATCH: (), LIN: (), TINY_CRASH: (), TINY: (), PRETRAIN_M8: ()}
EVENTS = {"train": 4, "val": 2, "test": 2}
WIDTH = 8  # every stage's width after shrinking (upstream: 48..512)
ROPE_WIDTH = 12  # the same for PT-v3m8, whose RoPE needs heads of a multiple of 6 channels (2 heads of 6)


@pytest.fixture(scope="module")
def data_roots(tmp_path_factory):
    """PILArNet-M files of generated events, one root per layout revision the
    configs name; every event above the panda configs' ``min_points=1024``."""
    roots = {}
    for revision in ("v1", "v2"):
        root = tmp_path_factory.mktemp(f"pilarnet_{revision}")
        for split, count in EVENTS.items():
            events = LArTPCSynthDataset(num_events=count, seed=3, split=split, points_per_event=(1100, 1400))
            (root / split).mkdir()
            write_pilarnet_h5((events[i] for i in range(count)), root / split / "events_0000.h5", revision=revision)
        roots[revision] = root
    return roots


def run_options(config: Path, data_roots: dict, save_path: Path) -> list[str]:
    """data_root for every split the config names, and for upstream's full-size
    configs the shrunk widths and a one-epoch run of two steps."""
    cfg = Config.fromfile(config)
    options = [f"save_path={save_path}"]
    for split in ("train", "val", "test"):
        if split in cfg.data:
            options.append(f"data.{split}.data_root={data_roots[cfg.data[split]['revision']]}")
    backbone = cfg.model["backbone"]
    if cfg.model["type"] == "Sonata-v1m1":  # pre-training: shrink the backbone, the heads and the run
        stages, level = len(backbone["enc_channels"]), cfg.model["up_cast_level"]
        options += [f"model.backbone.enc_channels={[ROPE_WIDTH] * stages}",
                    f"model.backbone.enc_num_head={[2] * stages}", f"model.backbone.enc_cpe_channels={[6] * stages}",
                    f"model.head_in_channels={ROPE_WIDTH * (level + 1)}", "model.head_hidden_channels=32",
                    "model.head_embed_channels=16", "model.head_num_prototypes=32",
                    "batch_size=2", "num_worker=0", "epoch=1", "eval_epoch=1"]
    elif max(backbone["enc_channels"]) > 16:
        stages, dec_stages = len(backbone["enc_channels"]), len(backbone["dec_channels"])
        out = WIDTH * stages if backbone["enc_mode"] else WIDTH
        options += [f"model.backbone.enc_channels={[WIDTH] * stages}", f"model.backbone.enc_num_head={[2] * stages}",
                    f"model.backbone.dec_channels={[WIDTH] * dec_stages}",
                    f"model.backbone.dec_num_head={[2] * dec_stages}", f"model.backbone_out_channels={out}",
                    "batch_size=2", "num_worker=0", "epoch=1", "eval_epoch=1"]
    return [o.replace(" ", "") for o in options]


def check_run(config: Path, save_path: Path, steps: int) -> str:
    records = [json.loads(line) for line in open(save_path / "metrics.jsonl")]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == steps and all(math.isfinite(v) for v in losses), losses
    if config == PRETRAIN_M8:
        return check_pretrain_run(save_path, records)
    val = [r for r in records if "val/mIoU" in r]
    assert val and {f"val/iou_{n}" for n in ("shower", "track", "michel", "delta", "led")} <= set(val[-1])
    state = torch.load(save_path / "model" / "model_last.pth", weights_only=True)["state_dict"]
    assert state["seg_head.weight"].shape[0] == 5
    if "test" in Config.fromfile(config).data:  # FinalEvaluator scored data.test
        assert (save_path / "test_metrics.json").is_file()
    return (save_path / "train.log").read_text()


def check_pretrain_run(save_path: Path, records: list[dict]) -> str:
    """Sonata's three losses, and a student and an EMA teacher of PT-v3m8's
    shape (bottleneck CPE, RoPE, upstream's parameter names)."""
    scalars = {k for r in records for k in r}
    assert {"train/mask_loss", "train/roll_mask_loss", "train/unmask_loss", "params/momentum"} <= scalars
    state = torch.load(save_path / "model" / "model_last.pth", weights_only=True)["state_dict"]
    block = "student.backbone.enc.enc1.block0."
    assert state[block + "cpe.down.weight"].shape == (6, ROPE_WIDTH)
    assert state[block + "cpe.conv.weight"].shape == (6, 3, 3, 3, 6)
    assert state[block + "attn.rope.inv_freq"].shape == (1,)  # heads of 6: 3 axes x 1 rotation pair
    assert f"{block}ls1.0.gamma" in state and "student.backbone.embedding.mask_token" in state
    assert any(not torch.equal(state[k], state["teacher" + k[len("student"):]])
               for k in state if k.startswith("student.backbone."))
    return (save_path / "train.log").read_text()


def steps_of(config: Path) -> int:
    # panda: 4 events in batches of 2, one epoch; tiny: 4 events in one batch per epoch
    return 2 if config.parent.parent == PANDA.parent else Config.fromfile(config).epoch


def pending(config: Path):
    needs = NEEDS[config]
    if not needs:
        return config
    issues = sorted({PENDING[h] for h in needs})
    reason = f"needs upstream's {', '.join(needs)} (issue {', '.join(issues)})"
    return pytest.param(config, marks=pytest.mark.xfail(strict=True, raises=PendingNameMissing, reason=reason))


class PendingNameMissing(Exception):
    """The run stopped at a hook or transform of ``PENDING`` (any other failure fails the test)."""


@pytest.mark.slow
@pytest.mark.parametrize("config", [pending(c) for c in NEEDS], ids=lambda c: c.stem)
def test_upstream_config_trains_unmodified(config, data_roots, tmp_path):
    save = tmp_path / "run"
    res = run_tool("train", config, *run_options(config, data_roots, save), timeout=600)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    if res.returncode == 2 and errors and any(f"'{name}'" in errors[-1] for name in NEEDS[config]):
        raise PendingNameMissing(errors[-1])
    assert res.returncode == 0, res.stderr[-3000:]
    check_trainable(config, check_run(config, save, steps_of(config)), data_roots, tmp_path)


def check_trainable(config: Path, log: str, data_roots, tmp_path) -> None:
    """lin trains its linear head alone; dec trains less than fft of the same model."""
    if config not in (LIN, DEC):
        return
    trainable = int(log.split("Model DefaultSegmentorV2: ")[1].split(" trainable")[0].replace(",", ""))
    if config == LIN:  # frozen encoder-only backbone: the linear head on 5 stages x 8 channels alone trains
        assert trainable == (5 * WIDTH) * 5 + 5
    if config == DEC:  # frozen embedding + encoder: fewer trainable than the full fine-tune of the same model
        assert trainable < int(_trainable_of(FFT, data_roots, tmp_path))


def without_pending(config: Path, directory: Path) -> Path:
    """A config that is ``config`` with only the hooks and transforms of ``PENDING`` left out."""
    cfg = Config.fromfile(config)
    left_out = {h["type"] for h in cfg.hooks if h["type"] in PENDING_HOOKS}
    hooks = [dict(h) for h in cfg.hooks if h["type"] not in PENDING_HOOKS]
    text = f"_base_ = [{str(config)!r}]\nhooks = {hooks!r}\n"
    if "hooks_override" in cfg:
        text += f"hooks_override = {({k: v for k, v in cfg.hooks_override.items() if k not in left_out})!r}\n"
    data = {}
    for split in ("train", "val", "test"):
        if split in cfg.data:
            transforms = cfg.data[split]["transform"]
            left_out |= {t["type"] for t in transforms if t["type"] in PENDING_TRANSFORMS}
            data[split] = dict(transform=[dict(t) for t in transforms if t["type"] not in PENDING_TRANSFORMS])
    if left_out & set(PENDING_TRANSFORMS):
        text += f"data = {data!r}\n"
    assert sorted(left_out) == sorted(NEEDS[config])  # nothing else is left out
    path = directory / f"{config.stem}-pending-left-out.py"
    path.write_text(text)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("config", [c for c in NEEDS if NEEDS[c]], ids=lambda c: c.stem)
def test_upstream_config_trains_with_only_the_pending_names_left_out(config, data_roots, tmp_path):
    wrapper = without_pending(config, tmp_path)
    save = tmp_path / "run"
    res = run_tool("train", wrapper, *run_options(config, data_roots, save), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    check_trainable(config, check_run(config, save, steps_of(config)), data_roots, tmp_path)


def _trainable_of(config: Path, data_roots, tmp_path) -> int:
    from pimm.engines.run.launch import load_config
    from pimm.engines.registries import MODELS

    cfg, _ = load_config(str(without_pending(config, tmp_path)),
                         run_options(config, data_roots, tmp_path / "unused"), world_size=1)
    return sum(p.numel() for p in MODELS.build(cfg.model).parameters() if p.requires_grad)


def test_checkpoint_saver_saves_at_each_mid_epoch_evaluation(tmp_path):
    """Upstream's CheckpointSaver(evaluator_every_n_steps=N): with evaluate=True,
    a checkpoint at every N-th step too (4 steps an epoch, 2 epochs)."""
    hooks = ('[dict(type="ClsEvaluator", num_classes=2, every_n_steps=3), '
             'dict(type="CheckpointSaver", evaluator_every_n_steps=3, keep_all=True)]')
    trainer = make_trainer(tmp_path / "eval", hooks)
    trainer.train()
    assert committed_steps(tmp_path / "eval" / "run") == [3, 4, 6, 8]
    trainer = make_trainer(tmp_path / "no_eval", hooks, options=["evaluate=False"])
    trainer.train()
    assert committed_steps(tmp_path / "no_eval" / "run") == [4, 8]


@pytest.mark.parametrize("config", list(NEEDS), ids=lambda c: c.stem)
def test_upstream_config_pieces_take_two_steps_in_process(config, data_roots, tmp_path):
    """The fast check (not slow): the file through pimm's config loader with
    the same options, then its model and criteria, its training data and
    transforms, its optimizer with ``param_dicts`` and its scheduler, built as
    the trainer builds them, take two optimizer steps."""
    from pimm.engines.run.launch import load_config

    cfg, _ = load_config(str(without_pending(config, tmp_path)),
                         run_options(config, data_roots, tmp_path / "run"), world_size=1)
    moved, frozen = two_steps_in_process(cfg)
    assert moved and not moved & frozen
    if config == LIN:
        assert moved == {"seg_head.weight", "seg_head.bias"}
    if config == DEC:
        assert frozen and all(n.startswith(("backbone.embedding.", "backbone.enc.")) for n in frozen)


@pytest.mark.slow
def test_upstream_crash_config_dies_after_its_checkpoint_and_resumes_to_the_same_weights(data_roots, tmp_path,
                                                                                         monkeypatch):
    """Upstream's tiny_semseg_crash.py with $PIMM_SIMULATE_CRASH_STEP: the run
    exits 137 right after step 5, before that epoch's checkpoint (one step an
    epoch), the resumed run goes on from step 4 and finishes, and its weights
    are those of the same config run without the variable."""
    options = lambda save: run_options(TINY_CRASH, data_roots, save) + ["epoch=6"]  # noqa: E731  (6 steps)
    reference = run_tool("train", TINY_CRASH, *options(tmp_path / "ref"), timeout=600)
    assert reference.returncode == 0, reference.stderr[-3000:]
    monkeypatch.setenv("PIMM_SIMULATE_CRASH_STEP", "5")
    crashed = run_tool("train", TINY_CRASH, *options(tmp_path / "run"), timeout=600)
    assert crashed.returncode == 137, crashed.stderr[-3000:]
    assert committed_steps(tmp_path / "run")[-1] == 4
    # Still set: the resumed process runs 2 steps, fewer than 5, as upstream counts them.
    resumed = run_tool("train", TINY_CRASH, *options(tmp_path / "run"), "resume=True", timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed from step000000004" in (tmp_path / "run" / "train.log").read_text()
    ref = torch.load(tmp_path / "ref" / "model" / "model_last.pth", weights_only=True)["state_dict"]
    got = torch.load(tmp_path / "run" / "model" / "model_last.pth", weights_only=True)["state_dict"]
    assert [k for k in ref if not torch.equal(ref[k], got[k])] == []


# -- upstream's panoptic detector configs (configs/panda/panseg/detector-v5-*) -------------
PANSEG = sorted((CONFIGS / "panda" / "panseg").glob("detector-v5-*.py"))


@pytest.fixture(scope="module")
def detector_roots(tmp_path_factory):
    """PILArNet-M v2 and v3 files of generated events with the detector truth."""
    roots = {}
    for revision in ("v2", "v3"):
        root = tmp_path_factory.mktemp(f"pilarnet_det_{revision}")
        events = LArTPCSynthDataset(num_events=4, seed=3, split="train", points_per_event=(1100, 1400))
        for split in ("train", "val", "test"):
            (root / split).mkdir()
            write_pilarnet_h5((events[i] for i in range(4)), root / split / "events_0000.h5", revision=revision)
        roots[revision] = root
    return roots


def detector_options(config: Path, roots: dict) -> list[str]:
    """data_root per split, and every width shrunk: 8-wide backbone stages, a
    16-wide decoder with 2 heads (upstream: 48..512 and 256 / 16)."""
    cfg = Config.fromfile(config)
    options = [f"data.{s}.data_root={roots[cfg.data[s]['revision']]}" for s in ("train", "val", "test")]
    backbone, stages = cfg.model["backbone"], len(cfg.model["backbone"]["enc_channels"])
    options += [f"model.backbone.enc_channels={[WIDTH] * stages}", f"model.backbone.enc_num_head={[2] * stages}",
                f"model.full_in_channels={WIDTH * stages}", "model.hidden_channels=16", "model.num_heads=2",
                "batch_size=2", "num_worker=0"]
    if "dec_channels" in backbone:
        dec = len(backbone["dec_channels"])
        options += [f"model.backbone.dec_channels={[WIDTH] * dec}", f"model.backbone.dec_num_head={[2] * dec}"]
    return [o.replace(" ", "") for o in options]


@pytest.mark.parametrize("config", PANSEG, ids=lambda c: c.stem)
def test_upstream_detector_config_builds_and_takes_a_step(config, detector_roots, tmp_path):
    """Every upstream detector-v5 config through pimm's config loader (every
    hook, tester and transform it names resolves), its model with the widths
    shrunk, its optimizer with ``param_dicts`` and its scheduler, and a forward
    + backward + step on its own training data pipeline over generated files."""
    from pimm.datasets import COLLATE_FNS, DATASETS
    from pimm.engines.optim import build_optimizer
    from pimm.engines.optim.scheduler import build_scheduler
    from pimm.engines.registries import HOOKS, MODELS, TESTERS
    from pimm.engines.run.launch import load_config

    cfg, _ = load_config(str(config), detector_options(config, detector_roots) + [f"save_path={tmp_path / 'r'}"],
                         world_size=1)
    assert cfg.model["type"] == "detector-v5"
    for hook in cfg.hooks:
        HOOKS.get(hook["type"])  # every hook upstream's config names is registered
    TESTERS.build(cfg.test)
    torch.manual_seed(0)
    model = MODELS.build(cfg.model).train()
    optimizer = build_optimizer(cfg.optimizer, model, cfg.param_dicts)
    scheduler = build_scheduler(cfg.scheduler, optimizer, total_steps=2)
    dataset = DATASETS.build(cfg.data["train"])
    batch = COLLATE_FNS.get("point_collate_fn")([dataset[0], dataset[1]])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = model(batch)
    assert torch.isfinite(out["loss"])
    optimizer.zero_grad()
    out["loss"].backward()
    optimizer.step()
    scheduler.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert moved and not moved & frozen
    if cfg.model["backbone"].get("freeze_encoder"):
        assert frozen and all(n.startswith("backbone.") for n in frozen)
    if "lin" in config.stem:  # lr 0 for all but the regression heads
        assert all("head_by_key" in n for n in moved), sorted(moved)
    model.eval()
    with torch.no_grad():
        fused = model.postprocess(model(batch))
    assert fused["instance_labels"].shape == (batch["coord"].shape[0],)


@pytest.mark.slow
@pytest.mark.parametrize("config", PANSEG, ids=lambda c: c.stem)
def test_upstream_detector_config_trains_through_the_command_line(config, detector_roots, tmp_path):
    """Each detector-v5 config trains through tools/train.py as upstream wrote
    it (W&B offline), only data_root, the widths and the run's size changed
    (and ``weight=None`` where it names published weights on the Hub, which
    this machine cannot reach): two steps, InstanceSegmentationEvaluator's
    metrics in metrics.jsonl, FinalEvaluator's InstanceSegTester in test_metrics.json."""
    save = tmp_path / "run"
    options = detector_options(config, detector_roots) + [f"save_path={save}", "epoch=1", "eval_epoch=1"]
    if str(Config.fromfile(config).get("weight") or "").startswith("hf://"):
        options.append("weight=None")
    res = run_tool("train", config, *options, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(line) for line in open(save / "metrics.jsonl")]
    assert len([r for r in records if "train/loss" in r]) == 2
    assert any(k.endswith("/ins_det_f1") and k.startswith("val/") for r in records for k in r)
    assert "InstanceSegmentationEvaluator" in json.loads((save / "test_metrics.json").read_text())["metrics"]
