"""Reading and writing PILArNet-M HDF5 event files (upstream pimm's layouts).

PILArNet-M (the public LArTPC dataset used by PoLAr-MAE, Panda and upstream
pimm) stores each event as variable-length rows of 1-D datasets (column by
column in ``docs/pilarnet.md``):

* ``point``: ``N * 8`` floats, rows ``(x, y, z, voxel value, dE, time,
  electrons, dx)``, grouped by cluster;
* ``cluster``: one row per cluster, ``(size, cluster id, group id,
  interaction id, semantic type)`` in revision v1, plus ``pid`` in v2 / v3;
* ``cluster_extra`` (v2 / v3): one float row per cluster, ``(mass, |p|,
  vertex x, y, z)`` in v2, plus ``is_primary`` in v3 (and ``px, py, pz``
  in v3's packed layout, :mod:`pimm.datasets.pilarnet_truth`).

:class:`PILArNetH5Dataset` takes upstream's options with upstream's meanings
(``revision``, ``min_points``, ``max_len``, ``loop``, ``energy_threshold``,
``remove_low_energy_scatters``, ``old_pid_mapping``, a list of splits, the
``$PILARNET_DATA_ROOT_<REV>`` fallback) and emits upstream's label keys
(``segment_motif``, ``segment_pid``, ``instance_particle``, ...) next to
pimm's (``segment``, ``instance``, ``interaction``). Files are opened lazily in
each process and handles are never pickled into DataLoader workers.
:func:`write_pilarnet_h5` writes events in those layouts, so generated data
round-trips and upstream's reader accepts the files.
"""

from __future__ import annotations

import glob
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import h5py
import numpy as np

from pimm.engines.registries import DATASETS
from pimm.utils.errors import ConfigError, UserError

from .event_checks import check_finite, check_labels
from .overlay import EventOverlay, OverlaidItems
from .pilarnet_truth import cluster_truth, truth_rows
from .point_dataset import SEGMENT_CLASSES, SPLITS, PointDataset
from pimm.utils.domains import (
    Choice, Count, FilePath, Int, Key, Keys, MAX_SIZE, NonNeg, PosInt, Prob, Seq, Transforms,
)

__all__ = ["PILArNetH5Dataset", "write_pilarnet_h5", "POINT_COLUMNS", "CLUSTER_COLUMNS", "REVISIONS"]

logger = logging.getLogger(__name__)

POINT_COLUMNS = ("x", "y", "z", "value", "dE", "time", "electrons", "dx")
CLUSTER_COLUMNS = ("size", "cluster_id", "group_id", "interaction_id", "semantic", "pid")  # v1: without pid
CLUSTER_EXTRA_COLUMNS = ("mass", "momentum", "vtx_x", "vtx_y", "vtx_z", "is_primary")  # v2: without is_primary
REVISIONS = ("v1", "v2", "v3")
_CLUSTER_WIDTH = {"v1": 5, "v2": 6, "v3": 6}
_EXTRA_WIDTHS = {"v2": (5, 6, 9, 11), "v3": (6, 9, 11)}  # a v3 file read as v2 drops is_primary (upstream too)
LOW_ENERGY = 4
_LED_PID, _LED_PID_OLD = 5, 6  # what pid -1 ("none", low-energy deposits) becomes in v2 / v3


def _split_files(root: str, splits: Sequence[str]) -> list[str]:
    files = []
    for split in splits:  # upstream's pattern: any directory whose name ends in the split
        files += sorted(glob.glob(os.path.join(root, f"*{split}", "*.h5")))
    if not files:
        files = sorted(glob.glob(os.path.join(root, "*.h5")))
    return sorted(dict.fromkeys(files))


