"""Reading the detector reference fixtures (``tests/fixtures/detector_v4`` and
``detector_v5``: upstream's own model run on CPU, written by their
``make_reference.py``) and comparing pimm's outputs with them."""

from __future__ import annotations

import io
import lzma
from pathlib import Path

import torch

from pimm.engines.state.weights import load_weights

TOLERANCE = 1e-4


def load_reference(path: Path) -> dict:
    return torch.load(io.BytesIO(lzma.decompress(Path(path).read_bytes())), weights_only=True)


def flatten(value, path: str = "", out: dict | None = None) -> dict:
    """{key path: tensor | None} of an output, as the fixture scripts write it."""
    out = {} if out is None else out
    if isinstance(value, dict):
        for key, item in value.items():
            flatten(item, f"{path}.{key}" if path else str(key), out)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            flatten(item, f"{path}.{i}", out)
    elif value is None or isinstance(value, torch.Tensor):
        out[path] = value
    elif isinstance(value, (int, float)):
        out[path] = torch.tensor(float(value))
    return out


def expected(ref: dict, leaves: list) -> dict:
    """The {key path: tensor | None} a run's leaves ``[path, kind, shape, start]`` stand for."""
    out = {}
    for path, kind, shape, start in leaves:
        if kind == "none":
            out[path] = None
            continue
        source = ref["floats"] if kind == "float" else ref["ints"]
        out[path] = source[start:start + torch.Size(shape).numel()].reshape(shape)
    return out


def compare(got: dict, want: dict, what: str) -> dict:
    """Same key paths, kinds and shapes; floats within TOLERANCE, integers
    equal. Returns {path: max abs diff}."""
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want)))
    diffs = {}
    for path, reference in want.items():
        actual = got[path]
        if reference is None:
            assert actual is None, (what, path)
            continue
        assert actual is not None and tuple(actual.shape) == tuple(reference.shape), (what, path)
        if reference.is_floating_point():
            assert actual.is_floating_point(), (what, path)
            diff = (actual.detach().float() - reference).abs()
            finite = torch.isfinite(reference)
            assert torch.equal(torch.isfinite(actual.detach()), finite), (what, path)
            diff = diff[finite]
            worst = float(diff.max()) if diff.numel() else 0.0
            assert worst <= TOLERANCE, (what, path, worst)
            diffs[path] = worst
        else:
            assert not actual.is_floating_point() and torch.equal(actual.long(), reference.long()), (what, path)
            diffs[path] = 0.0
    return diffs


def upstream_state(ref: dict, skip=()) -> dict:
    """Upstream's state dict of the fixture (float32), less the ``skip`` names."""
    state, start = {}, 0
    for name, shape in zip(ref["param_names"], ref["param_shapes"]):
        n = torch.Size(shape).numel()
        if name not in skip:
            state[name] = ref["params"][start:start + n].float().view(shape).clone()
        start += n
    return state


def load_upstream_checkpoint(model, ref: dict, run: dict, tmp_path: Path):
    """Write the fixture's weights as upstream saves a checkpoint (``module.``
    prefixed under ``state_dict``) and load them strictly, every tensor used."""
    state = {"module." + k: v for k, v in upstream_state(ref, run["unused_params"]).items()}
    ckpt = Path(tmp_path) / "upstream.pth"
    torch.save({"epoch": 1, "state_dict": state}, ckpt)
    report = load_weights(model, ckpt, strict=True, allow_unexpected=False)
    assert not report["missing"] and not report["unexpected"] and not report["mismatched"]
    return model


def run_input(ref: dict, run: dict) -> dict:
    """The fixture's input as the run saw it (truth or not, one event or two)."""
    keep = ("coord", "grid_coord", "offset", "feat")
    data = {k: v.clone() for k, v in ref["input"].items() if run["truth"] or k in keep}
    if run["events"] == 1:
        n = int(data["offset"][0])
        data = {k: v[:n] if k != "offset" else v[:1] for k, v in data.items()}
    return data
