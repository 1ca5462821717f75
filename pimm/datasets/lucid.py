"""``LUCiDDataset``: upstream pimm's water-Cherenkov data set (PMT response and
3D track segments from co-indexed LUCiD HDF5 shards, :mod:`.lucid_readers`).

One item is one event; what it holds depends on the modalities and, for the
sensors, ``output_mode`` (upstream's keys):

* ``"response"``: one entry per PMT -- ``coord`` (N_pmt, 3) PMT positions (or
  (N_pmt, 1) sensor indices when the shards hold none), ``energy`` (N_pmt, 1)
  summed PE, ``time`` (N_pmt, 1) first-hit time (-1 for unhit PMTs);
* ``"labels"``: one entry per (particle, PMT) hit -- ``coord``, ``energy``,
  ``segment`` (the particle's category), ``instance`` (its index), ``time``;
* ``"separate"``: the reader's raw ``pmt_*`` / ``pp_*`` keys, and with both
  modalities the segments under ``seg3d.*``;
* segments alone: ``coord`` (S, 3) midpoints, ``energy``, ``time``,
  ``track_ids``, ``pdg``, ``parent_ids``.

Every item also has ``name`` (``<shard>_evt<NNN>``) and ``split``. An event is
a pure function of its index, so the stateful sampler's position is all the
state exact mid-epoch resume needs.

Differences from upstream (docs/coming-from.md): co-indexed families must
agree shard by shard (upstream silently takes the shorter); ``min_segments``
drops an event from both families, keeping them aligned (upstream filters the
segment index only, which misaligns them); a missing family is one error line.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import numpy as np
from torch.utils.data import Dataset

from pimm.engines.registries import DATASETS
from pimm.utils.domains import Choice, Count, DictOf, FilePath, Int, Key, NonNeg, PosInt, Seq, Text, Transforms
from pimm.utils.errors import ConfigError, UserError

from .collate import collate_fn
from .default_dataset import refuse_test_mode
from .lucid_readers import LUCiDSegReader, LUCiDSensorReader, find_shards

__all__ = ["LUCiDDataset", "OUTPUT_MODES"]

logger = logging.getLogger(__name__)

OUTPUT_MODES = ("response", "labels", "separate")
MODALITIES = ("sensor", "seg")


@DATASETS.register_module()
class LUCiDDataset(Dataset):
    """Events from LUCiD sensor and/or segment shards (see the module doc).

    Args:
        data_root: the folder holding ``sensor/`` and/or ``seg/`` (or the shards themselves).
        split: a sub-folder to look in first (``""``: none), as upstream.
        transform: list of transform configs applied to each event.
        modalities: any of ``"sensor"``, ``"seg"``.
        dataset_name: shard file prefix (``wc`` for ``wc_sensor_0000.h5``).
        output_mode: ``"response"``, ``"labels"`` or ``"separate"`` (sensor modality).
        include_labels: read the per-particle decomposition (``labels`` needs it).
        pe_threshold: drop per-particle hits with this many PE or fewer.
        min_segments: keep events with at least this many track segments.
        max_len: keep at most this many events (-1 or 0: all), before ``loop``.
        loop: repeat the events this many times per epoch.
        test_mode, test_cfg: upstream's names; test-time fragments of a point
            cloud do not apply to sensor responses, so ``test_mode=True`` is refused.
    """

    domains = dict(data_root=FilePath, split=Text(empty=True), transform=Transforms,
                   modalities=Seq(Choice(*MODALITIES), min_len=1, max_len=2), dataset_name=Key,
                   output_mode=Choice(*OUTPUT_MODES), pe_threshold=NonNeg, min_segments=Count, max_len=Int(-1),
                   loop=PosInt, test_cfg=DictOf() | None)

    collate_fn = staticmethod(collate_fn)

    def __init__(self, data_root: str, split: str = "", transform: Sequence[Any] | None = None,
                 modalities: Sequence[str] = ("sensor",), dataset_name: str = "wc", output_mode: str = "response",
                 include_labels: bool = True, pe_threshold: float = 0.0, min_segments: int = 0, max_len: int = -1,
                 loop: int = 1, test_mode: bool = False, test_cfg: Any = None):
        super().__init__()
        refuse_test_mode("LUCiDDataset", test_mode, test_cfg)
        modalities = (modalities,) if isinstance(modalities, str) else tuple(modalities)
        if not modalities or any(m not in MODALITIES for m in modalities):
            raise ConfigError(f"LUCiDDataset: modalities={modalities!r} must name 'sensor' and/or 'seg'")
        if output_mode not in OUTPUT_MODES:
            raise ConfigError(f"LUCiDDataset: output_mode={output_mode!r} is not one of {', '.join(OUTPUT_MODES)}")
        if output_mode == "labels" and "sensor" in modalities and not include_labels:
            raise ConfigError("LUCiDDataset: output_mode='labels' reads the per-particle hits; "
                              "set include_labels=True")
        self.data_root, self.split = os.path.expanduser(str(data_root)), split
        if not os.path.isdir(self.data_root):
            raise UserError(f"LUCiDDataset: data_root {self.data_root} is not a folder; give the folder holding "
                            "sensor/ and seg/ shards (write some with `python tools/make_lucid.py`)")
        self.modalities, self.dataset_name, self.output_mode = modalities, dataset_name, output_mode
        self.include_labels, self.pe_threshold = bool(include_labels), float(pe_threshold)
        self.loop, self.max_len, self.test_mode = int(loop), int(max_len), False
        self.transform = None
        if transform:
            from .transforms import Compose

            self.transform = Compose(transform)
        self.sensor_reader = self.seg_reader = None
        if "sensor" in modalities:
            self.sensor_reader = LUCiDSensorReader(find_shards(self._root("sensor"), split, dataset_name, "sensor"))
        if "seg" in modalities:
            self.seg_reader = LUCiDSegReader(find_shards(self._root("seg"), split, dataset_name, "seg"))
        if self.sensor_reader is not None and self.seg_reader is not None:
            self._check_coindexed(self.sensor_reader, self.seg_reader)
        self.reader = self.sensor_reader or self.seg_reader
        self.index = self._build_index(int(min_segments))
        if len(self.index) == 0:
            raise UserError(f"LUCiDDataset: none of the {sum(self.reader.n_events)} events in "
                            f"{len(self.reader.h5_files)} shard(s) under {self.data_root} is kept "
                            f"(min_segments={min_segments}, max_len={max_len}); lower min_segments or check data_root")
        logger.info("LUCiDDataset: %d events x loop %d, modalities=%s, output_mode=%s", len(self.index), self.loop,
                    "/".join(modalities), output_mode)

    def _root(self, modality: str) -> str:
        folder = os.path.join(self.data_root, modality)
        return folder if os.path.isdir(folder) else self.data_root

    @staticmethod
    def _check_coindexed(sensor: LUCiDSensorReader, seg: LUCiDSegReader) -> None:
        if len(sensor.h5_files) != len(seg.h5_files):
            raise UserError(f"LUCiD shards are not co-indexed: {len(sensor.h5_files)} sensor shard(s) (first "
                            f"{sensor.h5_files[0]}) but {len(seg.h5_files)} segment shard(s) (first "
                            f"{seg.h5_files[0]}); both families need one shard per event block")
        for a, b, na, nb in zip(sensor.h5_files, seg.h5_files, sensor.n_events, seg.n_events):
            if na != nb:
                raise UserError(f"LUCiD shards are not co-indexed: {a} has {na} events but {b} has {nb}; "
                                "regenerate the pair so event i is the same event in both")

    def _build_index(self, min_segments: int) -> np.ndarray:
        blocks = []
        for file_id, n in enumerate(self.reader.n_events):
            events = np.arange(n, dtype=np.int64)
            if min_segments > 0 and self.seg_reader is not None:
                events = events[self.seg_reader.segment_counts(file_id) >= min_segments]
            blocks.append(np.stack([np.full(len(events), file_id, dtype=np.int64), events], axis=1))
        index = np.concatenate(blocks) if blocks else np.zeros((0, 2), dtype=np.int64)
        if self.seg_reader is not None:
            self.seg_reader.close()  # opened for the counts; workers reopen their own
        return index[: self.max_len] if self.max_len > 0 else index

    def __len__(self) -> int:
        return len(self.index) * self.loop

    def locate(self, idx: int) -> tuple[int, int]:
        """(shard, event within the shard) of index ``idx`` (modulo the events)."""
        file_id, event = self.index[int(idx) % len(self.index)]
        return int(file_id), int(event)

    def get_data_name(self, idx: int) -> str:
        file_id, event = self.locate(idx)
        return f"{os.path.basename(self.reader.h5_files[file_id])}_evt{event:03d}"

    def get_data(self, idx: int) -> dict:
        file_id, event = self.locate(idx)
        data: dict[str, Any] = {}
        if self.seg_reader is not None:
            seg = self.seg_reader.read_event(file_id, event)
            separate = self.sensor_reader is not None and self.output_mode == "separate"
            data.update({f"seg3d.{k}": v for k, v in seg.items()} if separate else seg)
        if self.sensor_reader is not None:
            sensor = self.sensor_reader.read_event(file_id, event, self.include_labels, self.pe_threshold)
            data.update(self._sensor_output(sensor))
        data["name"], data["split"] = self.get_data_name(idx), self.split
        return data

    def _sensor_output(self, sensor: dict) -> dict:
        if self.output_mode == "separate":
            return sensor
        if self.output_mode == "response":
            n = len(sensor["pmt_pe"])
            coord = sensor.get("pmt_coord", np.arange(n, dtype=np.float32)[:, None])
            return dict(coord=coord, energy=sensor["pmt_pe"][:, None], time=sensor["pmt_t"][:, None])
        if "pp_sensor_idx" not in sensor:  # an event without particles: no labelled entries
            return dict(coord=np.zeros((0, 3 if "pmt_coord" in sensor else 1), np.float32),
                        energy=np.zeros((0, 1), np.float32), segment=np.zeros(0, np.int32),
                        instance=np.zeros(0, np.int32), time=np.zeros((0, 1), np.float32))
        index = sensor["pp_sensor_idx"]
        coord = sensor["pmt_coord"][index] if "pmt_coord" in sensor else index.astype(np.float32)[:, None]
        return dict(coord=coord, energy=sensor["pp_pe"][:, None], segment=sensor["pp_category"],
                    instance=sensor["pp_particle_idx"], time=sensor["pp_t"][:, None])

    def __getitem__(self, idx: int) -> dict:
        n = len(self)
        if not -n <= int(idx) < n:
            raise IndexError(f"event index {idx} out of range for a LUCiDDataset of {n}")
        data = self.get_data(int(idx) % n)
        return self.transform(data) if self.transform is not None else data
