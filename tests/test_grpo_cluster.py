"""GRPO task 2: ClusterRadiusPolicy (per-event clustering radii of a frozen
PointGroupLite, reward = event ARI), per-event radii in cluster_instances,
ClusterPolicyEvaluator, and (slow) exact resume of a run through tools/train.py.

The unit tests use a tiny untrained backbone on small generated events: they
check the contract and the bookkeeping, not learning (the shipped config's
figures are in docs/grpo.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import pimm.datasets  # noqa: F401  (registers the generator)
from pimm.datasets.collate import inseg_collate_fn
from pimm.engines.registries import DATASETS, HOOKS, MODELS
from pimm.engines.trainers.grpo import _global_totals, split_rollout
from pimm.evaluation.metrics import adjusted_rand_index
from pimm.models.instance import cluster_instances
from pimm.utils.errors import ConfigError, UserError
from tests.support.run import ROOT, final_weights, run_tool, train_losses

TRANSFORM = [dict(type="LogTransform", key="energy"), dict(type="ToTensor"),
             dict(type="Collect", keys=("coord", "segment", "instance"), feat_keys=("energy",))]
SEGMENTOR = dict(num_classes=5, stuff_classes=(4,), offset_scale=50.0,
                 backbone=dict(type="SparseUNet", in_channels=1, channels=(8, 16), enc_blocks=(1, 1), dec_blocks=(1,)),
                 agree_radius=(6.0, 3.0, 4.0, 4.0, 3.0), merge_radius=(35.0, 10.0, 10.0, 10.0, 10.0))


def _policy(**options):
    torch.manual_seed(0)
    return MODELS.build(dict(type="ClusterRadiusPolicy", **{"require_weights": False, **SEGMENTOR, **options}))


def _events(count=3, seed=0):
    data = DATASETS.build(dict(type="LArTPCSynthDataset", num_events=count, seed=seed, split="train",
                               transform=TRANSFORM, points_per_event=(150, 300)))
    return inseg_collate_fn([data[i] for i in range(count)])


@pytest.fixture(scope="module")
def batch():
    return _events()


def test_the_supervised_network_is_frozen_and_stays_in_eval_mode():
    model = _policy()
    trainable = {name.split(".")[0] for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"policy"}
    model.train()
    assert not model.backbone.training and not model.offset_head.training and model.policy.training


def test_a_supervised_checkpoint_loads_and_the_initial_greedy_policy_is_the_supervised_model(batch):
    supervised = MODELS.build(dict(type="PointGroupLite", **SEGMENTOR))
    model = _policy()
    result = model.load_state_dict(supervised.state_dict(), strict=False)
    assert result.unexpected_keys == [] and {k.split(".")[0] for k in result.missing_keys} == {"policy"}
    model.eval()
    supervised.eval()
    out = model(batch)
    assert torch.equal(out["instance_pred"], out["instance_pred_supervised"])
    assert torch.equal(out["instance_pred_supervised"], supervised(batch)["instance_pred"])
    assert torch.equal(out["merge_scale"], torch.ones(3, 5)) and torch.equal(out["agree_scale"], torch.ones(3, 5))


def test_rollouts_need_trained_weights_in_the_network(batch):
    model = _policy(require_weights=True).eval()
    with pytest.raises(UserError, match="weight=PATH"):
        model.sample_grpo_batch(batch)
    network_only = {k: v for k, v in model.state_dict().items() if not k.startswith("policy.")}
    model.load_state_dict({k: v for k, v in network_only.items() if not k.startswith("offset_head.")}, strict=False)
    with pytest.raises(UserError):  # a partly loaded network is not the supervised model
        model.sample_grpo_batch(batch)
    model.load_state_dict(network_only, strict=False)
    assert model.sample_grpo_batch(batch)["trajectories"]["rewards"].shape == (3 * 8,)


def test_per_event_radii_cluster_each_event_as_alone(batch):
    """G copies of an event with different radii in one call give each copy's
    own clustering (what the rewards rely on); equal rows give the tuple's."""
    model = _policy().eval()
    frozen = model._frozen_pass(batch)
    n = int(batch["offset"][0])
    coord, shifted = batch["coord"][:n], (batch["coord"] + frozen["offset_pred"])[:n]
    semantic = frozen["semantic"][:n]
    radii = [((6.0, 3.0, 4.0, 4.0, 3.0), (35.0, 10.0, 10.0, 10.0, 10.0)), ((3.0,) * 5, (5.0,) * 5),
             ((12.0,) * 5, (60.0,) * 5)]
    alone = [cluster_instances(coord, shifted, semantic, torch.zeros(n, dtype=torch.long), 1.0, a, m, 1, (4,))
             for a, m in radii]
    together = cluster_instances(coord.repeat(3, 1), shifted.repeat(3, 1), semantic.repeat(3),
                                 torch.arange(3).repeat_interleave(n), 1.0, torch.tensor([a for a, _ in radii]),
                                 torch.tensor([m for _, m in radii]), 1, (4,))
    for i, labels in enumerate(alone):
        assert adjusted_rand_index(labels, together[i * n:(i + 1) * n]) == 1.0
    assert len({int(labels.max()) for labels in alone}) > 1  # the radii do change the clustering
    with pytest.raises(ConfigError, match="per-event radii"):
        cluster_instances(coord, shifted, semantic, torch.zeros(n, dtype=torch.long), 1.0, torch.ones(2, 5), 8.0)


