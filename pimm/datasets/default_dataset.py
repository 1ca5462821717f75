"""``DefaultDataset``: Pointcept's folder-per-scene ``.npy`` layout, the way a
user brings any point cloud.

Layout (upstream pimm's and Pointcept's)::

    data_root/
      train/                 # a split: one folder per scene
        scene0000/
          coord.npy          # (N, 3) positions (required)
          color.npy          # (N, 3), optional
          normal.npy         # (N, 3), optional
          strength.npy       # (N, 1), optional (intensity, energy, ...)
          segment.npy        # (N,) or (N, 1) semantic labels, optional (-1 when absent)
          instance.npy       # (N,) or (N, 1) instance ids, optional (-1 when absent)
          pose.npy           # anything, optional
      val/ ...
      train.json             # optional: a split may instead be a JSON list of
                             # scene folders relative to data_root

A split name that is a file under ``data_root`` is read as such a JSON list;
otherwise it is a folder whose sub-folders are scenes. Unlike upstream, scenes
are listed in sorted order (upstream takes ``glob``'s, which depends on the
file system), so an index names the same scene on every machine and a resumed
run reads the same events. Every read is a pure function of the index, so the
stateful sampler's position is all the state exact mid-epoch resume needs.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Sequence

import numpy as np
from torch.utils.data import Dataset

from pimm.engines.registries import DATASETS
from pimm.utils.domains import MAX_SIZE, FilePath, Int, Key, Keys, PosInt, Transforms
from pimm.utils.errors import ConfigError, UserError

from .collate import collate_fn
from .event_checks import check_finite, check_labels
from .fragments import TEST_CFG, build_test_item, fragments_for_test_mode

__all__ = ["DefaultDataset", "VALID_ASSETS", "refuse_test_mode"]

logger = logging.getLogger(__name__)

#: The ``<asset>.npy`` files a scene folder may hold; other files are ignored (as upstream).
VALID_ASSETS = ("coord", "color", "normal", "strength", "segment", "instance", "pose")
_FLOAT_ASSETS = ("coord", "color", "normal")
_LABEL_ASSETS = ("segment", "instance")


def refuse_test_mode(owner: str, test_mode: bool, test_cfg: Any) -> None:
    """Data sets whose items are not point clouds (LUCiD's sensor responses)
    have no test-time fragments: asking for them is one clear line."""
    if test_mode:
        raise ConfigError(f"{owner}: test_mode=True (test-time fragments of a point cloud) is not supported for "
                          "this data set; leave test_mode=False and evaluate with an evaluator hook on data.test")


@DATASETS.register_module()
class DefaultDataset(Dataset):
    """Scenes stored as one folder of ``.npy`` files each (see the module doc).

    Args:
        split: a split name or a list of them (each a folder of scenes under
            ``data_root``, or a JSON file there listing scene folders).
        data_root: the folder holding the splits.
        transform: list of transform configs applied to each scene.
        test_mode, test_cfg: upstream's test-time fragments, scored on every
            original point (:mod:`pimm.datasets.fragments`); ``loop`` is 1 then.
        cache: upstream reads scenes from a shared-memory cache filled by another
            tool; pimm has none, so ``True`` is refused.
        ignore_index: the label value of unlabelled points (recorded for configs
            that read it; missing ``segment``/``instance`` are filled with -1, as upstream).
        loop: repeat the scenes this many times per epoch.

    Items (numpy): every present asset (``coord``, ``color``, ``normal`` as
    float32; ``segment``/``instance`` as (N,) int32, -1 when absent), plus
    ``name`` (the scene folder's name) and ``split`` (its parent folder's name).
    """

    domains = dict(split=Key | Keys, data_root=FilePath, transform=Transforms, test_cfg=TEST_CFG,
                   ignore_index=Int(-1, MAX_SIZE), loop=PosInt)

    collate_fn = staticmethod(collate_fn)
    #: The assets read; a subclass lists its own, as upstream's data sets do.
    VALID_ASSETS = VALID_ASSETS

    def __init__(self, split: str | Sequence[str] = "train", data_root: str = "data/dataset",
                 transform: Sequence[Any] | None = None, test_mode: bool = False, test_cfg: Any = None,
                 cache: bool = False, ignore_index: int = -1, loop: int = 1):
        super().__init__()
        if cache:
            raise ConfigError("DefaultDataset: cache=True reads upstream's shared-memory scene cache, which pimm "
                              "does not have; leave cache=False (scenes are read from data_root)")
        if isinstance(loop, bool) or not isinstance(loop, int) or loop < 1:
            raise ConfigError(f"DefaultDataset: loop={loop!r} must be an integer >= 1")
        self.split, self.data_root = split, os.path.expanduser(str(data_root))
        self.ignore_index, self.loop, self.test_mode = ignore_index, 1 if test_mode else loop, bool(test_mode)
        self.transform = None
        if transform:
            from .transforms import Compose

            self.transform = Compose(transform)
        self.test_fragments = fragments_for_test_mode(test_mode, test_cfg, type(self).__name__)
        self.data_list = self.get_data_list()
        logger.info("DefaultDataset: %d scenes x loop %d in %s (split %s)", len(self.data_list), loop,
                    self.data_root, split)

    def get_data_list(self) -> list[str]:
        """Scene folders of every split, in order (sorted within a folder split)."""
        if not os.path.isdir(self.data_root):
            raise UserError(f"DefaultDataset: data_root {self.data_root} is not a folder; give the folder that "
                            "holds <split>/<scene>/coord.npy (Pointcept's layout, docs/own-data.md)")
        splits = [self.split] if isinstance(self.split, str) else list(self.split)
        scenes: list[str] = []
        for split in splits:
            path = os.path.join(self.data_root, split)
            if os.path.isfile(path):
                scenes += self._json_split(path)
            elif os.path.isdir(path):
                found = sorted(os.path.join(path, d) for d in os.listdir(path)
                               if os.path.isdir(os.path.join(path, d)))
                if not found:
                    raise UserError(f"DefaultDataset: {path} holds no scene folders; each scene is a folder "
                                    f"{path}/<scene>/ with coord.npy (and optional segment.npy, ...)")
                scenes += found
            else:
                present = sorted(os.listdir(self.data_root))[:8]
                raise UserError(f"DefaultDataset: split {split!r} is neither a folder nor a JSON file under "
                                f"{self.data_root} (it holds: {', '.join(present) or 'nothing'}); "
                                "set split to one of those folders")
        return scenes

    def _json_split(self, path: str) -> list[str]:
        try:
            with open(path) as f:
                names = json.load(f)
        except (OSError, ValueError) as err:
            raise UserError(f"DefaultDataset: cannot read the split file {path} as JSON ({err}); it must be a "
                            "list of scene folders relative to data_root") from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise UserError(f"DefaultDataset: the split file {path} must hold a JSON list of scene folder names")
        scenes = [os.path.join(self.data_root, n) for n in names]
        missing = [s for s in scenes if not os.path.isdir(s)]
        if missing:
            raise UserError(f"DefaultDataset: {path} lists {len(missing)} scene folder(s) that do not exist, "
                            f"first {missing[0]}; fix the list or the data_root")
        return scenes

    def __len__(self) -> int:
        return len(self.data_list) * self.loop

    def get_data_name(self, idx: int) -> str:
        return os.path.basename(self.data_list[idx % len(self.data_list)])

    def get_split_name(self, idx: int) -> str:
        return os.path.basename(os.path.dirname(self.data_list[idx % len(self.data_list)]))

    def get_data(self, idx: int) -> dict:
        """Read scene ``idx`` (modulo the number of scenes) into a dict of arrays."""
        path = self.data_list[idx % len(self.data_list)]
        data: dict[str, Any] = {}
        for asset in self.VALID_ASSETS:
            file = os.path.join(path, asset + ".npy")
            if os.path.isfile(file):
                try:
                    data[asset] = np.load(file)
                except (OSError, ValueError) as err:
                    raise UserError(f"DefaultDataset: cannot read {file} as a .npy array ({err}); "
                                    "rewrite it with numpy.save") from None
        if "coord" not in data:
            raise UserError(f"DefaultDataset: scene {path} has no coord.npy; every scene folder needs one "
                            "(N, 3) array of positions")
        coord = data["coord"]
        if coord.ndim != 2 or coord.shape[1] != 3:
            raise UserError(f"DefaultDataset: {path}/coord.npy has shape {coord.shape}; it must be (N, 3)")
        n = coord.shape[0]
        for asset in _FLOAT_ASSETS:
            if asset in data:
                data[asset] = data[asset].astype(np.float32)
        for asset in _LABEL_ASSETS:
            data[asset] = (data[asset].reshape(-1).astype(np.int32) if asset in data
                           else np.full(n, -1, dtype=np.int32))
        for asset in ("color", "normal", "strength", "segment", "instance"):
            if asset in data and data[asset].shape[0] != n:
                raise UserError(f"DefaultDataset: {path}/{asset}.npy has {data[asset].shape[0]} rows but "
                                f"coord.npy has {n}; every per-point file needs one row per point")
        self._check_values(data, path)
        data["name"], data["split"] = self.get_data_name(idx), self.get_split_name(idx)
        return data

    def _check_values(self, data: dict, path: str) -> None:
        """Finite positions and strengths; labels non-negative or the ignore
        index (-1, upstream's fill for a missing file, is always allowed)."""
        for asset in ("coord", "strength"):
            if asset in data:
                check_finite(data[asset], f"DefaultDataset: scene {path}, key '{asset}' ({asset}.npy)")
        for asset in _LABEL_ASSETS:
            check_labels(data[asset], f"DefaultDataset: scene {path}, key '{asset}' ({asset}.npy)",
                         allowed=(-1, self.ignore_index))

    def __getitem__(self, idx: int) -> dict:
        n = len(self)
        idx = int(idx)
        if not -n <= idx < n:
            raise IndexError(f"scene index {idx} out of range for a dataset of {n}")
        data = self.get_data(idx % n)
        if self.test_fragments is not None:
            return build_test_item(data, self.transform, self.test_fragments)
        return self.transform(data) if self.transform is not None else data
