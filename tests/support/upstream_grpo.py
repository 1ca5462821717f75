"""A GRPO policy written against upstream pimm's API (imported via ``custom_imports``).

A contextual bandit over ToyDataset: for each event (``x``, ``label``) a
trajectory picks ``steps`` of ``num_actions`` actions; its reward is the
fraction of picks equal to the label (a random policy scores
1 / num_actions). The rollout is upstream's format -- a list of event dicts,
each with a list of trajectory objects carrying ``.metrics`` -- and the loss
is averaged over the trajectories of the chunk it is given, as an upstream
policy's is. Nothing in it knows about pimm's trainer.
"""

from __future__ import annotations

import torch
from torch import nn

from pimm.engines import MODELS


class Trajectory:
    """One sampled trajectory, as upstream policies keep them: tensors and a ``metrics`` dict."""

    def __init__(self, actions: torch.Tensor, old_logp: torch.Tensor, reward: float):
        self.actions = actions
        self.old_logp = old_logp
        self.metrics = {"reward": reward, "length": float(len(actions))}


@MODELS.register_module(force=True)
class UpstreamBandit(nn.Module):
    def __init__(self, dim=8, num_actions=4, steps=2, num_generations=6, epsilon=0.2):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, 16), nn.Tanh(), nn.Linear(16, num_actions))
        self.steps, self.num_generations, self.epsilon = steps, num_generations, epsilon

    def forward(self, batch):
        return {"logits": self.net(batch["x"])}

    def sample_grpo_batch(self, batch):
        logits = self.net(batch["x"]).detach()
        events, rewards_all = [], []
        for x, label, event_logits in zip(batch["x"], batch["label"], logits):
            dist = torch.distributions.Categorical(logits=event_logits)
            actions = dist.sample((self.num_generations, self.steps))
            old_logp = dist.log_prob(actions)
            rewards = (actions == label).float().mean(1)
            advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
            events.append({
                "trajectories": [Trajectory(a, lp, float(r)) for a, lp, r in zip(actions, old_logp, rewards)],
                "advantages": advantages,
                "step_advantages": advantages[:, None].expand(-1, self.steps).clone(),
                "reward_std": float(rewards.std()),
                "rloo_score_mean": float(rewards.mean()),
                "x": x,
            })
            rewards_all.append(rewards)
        rewards_all = torch.cat(rewards_all)
        trajectories = [t for e in events for t in e["trajectories"]]
        return {"events": events, "metric_count": len(trajectories),
                "metric_sums": {"reward": float(rewards_all.sum()), "length": float(self.steps * len(trajectories))},
                "reward_stds": [e["reward_std"] for e in events],
                "rloo_score_means": [e["rloo_score_mean"] for e in events]}

    def grpo_loss_from_batch(self, rollout, update_index=0, policy_updates_per_rollout=1):
        per_trajectory, log_ratios, clipped, logps, adv_max = [], [], [], [], []
        for event in rollout["events"]:
            log_probs = torch.log_softmax(self.net(event["x"][None])[0], -1)
            for trajectory, step_adv in zip(event["trajectories"], event["step_advantages"]):
                logp = log_probs[trajectory.actions]
                log_ratio = logp - trajectory.old_logp
                ratio = log_ratio.exp()
                bounded = ratio.clamp(1 - self.epsilon, 1 + self.epsilon)
                per_trajectory.append(-torch.minimum(ratio * step_adv, bounded * step_adv).mean())
                log_ratios.append(log_ratio.detach())
                clipped.append((ratio.detach() != bounded.detach()).float())
                logps.append(logp.detach())
            adv_max.append(event["advantages"].abs().max())
        loss = torch.stack(per_trajectory).mean()  # averaged over this chunk's trajectories
        log_ratio = torch.cat(log_ratios)
        return {
            "loss": loss,
            "rl_pg_loss": loss.detach(),
            "rl_log_ratio": log_ratio.mean(), "rl_log_ratio_min": log_ratio.min(), "rl_log_ratio_max": log_ratio.max(),
            "rl_clip_frac": torch.cat(clipped).mean(),
            "rl_logprob": torch.cat(logps).mean(),
            "rl_advantage_abs_max": torch.stack(adv_max).max(),
            "chunk_reward_mean": torch.tensor(rollout["metric_sums"]["reward"] / rollout["metric_count"]),
            "chunks_seen": torch.tensor(1.0),
            "note": "upstream policies may return non-tensor values",
        }

    def _rollout_metric_tensors(self, rollout):
        return {"reward_mean": torch.tensor(rollout["metric_sums"]["reward"] / rollout["metric_count"]),
                "reward_std_mean": torch.tensor(sum(rollout["reward_stds"]) / len(rollout["reward_stds"]))}
