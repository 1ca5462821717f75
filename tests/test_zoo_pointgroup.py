"""``PG-v1m1`` (upstream's PointGroup) and its clustering (issue 47, item 2).

* :mod:`pimm.models.pointgroup_ops` -- upstream's CUDA ``ballquery_batch_p``
  and ``bfs_cluster`` as tensor code -- against a direct implementation of
  the algorithm (a loop over the points scanning their event in index order,
  then a breadth-first search from every unvisited point), on random clouds
  with dense blobs, with caps small enough that neighbour lists become one-way
  and with upstream's cap of 1000;
* the model against upstream's own ``PG-v1m1`` + ``SpUNet-v1m1`` run on CPU
  (``tests/fixtures/point_group/reference.pt.xz``, its ``make_reference.py``
  says how; its clustering stand-in is a transcription of upstream's C++):
  the checkpoint loads strictly through ``weight=``'s loader and
  ``pimm.from_pretrained``, every loss term, head output and proposal matches;
* the model on backbones pimm had before (a tensor one and a point-batch one)
  and ``configs/lartpc/inseg-pg-v1m1.py`` through the trainer.
"""

from __future__ import annotations

import collections
import json
import math
from copy import deepcopy
from pathlib import Path

import numpy as np
import pytest
import torch

import pimm
import pimm.models  # noqa: F401  (registers the models)
from pimm.engines.registries import MODELS
from pimm.models.pointgroup_ops import ballquery_batch_p, bfs_cluster
from pimm.utils.errors import ConfigError
from tests.support.detector_reference import compare, expected, flatten, load_reference, load_upstream_checkpoint
from tests.support.detector_reference import upstream_state

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "point_group" / "reference.pt.xz"


# -- the direct reference of upstream's clustering ----------------------------------------
def direct_ball_query(coords: torch.Tensor, bounds: list[int], radius: float, cap: int) -> list[list[int]]:
    """Every point scans its event in index order: float32 squared distance
    below the float32 squared radius, at most ``cap`` neighbours kept."""
    xyz = coords.float().numpy()
    radius2 = np.float32(radius) * np.float32(radius)
    lists = []
    for i in range(len(xyz)):
        event = next(b for b in range(len(bounds) - 1) if bounds[b] <= i < bounds[b + 1])
        d = xyz[i] - xyz[bounds[event]:bounds[event + 1]]
        close = np.nonzero(d[:, 0] * d[:, 0] + d[:, 1] * d[:, 1] + d[:, 2] * d[:, 2] < radius2)[0]
        lists.append((close[:cap] + bounds[event]).tolist())
    return lists


def direct_bfs(labels: list[int], lists: list[list[int]], threshold: int) -> list[list[int]]:
    visited, clusters = [False] * len(lists), []
    for seed in range(len(lists)):
        if visited[seed]:
            continue
        visited[seed], component, queue = True, [seed], collections.deque([seed])
        while queue:
            cur = queue.popleft()
            for k in lists[cur]:
                if labels[k] == labels[cur] and not visited[k]:
                    visited[k] = True
                    component.append(k)
                    queue.append(k)
        if len(component) >= threshold:
            clusters.append(component)
    return clusters


def _lists(idx: torch.Tensor, start_len: torch.Tensor) -> list[list[int]]:
    return [idx[s:s + n].tolist() for s, n in start_len.tolist()]


def _clusters(cluster_idxs: torch.Tensor, cluster_offsets: torch.Tensor) -> list[list[int]]:
    bounds = cluster_offsets.tolist()
    out = []
    for c, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        assert (cluster_idxs[a:b, 0] == c).all()
        out.append(cluster_idxs[a:b, 1].tolist())
    return out


