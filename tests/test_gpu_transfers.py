"""Transfers and process settings fit for a GPU, checked on the CPU: the
checkpoint snapshot's reusable (pinned on CUDA) buffers, the runtime keys
``matmul_precision`` / ``deterministic`` / ``empty_cache``, and pinned,
non-blocking batch copies. The CUDA side itself (pinned allocations,
asynchronous copies) runs in ``bench/gpu_check.py``."""

from __future__ import annotations

import os
from collections import OrderedDict

import pytest
import torch

from pimm.engines.hooks.memory import EmptyCache
from pimm.engines.run.runtime import apply_process_settings
from pimm.engines.state.manager import CheckpointManager
from pimm.engines.state.snapshot import SnapshotBuffers
from pimm.utils.config import Config


def _staged_on_cpu() -> SnapshotBuffers:
    """The buffer logic of a CUDA run, with CPU tensors standing in for CUDA ones."""
    return SnapshotBuffers(pin=False, stage=lambda t: True)


def _state(scale: float = 1.0) -> dict:
    weight = torch.full((4, 3), scale)
    model = OrderedDict(weight=weight, bias=torch.arange(3.0) * scale)
    model._metadata = OrderedDict({"": {"version": 1}})
    return {"model": model, "optimizer": {"state": {0: {"exp_avg": torch.ones(4, 3) * scale, "step": 7}},
                                          "param_groups": [{"lr": 0.1, "params": [0]}]}, "note": ["kept"]}


def test_snapshot_copies_are_independent_of_the_state_and_keep_its_structure():
    state = _state()
    snapshot = _staged_on_cpu().snapshot()
    frozen = snapshot.freeze(state, ("shared",))
    snapshot.finish()
    state["model"]["weight"].add_(5)  # training goes on
    state["optimizer"]["state"][0]["step"] = 8
    assert torch.equal(frozen["model"]["weight"], torch.ones(4, 3))
    assert frozen["optimizer"]["state"][0]["step"] == 7 and frozen["note"] == ["kept"]
    assert type(frozen["model"]) is OrderedDict and frozen["model"]._metadata == {"": {"version": 1}}


def test_snapshot_buffers_are_allocated_once_and_reused_while_shapes_match():
    pool = _staged_on_cpu()
    first = pool.snapshot()
    a = first.freeze(_state(1.0), ("shared",))
    first.finish()
    allocated = pool.allocations
    assert allocated == 3  # weight, bias, exp_avg
    pointers = {k: t.data_ptr() for k, t in pool.buffers.items()}
    second = pool.snapshot()
    b = second.freeze(_state(2.0), ("shared",))
    second.finish()
    assert pool.allocations == allocated  # nothing new
    assert {k: t.data_ptr() for k, t in pool.buffers.items()} == pointers
    assert b["model"]["weight"].data_ptr() == a["model"]["weight"].data_ptr()
    assert torch.equal(b["model"]["weight"], torch.full((4, 3), 2.0))

    grown = _state(3.0)
    grown["model"]["weight"] = torch.zeros(5, 3)  # a changed shape gets a new buffer; the rest are reused
    del grown["optimizer"]["state"][0]["exp_avg"]  # and a vanished tensor's buffer is let go
    third = pool.snapshot()
    c = third.freeze(grown, ("shared",))
    third.finish()
    assert pool.allocations == allocated + 1
    assert c["model"]["weight"].shape == (5, 3) and c["model"]["bias"].data_ptr() == pointers[
        ("shared", "model", "bias")]
    assert set(pool.buffers) == {("shared", "model", "weight"), ("shared", "model", "bias")}


def test_a_tensor_reached_twice_in_one_save_is_copied_once():
    weight = torch.randn(6)
    pool = _staged_on_cpu()
    snapshot = pool.snapshot()
    checkpoint = snapshot.freeze({"model": {"w": weight}}, ("shared",))
    model_file = snapshot.freeze({"state_dict": {"w": weight}}, ("after", 0))
    snapshot.finish()
    assert pool.allocations == 1 and checkpoint["model"]["w"] is model_file["state_dict"]["w"]
    assert torch.equal(model_file["state_dict"]["w"], weight)


