"""A checkpoint is data, never code (issue 32): every file pimm reads back
loads as data, and a folder whose ``common.pth`` or rank state carries a
pickled payload (with its COMMITTED manifest updated to match, as anyone who
can write the folder can do) is refused in one line, exit 2, with the payload
never run: for ``resume=True``, a fork (``resume="<folder>"``),
``tools/convert_checkpoint.py`` and ``weight=``. ``trust_checkpoint_code`` is
the opt-in for checkpoints written before states were plain.

The payload's ``__reduce__`` opens a marker file for writing: if anything
unpickles it, the marker exists.
"""

from __future__ import annotations

import fractions
import io
import json
import pickle
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from pimm.engines import HOOKS as HOOK_REGISTRY, HookBase
from pimm.engines.state.manager import CheckpointManager
from pimm.engines.state.safe_load import UnsafeCheckpointError, read_dcp_metadata, safe_load_planner
from pimm.utils.errors import CheckpointError
from tests.support import forkserver
from tests.support import inprocess
from tests.support.inprocess import committed_steps
from tests.support.run import ROOT, env, final_weights, non_log_lines, run_tool, write_toy_config

HOOKS = '[dict(type="InformationWriter", log_frequency=1), dict(type="CheckpointSaver", save_freq=2, keep="all")]'


class Payload:
    """Unpickling it creates ``marker`` (a stand-in for any code an attacker picks)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _sign(folder: Path, name: str) -> None:
    """Update the manifest entry of ``folder/name`` to the file as it is now (size, CRC-32)."""
    manifest = json.loads((folder / "COMMITTED").read_text())
    data = (folder / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "crc32": zlib.crc32(data)}
    (folder / "COMMITTED").write_text(json.dumps(manifest))
    assert CheckpointManager(folder.parent).verify(folder) == "ok"  # the folder passes every integrity check


def poison(folder: Path, name: str, marker: Path) -> None:
    """Put a payload into ``folder/name`` next to its real state and re-sign the manifest."""
    state = torch.load(folder / name, weights_only=True)
    state["extra"] = Payload(marker)
    torch.save(state, folder / name)
    _sign(folder, name)


def folder(save_path: Path, step: int) -> Path:
    (found,) = [p for p in (save_path / "checkpoints").iterdir() if p.name.startswith(f"step{step:09d}-")]
    return found


def one_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    lines = non_log_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-epoch (8-step) toy run with a checkpoint every 2 steps, all kept."""
    root = tmp_path_factory.mktemp("finished")
    inprocess.make_trainer(root, HOOKS, epoch=2).train()
    return root / "run"


@HOOK_REGISTRY.register_module(force=True)
class ObjectStateHook(HookBase):
    """A user's hook whose state holds an object that is not data (NumPy values
    and deques are kept as data: tests/test_hardening_r6_records.py)."""

    def state_dict(self) -> dict:
        return {"best": fractions.Fraction(1, 2)}


def copy_run(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


# -- what pimm writes is plain ----------------------------------------------------------------------
def test_every_saved_state_loads_as_plain_data(finished):
    """No allowlist needed: the checkpoint's files load with plain weights_only."""
    newest = folder(finished, 8)
    common = torch.load(newest / "common.pth", weights_only=True)
    rank = torch.load(newest / "rank00000.pth", weights_only=True)
    assert {"model", "optimizer", "scheduler", "train_state"} <= set(common)
    rng = rank["rng"]
    assert isinstance(rng["python"]["words"], torch.Tensor) and isinstance(rng["numpy"]["key"], torch.Tensor)


def test_no_full_unpickling_outside_the_opt_in():
    """``weights_only=False`` appears once in pimm and tools: the trust_checkpoint_code branch."""
    hits = []
    for path in [*(ROOT / "pimm").rglob("*.py"), *(ROOT / "tools").rglob("*.py")]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"weights_only\s*=\s*False", line):
                hits.append(f"{path.relative_to(ROOT)}:{number}")
    assert hits == [next(h for h in hits if h.startswith("pimm/engines/state/safe_load.py"))], hits


# -- resume=True --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["common.pth", "rank00000.pth"])
def test_resume_refuses_a_poisoned_newest_checkpoint_and_runs_nothing(tmp_path, finished, name):
    run = copy_run(finished, tmp_path)
    marker = tmp_path / "marker"
    poison(folder(run, 8), name, marker)
    config = write_toy_config(tmp_path, run, inprocess.SMALL.format(epoch=3) + f"hooks = {HOOKS}\n")
    line = one_error(run_tool("train", config, "resume=True"))
    assert not marker.exists()
    assert f"{name} refused: it refers to io.open" in line and "step000000008" in line
    assert f"resume='{folder(run, 6)}'" in line  # says how to continue from the one before
    assert committed_steps(run) == [2, 4, 6, 8]  # nothing moved, nothing deleted


