"""PILArNet-M events in parquet (upstream pimm's layout), read at random or streamed.

One parquet row is one event, in the same flat columns as the HDF5 files
(``docs/pilarnet.md``): ``point`` (list of ``N * 8`` floats), ``cluster`` (list
of ``K * 5`` or ``K * 6`` ints), ``cluster_extra`` (list of floats, v2 / v3),
plus ``n_points`` and ``event_id``, which upstream's converter adds and its
readers use when present. Both readers decode rows with the HDF5 reader's
:func:`~pimm.datasets.pilarnet.decode_event`, so an event reads the same from
either format.

* :class:`PILArNetParquetDataset` is map-style (memory-mapped Arrow tables,
  one open per process), for fine-tuning, validation and anything that wants
  random access; it takes the HDF5 reader's options.
* :class:`PILArNetParquetIterableDataset` streams: each process and data-loader
  worker reads its own contiguous block of the epoch (sequential reads, the
  access pattern network file systems reward), with shard-order shuffling and
  a reservoir buffer. It is written here rather than on Hugging Face
  ``datasets`` streaming (upstream's choice) because exact mid-epoch resume
  needs the stream's position to be state we own: the order is a pure
  function of ``(seed, epoch)`` over event *indices*, so a resumed stream
  replays the buffer on indices (no row is read twice) and continues at the
  sample where it stopped, across ranks and workers.

pyarrow is an optional dependency (``pip install "pimm[parquet]"``).
:func:`write_pilarnet_parquet` writes events in this layout
(``tools/export_pilarnet.py --format parquet``).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from pimm.engines.registries import DATASETS
from pimm.utils import comm
from pimm.utils.domains import (
    Bool, Choice, Count, DictOf, FilePath, Int, Key, MAX_SIZE, NonNeg, PosInt, Prob, Seq, Transforms,
)
from pimm.utils.errors import ConfigError, UserError
from pimm.utils.rng import derive_seed, seed_cpu_streams

from .parquet_files import (DEFAULT_REPO, _decode, _kept_rows, _Tables, resolve_parquet_files,  # noqa: F401
                            write_pilarnet_parquet)
from .collate import collate_fn as point_collate_fn
from .overlay import EventOverlay, OverlaidItems
from .pilarnet import REVISIONS
from .point_dataset import PointDataset

__all__ = ["PILArNetParquetDataset", "PILArNetParquetIterableDataset", "write_pilarnet_parquet",
           "resolve_parquet_files"]

logger = logging.getLogger(__name__)


def _refuse_test_mode(name: str, test_mode: bool, test_cfg: Any) -> None:
    if test_mode or test_cfg is not None:
        raise ConfigError(f"{name} does not support test_mode/test_cfg (as upstream); "
                          "test with PILArNetH5Dataset (tools/export_pilarnet.py writes both formats)")


_SHARED_DOMAINS = dict(repo_id=Key | None, data_root=FilePath | None, split=Key, transform=Transforms,
                       revision=Choice(*REVISIONS), parquet_revision=Key, config_name=Key, loop=PosInt,
                       ignore_index=Int(-1, MAX_SIZE), energy_threshold=NonNeg, min_points=Count,
                       max_len=Int(-1) | None, test_cfg=DictOf() | None)


@DATASETS.register_module()
class PILArNetParquetDataset(OverlaidItems, PointDataset):
    """PILArNet-M events from parquet files, at random (upstream's arguments).

    Args:
        repo_id: a Hugging Face dataset whose parquet export is read from the
            local cache when neither ``data_root`` nor
            ``$PILARNET_PARQUET_ROOT_<REV>`` is set (nothing is downloaded).
        data_root: a folder (searched as :func:`resolve_parquet_files` says),
            one ``.parquet`` file or a glob.
        split: ``"train"``, ``"val"`` (finds ``validation``) or ``"test"``.
        revision: the column layout, ``"v1"``, ``"v2"`` or ``"v3"``.
        parquet_revision, config_name: where the export lies in ``repo_id``.
        loop, ignore_index, energy_threshold, min_points, max_len,
        remove_low_energy_scatters, old_pid_mapping: as in
        :class:`~pimm.datasets.pilarnet.PILArNetH5Dataset`.
        test_mode, test_cfg: refused, as upstream.
        overlay_n_events, overlay_prob, overlay_allow_repeats: upstream's event
            overlay, as on :class:`~pimm.datasets.pilarnet.PILArNetH5Dataset`
            (:mod:`pimm.datasets.overlay`).

    Items are those of the HDF5 reader; ``name`` is the row's ``event_id``, or
    ``"<split>_<row>"`` when the file has none.
    """

    domains = dict(_SHARED_DOMAINS, overlay_n_events=PosInt | Seq(PosInt, length=2), overlay_prob=Prob)

    def __init__(self, repo_id: str | None = DEFAULT_REPO, data_root: str | os.PathLike | None = None,
                 split: str = "train", transform: Sequence[Any] | None = None, revision: str = "v2",
                 parquet_revision: str = "refs/convert/parquet", config_name: str = "default", loop: int = 1,
                 ignore_index: int = -1, energy_threshold: float = 0.0, min_points: int = 1024,
                 max_len: int | None = -1, remove_low_energy_scatters: bool = False, old_pid_mapping: bool = False,
                 test_mode: bool = False, test_cfg: Any = None, overlay_n_events: int | Sequence[int] = 1,
                 overlay_prob: float = 1.0, overlay_allow_repeats: bool = True):
        super().__init__(split="val" if split == "validation" else split, transform=transform)
        _refuse_test_mode(type(self).__name__, test_mode, test_cfg)
        self.overlay = EventOverlay(overlay_n_events, overlay_prob, overlay_allow_repeats)
        self.revision, self.loop, self.ignore_index = revision, loop, ignore_index
        self.files = resolve_parquet_files(split, data_root, repo_id=repo_id, parquet_revision=parquet_revision,
                                           config_name=config_name, revision=revision)
        self.index, total = _kept_rows(self.files, min_points, max_len)
        if len(self.index) == 0:
            raise UserError(f"none of the {total} events in {len(self.files)} parquet file(s) is kept "
                            f"(min_points={min_points}, max_len={max_len}); lower min_points or check data_root")
        self._options = dict(energy_threshold=float(energy_threshold),
                             remove_low_energy_scatters=bool(remove_low_energy_scatters),
                             old_pid_mapping=bool(old_pid_mapping), ignore_index=int(ignore_index))
        self._tables = _Tables(self.files)
        logger.info("PILArNetParquetDataset %s: %d of %d events in %d file(s) x loop %d", split, len(self.index),
                    total, len(self.files), loop)

    def __len__(self) -> int:
        return len(self.index) * self.loop

    def get_data(self, idx: int) -> dict:
        file_id, row = (int(v) for v in self.index[idx % len(self.index)])
        return _decode(self._tables, file_id, row, self.revision, self.split, self._options)


@DATASETS.register_module()
class PILArNetParquetIterableDataset(IterableDataset):
    """PILArNet-M events streamed from parquet files (upstream's arguments),
    resumable mid-epoch across processes and data-loader workers.

    Each epoch, the files are put in an order drawn from ``(seed, epoch)``
    (``shuffle``), their kept events laid end to end, and the sequence cut into
    one contiguous block per (process, worker); the last ``len % blocks``
    events of an epoch are left out so every block is equally long. Within a
    block a reservoir of ``shuffle_buffer_size`` events mixes the order. A
    block's events are a function of ``(seed, epoch, rank, worker)`` only, so a
    resumed stream continues at the event where it stopped. ``num_samples()``
    is the size of the whole stream (all processes), which the engine divides
    into steps per epoch (or set ``iters_per_epoch``).

    Args (beyond :class:`PILArNetParquetDataset`'s):
        shuffle: shuffle file order and events (buffered).
        shuffle_buffer_size: events held in the reservoir (1: file order only).
        seed: the stream's seed.
        loop: accepted for config-swap parity; a stream's epoch is set by
            ``iters_per_epoch``, so another value is refused.
    """

    domains = dict(_SHARED_DOMAINS, shuffle=Bool, shuffle_buffer_size=PosInt, seed=Int(0))

    def __init__(self, repo_id: str | None = DEFAULT_REPO, data_root: str | os.PathLike | None = None,
                 split: str = "train", transform: Sequence[Any] | None = None, revision: str = "v2",
                 parquet_revision: str = "refs/convert/parquet", config_name: str = "default",
                 energy_threshold: float = 0.0, min_points: int = 1024, max_len: int | None = -1,
                 remove_low_energy_scatters: bool = False, old_pid_mapping: bool = False, shuffle: bool = True,
                 shuffle_buffer_size: int = 1000, seed: int = 0, loop: int = 1, ignore_index: int = -1,
                 test_mode: bool = False, test_cfg: Any = None):
        super().__init__()
        _refuse_test_mode(type(self).__name__, test_mode, test_cfg)
        if loop != 1:
            raise ConfigError(f"loop={loop!r}: a stream has no loop; set iters_per_epoch in the config to "
                              "choose the epoch's length")
        self.split, self.revision, self.ignore_index = split, revision, ignore_index
        self.shuffle, self.buffer_size, self.seed = bool(shuffle), int(shuffle_buffer_size), int(seed)
        self.files = resolve_parquet_files(split, data_root, repo_id=repo_id, parquet_revision=parquet_revision,
                                           config_name=config_name, revision=revision)
        self.index, total = _kept_rows(self.files, min_points, max_len)
        if len(self.index) == 0:
            raise UserError(f"none of the {total} events in {len(self.files)} parquet file(s) is kept "
                            f"(min_points={min_points}, max_len={max_len}); lower min_points or check data_root")
        self.transform = None
        if transform:
            from .transforms import Compose

            self.transform = Compose(transform)
        self._options = dict(energy_threshold=float(energy_threshold),
                             remove_low_energy_scatters=bool(remove_low_energy_scatters),
                             old_pid_mapping=bool(old_pid_mapping), ignore_index=int(ignore_index))
        self._tables = _Tables(self.files)
        # The stream's resumable state: the epoch being read and how many of
        # this block's events were handed out. ``_fresh``: the next __iter__
        # continues this epoch (start of run, or just restored) instead of
        # starting the next one.
        self.epoch, self.offset, self._fresh = 0, 0, True

    collate_fn = staticmethod(point_collate_fn)

    def num_samples(self) -> int:
        """Events per epoch in the whole stream (all processes together)."""
        return len(self.index)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at its beginning on the next iteration."""
        self.epoch, self.offset, self._fresh = int(epoch), 0, True

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset, self._fresh = int(state["epoch"]), int(state["offset"]), True

    def _block(self, epoch: int) -> tuple[np.ndarray, int]:
        """This stream's event order for ``epoch`` and its (rank, worker) id."""
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        world, rank = comm.get_world_size(), comm.get_rank()
        blocks, block = world * workers, rank * workers + worker
        order = self.index
        if self.shuffle:
            files = np.random.default_rng(derive_seed(self.seed, epoch)).permutation(len(self.files))
            order = np.concatenate([self.index[self.index[:, 0] == f] for f in files])
        size = len(order) // blocks
        mine = order[block * size:(block + 1) * size]
        if self.shuffle and self.buffer_size > 1:
            mine = _reservoir(mine, self.buffer_size, np.random.default_rng(derive_seed(self.seed, epoch, block + 1)))
        return mine, block

    def __iter__(self):
        if not self._fresh:  # the previous pass ended (or was left): the next epoch
            self.epoch, self.offset = self.epoch + 1, 0
        self._fresh = False
        events, block = self._block(self.epoch)
        in_worker = get_worker_info() is not None
        while self.offset < len(events):
            file_id, row = (int(v) for v in events[self.offset])
            position = self.offset
            self.offset += 1
            data = _decode(self._tables, file_id, row, self.revision, self.split, self._options)
            if self.transform is not None:
                if in_worker:  # augmentations: a function of (seed, epoch, block, position), as map-style data
                    seed_cpu_streams(derive_seed(self.seed, self.epoch, block, position))
                data = self.transform(data)
            yield data


def _reservoir(events: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """The order a streaming shuffle buffer of ``size`` gives ``events``: fill
    the buffer, then for each new event hand out a random buffered one and put
    the new one in its place; drain the rest in random order."""
    buffer, out = [], []
    for event in events:
        if len(buffer) < size:
            buffer.append(event)
            continue
        slot = int(rng.integers(size))
        out.append(buffer[slot])
        buffer[slot] = event
    out.extend(buffer[i] for i in rng.permutation(len(buffer)))
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)
