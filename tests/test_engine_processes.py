"""The engine's seams through real processes: a requested stop is exit 0 with
a final checkpoint, two ranks reduce each metric by its op and both gather
every shared state, a stop requested on one rank is agreed by all, and a
config without ``_base_`` runs on the engine's defaults."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.run import ROOT, env, run_tool, train_losses, write_toy_config

pytestmark = pytest.mark.slow


def attempts(save_path: Path) -> list[dict]:
    return [json.loads(line) for line in (save_path / "attempts.jsonl").read_text().splitlines()]


def test_requested_stop_exits_0_with_a_final_checkpoint_and_an_attempt_record(tmp_path):
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save, "epoch = 5\nhooks = hooks + [dict(type='StopAtStep', step=13)]\n")
    result = run_tool("train", cfg)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Stopping at step 13 (StopAtStep(13))" in (save / "train.log").read_text()
    assert sorted(p.name for p in (save / "checkpoints").glob("step*"))[-1] == "step000000013-epoch0001"
    start, end = attempts(save)
    assert start["event"] == "start" and start["attempt"] == 1 and start["world_size"] == 1
    assert start["command"][-2:] == ["--config-file", str(cfg)] and start["versions"]["torch"] == torch.__version__
    assert end == {**end, "event": "end", "attempt": 1, "exit_code": 0, "exit_reason": "stopped: StopAtStep(13)"}


def test_two_ranks_reduce_by_op_gather_shared_state_and_agree_on_a_stop(tmp_path):
    save, probe = tmp_path / "run", tmp_path / "probe"
    probe.mkdir()
    cfg = write_toy_config(tmp_path, save, f"""
epoch = 3
train = dict(type="TrackingTrainer", probe_dir={str(probe)!r}, stop_check_every=4)
hooks = hooks + [dict(type="RankValues"), dict(type="StopAtStep", step=17, agreed=False)]
""")
    result = run_tool("train", cfg, num_gpus=2, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    probes = [r for r in rows if "probe/mean" in r]
    assert probes and all((r["probe/mean"], r["probe/sum"], r["probe/min"], r["probe/max"], r["probe/last"])
                          == (1.5, 3.0, 1.0, 2.0, 1.0) for r in probes)
    # A stop requested (on every rank, without agreement) at step 17 is agreed at the next check (step 20).
    assert max(r["step"] for r in probes) == 20
    assert sorted(p.name for p in (save / "checkpoints").glob("step*"))[-1] == "step000000020-epoch0001"
    # Every rank called the shared participant's state_dict at every save (rank 0 wrote it).
    calls = [(probe / f"state_dict_calls.rank{r}").read_text().split() for r in (0, 1)]
    assert calls[0] == calls[1] and len(calls[0]) >= 4


def test_config_without_base_runs_on_the_engine_defaults(tmp_path):
    save = tmp_path / "run"
    cfg = tmp_path / "minimal.py"
    cfg.write_text(f"""
custom_imports = ["tests.support.toy"]
save_path = {str(save)!r}
model = dict(type="ToyMLP")
data = dict(train=dict(type="ToyDataset", num_samples=64))
optimizer = dict(type="SGD", lr=0.1)
""")
    result = run_tool("train", cfg)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (save / "model" / "model_last.pth").is_file() and any((save / "tensorboard").iterdir())
    assert [step for step, _ in train_losses(save)] == [1, 2, 3, 4]  # epoch=1, batch_size=16
    assert sorted(p.name for p in (save / "checkpoints").glob("step*")) == ["step000000004-epoch0001"]


def test_no_hooks_at_all_warns_that_nothing_will_be_saved(tmp_path):
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save, "epoch = 1\ndefault_hooks = None\nhooks = []\n")
    result = run_tool("train", cfg)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("no hooks (default_hooks = None, hooks = []): nothing will log the training loss, evaluate or save "
            "checkpoints") in result.stderr
    assert not (save / "checkpoints").exists()
    # An empty hooks list alone keeps the runtime services: checkpoints and log lines.
    kept = tmp_path / "kept"
    result = run_tool("train", write_toy_config(tmp_path, kept, "epoch = 1\nhooks = []\n"))
    assert result.returncode == 0 and "nothing will log" not in result.stderr, result.stderr[-3000:]
    assert sorted(p.name for p in (kept / "checkpoints").glob("step*")) == ["step000000010-epoch0001"]  # 160 / 16


def test_attempt_provenance_reads_commit_dirty_flag_and_diff_hash_from_a_checkout(tmp_path):
    """attempts.jsonl's ``git`` field: the checkout's commit; ``dirty`` and a
    hash that changes with the uncommitted diff; untracked files count; None
    outside a checkout."""
    from pimm.engines.run.run_dir import _git_info

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              check=True, capture_output=True, text=True).stdout.strip()

    assert _git_info(tmp_path) is None
    git("init", "-q")
    (tmp_path / "train.py").write_text("lr = 0.1\n")
    git("add", "train.py")
    git("commit", "-qm", "first")
    clean = _git_info(tmp_path)
    assert clean == {"commit": git("rev-parse", "HEAD"), "dirty": False}
    (tmp_path / "train.py").write_text("lr = 0.2\n")
    first = _git_info(tmp_path)
    (tmp_path / "train.py").write_text("lr = 0.3\n")
    second = _git_info(tmp_path)
    assert first["dirty"] and second["dirty"] and first["commit"] == second["commit"] == clean["commit"]
    assert len(first["diff_sha256"]) == 16 and first["diff_sha256"] != second["diff_sha256"]
    git("checkout", "-q", "train.py")
    (tmp_path / "notes.py").write_text("x = 1\n")
    assert _git_info(tmp_path)["dirty"]