def _cloud(seed: int, sizes=(70, 1, 120, 40)):
    """Events of uniform points plus a dense blob each (many points in one ball)."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for n in sizes:
        xyz = torch.rand(n, 3, generator=g) * (2.0 + 6.0 * torch.rand(1, generator=g))
        blob = n // 3
        xyz[:blob] = xyz[:1] + 0.05 * torch.randn(blob, 3, generator=g)
        parts.append(xyz[torch.randperm(n, generator=g)])
    coords = torch.cat(parts) - 3.0  # negative coordinates too
    counts = torch.tensor(sizes)
    bounds = [0] + torch.cumsum(counts, 0).tolist()
    batch = torch.repeat_interleave(torch.arange(len(sizes)), counts)
    labels = torch.randint(0, 3, (coords.shape[0],), generator=g)
    return coords, batch, bounds, labels


@pytest.mark.parametrize("seed, cap, threshold", [(0, 1000, 1), (1, 5, 2), (2, 12, 3), (3, 30, 1), (4, 1, 1)])
def test_ball_query_and_bfs_cluster_match_the_direct_algorithm(seed, cap, threshold):
    coords, batch, bounds, labels = _cloud(seed)
    idx, start_len = ballquery_batch_p(coords, batch.int(), torch.tensor(bounds).int(), 1.0, 300, max_neighbors=cap)
    assert idx.dtype == start_len.dtype == torch.int32 and start_len.shape == (coords.shape[0], 2)
    reference = direct_ball_query(coords, bounds, 1.0, cap)
    assert _lists(idx, start_len) == reference
    one_way = sum(i not in reference[j] for i, ns in enumerate(reference) for j in ns)
    assert (one_way > 0) == (cap < 100)  # small caps make lists one-way: the seed order then matters
    cluster_idxs, cluster_offsets = bfs_cluster(labels.int(), idx, start_len, threshold)
    want = direct_bfs(labels.tolist(), reference, threshold)
    got = _clusters(cluster_idxs, cluster_offsets)
    assert [c[0] for c in got] == [c[0] for c in want]  # the same seeds, in the same order
    assert [sorted(c) for c in got] == [sorted(c) for c in want]


def test_upstreams_cap_of_1000_neighbours():
    """1,200 points in one ball: each keeps its first 1,000 neighbours by
    index, so the last 200 reach the first 1,000 but not the other way;
    with two labels the components depend on it exactly as upstream's."""
    g = torch.Generator().manual_seed(5)
    coords = torch.cat([0.1 * torch.rand(1200, 3, generator=g), 5 + torch.rand(30, 3, generator=g)])
    labels = torch.cat([torch.randint(0, 2, (1200,), generator=g), torch.zeros(30, dtype=torch.long)])
    bounds = [0, coords.shape[0]]
    idx, start_len = ballquery_batch_p(coords, torch.zeros(len(coords), dtype=torch.int32), torch.tensor(bounds), 0.5)
    reference = direct_ball_query(coords, bounds, 0.5, 1000)
    assert start_len[:1200, 1].max() == 1000 and _lists(idx, start_len) == reference
    got = _clusters(*bfs_cluster(labels.int(), idx, start_len, 1))
    assert [sorted(c) for c in got] == [sorted(c) for c in direct_bfs(labels.tolist(), reference, 1)]


def test_the_ops_refuse_inputs_upstreams_kernel_would_misread():
    coords = torch.rand(6, 3)
    with pytest.raises(ValueError, match="batch_idxs and batch_offsets disagree"):
        ballquery_batch_p(coords, torch.tensor([0, 0, 1, 0, 1, 1]), torch.tensor([0, 3, 6]), 0.5)
    with pytest.raises(ValueError, match="must rise from 0 to the number of points"):
        ballquery_batch_p(coords, torch.zeros(6, dtype=torch.int32), torch.tensor([0, 5]), 0.5)
    with pytest.raises(ValueError, match="radius must be > 0"):
        ballquery_batch_p(coords, torch.zeros(6, dtype=torch.int32), torch.tensor([0, 6]), 0.0)
    with pytest.raises(ValueError, match="outside"):
        bfs_cluster(torch.zeros(2, dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32),
                    torch.tensor([[0, 1], [1, 1]], dtype=torch.int32), 1)