def test_without_staging_host_tensors_are_cloned_and_no_buffer_is_kept():
    pool = SnapshotBuffers(pin=False)  # the default stage: CUDA tensors only
    snapshot = pool.snapshot()
    source = torch.ones(3)
    frozen = snapshot.freeze({"t": source}, ("rank",))
    snapshot.finish()
    assert frozen["t"].data_ptr() != source.data_ptr() and pool.allocations == 0 and pool.buffers == {}


class _Counter:
    def __init__(self):
        self.value = torch.zeros(8)

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value.copy_(state["value"])


@pytest.mark.parametrize("async_write", [False, True])
def test_checkpoints_through_reused_buffers_hold_each_saves_own_values(tmp_path, async_write):
    """A buffer is rewritten only after the previous save's write has finished."""
    manager = CheckpointManager(tmp_path / "checkpoints", async_write=async_write)
    manager.snapshot_buffers = _staged_on_cpu()
    counter = _Counter()
    manager.register("counter", counter)
    for step in (1, 2, 3):
        counter.value.fill_(step)
        manager.save(step, 0)
        counter.value.fill_(-1)  # training moves on while the write may still be in flight
    manager.wait()
    assert manager.snapshot_buffers.allocations == 1
    for step in (2, 3):  # the retention keeps the last two
        path = tmp_path / "checkpoints" / f"step{step:09d}-epoch0000"
        assert manager.verify(path) == "ok"
        saved = torch.load(path / "common.pth", weights_only=True)["counter"]["value"]
        assert torch.equal(saved, torch.full((8,), float(step)))


# -- runtime keys ------------------------------------------------------------
@pytest.fixture
def torch_settings():
    """Restore torch's process-wide settings (and CUBLAS_WORKSPACE_CONFIG) after the test."""
    saved = (torch.get_float32_matmul_precision(), torch.are_deterministic_algorithms_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
             os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    yield
    precision, algorithms, cudnn_det, benchmark, cudnn_tf32, workspace = saved
    torch.set_float32_matmul_precision(precision)
    torch.use_deterministic_algorithms(algorithms)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_det, benchmark
    torch.backends.cudnn.allow_tf32 = cudnn_tf32
    if workspace is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace


def _settings(**keys) -> Config:
    return Config(dict(dict(matmul_precision=None, deterministic=False), **keys))


def test_matmul_precision_sets_torchs_float32_matmul_precision(torch_settings):
    for value in ("high", "medium", "highest"):
        apply_process_settings(_settings(matmul_precision=value))
        assert torch.get_float32_matmul_precision() == value
    torch.set_float32_matmul_precision("high")
    apply_process_settings(_settings())  # None leaves it alone
    assert torch.get_float32_matmul_precision() == "high"


def test_deterministic_sets_algorithms_cudnn_tf32_and_the_cublas_workspace(torch_settings, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.backends.cudnn.benchmark = True
    apply_process_settings(_settings(deterministic=True, matmul_precision="high"))
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"  # no TF32, whatever matmul_precision says
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the environment's own choice is kept
    apply_process_settings(_settings(deterministic=True))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


@pytest.mark.parametrize("per_step,per_epoch,calls", [(True, False, (1, 0)), (False, True, (0, 1)),
                                                      (True, True, (1, 1))])
def test_empty_cache_empties_the_cuda_cache_at_its_moments(monkeypatch, per_step, per_epoch, calls):
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    hook = EmptyCache(per_step=per_step, per_epoch=per_epoch)
    for phase, expected in zip(("after_step", "after_epoch"), calls):
        emptied.clear()
        assert hook.overrides(phase) == bool(expected)
        if hook.overrides(phase):
            getattr(hook, phase)()
        assert len(emptied) == expected


def test_batches_are_copied_to_the_device_without_blocking(monkeypatch):
    """The trainer's copy to the device asks for non-blocking copies (from the
    loader's pinned memory on CUDA: ``pin_memory`` is on exactly there)."""
    from pimm.engines.trainers.default import DefaultTrainer

    calls = []

    class Recorder(torch.Tensor):
        def to(self, *args, **kwargs):
            calls.append(kwargs.get("non_blocking"))
            return self

    fake = type("T", (), {"device": torch.device("cuda", 0)})()
    batch = {"x": torch.ones(2).as_subclass(Recorder), "offset": torch.tensor([2]).as_subclass(Recorder), "n": 3}
    out = DefaultTrainer.to_device(fake, batch)
    assert calls == [True, True] and out["n"] == 3
