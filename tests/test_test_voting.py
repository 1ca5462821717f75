"""Test-time fragments and voting, scored on every original point (issue 40).

A hand-made event whose cells of 2 units hold points of different classes
shows the difference: an oracle that predicts every point it is shown
perfectly scores 1.0 on the voxelised points, but on the original points
each merged point takes its cell's prediction, so it scores exactly what
voxelisation loses -- and with test-mode fragments (every point shown in
some fragment) it scores 1.0 on every original point again.
"""

from __future__ import annotations

import contextlib
import csv
import json
import subprocess
import sys
import types
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pimm.cli  # noqa: E402

pimm.cli.register_all()

from pimm.datasets.fragments import build_test_item, fragments_for_test_mode  # noqa: E402
from pimm.datasets.lartpc import LArTPCSynthDataset  # noqa: E402
from pimm.datasets.pilarnet import PILArNetH5Dataset, write_pilarnet_h5  # noqa: E402
from pimm.datasets.point_dataset import PointDataset  # noqa: E402
from pimm.engines.observe.eval_records import write_eval_record  # noqa: E402
from pimm.engines.run.launch import main as launch_main  # noqa: E402
from pimm.datasets.point_dict import index_points  # noqa: E402
from pimm.engines.registries import DATASETS, MODELS, TRANSFORMS  # noqa: E402
from pimm.evaluation import InsSegEvaluator, SemSegEvaluator  # noqa: E402
from pimm.evaluation.voting import InstanceVotes  # noqa: E402
from pimm.utils.errors import ConfigError  # noqa: E402
from tests.support.run import env as tool_env  # noqa: E402

# Seven points in four 2-unit cells: (0, 1) share a cell with classes 0 and 1,
# (2, 3) with 1 and 1, (4, 5) with 2 and 0; point 6 is alone.
COORD = np.array([[0.2, 0.2, 0.2], [1.5, 1.5, 1.5], [4.2, 0.2, 0.2], [5.5, 1.5, 1.5],
                  [8.2, 0.2, 0.2], [9.5, 1.5, 1.5], [12.2, 0.2, 0.2]], dtype=np.float32)
SEGMENT = np.array([0, 1, 1, 1, 2, 0, 3])
INSTANCE = np.array([0, 1, 2, 2, 3, 4, 5])
TRAIN_GRID = dict(type="GridSample", grid_size=2.0, hash_type="ravel", mode="train", reduce="first",
                  return_inverse=True)
TEST_GRID = dict(type="GridSample", grid_size=2.0, hash_type="ravel", mode="test")
PACK = [dict(type="ToTensor"), dict(type="Collect", keys=("coord", "index"), feat_keys=("segment", "instance"))]