# -- upstream's own model ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference() -> dict:
    return load_reference(FIXTURE)


def _upstream_outputs(model, data: dict) -> dict:
    """The forward's outputs under the fixture's keys, the heads' outputs caught as the script does."""
    heads = {}
    hooks = [model.bias_head.register_forward_hook(lambda m, i, o: heads.__setitem__("bias_pred", o.detach())),
             model.seg_head.register_forward_hook(lambda m, i, o: heads.__setitem__("logit_pred", o.detach()))]
    torch.manual_seed(0)
    with torch.no_grad():
        out = model({k: v.clone() for k, v in data.items()})
    for hook in hooks:
        hook.remove()
    return {**out, **heads}


@pytest.mark.parametrize("name", ["eval", "eval-wide-balls", "train"])
def test_pg_computes_upstreams_function_from_its_checkpoint(reference, name, tmp_path):
    run = next(r for r in reference["runs"] if r["name"] == name)
    model = MODELS.build(deepcopy(dict(reference["kwargs"], **run["overrides"])))
    load_upstream_checkpoint(model, reference, dict(unused_params=[]), tmp_path)
    model.train(run["mode"] == "train")
    out = _upstream_outputs(model, reference["input"])
    want = expected(reference, run["output"])
    if run["mode"] == "eval":  # pimm's evaluators' keys besides upstream's
        seg_logits, instance_pred = out.pop("seg_logits"), out.pop("instance_pred")
        assert torch.equal(seg_logits, out["logit_pred"])
        masks = want["pred_masks"].bool()
        assert masks.shape[0] > 1 and masks.sum(0).max() == 1  # several proposals, disjoint
        assert torch.equal(instance_pred, torch.where(masks.any(0), masks.long().argmax(0), -1))
    diffs = compare(flatten(out), want, name)
    assert max(diffs.values()) <= 1e-4


def test_an_upstream_checkpoint_loads_strictly_through_from_pretrained(reference, tmp_path):
    state = upstream_state(reference)
    torch.save({"epoch": 3, "state_dict": {"module." + k: v for k, v in state.items()}}, tmp_path / "model_best.pth")
    model = pimm.from_pretrained(str(tmp_path / "model_best.pth"), model_config=reference["kwargs"])
    assert not model.training
    assert set(model.state_dict()) == set(state)
    assert all(torch.equal(model.state_dict()[k].float(), v.float()) for k, v in state.items())
    shapes = {k: list(v.shape) for k, v in MODELS.build(reference["kwargs"]).state_dict().items()}
    assert shapes == dict(zip(reference["param_names"], reference["param_shapes"]))


# -- on pimm's other backbones, and through the trainer -----------------------------------
def _event_batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    grid = torch.unique(torch.randint(0, 12, (400, 3), generator=g), dim=0)[:150]
    n = grid.shape[0]
    coord = grid.float() * 0.02
    instance = grid[:, 0] // 4 + 3 * (grid[:, 1] // 6)
    centroid = torch.zeros(n, 3)
    for i in instance.unique():
        centroid[instance == i] = coord[instance == i].mean(0)
    return dict(coord=coord, grid_coord=grid, feat=torch.randn(n, 2, generator=g), offset=torch.tensor([70, n]),
                segment=(instance % 3) + 1, instance=instance, instance_centroid=centroid, grid_size=0.02)


@pytest.mark.parametrize("backbone", [
    dict(type="SparseUNet", in_channels=2, channels=(8, 16), enc_blocks=(1, 1), dec_blocks=(1,), grid_size=0.02),
    dict(type="PT-v3m2", in_channels=2, order=("z",), stride=(2,), enc_depths=(1, 1), enc_channels=(8, 8),
         enc_num_head=(1, 1), enc_patch_size=(32, 32), dec_depths=(1,), dec_channels=(8,), dec_num_head=(1,),
         dec_patch_size=(32,), enable_flash=False)], ids=["SparseUNet", "PT-v3m2"])
