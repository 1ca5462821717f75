"""Event displays (pimm.evaluation.displays): arrays of the right shape and type,
not blank, and the predicted panels show the predicted labels."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pimm.datasets.rings import CherenkovRingDataset  # noqa: E402
from pimm.evaluation.displays import event_slice, render_point_event, render_ring_event  # noqa: E402

CLASSES = ("shower", "track", "michel")
BLUE, ORANGE = np.array([31, 119, 180]), np.array([255, 127, 14])  # tab10 colours of classes 0 and 1
GREEN, RED = np.array([44, 160, 44]), np.array([214, 39, 40])  # matplotlib's tab:green / tab:red


def near(image: np.ndarray, color: np.ndarray, tolerance: float = 40.0) -> np.ndarray:
    return np.linalg.norm(image.astype(np.float64) - color, axis=-1) < tolerance


@pytest.fixture(scope="module")
def event():
    rng = np.random.default_rng(0)
    coord = rng.normal(size=(600, 3)) * np.array([50.0, 20.0, 80.0])
    return coord


def test_point_event_image(event):
    segment = np.arange(len(event)) % 3
    image = render_point_event(event, segment, segment, CLASSES, title="event 0")
    assert image.ndim == 3 and image.shape[2] == 3 and image.dtype == np.uint8
    assert image.shape[0] > 300 and image.shape[1] > 300
    assert image.std() > 10 and (image < 250).any(axis=-1).mean() > 0.01  # far from a blank page
    assert near(image, BLUE).sum() > 50 and near(image, ORANGE).sum() > 50


def test_predicted_panels_show_the_predicted_labels(event):
    true = np.zeros(len(event), dtype=np.int64)
    wrong = np.ones(len(event), dtype=np.int64)
    image = render_point_event(event, true, wrong, CLASSES)
    height, width, _ = image.shape
    panels = image[: height - 40]  # above the legend, which shows every class colour
    left, right = panels[:, : width // 2], panels[:, width // 2:]
    assert near(left, BLUE).sum() > 200 and near(left, ORANGE).sum() < 20
    assert near(right, ORANGE).sum() > 200 and near(right, BLUE).sum() < 20
    right_when_correct = render_point_event(event, true, true, CLASSES)[: height - 40, width // 2:]
    assert near(right_when_correct, BLUE).sum() > 200 and near(right_when_correct, ORANGE).sum() < 20


def test_instance_columns_and_inputs_of_any_kind(event):
    segment = np.arange(len(event)) % 3
    instance = np.arange(len(event)) // 100 - 1  # ids -1 (grey) .. 4
    semantic = render_point_event(event, segment, segment, CLASSES)
    both = render_point_event(torch.from_numpy(event).float(), torch.from_numpy(segment), segment, CLASSES,
                              instance=torch.from_numpy(instance), pred_instance=instance[::-1].copy())
    assert both.shape[0] == semantic.shape[0] and both.shape[1] == pytest.approx(2 * semantic.shape[1], rel=0.1)
    with pytest.raises(ValueError, match="both instance and pred_instance"):
        render_point_event(event, segment, segment, CLASSES, instance=instance)
    with pytest.raises(ValueError, match="599 labels for 600 points"):
        render_point_event(event, segment, segment[1:], CLASSES)


def test_large_events_are_subsampled_the_same_way_each_time():
    rng = np.random.default_rng(1)
    coord = rng.uniform(0, 700, size=(30000, 3))
    labels = rng.integers(0, 3, size=30000)
    first = render_point_event(coord, labels, labels, CLASSES, max_points=2000)
    assert np.array_equal(first, render_point_event(coord, labels, labels, CLASSES, max_points=2000))


def test_event_slice():
    offset = torch.tensor([3, 10, 12])
    assert [event_slice(offset, i) for i in range(3)] == [slice(0, 3), slice(3, 10), slice(10, 12)]
    with pytest.raises(IndexError):
        event_slice(offset, 3)


def test_ring_event_image_title_colour_follows_the_verdict():
    dataset = CherenkovRingDataset(2, split="val")
    sample = dataset[0]
    label = int(sample["label"])
    right = render_ring_event(sample["img"], label, label, dataset.class_names, probability=0.9)
    wrong = render_ring_event(sample["img"].numpy(), label, 1 - label, dataset.class_names)
    for image in (right, wrong):
        assert image.ndim == 3 and image.shape[2] == 3 and image.dtype == np.uint8 and image.std() > 10
    title_rows = slice(0, right.shape[0] // 8)
    assert near(right[title_rows], GREEN).sum() > 20 and near(right[title_rows], RED).sum() == 0
    assert near(wrong[title_rows], RED).sum() > 20 and near(wrong[title_rows], GREEN).sum() == 0
    time_channel = render_ring_event(sample["img"], label, label, channel=1)
    assert not np.array_equal(time_channel, right)
    with pytest.raises(ValueError, match="channel 2 out of range"):
        render_ring_event(sample["img"], label, label, channel=2)
    with pytest.raises(ValueError, match="expected an image"):
        render_ring_event(np.zeros(5), label, label)
