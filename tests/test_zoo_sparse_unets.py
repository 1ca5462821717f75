"""Upstream's sparse U-Nets -- ``SpUNet-v1m1/v1m2/v1m3``, ``SpUNetNoSkipBase``
and the 15 ``MinkUNet*`` -- build under upstream's names and arguments, hold
upstream's parameters, load its checkpoints strictly and compute its function.

``tests/fixtures/sparse_unets/reference.pt.xz`` (``make_reference.py`` there
says how, at which upstream commit): upstream's own code run on a CPU -- the
SpUNets on spconv's CPU path, the MinkUNets on a stand-in of MinkowskiEngine
that computes with the dense reference of ``tests/support/minkowski_dense.py``
(MinkowskiEngine does not build here) -- with tiny widths: upstream's state
dicts, eval- and train-mode outputs and the BatchNorm statistics training
leaves; and the parameter names and shapes of all 19 names at upstream's
defaults. The MinkowskiEngine semantics (kernel offsets x fastest, even
kernels from the voxel on, strides, transposed convolutions onto the finer
level's voxels) are checked here against that dense reference convolution by
convolution, and the dense reference against MinkowskiEngine's definition.
"""

from __future__ import annotations

import io
import lzma
from pathlib import Path

import pytest
import torch

import pimm
import pimm.models  # noqa: F401  (registers the models)
from pimm.engines.registries import MODELS
from pimm.engines.state.weights import load_weights
from pimm.models.point_ops import voxelize
from pimm.models.sparse_layouts import MinkowskiConv, SpconvConv
from pimm.models.sparse_maps import kernel_map_pyramid, submanifold_kernel_map
from pimm.utils.config_domains import check_config_domains
from pimm.utils.errors import ConfigError
from tests.support import minkowski_dense as dense

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "sparse_unets" / "reference.pt.xz"
SPUNETS = {"SpUNet-v1m1": "num_classes", "SpUNet-v1m2": "num_classes", "SpUNet-v1m3": "num_classes",
           "SpUNetNoSkipBase": "out_channels"}
MINKUNETS = ["MinkUNet14", "MinkUNet14A", "MinkUNet14B", "MinkUNet14C", "MinkUNet14D", "MinkUNet18", "MinkUNet18A",
             "MinkUNet18B", "MinkUNet18D", "MinkUNet34", "MinkUNet34A", "MinkUNet34B", "MinkUNet34C", "MinkUNet50",
             "MinkUNet101"]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference() -> dict:
    return torch.load(io.BytesIO(lzma.decompress(FIXTURE.read_bytes())), weights_only=True)


def _state(arch: dict) -> dict[str, torch.Tensor]:
    """Upstream's state dict of a fixture model."""
    state, start = {}, 0
    for name, shape in zip(arch["param_names"], arch["param_shapes"]):
        size = int(torch.Size(shape).numel())
        state[name] = arch["params"][start:start + size].float().reshape(shape)
        start += size
    state.update((name, torch.tensor(count)) for name, count in arch["counters"].items())
    return state


def _model_config(arch: dict) -> tuple[dict, type | None]:
    """pimm's config of a fixture model, and for a tiny MinkUNet the class
    (upstream's class attributes made small, as the fixture script does)."""
    if arch["type"] != "MinkUNet":
        return dict(type=arch["type"], **arch["kwargs"]), None
    attrs = {k: tuple(v) if isinstance(v, list) else v for k, v in arch["mink"].items() if k != "base"}
    cls = type("TinyMinkUNet", (MODELS.get(arch["mink"]["base"]),), attrs)
    return dict(type=arch["mink"]["base"], **arch["kwargs"]), cls


def _build(arch: dict) -> torch.nn.Module:
    cfg, cls = _model_config(arch)
    return MODELS.build(cfg) if cls is None else cls(**{k: v for k, v in cfg.items() if k != "type"})


def _batch(arch: dict, data: dict) -> dict:
    batch = {k: v.clone() for k, v in data.items()}
    prompt = arch["prompt"]
    if prompt:
        batch["condition"] = list(prompt["condition"])
        if "context_channels" in prompt:  # the fixture script's context
            batch["context"] = torch.randn(1, prompt["context_channels"], generator=torch.Generator().manual_seed(9))
    return batch


