"""PILArNet-M parquet files: finding them, counting and reading rows, writing them.

The file side of :mod:`pimm.datasets.pilarnet_parquet` (the data sets). Rows
are decoded by the HDF5 reader's :func:`~pimm.datasets.pilarnet.decode_event`;
pyarrow is imported only when a file is touched (``pimm[parquet]``).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from pimm.utils.errors import UserError

from .pilarnet import POINT_COLUMNS, REVISIONS, _event_rows, decode_event

__all__ = ["resolve_parquet_files", "write_pilarnet_parquet", "SPLIT_ALIASES", "DEFAULT_REPO"]

SPLIT_ALIASES = {"val": "validation", "valid": "validation"}  # the Hugging Face export's split names
DEFAULT_REPO = "DeepLearnPhysics/PILArNet-M-mini"


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.compute  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise UserError('reading or writing PILArNet parquet files needs pyarrow: pip install "pimm[parquet]"') from None
    return pyarrow


def resolve_parquet_files(split: str, data_root: str | os.PathLike | None = None, *, repo_id: str | None = None,
                          parquet_revision: str = "refs/convert/parquet", config_name: str = "default",
                          revision: str = "v2") -> list[str]:
    """The parquet files of ``split``, sorted. ``data_root`` is searched as
    upstream does (``<config>/<split>/*.parquet``, ``<split>/*.parquet``,
    ``*<split>*/*.parquet``, ``*<split>*.parquet``; ``val`` also finds
    ``validation``); a single file or a glob is taken as it is. With no
    ``data_root``, ``$PILARNET_PARQUET_ROOT_<REV>``, then the local Hugging Face
    cache of ``repo_id`` (nothing is downloaded at run time)."""
    hf_split = SPLIT_ALIASES.get(split, split)
    if data_root is None:
        data_root = os.environ.get(f"PILARNET_PARQUET_ROOT_{revision.upper()}")
    if data_root is None:
        return _cached_hub_files(repo_id, hf_split, parquet_revision, config_name, revision)
    root = os.path.expanduser(str(data_root))
    if os.path.isfile(root):
        return [root]
    if glob.has_magic(root):
        files = sorted(f for f in glob.glob(root) if os.path.isfile(f))
        if not files:
            raise UserError(f"data_root={data_root!r} matches no file")
        return files
    if not os.path.isdir(root):
        raise UserError(f"data_root={data_root!r} does not exist; point it at a folder of PILArNet parquet files "
                        "(tools/export_pilarnet.py --format parquet writes one)")
    patterns = [f"{config_name}/{name}/*.parquet" for name in dict.fromkeys((hf_split, split))]
    patterns += [f"{hf_split}/*.parquet", f"*{hf_split}*/*.parquet", f"*{hf_split}*.parquet"]
    if split != hf_split:
        patterns += [f"{split}/*.parquet", f"*{split}*/*.parquet"]
    for pattern in patterns:
        files = sorted(glob.glob(os.path.join(root, pattern)))
        if files:
            return files
    raise UserError(f"no parquet files for split {split!r} under {root} (tried {', '.join(patterns)})")


def _cached_hub_files(repo_id, hf_split, parquet_revision, config_name, revision) -> list[str]:
    where = (f"set data_root (or $PILARNET_PARQUET_ROOT_{revision.upper()}) to a folder of parquet files, or fetch "
             f"them once with `huggingface-cli download --repo-type dataset {repo_id} --revision {parquet_revision}`")
    if repo_id is None:
        raise UserError(f"no data_root and no repo_id: {where}")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise UserError(f"no data_root: {where} (reading the cache needs pip install \"pimm[hub]\")") from None
    try:  # local_files_only: a training run never downloads
        folder = snapshot_download(repo_id, repo_type="dataset", revision=parquet_revision, local_files_only=True,
                                   allow_patterns=f"{config_name}/{hf_split}/*.parquet")
    except Exception:
        raise UserError(f"{repo_id}@{parquet_revision} is not in the local Hugging Face cache: {where}") from None
    files = sorted(glob.glob(os.path.join(folder, config_name, hf_split, "*.parquet")))
    if not files:
        raise UserError(f"the cached {repo_id}@{parquet_revision} has no {config_name}/{hf_split}/*.parquet: {where}")
    return files


def _point_counts(path: str) -> np.ndarray:
    """Per-row point counts: the ``n_points`` column when the file has one,
    else the lengths of the ``point`` lists / 8 (both read without the rows)."""
    pa = _pyarrow()
    try:
        schema = pa.parquet.read_schema(path)
        column = "n_points" if "n_points" in schema.names else "point"
        if column not in schema.names:
            raise UserError(f"{path} has no 'point' column: it is not a PILArNet parquet file "
                            f"(columns: {', '.join(schema.names)})")
        values = pa.parquet.read_table(path, columns=[column], memory_map=True).column(column)
    except (OSError, pa.ArrowException) as err:
        raise UserError(f"cannot read {path} as parquet: {err}") from None
    if column == "n_points":
        return np.asarray(values.to_numpy(), dtype=np.int64)
    return np.asarray(pa.compute.list_value_length(values).to_numpy(zero_copy_only=False), dtype=np.int64) // len(
        POINT_COLUMNS)


def _kept_rows(files: Sequence[str], min_points: int, max_len: int | None) -> tuple[np.ndarray, int]:
    """``(file id, row)`` of every event with at least ``min_points`` points,
    capped at ``max_len`` (``-1``/``0``/``None``: all), and the count before."""
    entries, total = [], 0
    for file_id, path in enumerate(files):
        counts = _point_counts(path)
        total += len(counts)
        rows = np.flatnonzero(counts >= min_points)
        entries.append(np.stack([np.full(len(rows), file_id), rows], axis=1))
    index = np.concatenate(entries).astype(np.int64) if entries else np.zeros((0, 2), dtype=np.int64)
    if max_len is not None and max_len > 0:
        index = index[:max_len]
    return index, total


class _Tables:
    """Memory-mapped Arrow tables, opened lazily in each process (never pickled)."""

    def __init__(self, files: Sequence[str]):
        self.files, self._open, self._pid = list(files), {}, os.getpid()

    def __getstate__(self):
        return {"files": self.files, "_open": {}, "_pid": None}

    def row(self, file_id: int, row: int) -> dict:
        if self._pid != os.getpid():
            self._open, self._pid = {}, os.getpid()
        table = self._open.get(file_id)
        if table is None:
            table = self._open[file_id] = _pyarrow().parquet.read_table(self.files[file_id], memory_map=True)
        one = table.slice(row, 1)
        out = {}
        for name in ("point", "cluster", "cluster_extra"):
            if name in one.column_names:
                out[name] = one.column(name).combine_chunks().flatten().to_numpy(zero_copy_only=False)
        if "event_id" in one.column_names:
            out["event_id"] = one.column("event_id")[0].as_py()
        return out


def _decode(tables: _Tables, file_id: int, row: int, revision: str, split: str, options: dict) -> dict:
    raw = tables.row(file_id, row)
    path = tables.files[file_id]
    if revision != "v1" and "cluster_extra" not in raw:
        raise UserError(f"{path} has no cluster_extra column, so it is a v1 file: use revision='v1'")
    data = decode_event(raw["point"], raw["cluster"], raw.get("cluster_extra") if revision != "v1" else None,
                        revision, where=f"{path}, row {row}", **options)
    data.update(name=raw.get("event_id") or f"{split}_{row}", split=split, revision=revision)
    return data


def write_pilarnet_parquet(events: Iterable[dict], path: str | os.PathLike, revision: str = "v2",
                           row_group_size: int = 256, name_prefix: str | None = None) -> int:
    """Write events (dicts with ``coord``, ``energy``, ``segment``, optionally
    ``instance`` / ``interaction``) to one parquet file in the PILArNet-M
    ``revision`` layout, with ``n_points`` and ``event_id`` columns; returns the
    number of events. Written to a temporary name, then renamed."""
    pa = _pyarrow()
    if revision not in REVISIONS:
        raise UserError(f"write_pilarnet_parquet: revision={revision!r} is not one of {', '.join(REVISIONS)}")
    path = Path(path)
    prefix = name_prefix if name_prefix is not None else path.stem
    columns: dict[str, list] = {"point": [], "cluster": [], "n_points": [], "event_id": []}
    if revision != "v1":
        columns["cluster_extra"] = []
    for i, event in enumerate(events):
        point, cluster, extra = _event_rows(event, revision)
        columns["point"].append(point)
        columns["cluster"].append(cluster)
        if revision != "v1":
            columns["cluster_extra"].append(extra)
        columns["n_points"].append(len(point) // len(POINT_COLUMNS))
        columns["event_id"].append(f"{prefix}_{i}")
    types = {"point": pa.list_(pa.float32()), "cluster": pa.list_(pa.int64()),
             "cluster_extra": pa.list_(pa.float32()), "n_points": pa.int64(), "event_id": pa.string()}
    table = pa.table({name: pa.array(values, type=types[name]) for name, values in columns.items()})
    tmp = path.with_name(f".{path.name}.tmp")
    pa.parquet.write_table(table, tmp, row_group_size=row_group_size)
    os.replace(tmp, path)
    return table.num_rows
