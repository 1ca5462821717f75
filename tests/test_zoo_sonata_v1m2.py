"""``Sonata-v1m2`` (one teacher head) computes upstream pimm's losses, loads
its checkpoints, and pre-trains on the LArTPC generator.

``tests/fixtures/sonata_v1m2/reference.pt.xz`` is upstream's own
``sonata_v1m2_uni_teacher_head.py`` with a PT-v3m2 encoder run on CPU
(``make_reference.py`` there says how): its state dict, a two-event
multi-view batch and, per run (all losses; unmask only; mask and unmask),
its losses in train mode after a seed (the patch mask and PT-v3's order
permutations are drawn in the same places in pimm).
"""

from __future__ import annotations

import io
import lzma
import math
from pathlib import Path

import pytest
import torch

import pimm
import pimm.models  # noqa: F401  (registers the models)
from pimm.engines.registries import MODELS
from pimm.engines.state.weights import load_weights
from pimm.utils.errors import ConfigError, RegistryError
from tests.support.inprocess import two_steps_in_process

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "sonata_v1m2" / "reference.pt.xz"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference() -> dict:
    return torch.load(io.BytesIO(lzma.decompress(FIXTURE.read_bytes())), weights_only=True)


def upstream_state(reference: dict, run: dict) -> dict:
    state, start = {}, 0
    for name, shape in zip(reference["param_names"], reference["param_shapes"]):
        n = math.prod(shape)
        if name not in run["unused_params"]:
            state[name] = reference["params"][start:start + n].float().view(shape).clone()
        start += n
    assert start == reference["params"].numel()
    return state


def losses(model, reference: dict, run: dict) -> dict:
    model.train()
    torch.manual_seed(run["seed"])
    out = model({k: v.clone() for k, v in reference["input"].items()})
    return {k: float(v.detach()) for k, v in out.items()}


@pytest.mark.parametrize("index", range(3))
def test_losses_match_upstream(reference, index, tmp_path):
    run = reference["runs"][index]
    model = MODELS.build(dict(reference["kwargs"], **run["overrides"]))
    ckpt = tmp_path / "upstream.pth"
    torch.save({"epoch": 1, "state_dict": {"module." + k: v for k, v in upstream_state(reference, run).items()}},
               ckpt)
    report = load_weights(model, ckpt, strict=True, allow_unexpected=False)
    assert not report["missing"] and not report["unexpected"] and not report["mismatched"]
    got = losses(model, reference, run)
    assert set(got) == set(run["losses"])  # upstream's keys: the losses that ran and "loss", no "total_loss"
    for key, expect in run["losses"].items():
        assert abs(got[key] - expect) <= TOLERANCE * max(1.0, abs(expect)), \
            f"{run['name']} {key}: {got[key]} vs {expect}"


def test_the_unmask_loss_reads_the_teachers_mask_head(reference):
    """What makes v1m2 v1m2: with a mask loss on, the student's unmask head is
    trained against the teacher's mask head. Sonata-v1m1 on the same
    weights (its teacher's own unmask head) gives another unmask loss; with
    the mask losses off both read the teacher's unmask head."""
    run = reference["runs"][0]
    v1m1 = MODELS.build(dict(reference["kwargs"], type="Sonata-v1m1"))
    v1m1.load_state_dict(upstream_state(reference, run), strict=True)
    assert abs(losses(v1m1, reference, run)["unmask_loss"] - run["losses"]["unmask_loss"]) > 0.01
    assert losses(v1m1, reference, run)["mask_loss"] == pytest.approx(run["losses"]["mask_loss"], abs=TOLERANCE)
    only = reference["runs"][1]
    v1m1 = MODELS.build(dict(reference["kwargs"], **only["overrides"], type="Sonata-v1m1"))
    v1m1.load_state_dict(upstream_state(reference, only), strict=True)
    assert losses(v1m1, reference, only)["unmask_loss"] == pytest.approx(only["losses"]["unmask_loss"],
                                                                          abs=TOLERANCE)


def test_from_pretrained_loads_an_upstream_checkpoint(reference, tmp_path):
    run = reference["runs"][0]
    ckpt = tmp_path / "model_last.pth"
    torch.save({"state_dict": upstream_state(reference, run)}, ckpt)
    model = pimm.from_pretrained(ckpt, model_config=reference["kwargs"], strict=True)
    got = losses(model, reference, run)
    assert got["loss"] == pytest.approx(run["losses"]["loss"], abs=TOLERANCE)


def test_mask_jitter_none_is_no_jitter_and_not_scheduled(reference):
    model = MODELS.build(dict(reference["kwargs"]))
    assert model.mask_jitter is None and "mask_jitter" not in model.schedules
    assert set(model.set_step(10, 100)) == {"mask_size", "mask_ratio", "teacher_temp", "momentum"}
    fixed = MODELS.build(dict(reference["kwargs"], mask_jitter=0.01))
    assert fixed.mask_jitter == 0.01 and "mask_jitter" not in fixed.schedules


@pytest.mark.parametrize("key", ["representation_fusion_channels", "mask_jitter_start"])
def test_v1m1_only_arguments_are_refused(reference, key):
    with pytest.raises((ConfigError, RegistryError), match=key) as err:
        MODELS.build(dict(reference["kwargs"], **{key: 8}))
    assert "\n" not in str(err.value)


def test_messages_name_the_variant(reference):
    with pytest.raises(ConfigError, match=r"Sonata-v1m2: head_in_channels=7 but up_cast_level=1"):
        MODELS.build(dict(reference["kwargs"], head_in_channels=7))


def test_pretraining_config_takes_two_steps(tmp_path):
    """configs/lartpc/pretrain-sonata.py with model.type=Sonata-v1m2 (its
    arguments are all v1m2's too) takes two optimizer steps."""
    from pimm.engines.run.launch import load_config

    cfg, _ = load_config(str(ROOT / "configs" / "lartpc" / "pretrain-sonata.py"),
                         ["model.type=Sonata-v1m2", f"save_path={tmp_path / 'run'}", "num_worker=0"], world_size=1)
    moved, frozen = two_steps_in_process(cfg)
    assert any(n.startswith("student.backbone.enc.") for n in moved)
    assert {"student.mask_head.mlp.0.weight", "student.unmask_head.mlp.0.weight"} <= moved
    assert all(n.startswith("teacher.") or n.endswith("original0") for n in frozen)
