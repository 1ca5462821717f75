"""PT-v3m1 / PT-v3m2 / PT-v3m8 compute upstream pimm's function.

The fixtures in ``tests/fixtures/ptv3/`` are upstream's own PT-v3 run on CPU
(``make_reference.py`` there says how, and which upstream commit): for each
architecture, upstream's state dict and, per run (orders, flash or not,
eval or train, options), the segmentor's logits on one two-cloud input.
Each test writes the weights the way upstream saves a checkpoint
(``{"state_dict": {"module." + name: tensor}}``), loads them through pimm's
documented path (:func:`pimm.engines.state.weights.load_weights`, strict,
every tensor used: what ``weight=`` with ``CheckpointLoader(strict=True)``
does) into pimm's model built from the same kwargs, and compares logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import pimm.models  # noqa: F401  (registers the models)
from pimm.engines.registries import MODELS
from pimm.engines.state.weights import load_weights

FIXTURES = Path(__file__).parent / "fixtures" / "ptv3"
TOLERANCE = 1e-4


def _load(name: str) -> dict:
    return torch.load(FIXTURES / f"{name}.pt", weights_only=True)


def _cases() -> list:
    cases = []
    for path in sorted(FIXTURES.glob("*.pt")):
        if path.stem == "input":
            continue
        for i, run in enumerate(_load(path.stem)["runs"]):
            cases.append(pytest.param(path.stem, i, id=f"{path.stem}-{run['name']}"))
    return cases


def _upstream_checkpoint(arch: dict, path: Path) -> None:
    state, start = {}, 0
    for name, shape in zip(arch["param_names"], arch["param_shapes"]):
        n = int(torch.Size(shape).numel())
        state["module." + name] = arch["params"][start:start + n].float().view(shape).clone()
        start += n
    assert start == arch["params"].numel()
    torch.save({"epoch": 1, "state_dict": state}, path)


def _segmentor(arch: dict, overrides: dict):
    backbone = dict(arch["kwargs"], **overrides, type=arch["type"])
    return MODELS.build(dict(type="DefaultSegmentorV2", num_classes=arch["num_classes"],
                             backbone_out_channels=arch["backbone_out_channels"], backbone=backbone))


def _input(arch: dict, run: dict) -> dict:
    data = _load("input")
    inp = {k: data[k].clone() for k in ("feat", "grid_coord", "coord", "offset")}
    if arch["input_mask"]:
        inp["mask"] = data["mask"].clone()
    if run["input"] == "coord":  # no grid_coord: the model voxelizes coord by grid_size
        inp.pop("grid_coord")
        inp["coord"] = data["center_coord"].clone()
        inp["grid_size"] = 0.5
    return inp


@pytest.mark.parametrize("arch_name,index", _cases())
def test_logits_match_upstream(arch_name, index, tmp_path):
    arch = _load(arch_name)
    run = arch["runs"][index]
    model = _segmentor(arch, run["overrides"])
    ckpt = tmp_path / "upstream.pth"
    _upstream_checkpoint(arch, ckpt)
    report = load_weights(model, ckpt, strict=True, allow_unexpected=False)
    assert not report["missing"] and not report["unexpected"] and not report["mismatched"]
    model.train(run["mode"] == "train")
    torch.manual_seed(run["seed"])  # train mode: the order permutations upstream drew after this seed
    with torch.no_grad():
        logits = model(_input(arch, run))["seg_logits"]
    expect = arch["logits"][index]
    assert logits.shape == expect.shape
    diff = (logits - expect).abs().max().item()
    assert diff <= TOLERANCE, f"{arch_name} {run['name']}: max |logit diff| {diff:.3g} (scale {expect.abs().max():.2f})"


def test_fixtures_cover_the_matrix():
    """3 order sets x flash on/off x 2 depths for both variants, train and
    eval, an encoder-only model, and the options upstream's configs use."""
    seen = {}
    for path in FIXTURES.glob("*.pt"):
        if path.stem == "input":
            continue
        arch = _load(path.stem)
        for run in arch["runs"]:
            kw = dict(arch["kwargs"], **run["overrides"])
            key = (arch["type"], len(kw["enc_depths"]))
            seen.setdefault(key, set()).add((tuple(kw["order"]), kw["enable_flash"], run["mode"]))
            for option in ("enc_mode", "cls_mode", "mask_token", "traceable", "layer_scale", "enable_rpe",
                           "cpe_first_layer_only", "cpe_shared_weight", "shuffle_orders", "qk_norm", "rope_jitter",
                           "rope_rescale"):
                if kw.get(option):
                    seen.setdefault(option, set()).add(arch["type"])
    # PT-v3m8 (issue 34, within the suite's 1 MB of fixtures): the matrix at 2 stages, its options at 3;
    # RPE beside RoPE, post-norm and the first-layer-only CPE are tested directly (test_ptv3m8).
    for variant, stages in (("PT-v3m1", 2), ("PT-v3m1", 3), ("PT-v3m2", 2), ("PT-v3m2", 3), ("PT-v3m8", 2)):
        combos = seen[(variant, stages)]
        assert len({o for o, _, m in combos if m == "eval"}) >= 3
        assert {f for _, f, _ in combos} == {True, False}
        assert {m for _, _, m in combos} == {"eval", "train"}
    assert seen["enc_mode"] == {"PT-v3m2", "PT-v3m8"} and seen["cls_mode"] == {"PT-v3m1"}
    for option in ("mask_token", "traceable", "layer_scale", "cpe_first_layer_only", "cpe_shared_weight"):
        assert "PT-v3m2" in seen[option]
    for option in ("mask_token", "traceable", "layer_scale", "enc_mode", "qk_norm", "rope_jitter", "rope_rescale"):
        assert "PT-v3m8" in seen[option]
    assert ("PT-v3m8", 3) in seen
    assert seen["enable_rpe"] == {"PT-v3m1", "PT-v3m2"}
    assert seen["shuffle_orders"] == {"PT-v3m1", "PT-v3m2", "PT-v3m8"}
    # PT-v3m8's bottleneck CPE narrower than, as wide as and wider than the stage
    widths = set()
    for path in FIXTURES.glob("m8_*.pt"):
        kw = _load(path.stem)["kwargs"]
        widths |= {(c > w) - (c < w) for c, w in zip(kw["enc_cpe_channels"], kw["enc_channels"])}
    assert widths == {-1, 0, 1}


