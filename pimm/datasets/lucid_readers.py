"""Readers of LUCiD's water-Cherenkov HDF5 shards (upstream pimm's format).

A LUCiD data set is two co-indexed shard families, event ``i`` of shard ``k``
being the same event in both::

    data_root/[split/]sensor/{name}_sensor_0000.h5   # PMT response
    data_root/[split/]seg/{name}_seg_0000.h5         # 3D track segments

(also ``sensor_events_*.h5`` / ``segment_events_*.h5``, or any ``*sensor*`` /
``*segment*`` file, as upstream looks for them). Both are flat CSR arrays:

* sensor: attributes ``n_events``, ``n_sensors``; ``event_hit_offsets``
  (n_events+1) into the per-hit ``event_hit_sensor_idx``, ``event_hit_PE``,
  ``event_hit_T``; per-particle decomposition ``particle_event_offset``
  (n_events+1) into ``particle_category`` and ``particle_hit_offsets``
  (n_particles+1) into ``particle_hit_sensor_idx`` / ``_PE`` / ``_T``; the PMT
  positions in ``config/pmt_positions`` (n_sensors, 3), optional.
* seg: attribute ``n_events``; ``track_event_offset`` (n_events+1) into the
  per-track ``track_id``, ``pdg``, ``parent_id``, ``initial_energy`` and
  ``segment_offset`` (n_tracks+1) into the per-segment ``start_x/y/z``,
  ``end_x/y/z``, ``edep``, ``time``.

Files open lazily in each process (never pickled into DataLoader workers).
A missing family, a file that is not such a shard, or co-indexed shards of
different lengths is one :class:`UserError` line naming the file.
"""

from __future__ import annotations

import glob
import os

import h5py
import numpy as np

from pimm.utils.errors import UserError

__all__ = ["LUCiDSensorReader", "LUCiDSegReader", "find_shards"]

_SENSOR_KEYS = ("event_hit_offsets", "event_hit_sensor_idx", "event_hit_PE", "event_hit_T")
_SEG_KEYS = ("track_event_offset", "segment_offset", "start_x", "start_y", "start_z", "end_x", "end_y", "end_z",
             "edep", "time", "track_id", "pdg", "parent_id")


def find_shards(root: str, split: str, dataset_name: str, family: str) -> list[str]:
    """The shard files of ``family`` ("sensor" or "seg"), by upstream's patterns, in order."""
    long = {"sensor": "sensor_events", "seg": "segment_events"}[family]
    loose = {"sensor": "*sensor*", "seg": "*segment*"}[family]
    for name in (f"{dataset_name}_{family}_*.h5", f"{long}_*.h5", f"{loose}.h5"):
        for folder in ((os.path.join(root, split), root) if split else (root,)):
            files = sorted(glob.glob(os.path.join(folder, name)))
            if files:
                return files
    where = os.path.join(root, split) if split else root
    raise UserError(f"no LUCiD {family} shards in {where} (looked for {dataset_name}_{family}_*.h5, {long}_*.h5 "
                    f"and {loose}.h5); write them with `python tools/make_lucid.py` or fix data_root/split")


class _ShardReader:
    """Shared part: the file list, per-file event counts, lazy per-process handles."""

    family = ""
    required: tuple[str, ...] = ()

    def __init__(self, files: list[str]):
        self.h5_files = files
        self.n_events: list[int] = []
        for path in files:
            try:
                with h5py.File(path, "r") as f:
                    missing = [k for k in self.required if k not in f]
                    if missing:
                        raise UserError(f"{path} is not a LUCiD {self.family} shard: it lacks {', '.join(missing)} "
                                        f"(found {', '.join(sorted(f.keys())[:8])}); regenerate it")
                    self.n_events.append(self._count(path, f))
                    self._inspect(path, f)
            except OSError as err:
                raise UserError(f"cannot open {path} as HDF5 ({err}); remove or regenerate it") from None
        self._handles: dict[int, h5py.File] = {}
        self._pid = os.getpid()

    def _count(self, path: str, f: h5py.File) -> int:
        offsets = f[self.required[0]]
        n = int(f.attrs.get("n_events", offsets.shape[0] - 1))
        if offsets.shape[0] != n + 1:
            raise UserError(f"{path}: n_events is {n} but {self.required[0]} has {offsets.shape[0]} entries "
                            f"(needs n_events + 1); the shard is damaged, regenerate it")
        return n

    def _inspect(self, path: str, f: h5py.File) -> None:
        pass

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state

    def file(self, file_id: int) -> h5py.File:
        if self._pid != os.getpid():  # forked after files were opened
            self._handles, self._pid = {}, os.getpid()
        if file_id not in self._handles:
            self._handles[file_id] = h5py.File(self.h5_files[file_id], "r")
        return self._handles[file_id]

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles = {}


