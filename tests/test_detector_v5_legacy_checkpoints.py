"""Checkpoints of pimm's own earlier ``detector-v5`` (before its decoder blocks
took upstream's parameter names) still load, and a run saved by it resumes:
the weights through ``load_state_dict``, ``load_weights`` (``weight=``,
``tools/test.py``) and an EMA's averaged copy, the optimizer's moments
through the resume participants, each following its parameter.

The old checkpoints are written here from the current model by the old
layout (pimm at commit fe84378): per decoder block the parameters in the
order that block registered them, ``self_attn.k`` / ``self_attn.v`` for
upstream's ``self_attn.kv``, ``cross_attn.q`` / ``k`` / ``v`` for
``q_proj`` / ``k_proj`` / ``v_proj``, and the ``anneal_factor`` buffer (1)
for ``anneal_progress``.
"""

from __future__ import annotations

import re
from copy import deepcopy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import pimm.models  # noqa: F401  (registers the models)
from pimm.engines.optim.optimizers import build_optimizer
from pimm.engines.registries import MODELS
from pimm.engines.state.participants import ModelParticipant, OptimizerParticipant
from pimm.engines.state.restore import RestoreContext
from pimm.engines.state.weights import load_weights
from tests.support.detector_reference import load_reference, run_input, upstream_state

FIXTURE = Path(__file__).parent / "fixtures" / "detector_v5" / "reference.pt.xz"
_LINEARS = ("weight", "bias")
# One decoder block's parameters in the order pimm's earlier block registered them.
OLD_BLOCK = ([f"{norm}.{p}" for norm in ("norm_kv", "norm1", "norm2", "norm3") for p in _LINEARS]
             + [f"cross_attn.{proj}.{p}" for proj in ("q", "k", "v", "proj") for p in _LINEARS]
             + [f"self_attn.{proj}.{p}" for proj in ("q", "k", "v", "proj") for p in _LINEARS]
             + [f"mlp.{fc}.{p}" for fc in ("fc1", "fc2") for p in _LINEARS]
             + ["ls1.gamma", "ls2.gamma", "ls3.gamma"]
             + [f"mask_mlp.{fc}.{p}" for fc in ("fc1", "fc2") for p in _LINEARS])
_BLOCK = re.compile(r"(decoder\.blocks\.\d+\.)(.*)")


def _old_tensors(block: str, rest: str, value: torch.Tensor) -> dict:
    """A current block tensor -> the old name(s) and tensor(s) it was."""
    if rest.startswith("self_attn.kv."):
        k, v = value.chunk(2)
        kind = rest.rsplit(".", 1)[1]
        return {f"{block}self_attn.k.{kind}": k, f"{block}self_attn.v.{kind}": v}
    if rest.startswith("cross_attn.") and "_proj." in rest:
        return {block + rest.replace("_proj.", "."): value}
    if rest == "anneal_progress":
        return {block + "anneal_factor": torch.ones(())}
    return {block + rest: value}


def old_layout(state: dict) -> dict:
    """A current v5 state dict written as pimm's earlier v5 wrote it (old
    names, each block's tensors in the old block's order)."""
    out, blocks = {}, {}
    for key, value in state.items():
        match = _BLOCK.fullmatch(key)
        if match is None:
            out[key] = value
            continue
        block = match[1]
        if block not in blocks:
            blocks[block] = {}
            out[block] = None  # the block's place in the dict
        blocks[block].update(_old_tensors(block, match[2], value))
    ordered = {}
    for key, value in out.items():
        if key in blocks:
            tensors = blocks[key]
            names = [key + rest for rest in OLD_BLOCK if key + rest in tensors] + [key + "anneal_factor"]
            assert sorted(names) == sorted(tensors), sorted(set(names) ^ set(tensors))
            ordered.update({name: tensors[name] for name in names})
        else:
            ordered[key] = value
    return ordered


@pytest.fixture(scope="module")
def reference() -> dict:
    return load_reference(FIXTURE)


def _model(reference):
    """pimm's v5 at the fixture's settings, without the point filter (pimm's
    earlier v5 had none), holding upstream's fixture weights."""
    model = MODELS.build(deepcopy(dict(reference["kwargs"], point_filter=None)))
    own = model.state_dict()
    model.load_state_dict({k: v for k, v in upstream_state(reference).items() if k in own}, strict=True)
    return model