def test_pg_trains_and_proposes_on_backbones_pimm_already_had(backbone):
    torch.manual_seed(0)
    model = MODELS.build(dict(type="PG-v1m1", backbone=backbone, backbone_out_channels=8, semantic_num_classes=4,
                              segment_ignore_index=(-1, 0), cluster_min_points=2, cluster_propose_points=2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = _event_batch()
    losses = []
    for _ in range(8):
        out = model(dict(data))
        optimizer.zero_grad()
        out["loss"].backward()
        optimizer.step()
        losses.append(out["loss"].item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    model.eval()
    out = model(dict(data))
    n = data["coord"].shape[0]
    assert out["pred_masks"].shape[1] == n and out["seg_logits"].shape == (n, 4)
    assert out["pred_scores"].shape == out["pred_classes"].shape == (out["pred_masks"].shape[0],)
    assert torch.equal(out["instance_pred"] >= 0, out["pred_masks"].bool().any(0))


def test_pg_training_without_the_offset_target_is_one_line():
    model = MODELS.build(dict(type="PG-v1m1", backbone_out_channels=8, semantic_num_classes=4,
                              backbone=dict(type="SparseUNet", in_channels=2, channels=(8, 16), enc_blocks=(1, 1),
                                            dec_blocks=(1,), grid_size=0.02)))
    data = _event_batch()
    del data["instance_centroid"]
    with pytest.raises(ConfigError, match=r"lacks \['instance_centroid'\] \(add InstanceParser"):
        model(data)
    model.eval()
    assert "loss" not in model(data) and "pred_masks" in model(data)  # inference needs no truth
    with pytest.raises(ConfigError, match="backbone_out_channels=16 but the backbone 'SparseUNet' outputs 8"):
        MODELS.build(dict(type="PG-v1m1", backbone_out_channels=16,
                          backbone=dict(type="SparseUNet", in_channels=2, channels=(8, 16), enc_blocks=(1, 1),
                                        dec_blocks=(1,))))


def test_the_lartpc_config_trains_two_steps_through_the_trainer(tmp_path, capsys):
    import pimm.cli

    pimm.cli.register_all()
    from pimm.engines.run.launch import main as launch_main

    save = tmp_path / "run"
    code = launch_main(["--config-file", str(ROOT / "configs" / "lartpc" / "inseg-pg-v1m1.py"), "--options",
                        f"save_path={save}", "data.train.num_events=4", "data.val.num_events=2", "batch_size=2",
                        "batch_size_val=2", "epoch=1", "scheduler.warmup_steps=1",
                        "+custom_imports=['tests.support.stop_after']", "+hooks=[dict(type='StopAfter', steps=2)]"])
    assert code == 0, capsys.readouterr().err[-2000:]
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(math.isfinite(r["train/loss"]) for r in steps)
    assert {"train/seg_loss", "train/bias_l1_loss", "train/bias_cosine_loss"} <= set(steps[0])
    assert any("val/ARI" in r and "val/mIoU" in r for r in records)  # proposals scored by InsSegEvaluator


def test_the_bench_times_pg_beside_its_backbone(capsys):
    """``bench/model_zoo.py --families pg``: a row per model and step kind, and PG's clustering alone."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("model_zoo", ROOT / "bench" / "model_zoo.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--families", "pg", "--rounds", "1", "--batches", "1", "--events", "1"])
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out if line.startswith("pg ") and "clustering" not in line]
    assert [(r[1], r[2]) for r in rows] == [("train", "SpUNet-v1m1+head"), ("train", "PG-v1m1"),
                                            ("eval", "SpUNet-v1m1+head"), ("eval", "PG-v1m1")]
    assert all(float(r[4]) > 0 for r in rows)
    assert any("clustering alone, perfect predictions" in line and "proposals a batch" in line for line in out)
