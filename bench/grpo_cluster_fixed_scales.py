"""The best *fixed* clustering-radius scales: the baseline GRPO task 2 must beat to claim per-event adaptation.

GRPO fine-tuning of :class:`~pimm.models.grpo.cluster_policy.ClusterRadiusPolicy`
can raise the ARI in two ways: by choosing radii event by event, or simply by
finding one better setting of the configured radii (a global recalibration,
which needs no policy at all). This script measures the second: starting
from scale 1 for every decision, coordinate ascent over the config's
``radius_scales`` (one decision at a time, each set to its best value, for
``--rounds`` passes) maximises the mean event ARI on ``--events`` training
events; the chosen constant scales are then scored on the test split next to
the configured radii (the supervised model) and, with ``--policy``, next to
the greedy GRPO policy of those weights. The frozen network runs once per
event; only the clustering is repeated.

    python bench/grpo_cluster_fixed_scales.py --config-file configs/grpo/lartpc-inseg-grpo.py \\
        --weight exp/lartpc/inseg-pointgroup/model/model_last.pth [--policy exp/grpo/lartpc-inseg/model/model_last.pth]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import pimm.datasets  # noqa: E402,F401  (registers data sets and collate functions)
import pimm.models  # noqa: E402,F401
from pimm.datasets.collate import inseg_collate_fn  # noqa: E402
from pimm.utils.config import Config  # noqa: E402
from pimm.engines.registries import DATASETS, MODELS  # noqa: E402
from pimm.engines.state.weights import load_weights  # noqa: E402
from pimm.evaluation.metrics import adjusted_rand_index  # noqa: E402


def frozen_outputs(model, dataset, count: int, batch: int = 16) -> list:
    """``(batch, frozen pass)`` for the first ``count`` events of ``dataset``."""
    cached = []
    for start in range(0, min(count, len(dataset)), batch):
        events = inseg_collate_fn([dataset[i] for i in range(start, min(start + batch, count, len(dataset)))])
        cached.append((events, model._frozen_pass(events)))
    return cached


def event_aris(model, cached: list, actions_of) -> torch.Tensor:
    """ARI of every cached event when clustered with ``actions_of(batch, frozen)``'s radii."""
    scores = []
    for events, frozen in cached:
        radii, _ = model.radii_of(actions_of(events, frozen))
        labels = model._cluster(events["coord"], events["coord"] + frozen["offset_pred"], frozen["semantic"],
                                frozen["events"], radii)
        ends = events["offset"].tolist()
        for start, end in zip([0] + ends[:-1], ends):
            scores.append(adjusted_rand_index(events["instance"][start:end].long(), labels[start:end]))
    return torch.tensor(scores, dtype=torch.float64)


def constant(actions: torch.Tensor):
    return lambda events, frozen: actions[None].expand(frozen["features"].shape[0], -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-file", required=True)
    parser.add_argument("--weight", required=True, help="the supervised weights")
    parser.add_argument("--policy", help="a GRPO run's weights, to score its greedy policy on the same test events")
    parser.add_argument("--events", type=int, default=400, help="training events the search scores")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = Config.fromfile(args.config_file)
    model = MODELS.build(cfg.model)
    load_weights(model, args.weight)
    model.eval()
    scales = model.scales.tolist()
    names = [f"{kind}_{c}" for kind in model.kinds for c in model.controlled]
    started = time.time()
    train = frozen_outputs(model, DATASETS.build(cfg.data.train), args.events)
    best = torch.full((len(names),), scales.index(1.0), dtype=torch.long)
    best_score = event_aris(model, train, constant(best)).mean().item()
    print(f"train ({args.events} events): configured radii ARI {best_score:.4f}")
    for round_index in range(args.rounds):
        for decision in range(len(names)):
            for choice in range(len(scales)):
                trial = best.clone()
                trial[decision] = choice
                score = event_aris(model, train, constant(trial)).mean().item()
                if score > best_score + 1e-9:
                    best, best_score = trial, score
        chosen = ", ".join(f"{n}={scales[i]:g}" for n, i in zip(names, best.tolist()))
        print(f"round {round_index + 1}: train ARI {best_score:.4f} with {chosen}")
    test = frozen_outputs(model, DATASETS.build(cfg.data.test), 10**9)
    supervised = event_aris(model, test, constant(torch.full_like(best, scales.index(1.0))))
    fixed = event_aris(model, test, constant(best))
    print(f"test ({len(supervised)} events): configured radii ARI {supervised.mean():.4f}, best fixed scales "
          f"ARI {fixed.mean():.4f} ({(fixed > supervised + 1e-6).double().mean():.1%} of events better)")
    if args.policy:
        load_weights(model, args.policy, strict=True)
        model.eval()
        greedy = event_aris(model, test, lambda events, frozen: model.policy(frozen["features"]).argmax(-1))
        print(f"test: greedy GRPO policy ARI {greedy.mean():.4f} ({(greedy > fixed + 1e-6).double().mean():.1%} of "
              f"events better than the best fixed scales, {(greedy < fixed - 1e-6).double().mean():.1%} worse)")
    print(f"({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
