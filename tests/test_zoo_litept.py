"""``LitePT`` computes upstream pimm's function, loads its checkpoints, and
trains on the LArTPC generator.

``tests/fixtures/litept/reference.pt.xz`` is upstream's own LitePT run on
CPU (``make_reference.py`` there says how): three tiny architectures (the
default's conv-then-attention layout, every block kind with a decoder, an
encoder-only one) and their logits, eval and train, several serialization
orders. Each test writes upstream's state dict the way upstream saves a
checkpoint and loads it through pimm's documented paths (``weight=``'s
strict loader, ``pimm.from_pretrained``).
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
from pimm.models.litept import PointRoPE
from pimm.utils.errors import ConfigError
from tests.support.inprocess import two_steps_in_process

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "litept" / "reference.pt.xz"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference() -> dict:
    return torch.load(io.BytesIO(lzma.decompress(FIXTURE.read_bytes())), weights_only=True)


def upstream_state(arch: dict) -> dict:
    state, start = {}, 0
    for name, shape in zip(arch["param_names"], arch["param_shapes"]):
        n = math.prod(shape)
        value = arch["params"][start:start + n].float().view(shape).clone()
        state[name] = value.long() if name.endswith("num_batches_tracked") else value
        start += n
    assert start == arch["params"].numel()
    return state


def segmentor_config(arch: dict, overrides: dict) -> dict:
    return dict(type="DefaultSegmentorV2", num_classes=arch["num_classes"],
                backbone_out_channels=arch["backbone_out_channels"],
                backbone=dict(arch["kwargs"], **overrides, type="LitePT"))


def batch(reference: dict, arch: dict, run: dict) -> dict:
    data = reference["input"]
    inp = {k: data[k].clone() for k in ("feat", "grid_coord", "coord", "offset")}
    if arch["input_mask"]:
        inp["mask"] = data["mask"].clone()
    if run["input"] == "coord":  # no grid_coord: the model grids coord by grid_size
        inp.pop("grid_coord")
        inp["coord"] = data["center_coord"].clone()
        inp["grid_size"] = 0.5
    return inp


def cases() -> list:
    archs = torch.load(io.BytesIO(lzma.decompress(FIXTURE.read_bytes())), weights_only=True)["archs"]
    return [pytest.param(name, i, id=f"{name}-{run['name']}") for name, arch in archs.items()
            for i, run in enumerate(arch["runs"])]


@pytest.mark.parametrize("arch_name,index", cases())
def test_logits_match_upstream(reference, arch_name, index, tmp_path):
    arch = reference["archs"][arch_name]
    run = arch["runs"][index]
    model = MODELS.build(segmentor_config(arch, run["overrides"]))
    ckpt = tmp_path / "upstream.pth"
    torch.save({"epoch": 1, "state_dict": {"module." + k: v for k, v in upstream_state(arch).items()}}, ckpt)
    report = load_weights(model, ckpt, strict=True, allow_unexpected=False)
    assert not report["missing"] and not report["unexpected"] and not report["mismatched"]
    model.train(run["mode"] == "train")
    torch.manual_seed(run["seed"])  # train mode: the order permutations upstream drew after this seed
    with torch.no_grad():
        logits = model(batch(reference, arch, run))["seg_logits"]
    expect = arch["logits"][index]
    diff = (logits - expect).abs().max().item()
    assert diff <= TOLERANCE, f"{arch_name} {run['name']}: max |logit diff| {diff:.3g} (scale {expect.abs().max():.2f})"


def test_fixture_runs_differ_where_the_options_do(reference):
    """The fixture can tell orders, shuffling and block kinds apart (a bug in
    any of them would move the logits far beyond the tolerance)."""
    for arch in reference["archs"].values():
        logits = arch["logits"]
        for i in range(1, len(logits)):
            if arch["runs"][i]["input"] == "grid_coord":
                assert (logits[i] - logits[0]).abs().max() > 100 * TOLERANCE
    kinds = set()
    for arch in reference["archs"].values():
        kw = arch["kwargs"]
        kinds |= {("conv", c) for c in kw["enc_conv"]} | {("attn", a) for a in kw["enc_attn"]}
        kinds |= {("dec_blocks", sum(kw.get("dec_depths", [0])) > 0), ("enc_mode", kw.get("enc_mode", False))}
    assert kinds == {(k, v) for k in ("conv", "attn", "dec_blocks", "enc_mode") for v in (True, False)}


def test_from_pretrained_loads_an_upstream_checkpoint(reference, tmp_path):
    arch = reference["archs"]["all_blocks"]
    run = arch["runs"][0]
    ckpt = tmp_path / "model_best.pth"
    torch.save({"state_dict": upstream_state(arch)}, ckpt)
    model = pimm.from_pretrained(ckpt, model_config=segmentor_config(arch, {}), strict=True)
    assert not model.training
    with torch.no_grad():
        logits = model(batch(reference, arch, run))["seg_logits"]
    assert (logits - arch["logits"][0]).abs().max() <= TOLERANCE


def pointrope_cpu_loop(tokens: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """upstream's ``libs/pointrope/pointrope.cpp`` ``pointrope_cpu`` (the
    extension's CPU kernel), written out loop for loop: tokens (B, N, H, D)."""
    out = tokens.clone()
    b_, n_, h_, dim = tokens.shape
    q = dim // 6
    for b in range(b_):
        for axis in range(3):
            for n in range(n_):
                p = int(positions[b, n, axis])
                for h in range(h_):
                    for d in range(q):
                        u = float(out[b, n, h, d + axis * 2 * q])
                        v = float(out[b, n, h, d + q + axis * 2 * q])
                        angle = p / base ** (d / q)
                        out[b, n, h, d + axis * 2 * q] = u * math.cos(angle) - v * math.sin(angle)
                        out[b, n, h, d + q + axis * 2 * q] = v * math.cos(angle) + u * math.sin(angle)
    return out


