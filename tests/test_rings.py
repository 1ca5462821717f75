"""Tests of the synthetic water-Cherenkov ring data set and the RingCNN classifier."""

import math

import numpy as np
import pytest
import torch

from pimm.datasets.rings import ELECTRON_MASS, MUON_MASS, CherenkovRingDataset
from pimm.engines.registries import DATASETS, MODELS
from pimm.models.ring_cnn import RingCNN
from pimm.utils.errors import UserError


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------- determinism


def test_same_seed_and_index_give_identical_events():
    a = CherenkovRingDataset(20, seed=7)
    b = CherenkovRingDataset(20, seed=7)
    for i in (0, 5, 19):
        assert _same(a[i], b[i])
    assert _same(a[-1], a[19])


def test_access_order_and_global_rng_do_not_matter():
    ds = CherenkovRingDataset(12, seed=3)
    forward = [ds[i] for i in range(12)]
    np.random.seed(123)
    torch.manual_seed(123)
    backward = {i: ds[i] for i in reversed(range(12))}
    np.random.seed(999)
    torch.manual_seed(999)
    again = ds[4]
    assert all(_same(forward[i], backward[i]) for i in range(12))
    assert _same(again, forward[4])


def test_event_does_not_depend_on_dataset_length():
    # A resumed or resized run must see the same event at the same index.
    assert _same(CherenkovRingDataset(5, seed=1)[2], CherenkovRingDataset(500, seed=1)[2])


def test_splits_and_seeds_give_different_events():
    train = CherenkovRingDataset(8, seed=0, split="train")
    val = CherenkovRingDataset(8, seed=0, split="val")
    test = CherenkovRingDataset(8, seed=0, split="test")
    other = CherenkovRingDataset(8, seed=1, split="train")
    for i in range(8):
        imgs = [d[i]["img"] for d in (train, val, test, other)]
        for j in range(4):
            for k in range(j + 1, 4):
                assert not torch.equal(imgs[j], imgs[k])


def test_in_memory_matches_on_the_fly():
    lazy = CherenkovRingDataset(6, seed=5, split="val")
    stored = CherenkovRingDataset(6, seed=5, split="val", in_memory=True)
    for i in range(6):
        assert _same(lazy[i], stored[i])
    sample = stored[2]
    sample["img"].zero_()  # a caller scribbling on its sample must not corrupt the store
    assert _same(stored[2], lazy[2])


# ----------------------------------------------------------- shapes and labels


def test_sample_shapes_and_dtypes():
    ds = CherenkovRingDataset(4, image_size=(24, 40))
    sample = ds[0]
    assert set(sample) == {"img", "label", "momentum"}
    assert sample["img"].shape == (2, 24, 40) and sample["img"].dtype == torch.float32
    assert sample["label"].shape == () and sample["label"].dtype == torch.int64
    assert sample["momentum"].shape == () and sample["momentum"].dtype == torch.float32
    assert torch.isfinite(sample["img"]).all()
    assert len(ds) == 4 and ds.num_classes == 2 and ds.class_names == ("electron", "muon")
    assert ds.in_channels == 2
    charge_only = CherenkovRingDataset(2, with_time=False)
    assert charge_only[0]["img"].shape == (1, 32, 64) and charge_only.in_channels == 1
    with pytest.raises(IndexError):
        ds[4]


def test_default_collate_builds_a_batch():
    ds = CherenkovRingDataset(8)
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=8)))
    assert batch["img"].shape == (8, 2, 32, 64)
    assert batch["label"].shape == (8,) and batch["momentum"].shape == (8,)


def test_labels_balanced_and_momentum_in_range():
    ds = CherenkovRingDataset(300, seed=11, momentum_range=(300.0, 700.0))
    samples = [ds[i] for i in range(len(ds))]
    labels = np.array([int(s["label"]) for s in samples])
    momenta = np.array([float(s["momentum"]) for s in samples])
    assert set(labels) == {0, 1} and 0.4 < labels.mean() < 0.6
    assert 300.0 <= momenta.min() and momenta.max() <= 700.0
    # Uniform, not clustered: both halves of the range are populated for both species.
    for label in (0, 1):
        assert 0.3 < np.mean(momenta[labels == label] < 500.0) < 0.7


def test_registered_and_buildable_from_config():
    ds = DATASETS.build(dict(type="CherenkovRingDataset", num_events=3, split="test"))
    assert isinstance(ds, CherenkovRingDataset) and len(ds) == 3
    model = MODELS.build(dict(type="RingCNN", in_channels=2))
    assert isinstance(model, RingCNN)


