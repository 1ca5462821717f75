"""``LUCiDEventSSLDataset``: raw PMT hits of several LUCiD productions (one per
"config", e.g. one per particle species) as point clouds, upstream's data set
for Sonata-style pre-training and event-level probes.

Each config is a folder ``data_root/<name>`` of LUCiD sensor shards (or its
own ``data_root``); its events get ``event_label`` = the config's label (its
position in ``configs`` unless given). Every config keeps a deterministic
holdout (``holdout_events_per_config`` or ``holdout_fraction`` of its events,
drawn with ``holdout_strategy``): ``split="train"`` reads the rest,
``"holdout"``/``"val"``/``"test"`` the holdout, ``"all"`` everything.
A training set and a held-out set read in one process (a run's
``data.train`` and ``data.val``) must not share an event: when their holdout
arguments differ so that they would (5 vs 10 held-out events: the training
set reads 5 of the validation events), the second one built is refused in
one line naming both.

An item: ``coord`` (H, 3) the hit PMTs' positions, ``energy`` / ``time``
(H, 1), ``sensor_idx`` (H,), ``event_label`` and ``config_id`` (1,),
``name`` (``<config>/<shard>_evt<NNN>``), ``split``. With
``aggregate_sensor_hits`` the hits of one PMT become one point (PE summed;
time by ``time_aggregation``: ``earliest``, ``mean``, ``pe_weighted`` or
``first``). Upstream reads the shards through the external ``pimm_data``
package; here through :class:`~pimm.datasets.lucid.LUCiDDataset`'s readers,
with the same keys.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np
from torch.utils.data import Dataset

from pimm.engines.registries import DATASETS
from pimm.utils.domains import (Anything, Choice, Count, DictOf, FilePath, Int, Key, OneOf, PosInt, Prob, Seq,
                                Transforms)
from pimm.utils.errors import ConfigError, UserError

from .collate import collate_fn
from .lucid import LUCiDDataset

__all__ = ["LUCiDEventSSLDataset"]

logger = logging.getLogger(__name__)

_SPLITS = ("train", "holdout", "val", "test", "all")
_HELD = ("holdout", "val", "test")
# The data sets alive in this process, so a training set and a held-out set
# of the same shards that would share events are refused (weak: a data set
# no longer used takes no part).
_LIVE: "weakref.WeakSet[LUCiDEventSSLDataset]" = weakref.WeakSet()
_TIME_AGGREGATIONS = ("earliest", "pe_weighted", "mean", "first")


@DATASETS.register_module()
class LUCiDEventSSLDataset(Dataset):
    """Hit-level point clouds of several LUCiD configs (see the module doc).

    Args:
        data_root: folder holding one sub-folder per config.
        configs: config names, or dicts with ``name``, ``label``, ``label_name``,
            ``data_root`` (or ``root``) and ``pimm_split`` (the shards' split sub-folder).
        split: ``train``, ``holdout``, ``val``, ``test`` or ``all``.
        dataset_name: shard file prefix.
        holdout_events_per_config: events each config reserves (None: use ``holdout_fraction``).
        holdout_fraction: fraction reserved when the count is None.
        holdout_seed: seed of the ``random`` holdout draw (plus the config's position).
        holdout_strategy: ``random``, ``head`` or ``tail``.
        max_events_per_config: keep at most this many events per config (-1: all).
        min_points: keep events with more than this many points.
        aggregate_sensor_hits, time_aggregation: one point per PMT, and how its time is formed.
        transform: list of transform configs; loop: repeats per epoch.
        test_mode, test_cfg: upstream refuses test mode for this data set, and so does pimm.
    """

    domains = dict(data_root=FilePath, configs=Seq(OneOf(Key, DictOf(Key)), min_len=1), split=Choice(*_SPLITS),
                   dataset_name=Key, holdout_events_per_config=Count | None, holdout_fraction=Prob | None,
                   holdout_seed=Count, holdout_strategy=Choice("random", "head", "tail"),
                   max_events_per_config=Int(-1), min_points=Count, time_aggregation=Choice(*_TIME_AGGREGATIONS),
                   transform=Transforms, loop=PosInt,
                   test_cfg=Anything("refused with test_mode; upstream accepts and ignores it"))

    collate_fn = staticmethod(collate_fn)

    def __init__(self, data_root: str, configs: Sequence[Any], split: str = "train", dataset_name: str = "wc",
                 holdout_events_per_config: int | None = 0, holdout_fraction: float | None = None,
                 holdout_seed: int = 0, holdout_strategy: str = "random", max_events_per_config: int = -1,
                 min_points: int = 0, aggregate_sensor_hits: bool = True, time_aggregation: str = "earliest",
                 transform: Sequence[Any] | None = None, loop: int = 1, test_mode: bool = False,
                 test_cfg: Any = None):
        super().__init__()
        if test_mode:
            raise ConfigError("LUCiDEventSSLDataset is for train/val loaders (as upstream): test_mode=True is "
                              "not supported; use LUCiDDataset for testing")
        if not configs:
            raise ConfigError("LUCiDEventSSLDataset: configs must name at least one LUCiD config")
        if split not in _SPLITS:
            raise ConfigError(f"LUCiDEventSSLDataset: split={split!r} is not one of {', '.join(_SPLITS)}")
        if holdout_strategy not in ("random", "head", "tail"):
            raise ConfigError(f"LUCiDEventSSLDataset: holdout_strategy={holdout_strategy!r} is not random, "
                              "head or tail")
        if time_aggregation not in _TIME_AGGREGATIONS:
            raise ConfigError(f"LUCiDEventSSLDataset: time_aggregation={time_aggregation!r} is not one of "
                              f"{', '.join(_TIME_AGGREGATIONS)}")
        self.data_root, self.split, self.dataset_name = str(data_root), split, dataset_name
        self.holdout_events_per_config, self.holdout_fraction = holdout_events_per_config, holdout_fraction
        self.holdout_seed, self.holdout_strategy = int(holdout_seed), holdout_strategy
        self.max_events_per_config, self.min_points = int(max_events_per_config), int(min_points)
        self.aggregate_sensor_hits, self.time_aggregation = bool(aggregate_sensor_hits), time_aggregation
        self.loop, self.test_mode = int(loop), False
        self.transform = None
        if transform:
            from .transforms import Compose

            self.transform = Compose(transform)
        self.config_specs = [self._spec(c, i) for i, c in enumerate(configs)]
        self.class_names = tuple(s["label_name"] for s in sorted(self.config_specs, key=lambda s: s["label"]))
        self.num_classes = len(self.config_specs)
        self.datasets = [self._source(spec) for spec in self.config_specs]
        self.data_list = self._build_data_list()
        if not self.data_list:
            raise UserError(f"LUCiDEventSSLDataset: split {split!r} keeps no event of "
                            f"{', '.join(s['name'] for s in self.config_specs)} (holdout_events_per_config="
                            f"{holdout_events_per_config}, min_points={min_points}); change the holdout or split")
        self._refuse_overlap()
        logger.info("LUCiDEventSSLDataset: %d events x loop %d, split=%s, configs=%s", len(self.data_list),
                    self.loop, split, [s["name"] for s in self.config_specs])

    @staticmethod
    def _spec(config: Any, position: int) -> dict:
        if isinstance(config, str):
            return dict(name=config, label=position, label_name=config, data_root=None, pimm_split="")
        if not isinstance(config, Mapping):
            raise ConfigError(f"LUCiDEventSSLDataset: configs[{position}] must be a name or a dict, "
                              f"got {type(config).__name__}")
        name = config.get("name", config.get("config", config.get("split")))
        root = config.get("data_root", config.get("root"))
        if name is None and root is None:
            raise ConfigError(f"LUCiDEventSSLDataset: configs[{position}] needs a 'name' or a 'data_root'")
        name = str(name if name is not None else os.path.basename(os.path.normpath(root)))
        return dict(name=name, label=int(config.get("label", position)),
                    label_name=str(config.get("label_name", name)), data_root=root,
                    pimm_split=config.get("pimm_split", ""))

    def _source(self, spec: dict) -> LUCiDDataset:
        root = spec["data_root"] or os.path.join(self.data_root, spec["name"])
        if not os.path.isdir(os.path.expanduser(str(root))):
            raise UserError(f"LUCiDEventSSLDataset: config {spec['name']!r} reads {os.path.abspath(root)}, which is "
                            f"not a folder; generate it with `python tools/make_lucid.py --out {self.data_root}` "
                            "or set data_root")
        source = LUCiDDataset(data_root=root, split=spec["pimm_split"], modalities=("sensor",),
                              dataset_name=self.dataset_name, include_labels=False)
        if source.sensor_reader.pmt_positions is None:
            raise UserError(f"LUCiDEventSSLDataset: {source.sensor_reader.h5_files[0]} has no config/pmt_positions; "
                            "hit point clouds need the PMT positions in the sensor shards")
        return source

    def _holdout_count(self, n: int) -> int:
        if self.holdout_events_per_config is not None:
            holdout = int(self.holdout_events_per_config)
        elif self.holdout_fraction is not None:
            holdout = int(round(float(self.holdout_fraction) * n))
        else:
            holdout = 0
        return max(0, min(holdout, n))

    def _split_indices(self, position: int, n: int) -> np.ndarray:
        indices = np.arange(n, dtype=np.int64)
        holdout = self._holdout_count(n)
        if self.split == "all":
            return indices
        if self.holdout_strategy == "head":
            held, rest = indices[:holdout], indices[holdout:]
        elif self.holdout_strategy == "tail":
            held, rest = indices[n - holdout:], indices[:n - holdout]
        else:
            order = np.random.default_rng(self.holdout_seed + position).permutation(indices)
            held, rest = np.sort(order[:holdout]), np.sort(order[holdout:])
        return rest if self.split == "train" else held

    def _build_data_list(self) -> list[tuple[int, int]]:
        data_list = []
        for position, source in enumerate(self.datasets):
            selected = [int(i) for i in self._split_indices(position, len(source))]
            if self.min_points > 0:
                kept = []
                for event in selected:
                    if self._point_count(source, event) > self.min_points:
                        kept.append(event)
                        if 0 < self.max_events_per_config <= len(kept):
                            break
                source.sensor_reader.close()  # opened for counting; workers reopen their own
                selected = kept
            elif self.max_events_per_config > 0:
                selected = selected[: self.max_events_per_config]
            data_list += [(position, event) for event in selected]
        return data_list

    def _event_keys(self) -> dict[tuple, int]:
        """Each event read, as (its config's shards, its index there) -> its position in this data set."""
        shards = [tuple(os.path.realpath(p) for p in source.sensor_reader.h5_files) for source in self.datasets]
        return {(shards[position], event): i for i, (position, event) in enumerate(self.data_list)}

    def _holdout_text(self) -> str:
        rule = (f"holdout_events_per_config={self.holdout_events_per_config}"
                if self.holdout_events_per_config is not None else f"holdout_fraction={self.holdout_fraction}")
        return f"{rule}, holdout_strategy={self.holdout_strategy!r}, holdout_seed={self.holdout_seed}"

    def _refuse_overlap(self) -> None:
        if self.split in _HELD or self.split == "train":
            mine = self._event_keys()
            counterpart = _HELD if self.split == "train" else ("train",)
            for other in list(_LIVE):
                if other.split not in counterpart:
                    continue
                shared = mine.keys() & other._event_keys().keys()
                if shared:
                    raise ConfigError(
                        f"LUCiDEventSSLDataset: split {self.split!r} ({self._holdout_text()}) and split "
                        f"{other.split!r} ({other._holdout_text()}) share {len(shared)} event(s), e.g. "
                        f"{self.get_data_name(mine[min(shared)])}: training would see held-out events; give both "
                        "the same holdout_* arguments")
        _LIVE.add(self)

    def _point_count(self, source: LUCiDDataset, event: int) -> int:
        sensor = source.sensor_reader.hits(*source.locate(event))[0]
        return int(np.unique(sensor).size if self.aggregate_sensor_hits else sensor.size)

    def __len__(self) -> int:
        return len(self.data_list) * self.loop

    def get_data_name(self, idx: int) -> str:
        position, event = self.data_list[int(idx) % len(self.data_list)]
        return f"{self.config_specs[position]['name']}/{self.datasets[position].get_data_name(event)}"

    def get_data(self, idx: int) -> dict:
        position, event = self.data_list[int(idx) % len(self.data_list)]
        source = self.datasets[position]
        sensor, pe, t = source.sensor_reader.hits(*source.locate(event))
        data = dict(coord=source.sensor_reader.pmt_positions[sensor], energy=pe[:, None], time=t[:, None],
                    sensor_idx=sensor, event_label=np.array([self.config_specs[position]["label"]], np.int64),
                    config_id=np.array([position], np.int64), name=self.get_data_name(idx), split=self.split)
        return self._aggregate(data) if self.aggregate_sensor_hits else data

    def _aggregate(self, data: dict) -> dict:
        """One point per PMT: PE summed, time by ``time_aggregation``."""
        sensor = data["sensor_idx"]
        if sensor.size == 0:
            return data
        order = np.argsort(sensor, kind="stable")
        unique, starts = np.unique(sensor[order], return_index=True)
        energy, time = data["energy"][order], data["time"][order]
        summed = np.add.reduceat(energy, starts, axis=0)
        if self.time_aggregation == "earliest":
            time_out = np.minimum.reduceat(time, starts, axis=0)
        elif self.time_aggregation == "mean":
            time_out = np.add.reduceat(time, starts, axis=0) / np.diff(np.r_[starts, len(sensor)])[:, None]
        elif self.time_aggregation == "pe_weighted":
            time_out = np.add.reduceat(time * energy, starts, axis=0) / np.maximum(summed, 1e-6)
        else:  # first: the first hit of the PMT in file order
            time_out = time[starts]
        data.update(coord=data["coord"][order][starts].astype(np.float32), energy=summed.astype(np.float32),
                    time=time_out.astype(np.float32), sensor_idx=unique.astype(np.int64))
        return data

    def __getitem__(self, idx: int) -> dict:
        n = len(self)
        if not -n <= int(idx) < n:
            raise IndexError(f"event index {idx} out of range for a LUCiDEventSSLDataset of {n}")
        data = self.get_data(int(idx) % n)
        return self.transform(data) if self.transform is not None else data