@pytest.mark.parametrize("head_dim,base", [(6, 100.0), (12, 10.0), (18, 100.0)])
def test_pointrope_is_the_extensions_rotation(head_dim, base):
    """pimm's PointRoPE against the CUDA extension's CPU loop (upstream runs
    the same kernel on GPU), on integer grid positions up to 700."""
    g = torch.Generator().manual_seed(head_dim)
    tokens = torch.randn(1, 9, 2, head_dim, generator=g)
    grid = torch.randint(0, 700, (1, 9, 3), generator=g)
    expect = pointrope_cpu_loop(tokens, grid, base)
    rope = PointRoPE(head_dim, freq=base)
    q = tokens.transpose(1, 2)  # (P, H, K, D): pimm's patch layout
    got, _ = rope(q, q.clone(), grid)
    # (float32 angles of positions in the hundreds carry ~4e-5 of rounding, in the extension as here)
    assert torch.allclose(got.transpose(1, 2), expect, atol=1e-4)
    assert not torch.allclose(got.transpose(1, 2), tokens, atol=1e-2)
    assert not rope.state_dict()  # upstream's module saves nothing


def test_patch_size_minus_one_attends_over_whole_events(reference):
    """``patch_size=-1`` is whole-event attention, the same as a patch longer
    than every event (upstream's own -1 path leaves the output in curve
    order: docs/models.md)."""
    arch = reference["archs"]["default_layout"]
    data = batch(reference, arch, arch["runs"][0])
    outs = []
    for patch in ((16, -1, -1), (16, 500, 500)):
        torch.manual_seed(0)
        model = MODELS.build(segmentor_config(arch, dict(enc_patch_size=patch))).eval()
        model.load_state_dict(upstream_state(arch))
        with torch.no_grad():
            outs.append(model({k: v.clone() for k, v in data.items()})["seg_logits"])
    assert torch.allclose(outs[0], outs[1], atol=1e-5)


