"""Collate functions: offsets, concatenation, event mixing, batch-unique instances."""

import functools

import numpy as np
import torch
from torch.utils.data import DataLoader

from pimm.datasets.collate import collate_fn, inseg_collate_fn, point_collate_fn
from pimm.datasets.lartpc import LArTPCSynthDataset
from pimm.engines.registries import COLLATE_FNS


def make_batch(sizes=(3, 5, 2), seed=0):
    rng = np.random.default_rng(seed)
    batch = []
    for i, n in enumerate(sizes):
        batch.append(dict(
            coord=torch.from_numpy(rng.normal(size=(n, 3)).astype(np.float32)),
            feat=torch.from_numpy(rng.normal(size=(n, 4)).astype(np.float32)),
            segment=torch.from_numpy(rng.integers(0, 5, n)),
            instance=torch.tensor([-1] + list(range(n - 1))),
            name=f"ev{i}",
            index=i,
        ))
    return batch


def test_registered_by_function_name():
    for fn in (collate_fn, point_collate_fn, inseg_collate_fn):
        assert COLLATE_FNS.get(fn.__name__) is fn


def test_collate_concatenates_and_offsets():
    batch = make_batch()
    out = collate_fn(batch)
    assert out["offset"].dtype == torch.int64
    assert out["offset"].tolist() == [3, 8, 10]
    assert out["offset"][-1] == len(out["coord"])
    for k in ("coord", "feat", "segment", "instance"):
        torch.testing.assert_close(out[k], torch.cat([b[k] for b in batch]))
    assert out["name"] == ["ev0", "ev1", "ev2"]
    assert out["index"].tolist() == [0, 1, 2]
    # numpy inputs become tensors too
    np_batch = [{k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in batch]
    torch.testing.assert_close(collate_fn(np_batch)["coord"], out["coord"])


def test_point_collate_mixing():
    batch = make_batch((3, 5, 2, 4))
    plain = collate_fn(batch)
    never = point_collate_fn(batch, mix_prob=0.0)
    assert never["offset"].tolist() == plain["offset"].tolist() == [3, 8, 10, 14]
    always = point_collate_fn(batch, mix_prob=1.0)
    assert always["offset"].tolist() == [8, 14]  # events 0+1 and 2+3 merged
    torch.testing.assert_close(always["coord"], plain["coord"])  # points untouched
    odd = point_collate_fn(make_batch((3, 5, 2)), mix_prob=1.0)
    assert odd["offset"].tolist() == [8, 10]  # the last event stays alone
    bound = functools.partial(point_collate_fn, mix_prob=1.0)
    assert bound(batch)["offset"].tolist() == [8, 14]
    np.random.seed(0)
    a = [len(point_collate_fn(batch, mix_prob=0.5)["offset"]) for _ in range(20)]
    np.random.seed(0)
    b = [len(point_collate_fn(batch, mix_prob=0.5)["offset"]) for _ in range(20)]
    assert a == b and set(a) == {2, 4}


def test_inseg_collate_makes_instances_unique():
    batch = make_batch((3, 5, 1, 4))
    out = inseg_collate_fn(batch)
    assert out["num_instances"].tolist() == [2, 4, 0, 3]
    inst, offset = out["instance"], out["offset"].tolist()
    starts = [0] + offset[:-1]
    seen = set()
    base = 0
    for i, (s, e) in enumerate(zip(starts, offset)):
        ids = inst[s:e]
        orig = batch[i]["instance"]
        assert torch.equal(ids == -1, orig == -1)  # ignore label survives
        torch.testing.assert_close(ids[orig >= 0], orig[orig >= 0] + base)
        ev_ids = set(ids[ids >= 0].tolist())
        assert not ev_ids & seen
        seen |= ev_ids
        base += out["num_instances"][i].item()
    assert batch[1]["instance"].tolist() == [-1, 0, 1, 2, 3]  # inputs not modified


def test_dataloader_with_generator_and_transforms():
    ds = LArTPCSynthDataset(num_events=4, transform=[
        dict(type="GridSample", grid_size=2.0, return_grid_coord=True), dict(type="ToTensor"),
        dict(type="Collect", keys=("coord", "grid_coord", "segment", "instance"), feat_keys=("coord", "energy"))])
    loader = DataLoader(ds, batch_size=2, collate_fn=inseg_collate_fn)
    batch = next(iter(loader))
    n = len(batch["coord"])
    assert batch["offset"][-1] == n and batch["offset"].shape == (2,)
    assert batch["grid_coord"].shape == (n, 3) and batch["grid_coord"].dtype == torch.int64
    assert batch["feat"].shape == (n, 4) and batch["segment"].dtype == torch.int64
    assert batch["num_instances"].shape == (2,)
    assert ds.collate_fn is collate_fn  # default batching for trainers that name none
    assert DataLoader(ds, batch_size=3, collate_fn=ds.collate_fn).__iter__().__next__()["offset"].shape == (3,)


def test_offset_keys_become_cumulative_and_private_keys_are_dropped():
    batch = make_batch((3, 5, 2))
    for b in batch:
        n = len(b["coord"])
        b["offset"] = torch.tensor([99])  # whatever Collect stored, offset follows the points
        b["origin_offset"] = torch.tensor([n + 1])  # a per-event count, as Collect(offset_keys_dict=...) writes
        b["_debug"] = object()
    out = collate_fn(batch)
    assert out["offset"].tolist() == [3, 8, 10]
    assert out["origin_offset"].tolist() == [4, 10, 13]
    assert "_debug" not in out
    # a cumulative entry (an event that was itself a batch) is split back into counts
    nested = [dict(coord=torch.zeros(4, 3), sub_offset=torch.tensor([1, 4])),
              dict(coord=torch.zeros(2, 3), sub_offset=torch.tensor([2]))]
    assert collate_fn(nested)["sub_offset"].tolist() == [1, 4, 6]


def test_mixing_keeps_instances_of_merged_events_apart():
    batch = make_batch((3, 5, 2))  # instances per event: [-1, 0, 1], [-1, 0..3], [-1, 0]
    mixed = point_collate_fn(batch, mix_prob=1.0)
    assert mixed["offset"].tolist() == [8, 10]
    # event 1 is merged into event 0: its ids move past event 0's max (1) + 1
    assert mixed["instance"].tolist() == [-1, 0, 1, -1, 2, 3, 4, 5, -1, 0]
    assert batch[1]["instance"].tolist() == [-1, 0, 1, 2, 3]  # inputs not modified
    assert point_collate_fn(batch, mix_prob=0.0)["instance"].tolist() == [-1, 0, 1, -1, 0, 1, 2, 3, -1, 0]