@DATASETS.register_module(force=True)
class VotingPairs(PointDataset):
    """The event above, ``num_events`` times (test data for this module)."""

    domains = dict(num_events=int)

    def __init__(self, num_events: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.num_events = num_events

    def __len__(self):
        return self.num_events

    def get_data(self, idx):
        return dict(coord=COORD.copy(), segment=SEGMENT.copy(), instance=INSTANCE.copy(), name=f"pairs_{idx}")


@MODELS.register_module(force=True)
class VotingOracle(torch.nn.Module):
    """Predicts each point it is shown from its labels (``feat`` = segment, instance)."""

    def __init__(self, num_classes: int = 4):
        super().__init__()
        self.num_classes = num_classes
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.calls = 0

    def forward(self, batch):
        self.calls += 1
        feat = batch["feat"]
        return dict(seg_logits=F.one_hot(feat[:, 0].long(), self.num_classes).float() * 5 * self.scale,
                    instance_pred=feat[:, 1].long())


@TRANSFORMS.register_module(force=True)
class KeepFirstPoints:
    """A crop for these tests: keeps the first ``count`` points."""

    domains = dict(count=int)

    def __init__(self, count: int = 1):
        self.count = count

    def __call__(self, data):
        return index_points(data, np.arange(min(self.count, len(data["coord"]))))


def fake_trainer():
    return types.SimpleNamespace(device=torch.device("cpu"), to_device=lambda b: b,
                                 autocast=contextlib.nullcontext)


def evaluate(evaluator, dataset, model=None):
    evaluator.trainer = fake_trainer()
    model = model or VotingOracle()
    return evaluator.evaluate(DataLoader(dataset, batch_size=2, collate_fn=dataset.collate_fn), model)


def semseg():
    evaluator = SemSegEvaluator(num_classes=4, ignore_index=-1)
    return evaluator


def test_a_model_is_scored_on_every_original_point_not_on_the_voxels():
    voxel_level = VotingPairs(split="test", transform=[TRAIN_GRID, *PACK[:1], dict(
        type="Collect", keys=("coord", "segment"), feat_keys=("segment", "instance"))])
    on_voxels = evaluate(semseg(), voxel_level)
    assert on_voxels["allAcc"] == 1.0 and sum(on_voxels["points"]) == 4  # one point per cell

    test_mode = VotingPairs(split="test", transform=[TRAIN_GRID], test_mode=True, test_cfg=dict(post_transform=PACK))
    on_points = evaluate(semseg(), test_mode)
    # Every original point counted once: 7 points, classes 0,1,1,1,2,0,3.
    assert on_points["points"] == [2, 3, 1, 1]
    # The merged points 1 (class 1) and 5 (class 0) take their cell's prediction (0 and 2): 5 of 7 right.
    assert on_points["allAcc"] == pytest.approx(5 / 7)
    assert on_points["confusion"][1][0] == 1 and on_points["confusion"][0][2] == 1


def test_fragments_and_augmentations_are_voted_back_onto_every_point():
    dataset = VotingPairs(num_events=3, split="test", test_mode=True, test_cfg=dict(
        voxelize=TEST_GRID, post_transform=PACK,
        aug_transform=[[], [dict(type="RandomFlip", p=1.0)], [dict(type="ShufflePoint")]], fragment_batch_size=2))
    item = dataset[0]
    # 3 augmentations x 2 fragments (the largest cell holds 2 points), in batches of 2.
    assert len(item["fragment_list"]) == 6 and item["transformed_points"] == 7
    held = np.concatenate([np.asarray(f["index"]) for f in item["fragment_list"]])
    assert np.array_equal(np.bincount(held, minlength=7), [3, 3, 3, 3, 3, 3, 6])
    for fragment in item["fragment_list"]:  # index follows the points through the shuffle
        assert np.array_equal(fragment["feat"][:, 0].numpy(), SEGMENT[np.asarray(fragment["index"])])
    model = VotingOracle()
    metrics = evaluate(semseg(), dataset, model)
    assert metrics["allAcc"] == 1.0 and metrics["points"] == [6, 9, 3, 3]
    assert model.calls == 3 * 3  # 3 events, 6 fragments each in batches of 2


def test_probabilities_are_averaged_over_the_fragments_that_hold_a_point():
    class Disagreeing(VotingOracle):
        """Right on the first fragment, class 3 on the two others: two wrong views outvote one right one."""

        def forward(self, batch):
            out = super().forward(batch)
            if self.calls > 1:  # every fragment after the first says class 3
                out["seg_logits"] = F.one_hot(torch.full_like(batch["feat"][:, 0].long(), 3), 4).float() * 5
            return out

    dataset = VotingPairs(split="test", test_mode=True, test_cfg=dict(
        post_transform=PACK, aug_transform=[[], [], []]))
    metrics = evaluate(semseg(), dataset, Disagreeing())
    assert metrics["points"] == [2, 3, 1, 1] and metrics["allAcc"] == pytest.approx(1 / 7)  # only class 3 right


def test_the_mapping_back_is_exact_through_gridsample_and_nearest_otherwise():
    fragments = fragments_for_test_mode(True, dict(post_transform=PACK), "VotingPairs")
    event = dict(coord=COORD, segment=SEGMENT, instance=INSTANCE)
    from pimm.datasets.transforms import Compose

    exact = build_test_item(event, Compose([TRAIN_GRID]), fragments)
    assert np.array_equal(exact["inverse"], [0, 0, 1, 1, 2, 2, 3])
    # A shuffle after the GridSample makes its inverse stale: the nearest kept point is used instead.
    np.random.seed(3)
    shuffled = build_test_item(event, Compose([TRAIN_GRID, dict(type="ShufflePoint")]), fragments)
    kept = np.concatenate([np.asarray(f["index"]) for f in shuffled["fragment_list"]])
    rows = shuffled["fragment_list"][0]["feat"][:, 0].numpy()  # the kept points' classes, shuffled
    assert sorted(kept.tolist()) == [0, 1, 2, 3]
    assert np.array_equal(rows[shuffled["inverse"]], [0, 0, 1, 1, 2, 2, 3])
    assert np.array_equal(shuffled["origin_segment"], SEGMENT) and len(shuffled["origin_coord"]) == 7


def test_instances_are_voted_by_overlap_and_mapped_to_every_point():
    votes = InstanceVotes(6)
    votes.add([0, 1, 2, 3], [0, 0, 1, 1])
    votes.add([0, 1, 2, 3, 4], [7, 7, 5, 5, 5])  # other ids, same grouping; row 4 joins the second
    votes.add([5], [9])  # shares no row: a new instance
    votes.add([0, 1, 2], [-1, 4, 4])  # a fragment splitting differently is outvoted on row 1
    assert votes.labels().tolist() == [0, 0, 1, 1, 1, 2]

    dataset = VotingPairs(split="test", transform=[TRAIN_GRID], test_mode=True, test_cfg=dict(
        voxelize=TEST_GRID, post_transform=PACK, aug_transform=[[], [dict(type="RandomFlip", p=1.0)]]))
    evaluator = InsSegEvaluator(num_classes=4, iou_threshold=0.5)
    metrics = evaluate(evaluator, dataset)
    # Scored on the 7 original points: the merged cells (0,1) and (4,5) hold two true instances each,
    # predicted as one: of 6 true instances, (2,3) and 6 are found, (0,1) and (4,5) each match one (IoU 0.5 is
    # not above the threshold), so 2 of 6 true and 2 of 4 predicted match.
    assert metrics["counts"] == {"tp": 2, "fp": 2, "fn": 4}


def test_every_point_data_set_takes_test_mode(tmp_path):
    cfg = dict(voxelize=dict(TEST_GRID, grid_size=4.0), post_transform=[dict(type="ToTensor"), dict(
        type="Collect", keys=("coord", "index", "segment"), feat_keys=("energy",))])
    synth = LArTPCSynthDataset(num_events=2, points_per_event=(200, 300), split="test", test_mode=True,
                               test_cfg=cfg)
    item = synth[1]
    raw = LArTPCSynthDataset(num_events=2, points_per_event=(200, 300), split="test")[1]
    assert np.array_equal(item["origin_segment"], raw["segment"]) and len(item["inverse"]) == len(raw["coord"])
    covered = np.unique(np.concatenate([f["index"].numpy() for f in item["fragment_list"]]))
    assert np.array_equal(covered, np.arange(len(raw["coord"])))  # the fragments hold every point
    write_pilarnet_h5([raw, raw], tmp_path / "events.h5")
    h5 = PILArNetH5Dataset(str(tmp_path / "events.h5"), min_points=0, loop=3, test_mode=True, test_cfg=cfg)
    assert len(h5) == 2  # loop is 1 in test mode: each event is scored once
    assert len(h5[0]["origin_coord"]) == len(raw["coord"])


@pytest.mark.parametrize("test_cfg, message", [
    (dict(voxelise=TEST_GRID), r"^VotingPairs.test_cfg.voxelise is not a test_cfg key; test_cfg takes voxelize, "),
    (dict(aug_transform=[dict(type="RandomFlip")]), r"^VotingPairs.test_cfg.aug_transform=.* is invalid: it takes "
                                                    r"a non-empty list of transform lists"),
    (dict(fragment_batch_size=0), r"^VotingPairs.test_cfg.fragment_batch_size=0 is invalid"),
    ([TEST_GRID], r"^VotingPairs.test_cfg=.* is invalid: it takes None or a dict"),
    (None, r"^VotingPairs: test_mode=True needs test_cfg="),
])
def test_a_bad_test_cfg_is_one_line_naming_the_key(test_cfg, message):
    with pytest.raises(ConfigError, match=message) as err:
        VotingPairs(split="test", test_mode=True, test_cfg=test_cfg)
    assert "\n" not in str(err.value)


def test_a_post_transform_that_drops_index_still_votes_and_one_that_drops_points_is_refused():
    dataset = VotingPairs(split="test", test_mode=True, test_cfg=dict(post_transform=[dict(type="ToTensor"), dict(
        type="Collect", keys=("coord",), feat_keys=("segment", "instance"))]))
    assert evaluate(semseg(), dataset)["allAcc"] == 1.0  # index is put back on every fragment
    cropping = VotingPairs(split="test", test_mode=True, test_cfg=dict(post_transform=[TRAIN_GRID]))
    with pytest.raises(ConfigError, match="test_cfg.post_transform changed a fragment's point count"):
        cropping[0]


def test_each_evaluation_writes_a_record_with_json_and_csv(tmp_path):
    now = datetime(2026, 12, 6, 7, 30, 5, tzinfo=timezone.utc)
    results = {"SemSegEvaluator": {"mIoU": 0.5, "allAcc": float("nan"), "points": [1, 2],
                                   "per_class": {"iou_a": 0.25}}}
    payload = {"weight": "w.pth", "metrics": {"SemSegEvaluator": {"mIoU": 0.5, "allAcc": None}}}
    first = write_eval_record(tmp_path, payload, results, now=now)
    second = write_eval_record(tmp_path, payload, results, now=now)
    assert first == tmp_path / "eval" / "20261206T073005Z" and second.name == "20261206T073005Z-2"
    document = json.loads((first / "test_metrics.json").read_text())
    assert document["weight"] == "w.pth" and document["created_at"].startswith("2026-12-06T07:30:05")
    rows = list(csv.reader(open(first / "test_metrics.csv")))
    assert rows == [["evaluator", "metric", "value"], ["SemSegEvaluator", "mIoU", "0.5"],
                    ["SemSegEvaluator", "allAcc", ""], ["SemSegEvaluator", "per_class.iou_a", "0.25"]]


CONFIG = '''
_base_ = {base!r}
custom_imports = ["tests.test_test_voting"]
save_path = {save_path!r}
num_worker = 0
batch_size = 2
model = dict(type="VotingOracle")
data = dict(
    num_classes=4,
    names=["a", "b", "c", "d"],
    test=dict(type="VotingPairs", num_events=2, split="test", transform=[{grid!r}],
              test_mode=True, test_cfg=dict(post_transform={pack!r})),
)
test = dict(type="SemSegTester")
optimizer = dict(type="AdamW", lr=0.01)
'''


def test_pimm_test_run_dir_scores_every_point_and_keeps_a_record_per_evaluation(tmp_path):
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    config = CONFIG.format(base=str(ROOT / "configs" / "_base_" / "default_runtime.py"), save_path=str(run),
                           grid=TRAIN_GRID, pack=PACK)
    (run / "config.py").write_text(config)
    torch.save({"state_dict": VotingOracle().state_dict(), "epoch": 1, "global_step": 1},
               run / "model" / "model_best.pth")
    # Once through the real command line, once in this process (tools/test.py's main).
    done = subprocess.run([sys.executable, "-m", "pimm.cli", "test", str(run)], capture_output=True, text=True,
                          env=tool_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert launch_main([str(run)], mode="test") == 0
    metrics = json.loads((run / "test_metrics.json").read_text())["metrics"]["SemSegEvaluator"]
    assert metrics["allAcc"] == pytest.approx(5 / 7) and metrics["points"] == [4, 6, 2, 2]
    records = sorted((run / "eval").iterdir())
    assert len(records) == 2  # one per evaluation, none overwritten
    for record in records:
        assert json.loads((record / "test_metrics.json").read_text())["metrics"]["SemSegEvaluator"] == metrics
        rows = {(r["evaluator"], r["metric"]): r["value"] for r in csv.DictReader(open(record / "test_metrics.csv"))}
        assert float(rows["SemSegEvaluator", "allAcc"]) == pytest.approx(5 / 7)


def test_a_bad_test_cfg_in_a_config_is_one_error_line_naming_the_key(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "config.py").write_text(CONFIG.format(base=str(ROOT / "configs" / "_base_" / "default_runtime.py"),
                                                 save_path=str(run), grid=TRAIN_GRID, pack=PACK))
    torch.save({"state_dict": VotingOracle().state_dict()}, run / "model" / "model_best.pth")
    for option, message in [
        ("+data.test.test_cfg.voxelise=None", "error: data.test.test_cfg.voxelise is not a test_cfg key; test_cfg "
                                              "takes voxelize, crop, post_transform, aug_transform, fragment_batch_size"),
        ("data.test.test_cfg.post_transform=[dict(type='GridSample', grid_size=-1)]",
         "error: data.test.test_cfg.post_transform.GridSample.grid_size=-1 is invalid: "),
    ]:
        capsys.readouterr()
        assert launch_main([str(run), "--options", option], mode="test") == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(message), errors
    assert not (run / "eval").exists() and not (run / "test_metrics.json").exists()


def test_a_model_output_without_the_voted_key_is_an_error_naming_it():
    class Silent(VotingOracle):
        def forward(self, batch):
            return {"other": batch["feat"]}

    dataset = VotingPairs(split="test", test_mode=True, test_cfg=dict(post_transform=PACK))
    with pytest.raises(KeyError, match="no 'seg_logits' to vote on .*keys: \\['other'\\]"):
        evaluate(semseg(), dataset, Silent())
    with pytest.raises(KeyError, match="no 'instance_pred' to vote on"):
        evaluate(InsSegEvaluator(num_classes=4), dataset, Silent())


def test_a_test_transform_that_packs_the_event_is_refused_with_what_to_do():
    packed = VotingPairs(split="test", transform=[TRAIN_GRID, *PACK[:1], dict(type="Collect", keys=("coord",),
                                                                                 feat_keys=("segment",))],
                         test_mode=True, test_cfg=dict(post_transform=PACK))
    with pytest.raises(ConfigError, match=r"^the data set's transform packs the event \(Collect/ToTensor\?\); in "
                                          r"test mode pack the fragments in test_cfg.post_transform instead$"):
        packed[0]
    narrowed = VotingPairs(split="test", transform=[dict(type="Update", keys_dict={"index_valid_keys": ["coord"]}),
                                                   TRAIN_GRID], test_mode=True, test_cfg=dict(post_transform=PACK))
    with pytest.raises(ConfigError, match="lost track of which points it kept"):
        narrowed[0]


def test_points_no_fragment_holds_are_counted_and_scored_with_uniform_probabilities(caplog):
    dataset = VotingPairs(split="test", test_mode=True, test_cfg=dict(
        crop=dict(type="KeepFirstPoints", count=5), post_transform=PACK))
    with caplog.at_level("WARNING", logger="pimm"):
        metrics = evaluate(semseg(), dataset)
    assert "test voting: 2 transformed points were in no fragment" in caplog.text
    # Points 5 (class 0) and 6 (class 3) were cut: uniform probabilities argmax to class 0.
    assert metrics["points"] == [2, 3, 1, 1] and metrics["allAcc"] == pytest.approx(6 / 7)
    assert metrics["confusion"][3][0] == 1