def _expected(arch: dict) -> list[torch.Tensor]:
    outs, start = [], 0
    for run in arch["runs"]:
        size = int(torch.Size(run["shape"]).numel())
        outs.append(arch["outs"][start:start + size].reshape(run["shape"]))
        start += size
    return outs


def _compare(model: torch.nn.Module, arch: dict, inputs: dict, state: dict) -> float:
    """Every run of a fixture model; returns the largest difference."""
    worst, trained = 0.0, 0
    for run, expected in zip(arch["runs"], _expected(arch)):
        model.load_state_dict(state, strict=True)
        model.train(run["mode"] == "train")
        with torch.no_grad():
            out = model(_batch(arch, inputs[run["input"]]))
        assert out.shape == expected.shape
        worst = max(worst, (out - expected).abs().max().item())
        if run["mode"] == "train":  # the running statistics training leaves (momentum, unbiased variance)
            now = model.state_dict()
            got = torch.cat([now[k].reshape(-1) for k in arch["running_names"]])
            worst = max(worst, (got - arch["after_train"][trained]).abs().max().item())
            trained += 1
    return worst


ARCHS = ["v1m1", "v1m1_cls", "v1m2", "noskip", "v1m3", "v1m3_plain", "mink_basic", "mink_bottleneck"]


@pytest.mark.parametrize("name", ARCHS)
def test_upstreams_state_dict_loads_strictly_and_computes_upstreams_output(reference, name):
    arch = reference["archs"][name]
    model = _build(arch)
    state = _state(arch)
    assert set(model.state_dict()) == set(state)  # upstream's names (the default-size test checks their order)
    assert _compare(model, arch, reference["inputs"], state) < TOLERANCE


def test_v1m2s_grid_drops_the_edge_voxels_as_spconv_does(reference):
    """v1m2 bounds the grid at max(grid_coord) + 1: the fixture input loses
    voxels in the strided convolutions (its script counts 14 and 10), and
    the same model bounded like v1m1 (+ 96) computes something else."""
    arch = reference["archs"]["v1m2"]
    model, state = _build(arch), _state(arch)
    model.load_state_dict(state)
    model.eval()
    batch = _batch(arch, reference["inputs"]["input"])
    with torch.no_grad():
        bounded = model(batch)
        model.extent_margin = 96
        unbounded = model(batch)
    assert torch.allclose(bounded, _expected(arch)[0], atol=TOLERANCE)
    assert (bounded - unbounded).abs().max() > 1e-2


@pytest.mark.parametrize("name", [*SPUNETS, "SpUNet-v1m1 cls_mode", *MINKUNETS])
def test_every_name_builds_with_upstreams_defaults_and_parameters(reference, name):
    """Upstream's names and shapes, read off upstream's modules at its defaults
    (6 input channels, 13 classes; MinkUNet's layers with MinkowskiEngine's
    parameter shapes)."""
    base, _, option = name.partition(" ")
    kwargs = dict(in_channels=6, **{SPUNETS.get(base, "out_channels"): 13})
    if option:
        kwargs["cls_mode"] = True
    model = MODELS.build(dict(type=base, **kwargs))
    got = "\n".join(f"{k} {','.join(map(str, v.shape))}" for k, v in model.state_dict().items())
    assert got == reference["listings"][name]


# ---------------------------------------------------------------------------------------- checkpoints


def _upstream_file(path: Path, state: dict, prefix: str) -> None:
    """A checkpoint as upstream's trainer saves it (DDP's ``module.`` prefix)."""
    torch.save({"epoch": 3, "state_dict": {f"module.{prefix}{k}": v for k, v in state.items()}}, path)


