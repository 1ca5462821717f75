"""FSDP2 (``parallel.strategy='fsdp'``) end to end: real ``tools/train.py``
processes on CPU (gloo), on the toy task of ``tests/test_resume.py``.

* two FSDP processes train the same model as two DDP processes, to float
  rounding (reduce-scatter and all-reduce group the sums differently);
* checkpoints hold the model and optimizer as DCP shards in ``sharded/``,
  every file in the manifest; ``model_last.pth`` is a plain whole-model file;
* SIGKILL and ``resume=True`` at the same world size is bit-identical to the
  uninterrupted run; the 2-process checkpoint resumes on 1 and on 4
  processes (DCP reshards) with the layout warning;
* ``tools/convert_checkpoint.py`` writes the gathered weights, bit for bit.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from pimm.engines.state.manager import CheckpointManager
from tests.support import forkserver
from tests.support.run import ROOT, env, final_weights, train_losses
from tests.test_resume import TOTAL_STEPS, Run, assert_clean_losses, assert_same_weights

pytestmark = pytest.mark.slow

FSDP = "parallel.strategy=fsdp"
KILL_STEP = 13  # after the commits of steps 5 and 10 (the end of epoch 1), mid-epoch 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted DDP and FSDP runs and an FSDP run SIGKILLed at step 13
    (two processes each), and a pristine copy of the killed run's directory."""
    root = tmp_path_factory.mktemp("fsdp")
    ddp = Run(root, "ddp")
    ddp.train(num_gpus=2)
    fsdp = Run(root, "fsdp")
    fsdp.train(FSDP, num_gpus=2)
    killed = Run(root, "killed")
    # Both ranks SIGKILL themselves after step 13, once step 10's checkpoint (written in
    # the background) is committed; the --num-gpus parent then exits 1.
    killed.train(FSDP, f"hooks.KillAtStep.step={KILL_STEP}", "hooks.KillAtStep.wait_for_commit=True", expect=1,
                 num_gpus=2)
    pristine = root / "killed-pristine"
    shutil.copytree(killed.save, pristine)
    return {"ddp": ddp, "fsdp": fsdp, "killed": killed, "pristine": pristine, "root": root}


def _resumed_copy(runs, name: str) -> Run:
    run = Run(runs["root"], name)
    shutil.copytree(runs["pristine"], run.save)
    return run


def test_fsdp_trains_the_same_model_as_ddp(runs):
    ddp, fsdp = runs["ddp"].save, runs["fsdp"].save
    ddp_losses, fsdp_losses = train_losses(ddp), train_losses(fsdp)
    assert [s for s, _ in fsdp_losses] == [s for s, _ in ddp_losses] and fsdp_losses[-1][0] == TOTAL_STEPS
    torch.testing.assert_close(torch.tensor([v for _, v in fsdp_losses]), torch.tensor([v for _, v in ddp_losses]),
                               atol=1e-5, rtol=0)
    a, b = final_weights(fsdp)["state_dict"], final_weights(ddp)["state_dict"]
    assert list(a) == list(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=0, msg=key)


def test_sharded_checkpoints_are_committed_with_every_shard_in_the_manifest(runs):
    newest = CheckpointManager(runs["fsdp"].save / "checkpoints").committed()[-1]
    manifest = json.loads((newest / "COMMITTED").read_text())
    assert manifest["world_size"] == 2 and manifest["sharded"] == ["model", "optimizer"]
    on_disk = {p.relative_to(newest).as_posix() for p in newest.rglob("*") if p.is_file() and p.name != "COMMITTED"}
    assert on_disk == set(manifest["files"])
    assert {"sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"} <= on_disk
    common = torch.load(newest / "common.pth", weights_only=True)
    assert "model" not in common and "optimizer" not in common  # no rank holds them whole
    weights = torch.load(runs["fsdp"].save / "model" / "model_last.pth", weights_only=True)
    assert weights["global_step"] == TOTAL_STEPS
    assert all(type(t) is torch.Tensor for t in weights["state_dict"].values())  # plain, not DTensor
    assert not list((runs["fsdp"].save / "checkpoints").glob(".tmp-*"))


