"""MultiDatasetTrainer: train on several data sets mixed by sampling ratios.

``data.train`` is a list of data-set configs; ``train = dict(type=
"MultiDatasetTrainer", ratios=[...], samples_per_epoch=N)`` fixes the mix and
the epoch length. The mix is drawn by a :class:`RatioSampler` — a stateful,
rank-aware sampler like the default one — so the position inside an epoch
resumes exactly.
"""

from __future__ import annotations

from torch.utils.data import ConcatDataset

from pimm.distributed.sampler import RatioSampler
from pimm.engines.trainers.default import DefaultTrainer
from pimm.engines.registries import DATASETS, TRAINERS
from pimm.utils.errors import ConfigError
from pimm.utils.domains import NonNeg, PosInt, Seq

__all__ = ["MultiDatasetTrainer"]


class _Mixture(ConcatDataset):
    """ConcatDataset that keeps the first member's ``collate_fn`` / ``class_names``."""

    def __getattr__(self, name):
        if name == "datasets":
            raise AttributeError(name)
        return getattr(self.datasets[0], name)


@TRAINERS.register_module()
class MultiDatasetTrainer(DefaultTrainer):
    """DefaultTrainer over a mixture of the ``data.train`` list.

    Args:
        ratios: sampling weight of each data set (None: in proportion to size).
        samples_per_epoch: samples drawn per epoch (None: the data sets' total).
    """
    domains = dict(ratios=Seq(NonNeg, min_len=1) | None, samples_per_epoch=PosInt | None)

    def __init__(self, cfg, ratios=None, samples_per_epoch=None, **options):
        self.ratios = ratios
        self.samples_per_epoch = samples_per_epoch
        super().__init__(cfg, **options)

    def build_train_loader(self):
        train_cfgs = self.cfg.data.get("train")
        if not isinstance(train_cfgs, (list, tuple)) or not train_cfgs:
            raise ConfigError("MultiDatasetTrainer needs data.train = [dict(type=...), dict(type=...), ...]")
        datasets = [DATASETS.build(c) for c in train_cfgs]
        ratios = self.ratios if self.ratios is not None else [len(d) for d in datasets]
        if len(ratios) != len(datasets):
            raise ConfigError(f"train.ratios has {len(ratios)} entries for {len(datasets)} data sets in data.train")
        if any(isinstance(r, bool) or not isinstance(r, (int, float)) or r < 0 for r in ratios) or sum(ratios) <= 0:
            raise ConfigError(f"train.ratios={list(ratios)} must be non-negative numbers with a positive sum")
        length = self.samples_per_epoch if self.samples_per_epoch is not None else sum(len(d) for d in datasets)
        if isinstance(length, bool) or not isinstance(length, int) or length < self.cfg.batch_size:
            raise ConfigError(f"train.samples_per_epoch={length!r} must be an integer >= batch_size "
                              f"({self.cfg.batch_size})")
        sampler = RatioSampler([len(d) for d in datasets], list(ratios), length, rank=self.rank,
                               world_size=self.world_size, seed=self.cfg.seed,
                               with_seeds=self.num_workers_per_rank > 0)
        return self._make_train_loader(_Mixture(datasets), sampler=sampler)