@pytest.mark.parametrize("name", ["v1m1", "v1m3", "mink_basic"])
def test_an_upstream_segmentor_checkpoint_loads_strictly_through_weight_and_from_pretrained(reference, name,
                                                                                              tmp_path, monkeypatch):
    """Upstream's DefaultSegmentor (no num_classes: the backbone's output is
    the logits) holds only ``backbone.*``: its checkpoint loads strictly into
    pimm's DefaultSegmentor through ``weight=``'s loader and
    ``pimm.from_pretrained``, and the model then computes upstream's output."""
    arch = reference["archs"][name]
    state = _state(arch)
    _upstream_file(tmp_path / "model_best.pth", state, "backbone.")
    backbone_cfg, cls = _model_config(arch)
    if cls is not None:  # a tiny MinkUNet: registered for this test only, as the segmentor's backbone
        monkeypatch.setitem(MODELS._modules, "TinyMinkUNetForTest", cls)
        backbone_cfg["type"] = "TinyMinkUNetForTest"
    segmentor = dict(type="DefaultSegmentor", backbone=backbone_cfg)
    model = MODELS.build(segmentor)
    report = load_weights(model, tmp_path / "model_best.pth", strict=True, allow_unexpected=False)
    assert report["loaded"] == len(state) and not report["missing"] and not report["unexpected"]
    loaded = pimm.from_pretrained(tmp_path / "model_best.pth", model_config=segmentor)
    data = _batch(arch, reference["inputs"]["input"])
    for m in (model.eval(), loaded):
        with torch.no_grad():
            logits = m(data)["seg_logits"]
        assert torch.allclose(logits, _expected(arch)[0], atol=TOLERANCE)


def test_default_segmentor_without_num_classes_needs_a_backbone_with_a_classifier():
    ok = dict(type="DefaultSegmentor", backbone=dict(type="MinkUNet14A", in_channels=1, out_channels=5))
    check_config_domains(dict(model=ok))
    assert [k for k in MODELS.build(ok).state_dict() if not k.startswith("backbone.")] == []
    for backbone in (dict(type="SparseUNet", in_channels=1), dict(type="SpUNet-v1m1", in_channels=1, num_classes=0)):
        with pytest.raises(ConfigError, match=r"^model.num_classes=None is invalid: it takes a number of classes"):
            check_config_domains(dict(model=dict(type="DefaultSegmentor", backbone=backbone)))
        with pytest.raises(ConfigError, match="num_classes is missing"):
            MODELS.build(dict(type="DefaultSegmentor", backbone=backbone))


# ----------------------------------------------------------------------------- MinkowskiEngine semantics