def test_the_runs_older_checkpoint_stays_usable(tmp_path, finished):
    """Continuing from the previous checkpoint sets the refused one aside and is exact."""
    run = copy_run(finished, tmp_path)
    marker = tmp_path / "marker"
    poisoned = folder(run, 8)
    poison(poisoned, "common.pth", marker)
    with pytest.raises(CheckpointError):
        inprocess.make_trainer(tmp_path, HOOKS, epoch=2, options=["resume=True"]).train()
    previous = folder(run, 6)
    inprocess.make_trainer(tmp_path, HOOKS, epoch=2, options=[f"resume={previous}"]).train()
    assert not marker.exists()
    assert (run / "checkpoints" / f"superseded-{previous.name}" / poisoned.name).is_dir()
    mine, theirs = final_weights(run), final_weights(finished)
    assert all(torch.equal(mine["state_dict"][k], theirs["state_dict"][k]) for k in theirs["state_dict"])


@pytest.mark.slow  # two-rank training, then a two-rank resume
def test_a_poisoned_rank_state_of_another_rank_stops_every_rank(tmp_path):
    """Two processes: rank 1's own file carries the payload; every rank stops, the line names that file."""
    config = write_toy_config(tmp_path, tmp_path / "run", inprocess.SMALL.format(epoch=1) + f"hooks = {HOOKS}\n")
    assert run_tool("train", config, num_gpus=2).returncode == 0
    marker = tmp_path / "marker"
    poison(folder(tmp_path / "run", 4), "rank00001.pth", marker)
    line = one_error(run_tool("train", config, "resume=True", "epoch=2", num_gpus=2))
    assert not marker.exists()
    assert "rank00001.pth refused: it refers to io.open" in line and "step000000004" in line


# -- a fork, convert, weight= ------------------------------------------------------------------------
def test_a_fork_of_a_poisoned_checkpoint_is_refused(tmp_path, finished):
    other = copy_run(finished, tmp_path / "other")
    marker = tmp_path / "marker"
    chosen = folder(other, 6)
    poison(chosen, "common.pth", marker)
    config = write_toy_config(tmp_path, tmp_path / "fork", inprocess.SMALL.format(epoch=2) + f"hooks = {HOOKS}\n")
    line = one_error(run_tool("train", config, f"resume={chosen}"))
    assert not marker.exists()
    assert "common.pth refused: it refers to io.open" in line and "never code" in line
    assert not (tmp_path / "fork" / "checkpoints").exists()


def test_convert_refuses_a_poisoned_checkpoint(tmp_path, finished):
    run = copy_run(finished, tmp_path)
    marker = tmp_path / "marker"
    poison(folder(run, 8), "common.pth", marker)
    out = tmp_path / "weights.pth"
    result = forkserver.run([sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), str(run), str(out)],
                            capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300)
    line = one_error(result)
    assert "common.pth refused: it refers to io.open" in line and "--trust-checkpoint-code" in line
    assert not marker.exists() and not out.exists()


def test_weight_refuses_a_poisoned_model_file(tmp_path, finished):
    marker = tmp_path / "marker"
    weights = torch.load(finished / "model" / "model_last.pth", weights_only=True)
    weights["extra"] = Payload(marker)
    torch.save(weights, tmp_path / "poisoned.pth")
    config = write_toy_config(tmp_path, tmp_path / "run", inprocess.SMALL.format(epoch=1) + f"hooks = {HOOKS}\n")
    line = one_error(run_tool("train", config, f"weight={tmp_path / 'poisoned.pth'}"))
    assert not marker.exists()
    assert "poisoned.pth' refused: it refers to io.open" in line


# -- FSDP's sharded/ folder ---------------------------------------------------------------------------
def _sharded_folder(tmp_path: Path) -> Path:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.arange(4.0)}, "optimizer": {"lr": 0.5}},
                 storage_writer=dcp.FileSystemWriter(str(tmp_path / "sharded")))
    return tmp_path / "sharded"


def test_dcp_metadata_is_read_as_data(tmp_path):
    folder_ = _sharded_folder(tmp_path)
    metadata = read_dcp_metadata(folder_)
    assert "model.w" in metadata.state_dict_metadata
    # The same metadata with a payload in it.
    marker = tmp_path / "marker"
    metadata.storage_meta.modules = [Payload(marker)]
    (folder_ / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match="refers to io.open"):
        read_dcp_metadata(folder_)
    assert not marker.exists()


def test_convert_refuses_poisoned_sharded_metadata(tmp_path):
    """An FSDP-style checkpoint (sharded/ only): converts as data; with a payload in .metadata, refused."""
    checkpoint = tmp_path / "checkpoints" / "step000000001-epoch0001"
    checkpoint.mkdir(parents=True)
    _sharded_folder(checkpoint)
    files = {p.relative_to(checkpoint).as_posix(): {"size": p.stat().st_size, "crc32": zlib.crc32(p.read_bytes())}
             for p in (checkpoint / "sharded").iterdir()}
    (checkpoint / "COMMITTED").write_text(json.dumps({"global_step": 1, "epoch": 1, "world_size": 1,
                                                      "sharded": ["model", "optimizer"], "files": files}))

    def convert(out: Path) -> subprocess.CompletedProcess:
        return forkserver.run([sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), str(checkpoint),
                               str(out)], capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300)

    done = convert(tmp_path / "plain.pth")
    assert done.returncode == 0, done.stderr
    assert torch.equal(torch.load(tmp_path / "plain.pth", weights_only=True)["state_dict"]["w"], torch.arange(4.0))
    marker = tmp_path / "marker"
    metadata = read_dcp_metadata(checkpoint / "sharded")
    metadata.storage_meta.modules = [Payload(marker)]
    (checkpoint / "sharded" / ".metadata").write_bytes(pickle.dumps(metadata))
    _sign(checkpoint, "sharded/.metadata")
    line = one_error(convert(tmp_path / "poisoned.pth"))
    assert ".metadata refused: it refers to io.open" in line
    assert not marker.exists() and not (tmp_path / "poisoned.pth").exists()