def test_an_old_state_dict_loads_into_the_new_names_and_computes_the_same(reference, tmp_path):
    model = _model(reference).eval()
    old = old_layout(model.state_dict())
    assert "decoder.blocks.0.self_attn.k.weight" in old and "decoder.blocks.0.self_attn.kv.weight" not in old
    fresh = MODELS.build(deepcopy(dict(reference["kwargs"], point_filter=None))).eval()
    fresh.load_state_dict(old, strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key

    batch = run_input(reference, next(r for r in reference["runs"] if r["name"] == "eval"))
    with torch.no_grad():
        want = model(batch)
    torch.save({"state_dict": old, "epoch": 3}, tmp_path / "model_last.pth")  # the file tools/test.py reads
    tested = MODELS.build(deepcopy(dict(reference["kwargs"], point_filter=None))).eval()
    report = load_weights(tested, tmp_path / "model_last.pth", strict=True, allow_unexpected=False)
    assert not report["missing"] and not report["unexpected"] and not report["mismatched"]
    with torch.no_grad():
        got = tested(batch)
    assert all(torch.equal(a, b) for a, b in zip(got["pred_masks"], want["pred_masks"]))
    assert torch.equal(got["seg_logits"], want["seg_logits"])


def test_an_ema_copy_in_the_old_names_loads(reference):
    """EMAHook resumes its averaged model with a plain ``load_state_dict``
    under the ``module.`` prefix of torch's AveragedModel."""
    model = _model(reference)
    averaged = torch.optim.swa_utils.AveragedModel(model, use_buffers=True)
    saved = {k: v for k, v in averaged.state_dict().items() if not k.startswith("module.")}
    saved.update({"module." + k: v + 1.0 for k, v in old_layout(model.state_dict()).items()})
    again = torch.optim.swa_utils.AveragedModel(_model(reference), use_buffers=True)
    again.load_state_dict(saved, strict=True)
    kv = again.module.decoder.blocks[1].self_attn.kv.weight
    assert torch.equal(kv, model.decoder.blocks[1].self_attn.kv.weight + 1.0)


def _optimizer(model):
    cfg = dict(type="AdamW", lr=1e-3, weight_decay=0.01, no_weight_decay=dict(bias=True, norm=True))
    return build_optimizer(cfg, model, [dict(keyword="decoder.blocks", lr_scale=0.5)])


def _step(model, optimizer, batch) -> float:
    model.train()
    torch.manual_seed(0)
    loss = model(batch)["loss"]
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def _old_optimizer_state(model, optimizer) -> dict:
    """The optimizer's state as pimm's earlier v5 saved it: every group's
    parameters in the old model's order, a kv's moments split in k and v."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = optimizer.state_dict()
    per_name = {}
    for group, saved in zip(optimizer.param_groups, state["param_groups"]):
        for p, i in zip(group["params"], saved["params"]):
            per_name[names[id(p)]] = state["state"][i]
    old_order = list(old_layout(model.state_dict()))
    groups, per_id, next_id = [], {}, 0
    for group, saved in zip(optimizer.param_groups, state["param_groups"]):
        members = {names[id(p)] for p in group["params"]}
        old_members = {}
        for name in members:
            block = _BLOCK.fullmatch(name)
            moments = per_name[name]
            if block is None:
                old_members[name] = moments
                continue
            split = {k: _old_tensors(block[1], block[2], v) if v.dim() else None for k, v in moments.items()}
            for old_name in _old_tensors(block[1], block[2], torch.zeros(2)):
                old_members[old_name] = {k: moments[k] if split[k] is None else split[k][old_name]
                                         for k in moments}
        ids = []
        for name in (n for n in old_order if n in old_members):
            per_id[next_id] = old_members[name]
            ids.append(next_id)
            next_id += 1
        groups.append({**saved, "params": ids})
    return {"state": per_id, "param_groups": groups}


def test_a_run_saved_by_the_old_v5_resumes_with_its_optimizer_state(reference, tmp_path):
    """The model and optimizer participants take an old checkpoint: every
    weight and every Adam moment lands on its parameter (the self-attention's
    k and v moments joined like the weights), so the next step is the step
    the run would have taken."""
    batch = run_input(reference, next(r for r in reference["runs"] if r["name"] == "train"))
    model = _model(reference)
    optimizer = _optimizer(model)
    _step(model, optimizer, batch)
    torch.save({"model": old_layout(model.state_dict()), "optimizer": _old_optimizer_state(model, optimizer)},
               tmp_path / "common.pth")
    checkpoint = torch.load(tmp_path / "common.pth", weights_only=True)
    # the old optimizer state has more parameters (k and v apart), in the old block's order
    assert [len(g["params"]) for g in checkpoint["optimizer"]["param_groups"]] != \
        [len(g["params"]) for g in optimizer.state_dict()["param_groups"]]

    resumed = MODELS.build(deepcopy(dict(reference["kwargs"], point_filter=None)))
    resumed_optimizer = _optimizer(resumed)
    context = RestoreContext(SimpleNamespace(path=tmp_path / "step000000001-epoch0000"), lambda path: {})
    ModelParticipant(resumed).restore(checkpoint["model"], context)
    OptimizerParticipant(resumed_optimizer).restore(checkpoint["optimizer"], context)
    assert any("older parameter names" in note for note in context.notes)
    for key, value in model.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key
    want, got = optimizer.state_dict(), resumed_optimizer.state_dict()
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in want["param_groups"]]
    for i, moments in want["state"].items():
        for key, value in moments.items():
            assert torch.equal(got["state"][i][key], value), (i, key)

    assert _step(resumed, resumed_optimizer, batch) == _step(model, optimizer, batch)
    for key, value in model.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


def test_a_current_checkpoint_is_left_alone(reference):
    model = _model(reference)
    state = model.state_dict()
    assert model.upgrade_state_dict(dict(state)) == {}