def _voxels(seed: int, n: int = 150, span: int = 19) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    grid = torch.unique(torch.randint(0, span, (n, 3), generator=g), dim=0)
    batch = (torch.arange(grid.shape[0]) >= grid.shape[0] // 2).long()
    grid, batch, _ = voxelize(grid, batch)
    return grid, batch


def _me_coords(grid: torch.Tensor, batch: torch.Tensor, tensor_stride: int) -> torch.Tensor:
    return torch.cat([batch[:, None], grid * tensor_stride], 1)


def test_the_dense_reference_is_minkowski_engines_definition():
    """Against MinkowskiEngine's kernel map written out voxel by voxel:
    ``out[o] = sum_k in[o + offset_k] @ kernel[k]``, ``k = ix + K (iy + K iz)``."""
    grid, batch = _voxels(1, n=40, span=7)
    coords = _me_coords(grid, batch, 2)
    where = {tuple(c): i for i, c in enumerate(coords.tolist())}
    g = torch.Generator().manual_seed(2)
    feat = torch.randn(len(coords), 3, generator=g)
    for size in (3, 2):
        kernel = torch.randn(size**3, 3, 4, generator=g)
        out_coords = coords if size == 3 else dense.strided_coordinates(coords, 4)
        expected = torch.zeros(len(out_coords), 4)
        for o, (b, x, y, z) in enumerate(out_coords.tolist()):
            for k in range(size**3):
                i = [(k // size**a) % size for a in range(3)]  # x fastest
                off = [(v - size // 2) * 2 if size % 2 else v * 2 for v in i]
                src = where.get((b, x + off[0], y + off[1], z + off[2]))
                if src is not None:
                    expected[o] += feat[src] @ kernel[k]
        got = dense.conv(feat, coords, kernel, size, tensor_stride=2, stride=1 if size == 3 else 2)
        assert torch.allclose(got, expected, atol=1e-5)
    # transposed: every coarse voxel's weight k reaches its child at coarse + offset_k
    coarse = dense.strided_coordinates(coords, 4)
    kernel = torch.randn(8, 3, 4, generator=g)
    cfeat = torch.randn(len(coarse), 3, generator=g)
    cwhere = {tuple(c): i for i, c in enumerate(coarse.tolist())}
    expected = torch.zeros(len(coords), 4)
    for o, (b, x, y, z) in enumerate(coords.tolist()):
        parent = cwhere[(b, x // 4 * 4, y // 4 * 4, z // 4 * 4)]
        ix, iy, iz = (x % 4) // 2, (y % 4) // 2, (z % 4) // 2
        expected[o] = cfeat[parent] @ kernel[ix + 2 * (iy + 2 * iz)]
    got = dense.conv_transpose(cfeat, coarse, kernel, 2, tensor_stride=4, stride=2, out_coords=coords)
    assert torch.allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize("level", [0, 2])
def test_minkowski_convolutions_match_the_dense_reference_at_every_tensor_stride(level):
    """pimm's MinkowskiConv on pimm's kernel maps against the dense reference:
    stride-1 (3^3, 5^3, 1x1x1 with bias), stride-2 and transposed, with the
    voxels of pyramid level ``level`` at tensor stride ``2**level``."""
    grid, batch = _voxels(3, n=400, span=23)
    subm, down = kernel_map_pyramid(grid, batch, 4)
    grids, batches = [grid], [batch]
    for _ in range(3):
        coarse, cbatch, _ = voxelize(torch.div(grids[-1], 2, rounding_mode="floor"), batches[-1])
        grids.append(coarse)
        batches.append(cbatch)
    t = 2**level
    fine, coarse = _me_coords(grids[level], batches[level], t), _me_coords(grids[level + 1], batches[level + 1], 2 * t)
    torch.manual_seed(4)
    x = torch.randn(len(fine), 3)
    stem = submanifold_kernel_map(grids[level], batches[level], 5)
    for size, kmap in ((3, subm[level]), (5, stem)):
        conv = MinkowskiConv(3, 4, size)
        assert torch.allclose(conv(x, kmap), dense.conv(x, fine, conv.kernel.detach(), size, t), atol=1e-5)
    point = MinkowskiConv(3, 4, 1, bias=True)
    assert point.kernel.shape == (3, 4) and point.bias.shape == (1, 4)
    assert torch.allclose(point(x), x @ point.kernel + point.bias)
    strided = MinkowskiConv(3, 4, 2)
    y = strided(x, down[level])
    # pimm's coarse voxels are sorted like strided_coordinates' (event, x, y, z)
    assert torch.equal(coarse, dense.strided_coordinates(fine, 2 * t))
    assert torch.allclose(y, dense.conv(x, fine, strided.kernel.detach(), 2, t, stride=2), atol=1e-5)
    up = MinkowskiConv(4, 3, 2, transposed=True)
    assert torch.allclose(up(y, down[level].transposed()),
                          dense.conv_transpose(y, coarse, up.kernel.detach(), 2, 2 * t, 2, fine), atol=1e-5)


def test_spconv_layout_against_dense_conv3d():
    """spconv's ``(C_out, K, K, K, C_in)``: entry ``[:, i, j, l]`` acts on the
    input at ``output + (i, j, l) - K // 2``; its 1x1x1 weight is read as
    ``(C_in, C_out)`` memory, as spconv's matrix-product path does."""
    grid, batch = _voxels(5)
    torch.manual_seed(6)
    x = torch.randn(len(grid), 3)
    for size in (3, 5):
        conv = SpconvConv(3, 4, size)
        w = conv.weight.detach()
        cells = grid + size // 2
        dense_grid = torch.zeros(2, 3, *(int(s) + size for s in cells.max(0).values))
        dense_grid[batch, :, cells[:, 0], cells[:, 1], cells[:, 2]] = x
        ref = torch.nn.functional.conv3d(dense_grid, w.permute(0, 4, 1, 2, 3))[batch, :, grid[:, 0], grid[:, 1],
                                                                                grid[:, 2]]
        assert torch.allclose(conv(x, submanifold_kernel_map(grid, batch, size)), ref, atol=1e-5)
    point = SpconvConv(3, 4, 1, bias=True)
    assert torch.allclose(point(x), x @ point.weight.detach().reshape(3, 4) + point.bias.detach())


# ------------------------------------------------------------------------------------------ inputs


def _tiny(name: str, **kwargs) -> torch.nn.Module:
    if name.startswith("Mink"):
        return type("Tiny", (MODELS.get(name),), dict(PLANES=(3, 4, 4, 4, 4, 4, 3, 3), INIT_DIM=3))(2, 3)
    small = dict(base_channels=3, channels=(3, 4, 4, 3), layers=(1, 1, 1, 1))
    return MODELS.build(dict(type=name, in_channels=2, **{SPUNETS[name]: 3}, **small, **kwargs))


def _points(seed: int = 0) -> dict:
    grid, batch = _voxels(seed, n=120)
    return dict(grid_coord=grid, feat=torch.randn(len(grid), 2, generator=torch.Generator().manual_seed(seed)),
                offset=torch.tensor([int((batch == 0).sum()), len(grid)]))


@pytest.mark.parametrize("name", ["MinkUNet14", "SpUNet-v1m1"])
def test_a_shift_by_a_multiple_of_the_coarsest_stride_changes_nothing(name):
    """MinkowskiEngine rounds coordinates down at every stride, so moving the
    whole grid by a multiple of 16, negative included, gives the same
    output; spconv cannot take negative coordinates, and pimm moves them so."""
    model = _tiny(name).eval()
    data = _points()
    with torch.no_grad():
        base = model(data)
        for shift in (-32, -16, 48):
            moved = model(dict(data, grid_coord=data["grid_coord"] + shift))
            assert torch.allclose(base, moved, atol=1e-5), shift


@pytest.mark.parametrize("name", ["MinkUNet14", "SpUNetNoSkipBase"])
def test_points_sharing_a_voxel_are_averaged_and_share_its_output(name):
    model = _tiny(name).eval()
    data = _points(1)
    n0 = int(data["offset"][0])
    twin = dict(grid_coord=torch.cat([data["grid_coord"][:n0], data["grid_coord"][:1], data["grid_coord"][n0:]]),
                feat=torch.cat([data["feat"][:n0], -data["feat"][:1], data["feat"][n0:]]),
                offset=data["offset"] + 1)
    merged = dict(data, feat=data["feat"].clone())
    merged["feat"][0] = 0.0  # the mean of x and -x
    with torch.no_grad():
        out, expected = model(twin), model(merged)
    assert torch.allclose(out[0], out[n0]) and torch.allclose(out[0], expected[0], atol=1e-5)
    assert torch.allclose(torch.cat([out[:n0], out[n0 + 1:]]), expected, atol=1e-5)


def test_bad_batches_are_one_line_errors():
    model = _tiny("SpUNet-v1m1").eval()
    data = _points()
    with pytest.raises(ConfigError, match=r"needs 'grid_coord' in the batch \(add GridSample"):
        model({k: v for k, v in data.items() if k != "grid_coord"})
    prompted = _tiny("SpUNet-v1m3", conditions=("A", "B"), context_channels=4).eval()
    context = torch.zeros(1, 4)
    for batch, message in ((dict(data, context=context), "needs the batch's 'condition'"),
                           (dict(data, condition=["A", "B"], context=context), "one condition per batch"),
                           (dict(data, condition="C", context=context), "condition 'C' is not in conditions"),
                           (dict(data, condition="A"), "needs the batch's 'context'"),
                           (dict(data, condition="A", context=torch.zeros(1, 5)), "context_channels=4")):
        with pytest.raises(ConfigError, match=message):
            prompted(batch)
    with torch.no_grad():
        one, per_event = prompted(dict(data, condition="B", context=context)), prompted(
            dict(data, condition=["B", "B"], context=context.reshape(-1)))
    assert torch.equal(one, per_event)


def test_v1m3_without_adaptive_norms_needs_no_context_and_the_condition_picks_the_norms():
    model = _tiny("SpUNet-v1m3", conditions=("A", "B"), norm_adaptive=False, zero_init=True).eval()
    assert not any("modulation" in k for k in model.state_dict())
    with torch.no_grad():
        model.conv_input.bn.bns[1].running_mean.fill_(3.0)
        data = _points()
        assert not torch.allclose(model(dict(data, condition="A")), model(dict(data, condition="B")))


# ------------------------------------------------------------------------------------------ training


@pytest.mark.parametrize("options", [[], ["model.backbone=dict(type='MinkUNet14A', in_channels=1, out_channels=5)"]],
                         ids=["SpUNet-v1m1", "MinkUNet14A"])
def test_each_family_takes_two_training_steps_on_the_lartpc_config(options, tmp_path):
    from pimm.engines.run.launch import load_config
    from tests.support.inprocess import two_steps_in_process

    shrink = [f"save_path={tmp_path / 'run'}", "scheduler.warmup_steps=1", "data.train.num_events=4"]
    cfg, _ = load_config(str(ROOT / "configs" / "lartpc" / "semseg-spunet.py"), [*shrink, *options], world_size=1)
    moved, frozen = two_steps_in_process(cfg)
    assert not frozen and moved == {n for n, _ in MODELS.build(cfg.model).named_parameters()}


def test_the_model_zoo_bench_takes_a_list_of_model_specs(capsys):
    """``bench/model_zoo.py``: named and literal specs, one row per model on
    the same batches (tiny, so the test stays fast; no timing asserted)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("model_zoo", ROOT / "bench" / "model_zoo.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.parse_spec("MinkUNet14A") == ("MinkUNet14A", dict(type="MinkUNet14A", in_channels=1,
                                                                   out_channels=5))
    with pytest.raises(SystemExit, match="unknown model 'Nope'"):
        bench.parse_spec("Nope")
    tiny = "dict(type='SpUNet-v1m1', in_channels=1, num_classes=5, base_channels=4, channels=(4, 4, 4, 4), " \
           "layers=(1, 1, 1, 1))"
    unet = "dict(type='SparseUNet', in_channels=1, channels=(4, 8), enc_blocks=(1, 1), dec_blocks=(1,))"
    bench.main(["--models", f"spunet={tiny}", f"unet={unet}", "--rounds", "1", "--batches", "1", "--events", "1"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert [item.split("=")[0] for item in last.split()] == ["spunet", "unet"]


def test_a_grid_narrower_than_the_coarsest_stride_keeps_one_plane():
    """v1m2's ``max + 1`` grid would shrink to 0 planes on a flat axis (spconv
    stops there); pimm keeps one, and the output is every point's."""
    model = _tiny("SpUNet-v1m2").eval()
    data = _points(2)
    flat = dict(data, grid_coord=data["grid_coord"] * torch.tensor([1, 1, 0]))
    flat["grid_coord"], flat["feat"], flat["offset"] = _distinct(flat)
    with torch.no_grad():
        out = model(flat)
    assert out.shape == (len(flat["grid_coord"]), 3) and torch.isfinite(out).all()


def _distinct(data: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One point per voxel again after flattening (the first of each)."""
    batch = torch.repeat_interleave(torch.arange(2), torch.diff(data["offset"], prepend=torch.zeros(1).long()))
    keys = torch.cat([batch[:, None], data["grid_coord"]], 1)
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), len(inverse)).scatter_reduce(0, inverse, torch.arange(len(inverse)),
                                                                                 "amin").sort().values
    return data["grid_coord"][first], data["feat"][first], torch.tensor([int((batch[first] == 0).sum()), len(first)])


def test_v1m3_takes_its_condition_from_the_data_pipeline():
    """As docs/models.md says: ``Update`` sets the data set's name, ``Collect``
    keeps it, the collated batch holds one per event, and v1m3 trains on it."""
    from pimm.datasets.collate import point_collate_fn
    from pimm.engines.registries import DATASETS

    transform = [dict(type="GridSample", grid_size=1.0, hash_type="fnv", mode="train", return_grid_coord=True),
                 dict(type="Update", keys_dict=dict(condition="LArTPC")), dict(type="ToTensor"),
                 dict(type="Collect", keys=("grid_coord", "segment", "condition"), feat_keys=("energy",))]
    data = DATASETS.build(dict(type="LArTPCSynthDataset", num_events=2, split="train", seed=0, transform=transform))
    batch = point_collate_fn([data[0], data[1]])
    assert batch["condition"] == ["LArTPC", "LArTPC"]
    model = MODELS.build(dict(type="DefaultSegmentor", backbone=dict(
        type="SpUNet-v1m3", in_channels=1, num_classes=5, base_channels=4, channels=(4, 4, 4, 4), layers=(1, 1, 1, 1),
        conditions=("Other", "LArTPC"), norm_adaptive=False, norm_affine=True)))
    model(batch)["loss"].backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "bns." in n}
    assert grads and all((g is None) == (".bns.0." in n) for n, g in grads.items())  # only LArTPC's norms learn
