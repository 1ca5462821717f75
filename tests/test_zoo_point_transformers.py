"""Point Transformer v1 (``PointTransformer-Seg/PartSeg/Cls26/38/50``) and v2
(``PT-v2m1``, ``PT-v2m2``, ``PT-v2m3``) under upstream's names.

* every output (and two gradients per family) matches upstream's own model
  code run on CPU over Python ports of pointops' CUDA kernels
  (``tests/fixtures/point_transformers/make_reference.py``), with weights
  loaded strictly under upstream's state-dict names and shapes;
* the twelve names built with upstream's defaults have upstream's layout;
* an upstream-format checkpoint loads strictly through ``weight=``'s loader
  and through ``pimm.from_pretrained``;
* each pointops operation (kNN, grouping, farthest point sampling,
  interpolation, grid pooling) against a direct loop reference written from
  the kernels' source: pointops itself is CUDA-only and cannot run here;
* bad batches and arguments are one line; both families train two steps on
  the LArTPC generator through the shipped config.
"""

from __future__ import annotations

import io
import json
import lzma
import math
from pathlib import Path

import pytest
import torch

import pimm.models  # noqa: F401  (registers)
from pimm.engines.registries import MODELS
from pimm.models import pointops
from pimm.utils.errors import ConfigError, UserError
from tests.support.point_transformer_reference import batch_for, formula_state, make_inputs, uniform

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "point_transformers" / "reference.pt.xz"
REFERENCE = torch.load(io.BytesIO(lzma.decompress(FIXTURE.read_bytes())), weights_only=True)
RUNS = {run["name"]: run for run in REFERENCE["runs"] if "output" in run}
DEFAULTS = {run["type"]: run for run in REFERENCE["runs"] if run["name"].startswith("defaults:")}
NAMES = [f"PointTransformer-{task}{depth}" for task in ("Seg", "PartSeg", "Cls") for depth in (26, 38, 50)]
NAMES += ["PT-v2m1", "PT-v2m2", "PT-v2m3"]
TOLERANCE = 1e-4


def layout(run: dict) -> dict[str, tuple[int, ...]]:
    """Upstream's state-dict names and shapes of a run, in upstream's order."""
    names = [REFERENCE["names"][i] for i in run["names"].tolist()]
    dims, shapes, at = run["dims"].tolist(), [], 0
    for ndim in run["ndims"].tolist():
        shapes.append(tuple(dims[at:at + ndim]))
        at += ndim
    return dict(zip(names, shapes))


def upstream_state(run: dict) -> dict[str, torch.Tensor]:
    """The run's weights under upstream's names (the formula the fixture used)."""
    return formula_state(layout(run))


def built(run: dict) -> torch.nn.Module:
    model = MODELS.build(dict(type=run["type"], **run["kwargs"]))
    model.load_state_dict(upstream_state(run), strict=True)
    return model.train(run["mode"] == "train")