def test_events_do_not_see_each_other(reference):
    """An event's output does not depend on its batch-mates (eval)."""
    arch = reference["archs"]["all_blocks"]
    model = MODELS.build(segmentor_config(arch, {})).eval()
    model.load_state_dict(upstream_state(arch))
    data = batch(reference, arch, arch["runs"][0])
    with torch.no_grad():
        both = model({k: v.clone() for k, v in data.items()})["seg_logits"]
        n = int(data["offset"][0])
        first = model({k: (v[:n].clone() if k != "offset" else v[:1].clone()) for k, v in data.items()})["seg_logits"]
    assert torch.allclose(both[:n], first, atol=1e-5)


@pytest.mark.parametrize("overrides,message", [
    (dict(enc_channels=(6, 6, 8), enc_num_head=(1, 1, 2)), "needs a multiple of 6"),
    (dict(enc_attn=(False, False, True), dec_attn=(False, True)), "dec_attn"),
    (dict(enc_conv=(True, True)), "enc_conv"),
    (dict(stride=(2,)), "stride"),
])
def test_bad_arguments_are_one_line(reference, overrides, message):
    arch = reference["archs"]["all_blocks"]
    with pytest.raises(ConfigError, match=message) as err:
        MODELS.build(dict(arch["kwargs"], **overrides, type="LitePT"))
    assert "\n" not in str(err.value)


LITEPT = ("model.backbone=dict(type='LitePT',in_channels=4,stride=(2,2,2),enc_depths=(1,1,1,1),"
          "enc_channels=(18,36,72,96),enc_num_head=(1,2,4,4),enc_patch_size=(64,64,64,64),"
          "enc_conv=(True,True,False,False),enc_attn=(False,False,True,True),"
          "enc_rope_freq=(100.0,100.0,100.0,100.0),dec_depths=(0,0,0),dec_channels=(16,36,72),"
          "dec_num_head=(1,2,4),dec_patch_size=(64,64,64),dec_conv=(False,False,False),"
          "dec_attn=(False,False,False),dec_rope_freq=(100.0,100.0,100.0),mlp_ratio=2,drop_path=0.0)")


def test_docs_options_line_trains_on_the_lartpc_generator(tmp_path):
    """docs/models.md's LitePT line: configs/lartpc/semseg-ptv3.py with the
    backbone swapped takes two optimizer steps (every parameter moves)."""
    from pimm.engines.run.launch import load_config

    docs = "".join((ROOT / "docs" / "models.md").read_text().split()).replace("\\", "").replace('"', "")
    assert LITEPT in docs
    cfg, _ = load_config(str(ROOT / "configs" / "lartpc" / "semseg-ptv3.py"),
                         [LITEPT, f"save_path={tmp_path / 'run'}", "num_worker=0", "scheduler.warmup_steps=1"],
                         world_size=1)
    moved, frozen = two_steps_in_process(cfg)
    assert not frozen and any(n.startswith("backbone.enc.enc3.block0.attn.") for n in moved)
    assert {n for n in moved if n.startswith("backbone.")} >= {"backbone.embedding.stem.conv.weight",
                                                                "backbone.enc.enc0.block0.conv.0.weight"}


def test_a_config_whose_decoder_attends_where_the_encoder_does_not_is_refused(tmp_path):
    """Checked on the resolved config, before a model or run directory exists."""
    from pimm.engines.run.launch import load_config

    bad = LITEPT.replace("dec_attn=(False,False,False)", "dec_attn=(True,False,False)")
    with pytest.raises(ConfigError, match=r"model\.backbone\.dec_attn=\(True, False, False\) is invalid"):
        load_config(str(ROOT / "configs" / "lartpc" / "semseg-ptv3.py"), [bad, f"save_path={tmp_path / 'run'}"],
                    world_size=1)
    assert not (tmp_path / "run").exists()