def test_a_rollout_has_the_contract_shapes_and_its_rewards_are_the_events_ari(batch):
    model = _policy(num_generations=4, keep_bias=0.0).eval()
    rollout = model.sample_grpo_batch(batch)
    traj = rollout["trajectories"]
    decisions = 2 * 4  # (agree, merge) x the 4 classes that are not stuff
    assert traj["actions"].shape == traj["old_logp"].shape == traj["action_mask"].shape == (12, decisions)
    assert bool(traj["action_mask"].all()) and torch.equal(traj["event_index"], torch.arange(3).repeat_interleave(4))
    uniform = -torch.log(torch.tensor(float(len(model.scales))))  # keep_bias 0: all scales equally likely
    assert torch.allclose(traj["old_logp"], torch.full_like(traj["old_logp"], uniform))
    assert rollout["context"]["features"].shape[0] == 3 and "ref_logp" not in traj  # beta = 0: no reference
    frozen = model._frozen_pass(batch)
    ends = batch["offset"].tolist()
    for row in (0, 5, 11):
        event = int(traj["event_index"][row])
        start, end = ([0] + ends)[event], ends[event]
        radii, _ = model.radii_of(traj["actions"][row:row + 1])
        labels = cluster_instances(batch["coord"][start:end], (batch["coord"] + frozen["offset_pred"])[start:end],
                                   frozen["semantic"][start:end], torch.zeros(end - start, dtype=torch.long), 1.0,
                                   radii["agree"], radii["merge"], 1, (4,))
        want = adjusted_rand_index(batch["instance"][start:end], labels)
        assert traj["rewards"][row].item() == pytest.approx(want, abs=1e-6)
    for event in range(3):
        group = traj["advantages"][traj["event_index"] == event]
        assert abs(float(group.sum())) < 1e-4
    assert rollout["metrics"]["reward_mean"] == pytest.approx(float(traj["rewards"].mean()), abs=1e-6)


def test_the_loss_trains_only_the_head_and_micro_batches_give_the_same_gradient(batch):
    model = _policy(num_generations=4, keep_bias=0.0, grpo=dict(beta=0.04, loss_type="grpo")).eval()
    rollout = model.sample_grpo_batch(batch)
    assert "ref_logp" in rollout["trajectories"]
    rollout["totals"] = _global_totals(rollout["trajectories"]["action_mask"])
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]

    def gradient(size):
        model.zero_grad()
        for micro in split_rollout(rollout, size):
            out = model.grpo_loss_from_batch(micro)
            out["loss"].backward()
        return torch.cat([p.grad.flatten() for p in params])

    whole = gradient(None)
    assert whole.abs().sum() > 0
    assert torch.allclose(gradient(5), whole, rtol=1e-5, atol=1e-7)
    assert all(p.grad is None for p in model.backbone.parameters())


def test_bad_options_are_one_line_config_errors():
    for options, match in [(dict(radius_scales=(0.5, 2.0)), "including 1.0"), (dict(num_generations=1), ">= 2"),
                           (dict(radius_kinds=("merge", "split")), "radius_kinds"),
                           (dict(use_event_features="yes"), "use_event_features")]:
        with pytest.raises(ConfigError, match=match):
            _policy(**options)


def test_the_global_policy_ignores_the_event():
    model = _policy(use_event_features=False)
    with torch.no_grad():
        model.policy.mlp[-1].weight.normal_()
    logits = model.policy(torch.randn(4, model.policy.norm.normalized_shape[0]))
    assert torch.equal(logits[0], logits[3])


