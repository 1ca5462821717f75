"""Reading and writing PILArNet-M style HDF5 event files.

PILArNet-M (the public LArTPC dataset used by PoLAr-MAE and Panda) stores each
event as variable-length rows of three 1-D datasets (see ``docs/pilarnet.md``
for the column-by-column layout and what could not be confirmed):

* ``point``: ``N * 8`` floats per event, rows ``(x, y, z, voxel value [MeV],
  dE [MeV], time [ns], electrons, dx [mm])``, grouped by cluster;
* ``cluster``: ``M * 6`` integers per event, rows ``(num points, fragment id,
  group id, interaction id, semantic type, pid)``; older (v1) files have 5
  columns, without ``pid``;
* ``cluster_extra`` (v2 only): ``M * 5`` floats per event, rows
  ``(mass, momentum, vertex x, y, z)``.

:class:`PILArNetH5Dataset` reads such files lazily (h5py handles are opened
on first use in each process and never pickled into DataLoader workers) and
returns the same dict layout as :class:`~pimm.datasets.lartpc.LArTPCSynthDataset`;
:func:`write_pilarnet_h5` writes events in that layout so generated data
round-trips through files.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import h5py
import numpy as np

from pimm.engines.registries import DATASETS
from pimm.utils.errors import UserError

from .point_dataset import PointDataset

__all__ = ["PILArNetH5Dataset", "write_pilarnet_h5", "POINT_COLUMNS", "CLUSTER_COLUMNS"]

POINT_COLUMNS = ("x", "y", "z", "value", "dE", "time", "electrons", "dx")
CLUSTER_COLUMNS = ("size", "fragment", "group", "interaction", "semantic", "pid")
CLUSTER_EXTRA_COLUMNS = ("mass", "momentum", "vtx_x", "vtx_y", "vtx_z")
LOW_ENERGY = 4


def _resolve_files(data_root: str | os.PathLike, split: str) -> list[str]:
    """``data_root`` may be a file, a directory (``<dir>/<split>/*.h5`` if
    that exists, else ``<dir>/*.h5``) or a glob pattern."""
    root = str(data_root)
    if os.path.isfile(root):
        return [root]
    if os.path.isdir(root):
        split_dir = os.path.join(root, split)
        pattern = os.path.join(split_dir if os.path.isdir(split_dir) else root, "*.h5")
        files = sorted(glob.glob(pattern))
        if not files:
            raise UserError(f"PILArNetH5Dataset: no *.h5 files in {split_dir if os.path.isdir(split_dir) else root} "
                            f"(expected {root}/{split}/*.h5 or {root}/*.h5)")
        return files
    if glob.has_magic(root):
        files = sorted(f for f in glob.glob(root) if os.path.isfile(f))
        if not files:
            raise UserError(f"PILArNetH5Dataset: the pattern {root} matches no files")
        return files
    raise UserError(f"PILArNetH5Dataset: data_root {root} does not exist "
                    "(give a directory of *.h5 files, a single .h5 file or a glob)")


def _check_structure(path: str, f: h5py.File) -> int:
    """Validate the layout of an open file and return its number of events."""
    for name in ("point", "cluster"):
        if name not in f or not isinstance(f[name], h5py.Dataset) or f[name].ndim != 1:
            raise UserError(f"{path} is not a PILArNet file: expected 1-D variable-length datasets "
                            f"'point' and 'cluster' (and optionally 'cluster_extra'), found {sorted(f.keys())}")
    if f["cluster"].shape != f["point"].shape:
        raise UserError(f"{path}: 'point' has {f['point'].shape[0]} events but 'cluster' has "
                        f"{f['cluster'].shape[0]}; each event needs one row in both")
    return int(f["point"].shape[0])


@DATASETS.register_module()
class PILArNetH5Dataset(PointDataset):
    """Events from PILArNet-M style HDF5 files.

    Args:
        data_root: a directory (``<dir>/<split>/*.h5`` or ``<dir>/*.h5``), a
            single ``.h5`` file or a glob pattern.
        split: ``"train"``, ``"val"`` or ``"test"`` (selects the subdirectory).
        transform: list of transform configs applied to each event.
        min_points: skip events with fewer points (counted from the
            ``<file>_points.npy`` index next to a file when present, else from
            the ``cluster`` sizes).
        max_events: keep at most this many events (after ``min_points``).
        energy_threshold: drop points whose voxel value is below this (MeV).

    Items: ``coord`` (N,3) float32 voxel coordinates, ``energy`` (N,1) float32
    (the voxel value column), ``segment`` / ``instance`` / ``interaction``
    (N,) int64 and ``name`` = ``"<file stem>_<event index in file>"``.
    ``instance`` is the cluster's group id renumbered to 0..K-1 in order of
    id; low-energy clusters (semantic type 4) and negative group ids give -1.
    """

    def __init__(self, data_root: str | os.PathLike, split: str = "train",
                 transform: Sequence[Any] | None = None, min_points: int = 0,
                 max_events: int | None = None, energy_threshold: float = 0.0):
        super().__init__(split=split, transform=transform)
        if data_root is None:
            raise UserError("PILArNetH5Dataset needs data_root (a directory, .h5 file or glob)")
        self.files = _resolve_files(data_root, split)
        self.energy_threshold = float(energy_threshold)
        self.versions: list[int] = []
        entries: list[np.ndarray] = []
        for file_id, path in enumerate(self.files):
            try:
                with h5py.File(path, "r") as f:
                    n_events = _check_structure(path, f)
                    self.versions.append(2 if "cluster_extra" in f else 1)
                    keep = np.arange(n_events)
                    if min_points > 0:
                        keep = keep[self._point_counts(path, f, n_events) >= min_points]
            except OSError as err:
                raise UserError(f"cannot open {path} as HDF5: {err}") from None
            entries.append(np.stack([np.full(len(keep), file_id), keep], axis=1))
        index = np.concatenate(entries) if entries else np.zeros((0, 2), dtype=np.int64)
        if max_events is not None:
            index = index[: max(int(max_events), 0)]
        self.index = index.astype(np.int64)
        self._handles: dict[int, h5py.File] = {}
        self._pid = os.getpid()

    def _point_counts(self, path: str, f: h5py.File, n_events: int) -> np.ndarray:
        index_file = Path(path).with_name(Path(path).stem + "_points.npy")
        if index_file.exists():
            counts = np.load(index_file)
            if counts.shape == (n_events,):
                return counts
        width = 6 if "cluster_extra" in f else 5
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
        return len(self.index)

    def get_data(self, idx: int) -> dict:
        file_id, event = (int(v) for v in self.index[idx])
        f, path = self._file(file_id), self.files[file_id]
        width = 6 if self.versions[file_id] == 2 else 5
        point = np.asarray(f["point"][event])
        cluster = np.asarray(f["cluster"][event])
        if point.size % len(POINT_COLUMNS) or cluster.size % width:
            raise UserError(f"{path}, event {event}: 'point' must hold rows of {len(POINT_COLUMNS)} values "
                            f"and 'cluster' rows of {width}; got {point.size} and {cluster.size} values")
        point = point.reshape(-1, len(POINT_COLUMNS))
        cluster = cluster.reshape(-1, width).astype(np.int64)
        sizes = cluster[:, 0]
        if sizes.sum() != len(point) or np.any(sizes < 0):
            raise UserError(f"{path}, event {event}: cluster sizes add up to {sizes.sum()} "
                            f"but the event has {len(point)} points")
        semantic = np.repeat(cluster[:, 4], sizes)
        group = np.repeat(np.where(cluster[:, 4] == LOW_ENERGY, -1, cluster[:, 2]), sizes)
        data = dict(
            coord=point[:, :3].astype(np.float32),
            energy=point[:, 3:4].astype(np.float32),
            segment=semantic,
            instance=_renumber(group),
            interaction=np.repeat(cluster[:, 3], sizes),
        )
        if self.energy_threshold > 0:
            keep = data["energy"][:, 0] >= self.energy_threshold
            data = {k: v[keep] for k, v in data.items()}
        data["name"] = f"{Path(path).stem}_{event}"
        return data


def _renumber(ids: np.ndarray) -> np.ndarray:
    """Map non-negative ids to 0..K-1 keeping their order; negatives -> -1."""
    out = np.full(ids.shape, -1, dtype=np.int64)
    valid = ids >= 0
    out[valid] = np.unique(ids[valid], return_inverse=True)[1]
    return out


def _event_rows(event: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
    cluster = np.stack([sizes, group, group, interaction[first], segment[first],
                        np.full(len(first), -1)], axis=1) if n else np.zeros((0, 6), dtype=np.int64)
    # Columns this library does not simulate (time, electrons, dx, mass,
    # momentum, vertex) are written as 0 / -1 placeholders; see the docs.
    point = np.zeros((n, len(POINT_COLUMNS)), dtype=np.float32)
    point[:, :3], point[:, 3], point[:, 4] = coord[order], energy[order], energy[order]
    extra = np.full((len(cluster), len(CLUSTER_EXTRA_COLUMNS)), -1.0, dtype=np.float32)
    return point.ravel(), cluster.astype(np.int64).ravel(), extra.ravel()


def write_pilarnet_h5(events: Iterable[dict], path: str | os.PathLike, write_index: bool = True) -> int:
    """Write events (dicts with ``coord``, ``energy``, ``segment`` and
    optionally ``instance`` / ``interaction``) to ``path`` in the PILArNet-M v2
    layout; returns the number of events written. Points are stored grouped
    by cluster (events from :class:`LArTPCSynthDataset` already are, so they
    read back identical). With ``write_index`` a ``<stem>_points.npy`` file of
    per-event point counts is written next to it, as in the public dataset."""
    path = Path(path)
    counts: list[int] = []
    # Write to a temporary name and rename: a crash never leaves a truncated
    # file behind, and readers holding the old file open are not disturbed.
    tmp = path.with_name(f".{path.name}.tmp")
    with h5py.File(tmp, "w") as f:
        datasets = {
            name: f.create_dataset(name, shape=(0,), maxshape=(None,), chunks=(64,),
                                   dtype=h5py.vlen_dtype(dtype))
            for name, dtype in (("point", np.float32), ("cluster", np.int64), ("cluster_extra", np.float32))
        }
        for i, event in enumerate(events):
            rows = _event_rows(event)
            for ds, row in zip(datasets.values(), rows):
                ds.resize((i + 1,))
                ds[i] = row
            counts.append(len(rows[0]) // len(POINT_COLUMNS))
        f.attrs["point_columns"] = ",".join(POINT_COLUMNS)
        f.attrs["cluster_columns"] = ",".join(CLUSTER_COLUMNS)
        f.attrs["cluster_extra_columns"] = ",".join(CLUSTER_EXTRA_COLUMNS)
    os.replace(tmp, path)
    if write_index:
        index = path.with_name(path.stem + "_points.npy")
        tmp = index.with_name(f".{index.stem}.tmp.npy")
        np.save(tmp, np.asarray(counts, dtype=np.int64))
        os.replace(tmp, index)
    return len(counts)