def _resolve_files(data_root: str | os.PathLike, splits: Sequence[str]) -> list[str]:
    """``data_root`` may be a file, a directory (``<dir>/*<split>/*.h5``, else
    ``<dir>/*.h5``) or a glob pattern; ``~`` is expanded."""
    root = os.path.expanduser(str(data_root))
    if os.path.isfile(root):
        return [root]
    if os.path.isdir(root):
        files = _split_files(root, splits)
        if not files:
            raise UserError(f"no *.h5 files in {root} (looked for "
                            f"{', '.join(os.path.join(root, '*' + s, '*.h5') for s in splits)} and {root}/*.h5)")
        return files
    if glob.has_magic(root):
        files = sorted(f for f in glob.glob(root) if os.path.isfile(f))
        if not files:
            raise UserError(f"the pattern {root} matches no files")
        return files
    raise UserError(f"data_root {root} does not exist "
                    "(give a directory of *.h5 files, a single .h5 file or a glob)")


def _default_root(revision: str | None) -> str:
    """Upstream's fallback when ``data_root`` is None."""
    if revision is None:
        raise ConfigError("data_root is None; give data_root, or a revision so that "
                          "$PILARNET_DATA_ROOT_<REVISION> or ~/.cache/pimm/pilarnet/<revision> is used")
    variable = f"PILARNET_DATA_ROOT_{revision.upper()}"
    cached = Path.home() / ".cache" / "pimm" / "pilarnet" / revision
    root = os.environ.get(variable) or (str(cached) if cached.is_dir() else None)
    if root is None:
        raise ConfigError(f"data_root is None and neither ${variable} nor {cached} is set up; "
                          "pass data_root=... (e.g. --options data.train.data_root=/path)")
    return root


def _file_revision(path: str, f: h5py.File) -> str:
    """The layout of an open file: v1 without ``cluster_extra``, else v2 / v3
    by the width of its rows."""
    for name in ("point", "cluster"):
        if name not in f or not isinstance(f[name], h5py.Dataset) or f[name].ndim != 1:
            raise UserError(f"{path} is not a PILArNet file: expected 1-D variable-length datasets "
                            f"'point' and 'cluster' (and 'cluster_extra' from v2 on), found {sorted(f.keys())}")
    n = f["point"].shape[0]
    for name in ("cluster", "cluster_extra"):
        if name in f and f[name].shape[0] != n:
            raise UserError(f"{path}: 'point' has {n} events but '{name}' has {f[name].shape[0]}; "
                            "each event needs one row in every dataset")
    if "cluster_extra" not in f:
        return "v1"
    for event in range(n):
        clusters = f["cluster"][event].size // 6
        if clusters:
            width = f["cluster_extra"][event].size / clusters
            if width in (5, 6, 9, 11):
                return "v2" if width == 5 else "v3"
            raise UserError(f"{path}: 'cluster_extra' has {width:g} values per cluster in event {event}; "
                            "PILArNet v2 has 5, v3 has 6 (9 or 11 with momentum components)")
    return "v2"