def test_the_evaluator_compares_policy_and_supervised_on_the_same_events():
    evaluator = HOOKS.build(dict(type="ClusterPolicyEvaluator", class_names=["a", "b"]))
    evaluator.trainer = type("T", (), {"device": torch.device("cpu")})()
    evaluator.reset()
    truth = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])  # two events of 4 points
    batch = {"instance": truth, "offset": torch.tensor([4, 8])}
    policy = torch.tensor([0, 0, 1, 1, 5, 5, 6, 6])  # perfect in both events
    supervised = torch.tensor([0, 0, 0, 0, 5, 5, 6, 6])  # the first event merged
    scales = torch.tensor([[1.0, 0.5], [1.0, 1.5]])
    evaluator.process(batch, {"instance_pred": policy, "instance_pred_supervised": supervised,
                              "agree_scale": torch.ones(2, 2), "merge_scale": scales})
    metrics = evaluator.compute(evaluator.accumulators())
    assert metrics["ARI"] == 1.0 and metrics["ARI_supervised"] == 0.5  # ARI 0 and 1
    assert metrics["ARI_gain"] == 0.5 and metrics["improved_frac"] == 0.5 and metrics["worse_frac"] == 0.0
    assert metrics["F1"] == 1.0 and metrics["F1_supervised"] == pytest.approx(2 * 2 / (2 * 2 + 1 + 2))
    assert metrics["merge_scale_b"] == 1.0 and metrics["merge_scale_a"] == 1.0 and metrics["agree_scale_a"] == 1.0
    assert "ARI gain +0.5000 over 2 events" in evaluator.report(metrics)


# -- slow: a run through tools/train.py, killed and resumed -----------------------------------------------------
RESUME = f"""
_base_ = {str(ROOT / "configs" / "grpo" / "lartpc-inseg-grpo.py")!r}
custom_imports = ["tests.support.toy"]
epoch = 1
batch_size = 4
batch_size_val = 4
_gen = dict(type="LArTPCSynthDataset", transform={TRANSFORM!r}, points_per_event=(150, 300), in_memory=False)
data = dict(train=dict(_gen, _delete_=True, num_events=16, split="train"),
            val=dict(_gen, _delete_=True, num_events=4, split="val"),
            test=dict(_gen, _delete_=True, num_events=4, split="test"))
model = dict(num_generations=4, backbone=dict(channels=(8, 16), enc_blocks=(1, 1), dec_blocks=(1,)))
hooks = [
    dict(type="CheckpointLoader"),
    dict(type="InformationWriter", log_frequency=2),
    dict(type="ClusterPolicyEvaluator", every_n_steps=4),
    dict(type="CheckpointSaver", save_freq=3, keep_last=2),
    dict(type="KillAtStep", step=10**9),
]
"""


def _run(tmp_path: Path, name: str, *options: str, expect: int = 0) -> Path:
    save = tmp_path / name
    config = tmp_path / f"{name}.py"
    config.write_text(RESUME + f"\nsave_path = {str(save)!r}\n")
    supervised = tmp_path / "supervised.pth"
    if not supervised.exists():  # an (untrained) supervised model of the tiny network, to warm-start from
        torch.manual_seed(0)
        network = MODELS.build(dict(type="PointGroupLite", **SEGMENTOR))
        torch.save({"state_dict": network.state_dict()}, supervised)
    result = run_tool("train", config, f"weight={supervised}", *options, timeout=600)
    assert result.returncode == expect, result.stderr[-3000:]
    return save


@pytest.mark.slow
def test_a_killed_run_resumes_bit_identically(tmp_path):
    """16 events, 4 per rollout, 2 updates per rollout: 8 steps; a checkpoint
    every 3 steps, so the one at step 3 falls between two updates of a rollout."""
    ref = _run(tmp_path, "ref")
    assert [s for s, _ in train_losses(ref)] == list(range(1, 9))
    assert "model tensors from " + str(tmp_path / "supervised.pth") in (ref / "train.log").read_text()  # warm start
    _run(tmp_path, "run", "hooks.KillAtStep.step=5", expect=-9)
    run = _run(tmp_path, "run", "resume=True")
    assert (run / "train.log").read_text().count("Resumed from") == 1
    got, want = final_weights(run)["state_dict"], final_weights(ref)["state_dict"]
    assert got.keys() == want.keys() and any(k.startswith("reference.") for k in want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    records = [[json.loads(line) for line in open(save / "metrics.jsonl")] for save in (run, ref)]
    assert records[0] == records[1] and any("val/ARI_supervised" in r for r in records[1])