def forward(model, run: dict, inputs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    batch = batch_for(inputs, run["input"], run["extra"])
    wants_grad = "feat_grad" in run
    batch["feat"].requires_grad_(wants_grad)
    torch.manual_seed(0)
    out = model(batch)
    if not wants_grad:
        return out.detach(), None
    projection = inputs["projection"]["v1" if run["input"].startswith("v1") else "v2"][:, :out.shape[1]]
    (out * projection).sum().backward()
    return out.detach(), batch["feat"].grad


@pytest.fixture(scope="module")
def inputs():
    return make_inputs()


# ------------------------------------------------------------------ upstream's function and layout


@pytest.mark.parametrize("name", list(RUNS))
def test_every_output_matches_upstream(name, inputs):
    run = RUNS[name]
    model = built(run)
    assert list(model.state_dict()) == list(layout(run))  # upstream's names, in upstream's order
    out, grad = forward(model, run, inputs)
    assert out.shape == run["output"].shape
    assert (out - run["output"]).abs().max().item() <= TOLERANCE, name
    if grad is not None:
        scale = run["feat_grad"].abs().max().item()
        assert (grad - run["feat_grad"]).abs().max().item() <= TOLERANCE * scale, name


def test_the_reference_is_not_trivial(inputs):
    """The outputs vary over points and events, and a model with other weights misses them."""
    for run in RUNS.values():
        assert run["output"].std().item() > 0.1, run["name"]
    seg = RUNS["seg26"]["output"]
    assert (seg[:800].mean(0) - seg[800:].mean(0)).abs().max() > 1e-3
    run = RUNS["m2_multiplier"]
    model = built(run)
    with torch.no_grad():
        model.seg_head[0].weight.mul_(1.01)
    out, _ = forward(model, run, inputs)
    assert (out - run["output"]).abs().max().item() > 100 * TOLERANCE


@pytest.mark.parametrize("name", NAMES)
def test_each_name_builds_with_upstreams_defaults_and_layout(name):
    kwargs = dict(in_channels=6, num_classes=13) if name.startswith("PT-v2") else {}  # PT-v2's two required ones
    model = MODELS.build(dict(type=name, **kwargs))
    want = layout(DEFAULTS[name])
    assert [(k, tuple(v.shape)) for k, v in model.state_dict().items()] == list(want.items())


def test_partseg_without_shape_classes_is_the_segmenters_head(inputs):
    """Upstream's part segmenter crashes without num_shape_classes (its head
    indexes the missing shape class); pimm's is then the segmenter."""
    run = RUNS["seg38"]
    part = MODELS.build(dict(type="PointTransformer-PartSeg38", **run["kwargs"])).eval()
    part.load_state_dict(upstream_state(run), strict=True)
    out, _ = forward(part, run, inputs)
    assert (out - run["output"]).abs().max().item() <= TOLERANCE


SEGMENTORS = {"DefaultSegmentor": {},  # upstream's form: no num_classes, the backbone's logits
              "DefaultSegmentorV2": dict(num_classes=0, backbone_out_channels=3)}


@pytest.mark.parametrize("segmentor", list(SEGMENTORS))
@pytest.mark.parametrize("name", ["m2_multiplier", "seg26"])
def test_upstream_checkpoint_loads_strictly_through_the_weight_loader(segmentor, name, tmp_path, inputs):
    """An upstream training checkpoint of DefaultSegmentor(backbone=...(num_classes=3))
    (``module.backbone.*``), as ``weight=`` with ``CheckpointLoader(strict=True)``
    reads it: every tensor, none left over, upstream's logits."""
    from pimm.engines.state.weights import load_weights

    run = RUNS[name]
    state = {f"module.backbone.{k}": v for k, v in upstream_state(run).items()}
    torch.save({"epoch": 3, "state_dict": state}, tmp_path / "model_last.pth")
    model = MODELS.build(dict(type=segmentor, backbone=dict(type=run["type"], **run["kwargs"]),
                              **SEGMENTORS[segmentor]))
    report = load_weights(model, tmp_path / "model_last.pth", strict=True, allow_unexpected=False)
    assert report["loaded"] == len(state) and not report["missing"] and not report["unexpected"]
    model.eval()
    batch = batch_for(inputs, run["input"], run["extra"])
    with torch.no_grad():
        logits = model(batch)["seg_logits"]
    assert (logits - run["output"]).abs().max().item() <= TOLERANCE
    head = next(k for k in state if k.endswith(".weight") and state[k].dim() == 2)
    state[head] = torch.zeros(2, 2)  # a wrong shape is one line
    torch.save({"state_dict": state}, tmp_path / "bad.pth")
    with pytest.raises(UserError) as err:
        load_weights(model, tmp_path / "bad.pth", strict=True)
    assert "\n" not in str(err.value) and head.removeprefix("module.") in str(err.value)


@pytest.mark.parametrize("name", ["m3_adaptive", "cls26"])
def test_upstream_export_loads_strictly_through_from_pretrained(name, tmp_path, inputs):
    """An export folder as upstream writes one (a bare model config, safetensors)."""
    safetensors = pytest.importorskip("safetensors.torch")
    import pimm

    run = RUNS[name]
    folder = tmp_path / "export"
    folder.mkdir()
    safetensors.save_file({k: v.contiguous() for k, v in upstream_state(run).items()},
                          str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model": dict(type=run["type"], **run["kwargs"])}))
    model = pimm.from_pretrained(str(folder), device="cpu")
    assert not model.training
    out, _ = forward(model, run, inputs)
    assert (out - run["output"]).abs().max().item() <= TOLERANCE


# ------------------------------------------------------------------ pointops against direct references


def _events(sizes, seed: int, integer: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenated events of ``sizes`` points: random floats (no ties), or
    points on a small integer grid (many exactly equal distances)."""
    n = sum(sizes)
    u = (uniform(3 * n, seed).reshape(n, 3) + 1) / 2
    xyz = torch.floor(u * 5) if integer else u * torch.tensor([2.0, 1.0, 0.5], dtype=torch.float64)
    return xyz.float().contiguous(), torch.cumsum(torch.tensor(sizes), 0)


def _bounds(offset) -> list[tuple[int, int]]:
    ends = offset.tolist()
    return list(zip([0] + ends[:-1], ends))


def knn_reference(k, xyz, offset, new_xyz, new_offset):
    """Each query's k nearest points of its event ranked by (squared distance, index),
    as a plain sort in float64; missing slots -1 / 1e5."""
    idx, dist = [], []
    for (a, b), (qa, qb) in zip(_bounds(offset), _bounds(new_offset)):
        for q in range(qa, qb):
            d2 = ((xyz[a:b].double() - new_xyz[q].double()) ** 2).sum(1).tolist()
            ranked = sorted(range(b - a), key=lambda j: (d2[j], j))[:k]
            idx.append([a + j for j in ranked] + [-1] * (k - len(ranked)))
            dist.append([math.sqrt(d2[j]) for j in ranked] + [1e5] * (k - len(ranked)))
    return torch.tensor(idx), torch.tensor(dist, dtype=torch.float64)


@pytest.mark.parametrize("integer", [False, True], ids=["floats", "grid-with-ties"])
def test_knn_query_is_the_direct_ranking(integer):
    xyz, offset = _events([37, 5, 60], 1, integer)
    idx, dist = pointops.knn_query(8, xyz, offset)
    want_idx, want_dist = knn_reference(8, xyz, offset, xyz, offset)
    assert torch.equal(idx, want_idx)
    assert torch.allclose(dist.double(), want_dist, atol=1e-6)
    assert (dist[:, 0] == 0).all()  # itself first (or a duplicate of lower index), at distance 0
    if not integer:
        assert torch.equal(idx[:, 0], torch.arange(len(xyz)))
    assert (idx[37:42, 5:] == -1).all() and (dist[37:42, 5:] == 1e5).all()  # 5 points: padded
    # queries of another set, with their own offsets
    queries, new_offset = _events([4, 9, 3], 2, integer)
    idx, dist = pointops.knn_query(6, xyz, offset, queries, new_offset)
    want_idx, want_dist = knn_reference(6, xyz, offset, queries, new_offset)
    assert torch.equal(idx, want_idx) and torch.allclose(dist.double(), want_dist, atol=1e-6)


def test_knn_query_in_chunks_is_the_same(monkeypatch):
    xyz, offset = _events([300, 200], 3)
    monkeypatch.setattr(pointops, "_CHUNK_ELEMENTS", 1 << 20)  # one chunk an event
    whole = pointops.knn_query(16, xyz, offset)
    monkeypatch.setattr(pointops, "_CHUNK_ELEMENTS", 1000)  # 3 queries a chunk
    chunked = pointops.knn_query(16, xyz, offset)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


@pytest.mark.parametrize("integer", [False, True], ids=["floats", "grid-with-ties"])
def test_knn_query_by_grid_cells_is_the_brute_force_ranking(integer, monkeypatch):
    """Large events search the 27 cells around each query (the brute force
    above is checked against the direct ranking); queries the cells cannot
    settle are brute-forced."""
    n = 2000
    u = (uniform(3 * n, 9).reshape(n, 3) + 1) / 2
    track = torch.linspace(0, 1, n, dtype=torch.float64)[:, None] * torch.tensor([600.0, 250.0, 90.0])
    xyz = (track + 4 * u).floor() if integer else track + 4 * u  # a thick track: LArTPC-like
    xyz, offset = xyz.float().contiguous(), torch.tensor([1200, 2000])
    queries, new_offset = xyz[::3].contiguous(), torch.tensor([400, 667])
    calls = []
    grid_search = pointops._grid_search

    def spy(*args):
        found = grid_search(*args)
        calls.append(None if found is None else int((~found[2]).sum()))
        return found

    monkeypatch.setattr(pointops, "_grid_search", spy)
    by_grid = [pointops.knn_query(k, xyz, offset, *q) for k in (3, 16) for q in ((), (queries, new_offset))]
    assert len(calls) >= 4 and all(c is not None for c in calls) and any(calls)  # some brute-forced
    monkeypatch.setattr(pointops, "_nearest_in_event", pointops._brute_force)
    direct = [pointops.knn_query(k, xyz, offset, *q) for k in (3, 16) for q in ((), (queries, new_offset))]
    for (a, da), (b, db) in zip(by_grid, direct):
        assert torch.equal(a, b) and torch.equal(da, db)


def test_grouping_reads_rows_and_offsets_with_zeros_for_missing():
    xyz, offset = _events([6, 3], 4)
    feat = torch.randn(9, 5, requires_grad=True)
    idx, _ = pointops.knn_query(4, xyz, offset)  # the 3-point event has one empty slot
    grouped = pointops.grouping(idx, feat, xyz, with_xyz=True)
    for i in range(9):
        for s in range(4):
            j = int(idx[i, s])
            want_pos = xyz[j] - xyz[i] if j >= 0 else torch.zeros(3)
            want_feat = feat[j] if j >= 0 else torch.zeros(5)
            assert torch.equal(grouped[i, s], torch.cat([want_pos, want_feat.detach()]))
    grouped[..., 3:].sum().backward()  # each row's gradient: how often it was read
    counts = torch.bincount(idx[idx >= 0], minlength=9).float()
    assert torch.equal(feat.grad, counts[:, None].expand(9, 5))
    assert torch.equal(pointops.grouping(idx, feat, xyz), grouped[..., 3:])


def fps_reference(xyz, offset, new_offset):
    """From each event's first point, the point farthest from those picked
    (float64 squared distances; ties: the lowest index)."""
    picked = []
    for (a, b), (qa, qb) in zip(_bounds(offset), _bounds(new_offset)):
        points = xyz[a:b].double()
        nearest = torch.full((b - a,), 1e10, dtype=torch.float64)
        chosen = [0]
        for _ in range(qb - qa - 1):
            nearest = torch.minimum(nearest, ((points - points[chosen[-1]]) ** 2).sum(1))
            best = max(range(b - a), key=lambda j: (nearest[j].item(), -j))
            chosen.append(best)
        picked += [a + j for j in chosen[:qb - qa]]
    return torch.tensor(picked)


@pytest.mark.parametrize("integer", [False, True], ids=["floats", "grid-with-ties"])
def test_farthest_point_sampling_is_the_direct_loop(integer):
    xyz, offset = _events([40, 13, 27], 5, integer)
    new_offset = pointops.strided_offset(offset, 4)
    assert new_offset.tolist() == [10, 13, 19]
    idx = pointops.farthest_point_sampling(xyz, offset, new_offset)
    assert torch.equal(idx, fps_reference(xyz, offset, new_offset))
    assert idx[0] == 0 and idx[10] == 40 and idx[13] == 53  # each event starts at its first point


def test_interpolation_is_inverse_distance_weighting():
    coarse, offset = _events([7, 2, 5], 6)
    fine, new_offset = _events([20, 8, 11], 7)
    feat = torch.randn(14, 4, requires_grad=True)
    out = pointops.interpolation(coarse, fine, feat, offset, new_offset)
    idx, dist = knn_reference(3, coarse, offset, fine, new_offset)
    for q in range(len(fine)):
        keep = idx[q] >= 0  # the 2-point event: only 2 neighbours
        w = 1.0 / (dist[q][keep] + 1e-8)
        want = (feat[idx[q][keep]].double() * (w / w.sum())[:, None]).sum(0)
        assert torch.allclose(out[q].double(), want, atol=1e-5)
    out.sum().backward()
    assert torch.allclose(feat.grad.sum(), torch.tensor(float(len(fine) * 4)), atol=1e-4)  # weights sum to 1


def test_grid_pool_is_per_event_cells_in_voxel_grid_order():
    xyz, offset = _events([50, 30], 8)
    feat = torch.randn(80, 3)
    coord, pooled, new_offset, cluster = pointops.grid_pool(xyz, feat, offset, 0.3)
    cells = []
    for e, (a, b) in enumerate(_bounds(offset)):
        corner = xyz[a:b].double().min(0).values
        for i in range(a, b):
            x, y, z = ((xyz[i].double() - corner) / 0.3).floor().long().tolist()
            cells.append((e, z, y, x))  # torch_geometric's id: the event, then z, y, x from most significant
    order = sorted(set(cells))
    assert cluster.tolist() == [order.index(c) for c in cells]
    assert new_offset.tolist() == [sum(1 for c in order if c[0] == 0), len(order)]
    for k in range(len(order)):
        members = [i for i, c in enumerate(cells) if c == order[k]]
        assert torch.allclose(coord[k], xyz[members].mean(0), atol=1e-6)
        assert torch.equal(pooled[k], feat[members].max(0).values)


# ------------------------------------------------------------------ one-line errors


def _tiny_v2(**overrides) -> dict:
    return dict(RUNS["m1_map"]["kwargs"], **overrides)


@pytest.mark.parametrize("config, words", [
    (dict(type="PT-v2m2", **_tiny_v2(enc_groups=(3, 4, 2, 4))), "enc_groups=[3, 4, 2, 4] must divide"),
    (dict(type="PT-v2m1", **_tiny_v2(dec_depths=(1, 1, 1))), "one entry per stage"),
    (dict(type="PT-v2m2", **_tiny_v2(unpool_backend="nearest")), "unpool_backend='nearest'"),
])
def test_bad_arguments_are_one_line(config, words):
    with pytest.raises(ConfigError) as err:
        MODELS.build(config)
    assert words in str(err.value) and "\n" not in str(err.value)


def _m3(**overrides):
    run = RUNS["m3_adaptive"]
    return MODELS.build(dict(type=run["type"], **dict(run["kwargs"], **overrides))).eval()


@pytest.mark.parametrize("model, extra, words", [
    ("v1", {"offset": torch.tensor([800, 1000])}, "event 1 of the batch has 200 points"),
    ("v1", {"feat": torch.zeros(1100, 4)}, "in_channels=6 but the batch's features have 4 channels"),
    ("partseg", {}, "needs each event's shape class as 'cls_token'"),
    ("partseg", {"cls_token": torch.tensor([0, 4])}, "cls_token must hold one shape class in [0, 4)"),
    ("m3", {"condition": ["LArTPC", "PILArNet"]}, "one condition per batch"),
    ("m3", {"condition": "ScanNet"}, "condition 'ScanNet' is none of conditions=['LArTPC', 'PILArNet']"),
    ("m3", {"context": None}, "norm_adaptive=True needs the batch's 'context'"),
    ("m3", {"context": torch.zeros(2, 8)}, "context has shape (2, 8)"),
    ("v2", {"feat": torch.zeros(270, 6)}, "in_channels=4 but the batch's feat has shape (270, 6)"),
])
def test_bad_batches_are_one_line(model, extra, words, inputs):
    if model == "v1":
        net, batch = MODELS.build(dict(type="PointTransformer-Seg26")), batch_for(inputs, "v1", {})
    elif model == "partseg":
        net = MODELS.build(dict(type="PointTransformer-PartSeg26", num_shape_classes=4))
        batch = batch_for(inputs, "v1", {})
    elif model == "m3":
        net, batch = _m3(), batch_for(inputs, "v2", RUNS["m3_adaptive"]["extra"])
    else:
        net, batch = MODELS.build(dict(type="PT-v2m2", **_tiny_v2())), batch_for(inputs, "v2", {})
    batch.update(extra)
    batch = {k: v for k, v in batch.items() if v is not None}
    with pytest.raises(UserError) as err:
        net.eval()(batch)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_pdnorm_condition_picks_its_own_batchnorm(inputs):
    """PDNorm's meaning: the condition selects the BatchNorm (and its
    statistics) a batch is normalised with; one name for the whole batch or
    one per event, all equal."""
    model = _m3(norm_adaptive=False)
    model.load_state_dict(upstream_state(RUNS["m3_decoupled"]), strict=True)
    as_list = batch_for(inputs, "v2", {"condition": ["LArTPC", "LArTPC"]})
    as_name = dict(batch_for(inputs, "v2", {}), condition="LArTPC")
    other = batch_for(inputs, "v2", {"condition": ["PILArNet", "PILArNet"]})
    with torch.no_grad():
        a, b, c = model(as_list), model(as_name), model(other)
    assert torch.equal(a, b) and (a - c).abs().max() > 1e-2
    model.train()
    model(other)  # training on PILArNet moves only its statistics
    stage = model.enc_stages[0].blocks.blocks[0].norm1.bns
    assert int(stage[1].num_batches_tracked) == 1 and int(stage[0].num_batches_tracked) == 0


# ------------------------------------------------------------------ training on the LArTPC generator


@pytest.mark.parametrize("backbone", ["PT-v2m2", "PointTransformer-Seg26"])
def test_the_lartpc_config_takes_two_steps(backbone, tmp_path):
    """configs/lartpc/semseg-ptv2.py (and its PT-v1 options line, docs/models.md)
    through the trainer's loader and builders: two optimizer steps."""
    import pimm.cli

    pimm.cli.register_all()
    from pimm.engines.run.launch import load_config
    from tests.support.inprocess import two_steps_in_process

    options = [f"save_path={tmp_path / 'run'}", "data.train.num_events=4", "data.val.num_events=2",
               "scheduler.warmup_steps=1"]  # (two steps in all)
    if backbone != "PT-v2m2":
        options.append('model.backbone=dict(type="PointTransformer-Seg26",in_channels=4,num_classes=5)')
    cfg, _ = load_config(str(ROOT / "configs" / "lartpc" / "semseg-ptv2.py"), options, world_size=1)
    assert cfg.model["backbone"]["type"] == backbone
    moved, frozen = two_steps_in_process(cfg)
    assert not frozen and any(n.startswith("backbone.enc") for n in moved)