class LUCiDSensorReader(_ShardReader):
    """PMT response: dense per-sensor sums, raw hits, and the per-particle decomposition."""

    family = "sensor"
    required = _SENSOR_KEYS

    def __init__(self, files: list[str]):
        self.n_sensors = 0
        self.pmt_positions: np.ndarray | None = None
        super().__init__(files)

    def _inspect(self, path: str, f: h5py.File) -> None:
        n_sensors = int(f.attrs.get("n_sensors", 0))
        if n_sensors <= 0:
            raise UserError(f"{path}: the n_sensors attribute is missing or 0; a LUCiD sensor shard records "
                            "how many PMTs the detector has")
        if self.n_sensors and n_sensors != self.n_sensors:
            raise UserError(f"{path} has {n_sensors} sensors but {self.h5_files[0]} has {self.n_sensors}; "
                            "all shards of a data set must come from one detector")
        self.n_sensors = n_sensors
        if self.pmt_positions is None and "config" in f and "pmt_positions" in f["config"]:
            positions = np.asarray(f["config"]["pmt_positions"][:], dtype=np.float32)
            if positions.shape != (n_sensors, 3):
                raise UserError(f"{path}: config/pmt_positions has shape {positions.shape}, expected "
                                f"({n_sensors}, 3)")
            self.pmt_positions = positions

    def hits(self, file_id: int, event: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sensor index int64, PE float32, time float32) of every hit of the event."""
        f = self.file(file_id)
        h0, h1 = (int(v) for v in f["event_hit_offsets"][event:event + 2])
        sensor = f["event_hit_sensor_idx"][h0:h1].astype(np.int64)
        if sensor.size and (sensor.min() < 0 or sensor.max() >= self.n_sensors):
            raise UserError(f"{self.h5_files[file_id]}, event {event}: a hit names sensor {int(sensor.max())} "
                            f"but the detector has {self.n_sensors}; the shard is damaged")
        return sensor, f["event_hit_PE"][h0:h1].astype(np.float32), f["event_hit_T"][h0:h1].astype(np.float32)

    def read_event(self, file_id: int, event: int, include_labels: bool = True, pe_threshold: float = 0.0) -> dict:
        """Upstream's reader output: ``pmt_pe``/``pmt_t`` (n_sensors,) -- summed PE and
        first-hit time (-1 where no hit) -- ``pmt_coord`` when positions are known,
        and the sparse per-particle ``pp_*`` arrays with ``include_labels``."""
        sensor, pe, t = self.hits(file_id, event)
        pmt_pe = np.zeros(self.n_sensors, dtype=np.float32)
        np.add.at(pmt_pe, sensor, pe)
        first = np.full(self.n_sensors, np.inf, dtype=np.float32)
        np.minimum.at(first, sensor, t)
        data = dict(pmt_pe=pmt_pe, pmt_t=np.where(np.isfinite(first), first, np.float32(-1.0)).astype(np.float32))
        if self.pmt_positions is not None:
            data["pmt_coord"] = self.pmt_positions.copy()
        f = self.file(file_id)
        if include_labels and "particle_hit_offsets" in f:
            p0, p1 = (int(v) for v in f["particle_event_offset"][event:event + 2])
            if p1 > p0:
                offsets = f["particle_hit_offsets"][p0:p1 + 1].astype(np.int64)
                per_particle = np.diff(offsets)
                lo, hi = int(offsets[0]), int(offsets[-1])
                pp = dict(
                    pp_sensor_idx=f["particle_hit_sensor_idx"][lo:hi].astype(np.int32),
                    pp_particle_idx=np.repeat(np.arange(p1 - p0, dtype=np.int32), per_particle),
                    pp_pe=f["particle_hit_PE"][lo:hi].astype(np.float32),
                    pp_t=f["particle_hit_T"][lo:hi].astype(np.float32),
                    pp_category=np.repeat(f["particle_category"][p0:p1].astype(np.int32), per_particle),
                )
                if pe_threshold > 0:
                    keep = pp["pp_pe"] > pe_threshold
                    pp = {k: v[keep] for k, v in pp.items()}
                data.update(pp)
        return data


class LUCiDSegReader(_ShardReader):
    """3D track segments: one point per segment, at its midpoint."""

    family = "seg"
    required = _SEG_KEYS

    def segment_counts(self, file_id: int) -> np.ndarray:
        """Number of segments of every event of a file (for ``min_segments``)."""
        f = self.file(file_id)
        tracks = f["track_event_offset"][:].astype(np.int64)
        segments = f["segment_offset"][:].astype(np.int64)
        return segments[tracks[1:]] - segments[tracks[:-1]]

    def read_event(self, file_id: int, event: int) -> dict:
        """``coord`` (S,3) midpoints, ``energy``/``time`` (S,1), and per-segment
        ``track_ids``, ``pdg``, ``parent_ids`` (int32) of the segment's track."""
        f = self.file(file_id)
        t0, t1 = (int(v) for v in f["track_event_offset"][event:event + 2])
        offsets = f["segment_offset"][t0:t1 + 1].astype(np.int64) if t1 > t0 else np.zeros(1, np.int64)
        s0, s1 = int(offsets[0]), int(offsets[-1])
        per_track = np.diff(offsets)
        start = np.stack([f[k][s0:s1] for k in ("start_x", "start_y", "start_z")], axis=1)
        end = np.stack([f[k][s0:s1] for k in ("end_x", "end_y", "end_z")], axis=1)
        return dict(
            coord=((start + end) / 2).astype(np.float32).reshape(-1, 3),
            energy=f["edep"][s0:s1].astype(np.float32)[:, None],
            time=f["time"][s0:s1].astype(np.float32)[:, None],
            track_ids=np.repeat(f["track_id"][t0:t1].astype(np.int32), per_track),
            pdg=np.repeat(f["pdg"][t0:t1].astype(np.int32), per_track),
            parent_ids=np.repeat(f["parent_id"][t0:t1].astype(np.int32), per_track),
        )