def test_sigkill_then_resume_at_the_same_world_size_is_bit_identical(runs):
    killed = runs["killed"]
    assert killed.committed() == [5, 10]
    killed.train(FSDP, "resume=True", num_gpus=2)
    assert "Resumed from step000000010-epoch0001" in killed.log()
    assert_same_weights(killed, runs["fsdp"])
    assert_clean_losses(killed, runs["fsdp"])


@pytest.mark.parametrize("processes", [1, 4])
def test_a_two_process_checkpoint_resumes_on_other_process_counts(runs, processes):
    run = _resumed_copy(runs, f"resumed-on-{processes}")
    run.train(FSDP, "resume=True", num_gpus=processes)
    log = run.log()
    assert "Resumed from step000000010-epoch0001" in log
    assert re.search(rf"WARNING.*different layout \(world_size 2 -> {processes}", log), log[-2000:]
    assert final_weights(run.save)["global_step"] == TOTAL_STEPS
    manifest = json.loads((CheckpointManager(run.save / "checkpoints").committed()[-1] / "COMMITTED").read_text())
    assert manifest["world_size"] == processes
    # Same samples per step from the same restored state: close to the uninterrupted run
    # (the per-rank dropout streams differ, so not equal).
    a, b = final_weights(run.save)["state_dict"], final_weights(runs["fsdp"].save)["state_dict"]
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 0.05


def _convert(*args: str) -> subprocess.CompletedProcess:
    return forkserver.run([sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=120)


def test_convert_checkpoint_writes_the_gathered_weights(runs, tmp_path):
    fsdp = runs["fsdp"].save
    out = tmp_path / "whole.pth"
    done = _convert(str(fsdp), str(out))
    assert done.returncode == 0, done.stderr
    assert "step000000030-epoch0003" in done.stdout
    converted = torch.load(out, weights_only=True)
    gathered = final_weights(fsdp)
    assert converted["global_step"] == gathered["global_step"] == TOTAL_STEPS
    assert list(converted["state_dict"]) == list(gathered["state_dict"])
    for key, tensor in gathered["state_dict"].items():
        assert torch.equal(converted["state_dict"][key], tensor), key

    again = _convert(str(fsdp / "checkpoints" / "step000000030-epoch0003"), str(out))
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "--overwrite" in again.stderr
    older = _convert(str(fsdp / "checkpoints" / "step000000025-epoch0002"), str(out), "--overwrite")
    assert older.returncode == 0, older.stderr
    assert torch.load(out, weights_only=True)["global_step"] == 25


def test_a_checkpoint_resumes_only_under_the_strategy_that_wrote_it(runs):
    run = Run(runs["root"], "ddp-as-fsdp")
    run.copy_from(runs["ddp"])
    run.train(FSDP, "resume=True", "epoch=4", expect=2)
    assert "parallel.strategy='ddp'" in run.output.read_text()


# -- other trainers ----------------------------------------------------------------------------
RINGS = ("epoch=2", "batch_size=32", "data.train.num_events=192", "data.val.num_events=64", "model.width=8",
         "default_hooks.checkpoint.save_freq=4", "+custom_imports=['tests.support.toy']")


def _rings(save_path, *options: str, num_gpus: int = 2, expect: int = 0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "tools" / "train.py"), "--config-file", str(ROOT / "configs/rings/cls-cnn.py"),
           "--num-gpus", str(num_gpus), "--options", FSDP, f"save_path={save_path}", *RINGS, *options]
    done = forkserver.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == expect, done.stderr[-3000:]
    return done


