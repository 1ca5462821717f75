"""One checkpoint's model weights as one plain file, without a process group.

A checkpoint of an FSDP run holds its weights in shards (``sharded/``,
Distributed Checkpoint); this reads every shard in one process and writes the
whole model in the format of ``model/model_last.pth``: ``{"state_dict",
"epoch", "global_step"}``, loadable with ``torch.load(path,
weights_only=True)`` and usable as ``weight=`` or with ``tools/test.py``. A
whole-model checkpoint (DDP) converts too (its ``common.pth`` holds the
weights). The checkpoint is verified against its manifest first.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pimm.engines.state.manager import MANIFEST, CheckpointManager, atomic_torch_save
from pimm.engines.state.safe_load import load_state_file, read_dcp_metadata
from pimm.engines.state.sharded import SHARDED_DIR, sharded_loader
from pimm.utils.errors import CheckpointError, UserError

__all__ = ["find_checkpoint", "read_checkpoint_weights", "convert_checkpoint"]


def find_checkpoint(path: str | Path) -> Path:
    """``path`` itself when it is a committed checkpoint folder; else the newest
    committed, intact checkpoint under it (a run's ``checkpoints/`` or its ``save_path``)."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: no such directory; give a checkpoint folder (save_path/checkpoints/step...-epoch...), "
                        "a checkpoints/ folder or a run's save_path")
    if (path / MANIFEST).is_file():
        verdict = CheckpointManager(path.parent).verify(path)
        if verdict != "ok":
            raise CheckpointError(f"{path} cannot be converted: {verdict}")
        return path
    directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    manager = CheckpointManager(directory)
    for candidate in reversed(manager.committed()):
        if manager.verify(candidate) == "ok":
            return candidate
    raise UserError(f"{path}: no committed, intact checkpoint in it (folders named step...-epoch... with a "
                    f"{MANIFEST} manifest)")


def _template(entries: dict[tuple, object]) -> dict:
    """An empty state dict shaped like the saved one (tensors of the saved size and dtype)."""
    out: dict = {}
    for key, meta in entries.items():
        size = getattr(meta, "size", None)
        out[key] = torch.empty(tuple(size), dtype=meta.properties.dtype) if size is not None else None
    return out


def read_checkpoint_weights(checkpoint: Path, trust_code: bool = False) -> dict:
    """The model state dict of a verified checkpoint folder, whole, on the CPU,
    read as data (``trust_code``: the opt-in of :mod:`pimm.engines.state.safe_load`)."""
    if (checkpoint / SHARDED_DIR).is_dir():
        metadata = read_dcp_metadata(checkpoint / SHARDED_DIR)
        entries = {path[1]: metadata.state_dict_metadata[flat] for flat, path in (metadata.planner_data or {}).items()
                   if path[0] == "model" and len(path) == 2}
        if not entries:
            raise CheckpointError(f"{checkpoint}: its sharded/ folder holds no model weights")
        state = _template(entries)
        sharded_loader(checkpoint / SHARDED_DIR, "model")(state)
        return state
    common = load_state_file(checkpoint / "common.pth", trust_code=trust_code, trust_hint="--trust-checkpoint-code")
    if not isinstance(common.get("model"), dict):
        raise CheckpointError(f"{checkpoint}: common.pth holds no model weights")
    return dict(common["model"])


def convert_checkpoint(source: str | Path, out: str | Path, overwrite: bool = False,
                       trust_code: bool = False) -> tuple[Path, Path]:
    """Write the weights of ``source`` (see :func:`find_checkpoint`) to ``out``;
    returns (the checkpoint used, ``out``). ``trust_code``: load a checkpoint
    written before states were plain data (see :mod:`pimm.engines.state.safe_load`)."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise UserError(f"{out} exists; choose another path or add --overwrite")
    if out.is_dir():
        raise UserError(f"{out} is a directory; give the path of the .pth file to write")
    checkpoint = find_checkpoint(source)
    manifest = CheckpointManager._read_manifest(checkpoint)
    payload = {"state_dict": read_checkpoint_weights(checkpoint, trust_code), "epoch": manifest.get("epoch"),
               "global_step": manifest.get("global_step")}
    try:
        atomic_torch_save(payload, out)
    except OSError as err:
        raise UserError(f"cannot write {out}: {err.strerror or err}") from None
    return checkpoint, out