def test_dcp_values_are_read_as_data(tmp_path):
    marker = tmp_path / "marker"
    blob = io.BytesIO()
    torch.save(Payload(marker), blob)
    blob.seek(0)
    item = type("Item", (), {"dest_index": type("Index", (), {"fqn": "optimizer.lr"})()})()
    with pytest.raises(UnsafeCheckpointError, match="io.open"):
        safe_load_planner().load_bytes(item, blob)
    assert not marker.exists()


# -- the opt-in for checkpoints written before states were plain ---------------------------------------
def _as_before(folder_: Path) -> None:
    """Rewrite the rank state the way pimm wrote it before: RNG states as tuples and a NumPy array."""
    state = torch.load(folder_ / "rank00000.pth", weights_only=True)
    rng = state["rng"]
    py, npy = rng["python"], rng["numpy"]
    rng["python"] = (py["version"], tuple(py["words"].tolist()), py["gauss_next"])
    rng["numpy"] = (npy["kind"], npy["key"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                    npy["cached_gaussian"])
    torch.save(state, folder_ / "rank00000.pth")
    _sign(folder_, "rank00000.pth")


def test_trust_checkpoint_code_resumes_an_old_checkpoint_exactly_with_a_warning(tmp_path, finished, caplog):
    run = copy_run(finished, tmp_path)
    for step in (2, 4, 6, 8):
        _as_before(folder(run, step))
    shutil.rmtree(folder(run, 8))
    with pytest.raises(CheckpointError, match=r"rank00000.pth refused: it refers to numpy\.\S+, .*"
                                              r"trust_checkpoint_code=True loads it"):
        inprocess.make_trainer(tmp_path, HOOKS, epoch=2, options=["resume=True"]).train()
    with caplog.at_level("WARNING", logger="pimm"):
        trainer = inprocess.make_trainer(tmp_path, HOOKS, epoch=2,
                                         options=["resume=True", "trust_checkpoint_code=True"])
        trainer.train()
    assert any("with the full unpickler" in r.getMessage() and "rank00000.pth" in r.getMessage()
               for r in caplog.records)
    mine, theirs = final_weights(run), final_weights(finished)
    assert all(torch.equal(mine["state_dict"][k], theirs["state_dict"][k]) for k in theirs["state_dict"])
    # The new checkpoint is plain again.
    torch.load(folder(run, 8) / "rank00000.pth", weights_only=True)


def test_the_runs_record_never_carries_trust(tmp_path):
    """Trusting one checkpoint is one invocation's decision: config.py and the
    run records beside it (resolved_config.json) record False."""
    from pimm.engines.run.run_dir import write_config
    from pimm.utils.config import Config

    cfg = Config(dict(save_path=str(tmp_path / "run"), seed=1, trust_checkpoint_code=True))
    path = write_config(cfg)
    assert Config.fromfile(str(path)).trust_checkpoint_code is False
    assert json.loads((path.parent / "resolved_config.json").read_text())["trust_checkpoint_code"] is False
    assert cfg.trust_checkpoint_code is True  # this invocation still trusts
    cfg.seed = 1
    write_config(cfg)  # the same run again: rewritten in place, nothing set aside
    assert sorted(p.name for p in path.parent.iterdir()) == ["config.py", "resolved_config.json", "run_metadata.json"]


def test_a_save_names_a_participant_whose_state_is_not_data(tmp_path, caplog):
    """Found at the save (a warning naming the hook), not at the resume; trust_checkpoint_code then resumes it."""
    hooks = HOOKS[:-1] + ', dict(type="ObjectStateHook")]'
    with caplog.at_level("WARNING", logger="pimm"):
        inprocess.make_trainer(tmp_path, hooks, epoch=1).train()
    warnings = [r.getMessage() for r in caplog.records if "Checkpoint participant" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once, not at every save
    assert "'hooks: ObjectStateHook' saves fractions.Fraction" in warnings[0] and "rank00000.pth" in warnings[0]
    with pytest.raises(CheckpointError, match="rank00000.pth refused: it refers to fractions"):
        inprocess.make_trainer(tmp_path, hooks, epoch=2, options=["resume=True"]).train()
    trainer = inprocess.make_trainer(tmp_path, hooks, epoch=2, options=["resume=True", "trust_checkpoint_code=True"])
    trainer.train()
    assert trainer.global_step == 8