def test_rope_frequencies_are_upstreams():
    """The RoPE frequencies are a saved buffer (``attn.rope.inv_freq``), so
    the logits above use upstream's; pimm's own, computed from ``rope_base``
    and the head width, must be the same (to the file's float16 storage)."""
    checked = 0
    for path in FIXTURES.glob("m8_*.pt"):
        arch = _load(path.stem)
        model = _segmentor(arch, {})
        stored, start = {}, 0
        for name, shape in zip(arch["param_names"], arch["param_shapes"]):
            n = int(torch.Size(shape).numel())
            stored[name] = arch["params"][start:start + n].float().view(shape)
            start += n
        for name, value in model.state_dict().items():
            if name.endswith("rope.inv_freq"):
                torch.testing.assert_close(value, stored[name], rtol=1e-3, atol=0)
                checked += 1
    assert checked >= 6  # the blocks of m8_shallow and m8_options


#: The suite's budget for committed reference fixtures, all folders together.
FIXTURE_BUDGET_BYTES = 2_000_000


def fixture_bytes(root: Path) -> list[Path]:
    """The fixture data files under ``root``: not the scripts that regenerate
    them (code) and not the bytecode that importing a script leaves in a
    ``__pycache__`` folder (made by whichever test ran first, never committed)."""
    return [p for p in root.rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]


def test_fixtures_stay_small():
    """Every reference fixture of the suite (tests/fixtures, all folders) stays
    within the 2 MB budget in all."""
    data = fixture_bytes(FIXTURES.parent)
    assert sum(p.stat().st_size for p in data) <= FIXTURE_BUDGET_BYTES, \
        sorted((p.stat().st_size, p.name) for p in data)[-5:]


def test_fixture_count_ignores_bytecode_left_by_other_tests(tmp_path):
    """The count does not depend on test order: bytecode that another test
    leaves beside a make_reference script is not a fixture."""
    (tmp_path / "m" / "__pycache__").mkdir(parents=True)
    (tmp_path / "m" / "ref.pt").write_bytes(b"x" * 10)
    (tmp_path / "m" / "make_reference.py").write_text("pass\n")
    (tmp_path / "m" / "__pycache__" / "make_reference.cpython-311.pyc").write_bytes(b"y" * 999)
    (tmp_path / "m" / "__pycache__" / "stray.opt-1.pyc.tmp").write_bytes(b"z" * 999)
    assert [p.name for p in fixture_bytes(tmp_path)] == ["ref.pt"]


def test_whole_event_attention_is_one_patch_per_event():
    """``patch_size=-1`` (flash) equals patches longer than every event: each
    event attends over itself, and the output lands on its own points (no
    fixture: upstream's m2 leaves this path's output in curve order, see
    docs/models/ptv3.md)."""
    arch = _load("m2_shallow")
    run = {"input": "grid_coord"}
    logits = []
    for sizes in (dict(enc_patch_size=(-1, -1), dec_patch_size=(-1,)),
                  dict(enc_patch_size=(1024, 1024), dec_patch_size=(1024,))):
        model = _segmentor(arch, dict(order=["z", "hilbert"], enable_flash=True, upcast_attention=False,
                                      upcast_softmax=False, **sizes)).eval()
        torch.manual_seed(0)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.3)
        with torch.no_grad():
            logits.append(model(_input(arch, run))["seg_logits"])
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)