@DATASETS.register_module()
class PILArNetH5Dataset(OverlaidItems, PointDataset):
    """Events from PILArNet-M HDF5 files, with upstream pimm's options.

    Args:
        data_root: a directory (``<dir>/*<split>/*.h5``, else ``<dir>/*.h5``),
            one ``.h5`` file or a glob; ``None`` reads ``$PILARNET_DATA_ROOT_<REV>``
            then ``~/.cache/pimm/pilarnet/<revision>`` (needs ``revision``).
        split: a split name or a list of them (``"train"``, ``"val"``, ``"test"``).
        transform: list of transform configs applied to each event.
        revision: ``"v1"``, ``"v2"`` or ``"v3"``; every file must have that
            layout (a v3 file read as v2 drops ``is_primary``, as upstream).
            ``None`` (pimm's default) takes each file's own layout.
        min_points: skip events with fewer points (upstream's default 1024;
            counted from the ``<file>_points.npy`` index when present).
        max_len: keep at most this many events (``-1`` or ``0``: all), before ``loop``.
        loop: repeat the events this many times per epoch (1 in test mode).
        energy_threshold: when positive, keep only points whose voxel value
            is above it (MeV).
        remove_low_energy_scatters: drop each event's first cluster (the
            low-energy deposits) and its points.
        old_pid_mapping: particle type -1 becomes 6 instead of 5 (v2 / v3).
        ignore_index: recorded for configs that read it; labels are not changed.
        test_mode, test_cfg: upstream's test fragments: each item is then the
            fragments of one event with its full-resolution points (see
            :mod:`pimm.datasets.fragments`).
        overlay_n_events, overlay_prob, overlay_allow_repeats: upstream's event
            overlay (:mod:`pimm.datasets.overlay`): with probability ``overlay_prob``
            an event is composited with ``overlay_n_events - 1`` others (a count, or
            an inclusive ``(low, high)`` range), drawn with or without repeats.

    Items (numpy): ``coord`` (N,3) float32 voxel coordinates, ``energy``
    (N,1) float32 (voxel value); int64 (N,) labels ``segment`` = ``segment_motif``
    (semantic type), ``segment_pid`` (particle type), ``instance_particle``
    (group id renumbered 0..K-1, -1 for negative ids), ``instance_interaction``
    (the same for interactions), ``segment_interaction`` (1 inside an
    interaction, 0 for background), ``is_primary`` (v3 only), ``momentum``
    (N, 1), ``momentum_vec`` (N, 3) and ``vertex`` (N, 3) (the particle truth,
    :mod:`pimm.datasets.pilarnet_truth`), and pimm's
    ``instance`` (as ``instance_particle`` but -1 for low-energy deposits) and
    ``interaction`` (raw interaction id); ``name`` = ``"<file>.h5_<event>"``,
    ``split`` and ``revision`` strings.
    """

    domains = dict(data_root=FilePath | None, split=Key | Keys, transform=Transforms,
                   loop=PosInt, ignore_index=Int(-1, MAX_SIZE), energy_threshold=NonNeg, min_points=Count,
                   max_len=Int(-1) | None, revision=Choice(*REVISIONS) | None,
                   overlay_n_events=PosInt | Seq(PosInt, length=2), overlay_prob=Prob)

    def __init__(self, data_root: str | os.PathLike | None = None, split: str | Sequence[str] = "train",
                 transform: Sequence[Any] | None = None, test_mode: bool = False, test_cfg: Any = None,
                 loop: int = 1, ignore_index: int = -1, energy_threshold: float = 0.0, min_points: int = 1024,
                 max_len: int | None = -1, remove_low_energy_scatters: bool = False, old_pid_mapping: bool = False,
                 revision: str | None = None, overlay_n_events: int | Sequence[int] = 1, overlay_prob: float = 1.0,
                 overlay_allow_repeats: bool = True):
        splits = [split] if isinstance(split, str) else list(split)
        if not splits or not all(isinstance(s, str) for s in splits):
            raise ConfigError(f"split must be a split name or a list of them, got {split!r}")
        if any(name not in SPLITS for name in splits):
            raise UserError(f"split={split!r} is not supported; use one of {', '.join(SPLITS)} (or a list of them)")
        super().__init__(split=splits[0], transform=transform, test_mode=test_mode, test_cfg=test_cfg)
        if len(splits) > 1:
            self.split = "custom"  # upstream's name for a multi-split set
        self.overlay = EventOverlay(overlay_n_events, overlay_prob, overlay_allow_repeats)
        if revision is not None and revision not in REVISIONS:
            raise ConfigError(f"revision={revision!r} is not one of {', '.join(REVISIONS)} "
                              "(or None to take each file's layout)")
        for name, value, low in (("loop", loop, 1), ("min_points", min_points, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name}={value!r} must be an integer >= {low}")
        self.revision, self.ignore_index = revision, ignore_index
        self.loop = 1 if test_mode else loop  # each test event is scored once (upstream too)
        self.energy_threshold = float(energy_threshold)
        self.remove_low_energy_scatters, self.old_pid_mapping = bool(remove_low_energy_scatters), bool(old_pid_mapping)
        self.files = _resolve_files(_default_root(revision) if data_root is None else data_root, splits)
        self.versions: list[str] = []
        entries, total = [], 0
        for file_id, path in enumerate(self.files):
            try:
                with h5py.File(path, "r") as f:
                    found = _file_revision(path, f)
                    self.versions.append(self._check_revision(path, found))
                    n_events = f["point"].shape[0]
                    total += n_events
                    keep = np.arange(n_events)
                    if min_points > 0:
                        keep = keep[self._point_counts(path, f, n_events, file_id) >= min_points]
            except OSError as err:
                raise UserError(f"cannot open {path} as HDF5: {err}") from None
            entries.append(np.stack([np.full(len(keep), file_id), keep], axis=1))
        index = np.concatenate(entries) if entries else np.zeros((0, 2), dtype=np.int64)
        if max_len is not None and max_len > 0:  # upstream: 0 or negative = no cap
            index = index[:max_len]
        self.index = index.astype(np.int64)
        if len(self.index) == 0:
            raise UserError(f"none of the {total} events in {len(self.files)} file(s) under "
                            f"{self.files[0] if len(self.files) == 1 else os.path.dirname(self.files[0])} is kept "
                            f"(min_points={min_points}, max_len={max_len}); lower min_points (upstream's default "
                            "is 1024) or check data_root and split")
        logger.info("PILArNetH5Dataset %s: %d of %d events in %d file(s) (min_points=%d, max_len=%s) x loop %d",
                    "/".join(splits), len(self.index), total, len(self.files), min_points, max_len, loop)
        self._handles: dict[int, h5py.File] = {}
        self._pid = os.getpid()

    def _check_revision(self, path: str, found: str) -> str:
        wanted = self.revision
        if wanted is None or wanted == found or (wanted == "v2" and found == "v3"):
            return wanted or found
        raise UserError(f"{path} is a PILArNet {found} file but revision={wanted!r}; "
                        f"use revision={found!r} (or None to take each file's layout)")

    def _point_counts(self, path: str, f: h5py.File, n_events: int, file_id: int) -> np.ndarray:
        index_file = path[: -len(".h5")] + "_points.npy" if path.endswith(".h5") else None
        if index_file and os.path.exists(index_file):
            counts = np.load(index_file)
            if counts.shape == (n_events,):
                return counts
        width = _CLUSTER_WIDTH[self.versions[file_id]]
        return np.array([int(np.asarray(row).reshape(-1, width)[:, 0].sum()) for row in f["cluster"]])

    # h5py handles cannot cross process boundaries: drop them when pickled
    # (DataLoader workers, spawn) and reopen lazily in the new process.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state

    def _file(self, file_id: int) -> h5py.File:
        if self._pid != os.getpid():  # forked after files were opened
            self._handles, self._pid = {}, os.getpid()
        if file_id not in self._handles:
            self._handles[file_id] = h5py.File(self.files[file_id], "r")
        return self._handles[file_id]

    def __len__(self) -> int:
        return len(self.index) * self.loop

    def get_data(self, idx: int) -> dict:
        file_id, event = (int(v) for v in self.index[idx % len(self.index)])
        f, path, revision = self._file(file_id), self.files[file_id], self.versions[file_id]
        extra = np.asarray(f["cluster_extra"][event]) if revision != "v1" else None
        data = decode_event(np.asarray(f["point"][event]), np.asarray(f["cluster"][event]), extra, revision,
                            where=f"{path}, event {event}", energy_threshold=self.energy_threshold,
                            remove_low_energy_scatters=self.remove_low_energy_scatters,
                            old_pid_mapping=self.old_pid_mapping, ignore_index=self.ignore_index)
        data.update(name=f"{os.path.basename(path)}_{event}", split=self.split, revision=revision)
        return data


def decode_event(point: np.ndarray, cluster: np.ndarray, extra: np.ndarray | None, revision: str, *,
                 where: str = "event", energy_threshold: float = 0.0, remove_low_energy_scatters: bool = False,
                 old_pid_mapping: bool = False, ignore_index: int = -1) -> dict:
    """One event's flat ``point`` / ``cluster`` / ``cluster_extra`` rows ->
    the per-point dict described in :class:`PILArNetH5Dataset`.

    What is read is checked (:mod:`pimm.datasets.event_checks`): finite
    coordinates and voxel values, semantic types in ``0..4`` or
    ``ignore_index``; a bad value is one error line naming ``where`` and the
    key. An event without points is a well-defined empty event (every key
    with 0 rows), as a v1 one always was; ``min_points`` leaves such events out."""
    width = _CLUSTER_WIDTH[revision]
    if point.size % len(POINT_COLUMNS) or cluster.size % width:
        raise UserError(f"{where}: 'point' must hold rows of {len(POINT_COLUMNS)} values and 'cluster' rows of "
                        f"{width} ({revision}); got {point.size} and {cluster.size} values")
    point = point.reshape(-1, len(POINT_COLUMNS))
    cluster = cluster.reshape(-1, width).astype(np.int64)
    sizes = cluster[:, 0]
    if np.any(sizes < 0) or sizes.sum() != len(point):
        raise UserError(f"{where}: cluster sizes add up to {sizes.sum()} but the event has {len(point)} points")
    if revision == "v1":
        pid = np.full(len(cluster), -1, dtype=np.int64)  # v1 has no particle type (kept as -1, as upstream)
    else:
        pid = np.where(cluster[:, 5] == -1, _LED_PID_OLD if old_pid_mapping else _LED_PID, cluster[:, 5])
    primary = None
    if revision != "v1":
        widths = _EXTRA_WIDTHS[revision]
        if len(cluster) and (extra.size % len(cluster) or extra.size // len(cluster) not in widths):
            raise UserError(f"{where}: 'cluster_extra' must hold {' or '.join(map(str, widths))} values per "
                            f"cluster ({revision}), got {extra.size} for {len(cluster)} clusters")
    if revision == "v3":
        primary = extra.reshape(len(cluster), -1)[:, 5].astype(np.int64) if len(cluster) else np.zeros(0, np.int64)
    truth = cluster_truth(extra, len(cluster), revision)
    if remove_low_energy_scatters and len(cluster):
        point, cluster, pid = point[sizes[0]:], cluster[1:], pid[1:]
        primary = None if primary is None else primary[1:]
        truth = {k: v[1:] for k, v in truth.items()}
        sizes = cluster[:, 0]
    semantic, group, interaction = (np.repeat(cluster[:, c], sizes) for c in (4, 2, 3))
    coord, energy = point[:, :3].astype(np.float32), point[:, 3:4].astype(np.float32)
    check_finite(coord, f"{where}, key 'coord' (point columns x, y, z)")
    check_finite(energy, f"{where}, key 'energy' (point column value)")
    check_labels(semantic, f"{where}, key 'segment' (cluster column semantic type)", len(SEGMENT_CLASSES),
                 (ignore_index,))
    data = dict(
        coord=coord,
        energy=energy,
        segment=semantic,
        segment_motif=semantic.copy(),
        segment_pid=np.repeat(pid, sizes),
        instance=_renumber(np.where(semantic == LOW_ENERGY, -1, group)),
        instance_particle=_renumber(group),
        instance_interaction=_renumber(interaction),
        segment_interaction=(interaction != -1).astype(np.int64),
        interaction=interaction,
    )
    if primary is not None:
        data["is_primary"] = np.repeat(primary, sizes)
    data.update(momentum=np.repeat(truth["momentum"], sizes)[:, None], momentum_vec=np.repeat(truth["momentum_vec"],
                sizes, axis=0), vertex=np.repeat(truth["vertex"], sizes, axis=0))
    if energy_threshold > 0:
        keep = data["energy"][:, 0] > energy_threshold
        data = {k: v[keep] for k, v in data.items()}
    return data


def _renumber(ids: np.ndarray) -> np.ndarray:
    """Map non-negative ids to 0..K-1 keeping their order; negatives -> -1."""
    out = np.full(ids.shape, -1, dtype=np.int64)
    valid = ids >= 0
    out[valid] = np.unique(ids[valid], return_inverse=True)[1]
    return out


def _event_rows(event: dict, revision: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Turn one event dict into flattened (point, cluster, cluster_extra) rows."""
    coord = np.asarray(event["coord"], dtype=np.float32).reshape(-1, 3)
    n = len(coord)
    energy = np.asarray(event["energy"], dtype=np.float32).reshape(n)
    segment = np.asarray(event["segment"], dtype=np.int64).reshape(n)
    instance = np.asarray(event.get("instance", np.full(n, -1)), dtype=np.int64).reshape(n)
    interaction = np.asarray(event.get("interaction", np.full(n, -1)), dtype=np.int64).reshape(n)
    # A cluster is one particle (instance) or, for points without an instance,
    # one interaction; those come first as in PILArNet files. The segment is
    # part of the key so a cluster never mixes semantic types.
    low = instance < 0
    sub = np.where(low, interaction, instance)
    order = np.lexsort((segment, sub, ~low))
    keys = np.stack([low[order], sub[order], segment[order]], axis=1)
    starts = np.flatnonzero(np.r_[True, np.any(keys[1:] != keys[:-1], axis=1)]) if n else np.zeros(0, int)
    sizes = np.diff(np.r_[starts, n]).astype(np.int64)
    first = order[starts]
    group = np.where(low[first], -1, instance[first])
    columns = [sizes, group, group, interaction[first], segment[first]]
    extra = np.zeros((len(first), 0), dtype=np.float32)
    if revision != "v1":  # the particle truth when the event has it (generated events do), else -1
        pid, extra = truth_rows(event, first, revision)
        columns.append(pid)
    cluster = np.stack(columns, axis=1) if n else np.zeros((0, len(columns)), dtype=np.int64)
    # Columns this library does not simulate (time, electrons, dx) are written as 0.
    point = np.zeros((n, len(POINT_COLUMNS)), dtype=np.float32)
    point[:, :3], point[:, 3], point[:, 4] = coord[order], energy[order], energy[order]
    return point.ravel(), cluster.astype(np.int64).ravel(), extra.ravel()


def write_pilarnet_h5(events: Iterable[dict], path: str | os.PathLike, write_index: bool = True,
                      revision: str = "v2") -> int:
    """Write events (dicts with ``coord``, ``energy``, ``segment`` and
    optionally ``instance`` / ``interaction``) to ``path`` in the PILArNet-M
    ``revision`` layout (``"v2"`` by default; ``"v1"`` has no
    ``cluster_extra``); returns the number of events written. Points are
    stored grouped by cluster (generated events already are, so they read
    back identical). With ``write_index`` the ``<stem>_points.npy`` per-event
    point counts that upstream's reader looks for are written next to it."""
    if revision not in REVISIONS:
        raise UserError(f"write_pilarnet_h5: revision={revision!r} is not one of {', '.join(REVISIONS)}")
    path = Path(path)
    counts: list[int] = []
    layout = [("point", np.float32), ("cluster", np.int64)] + [("cluster_extra", np.float32)] * (revision != "v1")
    # Write to a temporary name and rename: a crash never leaves a truncated
    # file behind, and readers holding the old file open are not disturbed.
    tmp = path.with_name(f".{path.name}.tmp")
    with h5py.File(tmp, "w") as f:
        datasets = [f.create_dataset(name, shape=(0,), maxshape=(None,), chunks=(64,), dtype=h5py.vlen_dtype(dtype))
                    for name, dtype in layout]
        for i, event in enumerate(events):
            rows = _event_rows(event, revision)
            for ds, row in zip(datasets, rows):
                ds.resize((i + 1,))
                ds[i] = row
            counts.append(len(rows[0]) // len(POINT_COLUMNS))
    os.replace(tmp, path)
    if write_index:
        index = path.with_name(path.stem + "_points.npy")
        tmp = index.with_name(f".{index.stem}.tmp.npy")
        np.save(tmp, np.asarray(counts, dtype=np.int64))
        os.replace(tmp, index)
    return len(counts)
