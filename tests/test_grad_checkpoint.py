"""Gradient checkpointing of named submodules (runtime key ``gradient_checkpointing``):
the gradients and the training are those of the plain model, dropout included,
and exact resume still holds."""

from __future__ import annotations

import copy
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pimm.cli import register_all  # noqa: E402
from pimm.engines.optim.grad_checkpoint import apply_gradient_checkpointing, is_checkpointed  # noqa: E402
from pimm.engines.run.launch import build_trainer, load_config  # noqa: E402
from pimm.utils.errors import ConfigError  # noqa: E402
from tests.support.run import final_weights, train_losses, write_toy_config  # noqa: E402

register_all()  # models, data sets, evaluators


class Counting(nn.Module):
    """A block with dropout that counts how often its forward runs."""

    def __init__(self, width=16, p=0.3):
        super().__init__()
        self.linear, self.dropout, self.calls = nn.Linear(width, width), nn.Dropout(p), 0

    def forward(self, x, scale=1.0):
        self.calls += 1
        return self.dropout(torch.relu(self.linear(x))) * scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 16)
        self.encoder = nn.ModuleList([Counting(), Counting()])
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(16, 2))

    def forward(self, x):
        x = self.stem(x)
        for block in self.encoder:
            x = block(x, scale=0.5)
        return self.head(x)


def _grads(model, x, seed):
    torch.manual_seed(seed)
    model.zero_grad()
    model(x).square().mean().backward()
    after = torch.rand(4)  # the RNG stream must advance exactly as without checkpointing
    return [p.grad.clone() for p in model.parameters()], after


def test_checkpointed_gradients_equal_the_plain_ones_with_dropout():
    torch.manual_seed(0)
    plain = Net()
    wrapped = copy.deepcopy(plain)
    names = apply_gradient_checkpointing(wrapped, ["encoder.*", "head.0"])
    assert names == ["encoder.0", "encoder.1", "head.0"]
    x = torch.randn(32, 4)
    want, want_after = _grads(plain, x, seed=7)
    got, got_after = _grads(wrapped, x, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(got_after, want_after)
    assert [block.calls for block in wrapped.encoder] == [2, 2]  # forward, then the recomputation in backward
    assert plain.state_dict().keys() == wrapped.state_dict().keys()  # checkpoints and weight files unchanged
    assert type(wrapped.encoder[0]).__name__ == "Counting" and is_checkpointed(wrapped.encoder[0])


def test_evaluation_and_no_grad_run_the_plain_forward():
    model = Net()
    apply_gradient_checkpointing(model, ["encoder.0"])
    model.eval()
    model(torch.randn(3, 4))
    model.train()
    with torch.no_grad():
        model(torch.randn(3, 4))
    assert model.encoder[0].calls == 2  # once each: nothing recomputed


def test_a_deep_copy_runs_its_own_weights():
    model = Net()
    apply_gradient_checkpointing(model, ["encoder.*"])
    twin = copy.deepcopy(model)  # e.g. an EMA copy
    with torch.no_grad():
        for p in twin.encoder.parameters():
            p.zero_()
    x = torch.randn(5, 4, requires_grad=True)
    assert not torch.equal(model(x), twin(x))
    assert torch.equal(twin(x), twin.head(torch.zeros(5, 16)))  # zeroed encoder blocks output zeros


def test_nested_matches_are_wrapped_once_and_a_pattern_matching_nothing_names_modules():
    model = Net()
    assert apply_gradient_checkpointing(model, ["encoder*"]) == ["encoder"]  # not encoder.0 inside it as well
    with pytest.raises(ConfigError, match=r"'backbone\.enc\*' matches no submodule of Net; module names look like "
                                          r"stem, encoder, head, encoder\.0"):
        apply_gradient_checkpointing(Net(), ["backbone.enc*"])


# ----------------------------------------------------------------------------- through the trainer

SMALL = """
epoch = 2
data = dict(
    train=dict(type="ToyDataset", num_samples=64, noise_aug=0.1),
    val=dict(type="ToyDataset", num_samples=32, seed=1),
)
hooks = [dict(type="InformationWriter", log_frequency=2)]
"""


def _trained(directory: Path, *options: str, extra: str = ""):
    directory.mkdir(parents=True, exist_ok=True)
    cfg_path = write_toy_config(directory, directory / "run", SMALL + extra)
    cfg, hooks = load_config(str(cfg_path), list(options), world_size=1)
    trainer = build_trainer(cfg, hooks=hooks)
    trainer.train()
    return trainer


def test_training_with_checkpointed_modules_is_bit_identical_to_plain_training(tmp_path):
    plain = _trained(tmp_path / "plain")
    wrapped = _trained(tmp_path / "wrapped", "gradient_checkpointing=['net.0','net.2']")  # net.2 is the dropout
    assert is_checkpointed(wrapped.model_without_ddp.net[2])
    for (name, a), b in zip(plain.model_without_ddp.state_dict().items(),
                            wrapped.model_without_ddp.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("value, message", [
    ("5", r"gradient_checkpointing=5 is invalid: it takes a list of module-name patterns"),
    ("['']", r"gradient_checkpointing=\[''\] is invalid"),
    ("['encoder']", r"'encoder' matches no submodule of ToyMLP; module names look like net, net\.0"),
])
def test_bad_values_are_config_errors(tmp_path, value, message):
    with pytest.raises(ConfigError, match=message):
        _trained(tmp_path, f"gradient_checkpointing={value}")


def test_exact_resume_holds_with_gradient_checkpointing(tmp_path):
    """Stopped at step 7, its checkpoint thrown away (as if killed there), resumed from the
    epoch-end checkpoint at step 4: the same weights and losses as an uninterrupted plain run."""
    hooks = ("hooks = [dict(type='InformationWriter', log_frequency=2), dict(type='CheckpointSaver'), "
             "dict(type='StopAtStep', step={stop})]\n")
    on = "gradient_checkpointing=['net.*']"
    ref = _trained(tmp_path / "ref", extra=hooks.format(stop=10**9))
    first = _trained(tmp_path / "run", on, extra=hooks.format(stop=7))
    shutil.rmtree(first.save_path / "checkpoints" / "step000000007-epoch0001")
    resumed = _trained(tmp_path / "run", on, "resume=True", extra=hooks.format(stop=10**9))
    got, want = final_weights(resumed.save_path), final_weights(ref.save_path)
    assert got["global_step"] == want["global_step"] == 8
    assert (resumed.save_path / "metrics.rewound.jsonl").is_file()  # steps 5-7 were logged, then redone
    assert all(torch.equal(got["state_dict"][k], v) for k, v in want["state_dict"].items())
    assert train_losses(resumed.save_path) == train_losses(ref.save_path)