def test_image_class_trainer_with_batchnorm_resumes_bit_identically(tmp_path):
    """The ring CNN (ImageClassTrainer, BatchNorm: buffers FSDP does not shard)
    killed after step 9 and resumed gives the uninterrupted run's weights and
    running statistics; the KillAtStep hook comes from a ``custom_imports``
    module added on the command line."""
    hooks = ("hooks=[{{'type': 'InformationWriter', 'log_frequency': 4}}, {{'type': 'ClsEvaluator', 'num_classes': 2}}, "
             "{{'type': 'KillAtStep', 'step': {}}}]")  # checkpoints: default_hooks.checkpoint (save_freq=4)
    _rings(tmp_path / "ref", hooks.format(10**9))
    _rings(tmp_path / "run", hooks.format(9), expect=1)
    _rings(tmp_path / "run", hooks.format(10**9), "resume=True")
    a, b = final_weights(tmp_path / "ref")["state_dict"], final_weights(tmp_path / "run")["state_dict"]
    assert any("running_mean" in key for key in a)
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_grpo_trainer_under_fsdp_trains_like_ddp(tmp_path):
    """GRPOTrainer: the loss module is the FSDP root, rollouts run on gathered
    parameters and the frozen reference policy stays whole on every rank."""
    options = ("data.train.num_events=64", "data.val.num_events=32", "default_hooks.checkpoint.save_freq=4")
    runs = {}
    for strategy in ("ddp", "fsdp"):
        save = tmp_path / strategy
        cmd = [sys.executable, str(ROOT / "tools" / "train.py"), "--config-file",
               str(ROOT / "configs/grpo/tracks-grpo.py"), "--num-gpus", "2", "--options",
               f"parallel.strategy={strategy}", f"save_path={save}", *options]
        done = forkserver.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[strategy] = save
    ddp, fsdp = train_losses(runs["ddp"]), train_losses(runs["fsdp"])
    assert len(fsdp) == len(ddp) > 0
    torch.testing.assert_close(torch.tensor([v for _, v in fsdp]), torch.tensor([v for _, v in ddp]), atol=1e-5,
                               rtol=0)
    a, b = final_weights(runs["fsdp"])["state_dict"], final_weights(runs["ddp"])["state_dict"]
    assert list(a) == list(b) and any(key.startswith("reference.") for key in a)
    for key in a:
        torch.testing.assert_close(a[key].float(), b[key].float(), atol=1e-5, rtol=0, msg=key)


def test_units_per_module_class_accumulation_and_clipping_behave_as_under_ddp(tmp_path):
    """Each Linear its own FSDP unit, gathered parameters kept through backward,
    two micro-batches per step (no reduction on the first) and clipping: the
    same training as DDP with the same options."""
    common = ("batch_size=8", "grad_accum_steps=2", "clip_grad=0.5", "epoch=1")
    ddp = Run(tmp_path, "ddp-accum")
    ddp.train(*common, num_gpus=2)
    fsdp = Run(tmp_path, "fsdp-accum")
    fsdp.train(FSDP, "parallel.shard_modules=['Linear']", "parallel.reshard_after_forward=False", *common, num_gpus=2)
    assert "sharded over 2 processes in 3 unit(s) (Linear and the root)" in fsdp.log()
    a, b = train_losses(fsdp.save), train_losses(ddp.save)
    assert [s for s, _ in a] == [s for s, _ in b] and a[-1][0] == 10
    torch.testing.assert_close(torch.tensor([v for _, v in a]), torch.tensor([v for _, v in b]), atol=1e-5, rtol=0)
    norms = [r["train/grad_norm"] for r in fsdp.records() if "train/grad_norm" in r]
    ddp_norms = [r["train/grad_norm"] for r in ddp.records() if "train/grad_norm" in r]
    assert len(norms) == len(ddp_norms) > 0  # the global norm over the shards, as DDP's over whole gradients
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ddp_norms), atol=1e-5, rtol=1e-5)
    wa, wb = final_weights(fsdp.save)["state_dict"], final_weights(ddp.save)["state_dict"]
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], atol=1e-5, rtol=0, msg=key)
