"""``Volt-v1m1`` and ``Volt-v1m2`` compute upstream pimm's function, load
its checkpoints, and train on the LArTPC generator (v1m2 for segmentation,
v1m1 under Sonata).

``tests/fixtures/volt/reference.pt.xz`` is upstream's own Volt run on CPU
(``make_reference.py`` there says how): v1m1's token-resolution Point and
v1m2's per-point features for tokenizers of upstream's 5^3 patches and of
other kernel / stride pairs (overlapping, and leaving points outside every
patch), with and without the mask, ``grid_coord`` or ``coord`` +
``grid_size``. Upstream's v1m2 mixes the events of a batch (spconv's token
order), so its references hold one event each; pimm keeps events apart.
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
from pimm.utils.errors import ConfigError
from tests.support.inprocess import two_steps_in_process

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "volt" / "reference.pt.xz"
TOLERANCE = 1e-4


def load_reference() -> dict:
    return torch.load(io.BytesIO(lzma.decompress(FIXTURE.read_bytes())), weights_only=True)


@pytest.fixture(scope="module")
def reference() -> dict:
    return load_reference()


def upstream_state(spec: dict) -> dict:
    state, start = {}, 0
    for name, shape in zip(spec["param_names"], spec["param_shapes"]):
        n = math.prod(shape)
        state[name] = spec["params"][start:start + n].float().view(shape).clone()
        start += n
    assert start == spec["params"].numel()
    return state


def batch(reference: dict, run: dict) -> dict:
    data = reference["input"]
    inp = {k: data[k].clone() for k in ("feat", "grid_coord", "coord", "origin_coord", "offset", "segment")}
    if run["mask"]:
        inp["mask"] = data["mask"].clone()
    if run["input"] == "coord":  # no grid_coord: the model grids coord by grid_size
        inp.pop("grid_coord")
        inp["coord"] = data["center_coord"].clone()
        inp["grid_size"] = 0.5
    if run["event"] >= 0:
        start, end = ([0] + data["offset"].tolist())[run["event"]:run["event"] + 2]
        inp = {k: (v[start:end] if k != "offset" else torch.tensor([end - start])) if torch.is_tensor(v) else v
               for k, v in inp.items()}
    return inp


def cases() -> list:
    return [pytest.param(name, i, id=f"{name}-{run['name']}") for name, spec in load_reference()["models"].items()
            for i, run in enumerate(spec["runs"])]


@pytest.mark.parametrize("model_name,index", cases())
def test_outputs_match_upstream(reference, model_name, index, tmp_path):
    spec = reference["models"][model_name]
    run = spec["runs"][index]
    model = MODELS.build(dict(spec["kwargs"], type=spec["type"]))
    ckpt = tmp_path / "upstream.pth"
    torch.save({"epoch": 1, "state_dict": {"module." + k: v for k, v in upstream_state(spec).items()}}, ckpt)
    report = load_weights(model, ckpt, strict=True, allow_unexpected=False)
    assert not report["missing"] and not report["unexpected"] and not report["mismatched"]
    with torch.no_grad():
        out = model.eval()(batch(reference, run))
    assert set(run["output"]) <= set(out)
    for key, expect in run["output"].items():
        got = out[key] if torch.is_tensor(out[key]) else torch.tensor(float(out[key]))
        assert got.shape == expect.shape, key
        if expect.is_floating_point():
            diff = (got - expect).abs().max().item()
            assert diff <= TOLERANCE, f"{model_name} {run['name']} {key}: max diff {diff:.3g}"
        else:
            assert torch.equal(got.long(), expect.long()), key


def test_fixture_covers_the_options(reference):
    seen = set()
    for spec in reference["models"].values():
        kw = spec["kwargs"]
        seen.add((spec["type"], kw.get("kernel_size", 5) - kw.get("stride", 5)))
        for option in ("mask_token", "qk_norm", "init_values"):
            seen.add((spec["type"], option, bool(kw.get(option, option != "init_values"))))
        seen |= {(spec["type"], "mask-run") for r in spec["runs"] if r["mask"]}
        seen |= {(spec["type"], "coord-run") for r in spec["runs"] if r["input"] == "coord"}
    for kind in ("Volt-v1m1", "Volt-v1m2"):
        assert {(kind, 0), (kind, 1), (kind, "mask-run"), (kind, "coord-run")} <= seen
        for option in ("mask_token", "qk_norm", "init_values"):
            assert {(kind, option, True), (kind, option, False)} <= seen
    assert ("Volt-v1m2", -1) in seen  # kernel < stride: points outside every patch


def test_from_pretrained_loads_an_upstream_checkpoint(reference, tmp_path):
    spec = reference["models"]["v1m2_patch5"]
    run = spec["runs"][0]
    ckpt = tmp_path / "model_last.pth"
    torch.save({"state_dict": upstream_state(spec)}, ckpt)
    model = pimm.from_pretrained(ckpt, model_config=dict(spec["kwargs"], type=spec["type"]), strict=True)
    with torch.no_grad():
        feat = model(batch(reference, run))["feat"]
    assert (feat - run["output"]["feat"]).abs().max() <= TOLERANCE


def test_v1m2_keeps_events_apart(reference):
    """Two events in one batch give each event's own output (upstream's
    v1m2 would attend across them: docs/models.md)."""
    spec = reference["models"]["v1m2_patch5"]
    model = MODELS.build(dict(spec["kwargs"], type=spec["type"])).eval()
    model.load_state_dict(upstream_state(spec))
    whole = dict(mask=False, input="grid_coord", event=-1)
    with torch.no_grad():
        both = model(batch(reference, whole))["feat"]
        apart = [model(batch(reference, dict(whole, event=e)))["feat"] for e in (0, 1)]
    assert torch.allclose(both, torch.cat(apart), atol=1e-5)


def test_segmentor_widths(reference):
    """DefaultSegmentorV2 over v1m1 concatenates the input features and the
    point's token (upstream's pooling chain), over v1m2 reads the decoder."""
    data = batch(reference, dict(mask=False, input="grid_coord", event=-1))
    for name, width in (("v1m1_patch5", 4 + 12), ("v1m2_patch5", 3)):
        spec = reference["models"][name]
        model = MODELS.build(dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=width,
                                  backbone=dict(spec["kwargs"], type=spec["type"])))
        out = model({k: v.clone() for k, v in data.items()})
        assert out["seg_logits"].shape == (data["feat"].shape[0], 5) and torch.isfinite(out["loss"])
        with pytest.raises(ConfigError, match=f"outputs {width} channels"):
            MODELS.build(dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=width + 1,
                              backbone=dict(spec["kwargs"], type=spec["type"])))


@pytest.mark.parametrize("kind,overrides,message", [
    ("Volt-v1m1", dict(rope_freq_split=(3, 3, 1)), "rope_freq_split"),
    ("Volt-v1m2", dict(embed_dim=12, num_heads=5), "num_heads"),
    ("Volt-v1m1", dict(kernel_size=2, stride=3), "kernel_size=2 < stride=3"),
])
def test_bad_arguments_are_one_line(kind, overrides, message):
    kwargs = dict(in_channels=4, stem_channels=2, embed_dim=12, depth=1, num_heads=1, rope_freq_split=(3, 2, 1))
    with pytest.raises(ConfigError, match=message) as err:
        MODELS.build(dict(kwargs, **overrides, type=kind))
    assert "\n" not in str(err.value)


def test_tokens_beyond_the_rope_table_are_one_line(reference):
    spec = reference["models"]["v1m1_patch5"]
    model = MODELS.build(dict(spec["kwargs"], rope_max_grid_size=(1024, 3, 1024), type=spec["type"]))
    with pytest.raises(ConfigError, match=r"token sits at y=\d+, beyond rope_max_grid_size=\[1024, 3, 1024\]"):
        model(batch(reference, spec["runs"][0]))


VOLT_V1M2 = ("model.backbone=dict(type='Volt-v1m2',in_channels=4,stem_channels=16,embed_dim=96,depth=4,"
             "num_heads=4,rope_freq_split=(4,4,4),decoder_dim=32,drop_path=0.0)")
VOLT_V1M1 = ("model.backbone=dict(type='Volt-v1m1',in_channels=4,stem_channels=16,embed_dim=48,depth=2,"
             "num_heads=2,rope_freq_split=(4,4,4),drop_path=0.1)")


def test_docs_options_lines_train_on_the_lartpc_generator(tmp_path):
    """docs/models.md's Volt lines: v1m2 under configs/lartpc/semseg-ptv3.py,
    v1m1 as Sonata-v1m2's encoder under configs/lartpc/pretrain-sonata.py,
    each two optimizer steps."""
    from pimm.engines.run.launch import load_config

    docs = "".join((ROOT / "docs" / "models.md").read_text().split()).replace("\\", "").replace('"', "")
    semseg = [VOLT_V1M2, "model.backbone_out_channels=32"]
    pretrain = ["model.type=Sonata-v1m2", VOLT_V1M1, "model.up_cast_level=0", "model.head_in_channels=48",
                "param_dicts=None", "scheduler.max_lr=0.0015"]
    for config, options in (("semseg-ptv3.py", semseg), ("pretrain-sonata.py", pretrain)):
        assert " ".join(options).replace(" ", "") in docs
        extra = ["scheduler.warmup_steps=1"] if config == "semseg-ptv3.py" else []
        cfg, _ = load_config(str(ROOT / "configs" / "lartpc" / config),
                             options + extra + [f"save_path={tmp_path / config}", "num_worker=0"], world_size=1)
        moved, frozen = two_steps_in_process(cfg)
        assert moved and not moved & frozen
        backbone = "student.backbone." if config == "pretrain-sonata.py" else "backbone."
        assert {backbone + "tokenizer" + (".conv" if VOLT_V1M2 in options else "") + ".weight",
                backbone + "blocks.1.attn.qkv.weight"} <= moved


def test_a_config_whose_rope_does_not_fit_the_heads_is_refused(tmp_path):
    """Upstream's default rope_freq_split (11, 11, 10) fits heads of 64
    channels: at 96 / 4 it is one line on the resolved config."""
    from pimm.engines.run.launch import load_config

    with pytest.raises(ConfigError, match=r"model\.backbone\.rope_freq_split=\(11, 11, 10\) is invalid"):
        load_config(str(ROOT / "configs" / "lartpc" / "semseg-ptv3.py"),
                    ["model.backbone=dict(type='Volt-v1m2',in_channels=4,embed_dim=96,num_heads=4)",
                     f"save_path={tmp_path / 'run'}"], world_size=1)
    assert not (tmp_path / "run").exists()


def test_the_model_zoo_bench_has_litept_and_volt_rows(capsys):
    """``bench/model_zoo.py`` names the docs' LitePT and Volt lines, and a
    Volt-v1m1 (a token-resolution output) trains there per point (tiny
    widths, one event; no timing asserted)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("model_zoo", ROOT / "bench" / "model_zoo.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for name in ("LitePT", "Volt-v1m2", "Volt-v1m1"):
        assert bench.parse_spec(name)[1]["type"] == name
    volt = "dict(type='Volt-v1m1', in_channels=1, stem_channels=2, embed_dim=6, depth=1, num_heads=1, " \
           "rope_freq_split=(1, 1, 1))"
    bench.main(["--models", f"volt={volt}", "--rounds", "1", "--batches", "1", "--events", "1"])
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("volt=")
