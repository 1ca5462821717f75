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
different lengths is one :class:`UserError` line naming the file. So is a
damaged shard: every offsets array is checked once per file when the data
set is built (it is not negative, never decreases and ends within the arrays
it indexes, or events would silently read other events' hits), and each event's
values once when it is read (sensor indices in range, finite positions,
charges, times and energies), naming the file, the event and the key.
"""

from __future__ import annotations

import glob
import os

import h5py
import numpy as np

from pimm.utils.errors import UserError

from .event_checks import check_finite

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


def check_offsets(path: str, f: h5py.File, key: str, indexed: tuple[str, ...]) -> None:
    """``f[key]`` cuts the arrays ``indexed`` into consecutive slices: it must
    not be negative, never decrease and end within every one of them."""
    offsets = np.asarray(f[key][:], dtype=np.int64)
    if offsets.size == 0:
        return
    if offsets[0] < 0:
        raise UserError(f"{path}: {key}[0] is {int(offsets[0])}, a negative row; the shard is damaged, "
                        "regenerate it")
    falls = np.flatnonzero(np.diff(offsets) < 0)
    if falls.size:
        i = int(falls[0])
        raise UserError(f"{path}: {key} decreases at entry {i} ({int(offsets[i])} -> {int(offsets[i + 1])}), "
                        f"so event {i} would read other events' rows; the shard is damaged, regenerate it")
    for name in indexed:
        if name in f and int(offsets[-1]) > f[name].shape[0]:
            i = int(np.argmax(offsets > f[name].shape[0])) - 1
            raise UserError(f"{path}: {key} runs to {int(offsets[-1])} but {name} has {f[name].shape[0]} rows "
                            f"(first past the end: entry {i}); the shard is damaged, regenerate it")


class _ShardReader:
    """Shared part: the file list, per-file event counts, lazy per-process handles."""

    family = ""
    required: tuple[str, ...] = ()
    #: ``(offsets key, keys it indexes)``: CSR arrays checked once per file.
    offset_keys: tuple[tuple[str, tuple[str, ...]], ...] = ()

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
        for key, indexed in self.offset_keys:
            if key in f:
                check_offsets(path, f, key, indexed)

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
    offset_keys = (("event_hit_offsets", ("event_hit_sensor_idx", "event_hit_PE", "event_hit_T")),
                   ("particle_event_offset", ("particle_category",)),
                   ("particle_hit_offsets", ("particle_hit_sensor_idx", "particle_hit_PE", "particle_hit_T")))

    def __init__(self, files: list[str]):
        self.n_sensors = 0
        self.pmt_positions: np.ndarray | None = None
        super().__init__(files)

    def _inspect(self, path: str, f: h5py.File) -> None:
        super()._inspect(path, f)
        if "particle_event_offset" in f and "particle_hit_offsets" in f:  # one hit-offset entry per particle, + 1
            particles = int(f["particle_event_offset"][-1]) if f["particle_event_offset"].shape[0] else 0
            if particles + 1 > f["particle_hit_offsets"].shape[0]:
                raise UserError(f"{path}: particle_event_offset names {particles} particles but "
                                f"particle_hit_offsets has {f['particle_hit_offsets'].shape[0]} entries (needs one "
                                "more than the particles); the shard is damaged, regenerate it")
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
            check_finite(positions, f"{path}: config/pmt_positions")
            self.pmt_positions = positions

    def _sensors(self, sensor: np.ndarray, file_id: int, event: int, key: str) -> np.ndarray:
        bad = np.flatnonzero((sensor < 0) | (sensor >= self.n_sensors))
        if bad.size:
            raise UserError(f"{self.h5_files[file_id]}, event {event}: {key} names sensor {int(sensor[bad[0]])} "
                            f"but the detector's sensors are 0..{self.n_sensors - 1}; the shard is damaged")
        return sensor

    def hits(self, file_id: int, event: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sensor index int64, PE float32, time float32) of every hit of the event."""
        f = self.file(file_id)
        h0, h1 = (int(v) for v in f["event_hit_offsets"][event:event + 2])
        sensor = self._sensors(f["event_hit_sensor_idx"][h0:h1].astype(np.int64), file_id, event,
                               "event_hit_sensor_idx")
        pe, t = f["event_hit_PE"][h0:h1].astype(np.float32), f["event_hit_T"][h0:h1].astype(np.float32)
        where = f"{self.h5_files[file_id]}, event {event}"
        check_finite(pe, f"{where}: event_hit_PE")
        check_finite(t, f"{where}: event_hit_T")
        return sensor, pe, t

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
                    pp_sensor_idx=self._sensors(f["particle_hit_sensor_idx"][lo:hi].astype(np.int32), file_id,
                                                event, "particle_hit_sensor_idx"),
                    pp_particle_idx=np.repeat(np.arange(p1 - p0, dtype=np.int32), per_particle),
                    pp_pe=f["particle_hit_PE"][lo:hi].astype(np.float32),
                    pp_t=f["particle_hit_T"][lo:hi].astype(np.float32),
                    pp_category=np.repeat(f["particle_category"][p0:p1].astype(np.int32), per_particle),
                )
                where = f"{self.h5_files[file_id]}, event {event}"
                check_finite(pp["pp_pe"], f"{where}: particle_hit_PE")
                check_finite(pp["pp_t"], f"{where}: particle_hit_T")
                if pe_threshold > 0:
                    keep = pp["pp_pe"] > pe_threshold
                    pp = {k: v[keep] for k, v in pp.items()}
                data.update(pp)
        return data


class LUCiDSegReader(_ShardReader):
    """3D track segments: one point per segment, at its midpoint."""

    family = "seg"
    required = _SEG_KEYS
    offset_keys = (("track_event_offset", ("track_id", "pdg", "parent_id")),
                   ("segment_offset", ("start_x", "start_y", "start_z", "end_x", "end_y", "end_z", "edep", "time")))

    def _inspect(self, path: str, f: h5py.File) -> None:
        super()._inspect(path, f)
        tracks = int(f["track_event_offset"][-1]) if f["track_event_offset"].shape[0] else 0
        if tracks + 1 > f["segment_offset"].shape[0]:
            raise UserError(f"{path}: track_event_offset names {tracks} tracks but segment_offset has "
                            f"{f['segment_offset'].shape[0]} entries (needs one more than the tracks); the shard "
                            "is damaged, regenerate it")

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
        where = f"{self.h5_files[file_id]}, event {event}"
        columns = {k: f[k][s0:s1] for k in ("start_x", "start_y", "start_z", "end_x", "end_y", "end_z", "edep",
                                            "time")}
        for key, values in columns.items():
            check_finite(values, f"{where}: {key}")
        start = np.stack([columns[k] for k in ("start_x", "start_y", "start_z")], axis=1)
        end = np.stack([columns[k] for k in ("end_x", "end_y", "end_z")], axis=1)
        return dict(
            coord=((start + end) / 2).astype(np.float32).reshape(-1, 3),
            energy=columns["edep"].astype(np.float32)[:, None],
            time=columns["time"].astype(np.float32)[:, None],
            track_ids=np.repeat(f["track_id"][t0:t1].astype(np.int32), per_track),
            pdg=np.repeat(f["pdg"][t0:t1].astype(np.int32), per_track),
            parent_ids=np.repeat(f["parent_id"][t0:t1].astype(np.int32), per_track),
        )