@pytest.mark.parametrize(
    "kwargs, culprit",
    [
        (dict(num_events=0), "num_events"),
        (dict(num_events=-3), "num_events"),
        (dict(num_events=2.5), "num_events"),
        (dict(num_events=4, split="training"), "split"),
        (dict(num_events=4, seed=-1), "seed"),
        (dict(num_events=4, image_size=(2, 64)), "image_size"),
        (dict(num_events=4, momentum_range=(100.0, 500.0)), "momentum_range"),  # below muon threshold
        (dict(num_events=4, momentum_range=(600.0, 500.0)), "momentum_range"),
        (dict(num_events=4, noise_rate=-0.1), "noise_rate"),
        (dict(num_events=4, refractive_index=1.0), "refractive_index"),
        (dict(num_events=4, pe_per_cm=0), "pe_per_cm"),
    ],
)
def test_bad_arguments_raise_user_error_naming_them(kwargs, culprit):
    with pytest.raises(UserError, match=culprit):
        CherenkovRingDataset(**kwargs)


# ---------------------------------------------------------------------- physics


def _pixel_directions(ds: CherenkovRingDataset, vertex: np.ndarray) -> np.ndarray:
    """Unit vectors from ``vertex`` to every pixel centre on the barrel, (H, W, 3)."""
    height, width = ds.image_size
    phi = (np.arange(width) + 0.5) / width * 2 * math.pi - math.pi
    z = ((np.arange(height) + 0.5) / height * 2 - 1) * ds.tank_half_height
    points = np.stack(
        np.broadcast_arrays(
            ds.tank_radius * np.cos(phi)[None, :], ds.tank_radius * np.sin(phi)[None, :], z[:, None]
        ),
        axis=-1,
    )
    rel = points - vertex
    return rel / np.linalg.norm(rel, axis=-1, keepdims=True)


def _opening_angles(ds, event) -> np.ndarray:
    """Angle (deg) between the particle direction and the vertex->pixel line, (H, W)."""
    cos = _pixel_directions(ds, event["vertex"]) @ event["direction"]
    return np.degrees(np.arccos(np.clip(cos, -1.0, 1.0)))


def test_muon_rings_have_a_sharp_edge_and_electron_rings_a_diffuse_one():
    """Seen from the vertex, a muon's light stays inside the maximal Cherenkov
    cone (41 deg; it only shrinks as the muon slows). A shower's scattered
    secondaries spill light outside it. The fraction of charge beyond 46 deg
    measures how diffuse the outer edge is."""
    ds = CherenkovRingDataset(160, seed=2, noise_rate=0.0, log_charge=False)
    outside = {0: [], 1: []}
    for i in range(len(ds)):
        event = ds.generate(i)
        charge = event["img"][0]
        if charge.sum() < 50:  # nearly all light on a cap: no ring to judge
            continue
        frac = charge[_opening_angles(ds, event) > 46.0].sum() / charge.sum()
        outside[event["label"]].append(frac)
    electron, muon = np.array(outside[0]), np.array(outside[1])
    assert len(electron) > 40 and len(muon) > 40
    assert np.median(muon) < 0.005
    assert np.median(electron) > 0.03
    # Nearly every electron is fuzzier than the typical muon.
    assert np.mean(electron > np.percentile(muon, 90)) > 0.9


def _muon_edge_angles(p_range) -> tuple[float, float]:
    """Medians over muon events of the outer ring edge seen from the vertex (deg):
    the angle containing 90 % of the charge, and the largest lit angle."""
    ds = CherenkovRingDataset(160, seed=4, noise_rate=0.0, log_charge=False, momentum_range=p_range)
    edges = []
    for i in range(len(ds)):
        event = ds.generate(i)
        charge = event["img"][0]
        if event["label"] != 1 or charge.sum() < 20:
            continue
        angles = _opening_angles(ds, event).ravel()
        order = np.argsort(angles)
        cumulative = np.cumsum(charge.ravel()[order]) / charge.sum()
        edges.append((angles[order][np.searchsorted(cumulative, 0.9)], angles[charge.ravel() > 0].max()))
    assert len(edges) > 30
    q90, q_max = np.median(edges, axis=0)
    return float(q90), float(q_max)


def test_cherenkov_angle_follows_momentum_for_muons():
    """cos(theta) = 1/(n beta): a muon just above threshold has a narrow cone; a fast
    one (and any electron) is near the maximal 41 deg."""

    def cone_deg(p, mass):
        return math.degrees(math.acos(math.hypot(p, mass) / (1.33 * p)))

    assert cone_deg(200.0, MUON_MASS) == pytest.approx(31.7, abs=0.1)
    assert cone_deg(200.0, ELECTRON_MASS) == pytest.approx(41.2, abs=0.1)
    slow, fast = _muon_edge_angles((200.0, 240.0)), _muon_edge_angles((900.0, 1000.0))
    # Seen from the vertex, a slow muon's light stays near its 31.7 deg cone
    # (pixels are ~5 deg wide from a few metres), well inside the 41 deg of a fast one.
    assert slow[0] < 36.0
    assert fast[0] > slow[0] + 2.5
    assert fast[1] > slow[1] + 4.0


def test_light_yield_grows_with_momentum_and_charge_overlaps_between_species():
    def totals(p_range):
        ds = CherenkovRingDataset(120, seed=6, noise_rate=0.0, log_charge=False, momentum_range=p_range)
        out = {0: [], 1: []}
        for i in range(len(ds)):
            e = ds.generate(i)
            out[e["label"]].append(e["img"][0].sum())
        return {k: np.median(v) for k, v in out.items()}

    low, high = totals((200.0, 300.0)), totals((800.0, 1000.0))
    assert high[0] > 2 * low[0] and high[1] > 2 * low[1]
    # A 900 MeV/c muon is brighter than a 250 MeV/c electron: charge alone cannot tell them apart.
    assert high[1] > low[0]


def test_dark_noise_lights_pixels_behind_the_particle():
    """No Cherenkov light goes backwards, so charge behind the vertex is pure dark noise."""

    def behind_hits(noise_rate):
        ds = CherenkovRingDataset(30, seed=8, noise_rate=noise_rate, log_charge=False)
        lit = pixels = 0
        for i in range(len(ds)):
            event = ds.generate(i)
            back = _opening_angles(ds, event) > 100.0
            lit += int((event["img"][0][back] > 0).sum())
            pixels += int(back.sum())
        return lit, pixels

    lit, pixels = behind_hits(0.05)
    assert lit > 0 and lit / pixels == pytest.approx(1 - math.exp(-0.05), rel=0.3)
    assert behind_hits(0.0)[0] == 0


def test_time_channel_is_relative_to_the_first_photon():
    ds = CherenkovRingDataset(10, seed=9, noise_rate=0.0, log_charge=False, time_jitter=0.0)
    for i in range(len(ds)):
        img = ds.generate(i)["img"]
        charge, time = img[0], img[1]
        if charge.sum() == 0:
            continue
        assert np.all(time[charge == 0] == 0)
        assert time.min() >= 0.0  # the trigger photon defines t = 0
        # Light crosses at most the tank diameter-ish: well below 100 ns.
        assert time.max() * ds.time_scale < 100.0


# ------------------------------------------------------------------------ model


@pytest.fixture
def one_thread():
    """Tiny models run faster on one thread, and do not stall on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_model_outputs_and_loss(one_thread):
    model = RingCNN(in_channels=2, num_classes=2, width=8, depth=2)
    img = torch.randn(3, 2, 32, 64)
    out = model({"img": img})
    assert set(out) == {"cls_logits"} and out["cls_logits"].shape == (3, 2)
    out = model({"img": img, "label": torch.tensor([0, 1, 1])})
    assert out["loss"].shape == () and torch.isfinite(out["loss"])
    expected = torch.nn.functional.cross_entropy(out["cls_logits"], torch.tensor([0, 1, 1]))
    assert torch.allclose(out["loss"], expected)


def test_model_padding_is_circular_along_phi(one_thread):
    """Rolling the image along phi (the periodic axis) must not change the logits
    up to the stride grid: a roll by a multiple of the total stride commutes."""
    torch.manual_seed(0)
    model = RingCNN(in_channels=1, width=4, depth=2).eval()
    img = torch.randn(2, 1, 16, 32)
    with torch.no_grad():
        a = model({"img": img})["cls_logits"]
        b = model({"img": torch.roll(img, shifts=8, dims=3)})["cls_logits"]
    assert torch.allclose(a, b, atol=1e-5)
    flat = RingCNN(in_channels=1, width=4, depth=2, circular_phi=False).eval()
    flat.load_state_dict(model.state_dict())
    with torch.no_grad():
        c = flat({"img": torch.roll(img, shifts=8, dims=3)})["cls_logits"]
    assert not torch.allclose(a, c, atol=1e-5)


def test_model_rejects_wrong_channel_count_and_bad_args():
    with pytest.raises(UserError, match="in_channels"):
        RingCNN(in_channels=2)({"img": torch.zeros(1, 1, 16, 32)})
    with pytest.raises(UserError, match="norm"):
        RingCNN(norm="ln")
    with pytest.raises(UserError, match="width"):
        RingCNN(width=0)


@pytest.mark.parametrize("norm, lr", [("bn", 1e-2), ("gn", 3e-3)])
def test_a_few_steps_reduce_the_loss(norm, lr, one_thread):
    torch.manual_seed(0)
    ds = CherenkovRingDataset(16, seed=0, image_size=(16, 32))
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=16)))
    model = RingCNN(in_channels=ds.in_channels, width=8, depth=2, norm=norm)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(25):
        loss = model(batch)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.75 * losses[0]
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
