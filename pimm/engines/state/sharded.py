"""Model and optimizer state under FSDP: sharded, through PyTorch Distributed
Checkpoint (DCP), inside pimm's own commit protocol.

Under ``parallel.strategy='fsdp'`` no rank holds the whole model or optimizer
state, so these two are not gathered into ``common.pth``: every rank writes
its own shards with ``torch.distributed.checkpoint.save`` into the
``sharded/`` folder of the checkpoint being written (``.tmp-<name>/``).
The rest of the protocol is unchanged: every file, the DCP shards and their
``.metadata`` included, is fsynced and listed with its size and CRC-32 in the
``COMMITTED`` manifest, which is written last, before the folder is renamed
into place; retention deletes whole folders.

Loading goes through DCP too: the participant builds the state dict it wants
(sharded as the current run shards it: any world size, or a plain model on one
process), DCP reads the matching pieces of every saved shard into it — that is
the resharding — and ``set_model_state_dict`` / ``set_optimizer_state_dict``
install it. ``torch.distributed.checkpoint.state_dict`` keys everything by
parameter name, so the layout of the saving run does not matter.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from pimm.engines.state.participants import check_model_fits
from pimm.engines.state.safe_load import dcp_failure, read_dcp_metadata, safe_file_system_reader, safe_load_planner
from pimm.utils.errors import CheckpointError

__all__ = ["SHARDED_DIR", "save_sharded", "sharded_loader", "saved_structure", "ShardedModelParticipant",
           "ShardedOptimizerParticipant"]

SHARDED_DIR = "sharded"


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it assumes one process when no process group exists; that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_sharded(states: dict, folder: Path) -> None:
    """Every rank writes its shards of ``states`` to ``folder`` (a collective;
    rank 0 also writes DCP's ``.metadata``). Files are fsynced."""
    import torch.distributed.checkpoint as dcp

    with _quiet_single_process():
        dcp.save(states, storage_writer=dcp.FileSystemWriter(str(folder), sync_files=True))


def own_shard_files(folder: Path, rank: int) -> list[Path]:
    """The shard files ``rank`` wrote (DCP names them ``__<rank>_<n>.distcp``).
    Whatever is not claimed here is checksummed by rank 0 at commit time."""
    return sorted(folder.glob(f"__{rank}_*.distcp"))


def saved_structure(folder: Path) -> dict[str, dict[tuple, tuple | None]]:
    """``{participant: {key path: tensor shape or None}}`` from DCP's metadata (one small read, as data)."""
    metadata = read_dcp_metadata(folder)
    out: dict[str, dict[tuple, tuple | None]] = {}
    for flat, path in (metadata.planner_data or {}).items():
        entry = metadata.state_dict_metadata.get(flat)
        out.setdefault(path[0], {})[tuple(path[1:])] = tuple(entry.size) if hasattr(entry, "size") else None
    return out


def sharded_loader(folder: Path, name: str) -> Callable[[dict], None]:
    """``load(template)``: fill ``template`` (a state dict shaped like the one
    saved under ``name``) from the checkpoint, in place (a collective). Every
    file is read as data (:mod:`pimm.engines.state.safe_load`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    def load(template: dict) -> None:
        try:
            with _quiet_single_process():
                dcp.load({name: template}, storage_reader=safe_file_system_reader(folder), planner=safe_load_planner())
        except CheckpointException as err:  # a BaseException: it would pass every `except Exception` on its way
            raise dcp_failure(err, folder) from None
    return load


def _shape(value) -> tuple | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


class ShardedModelParticipant:
    """Model weights as sharded tensors; a checkpoint that does not fit the model
    is a one-line error, as for a whole-model checkpoint."""

    sharded = True

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        """The sharded state (Distributed Checkpoint's state-dict API)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from pimm.engines.run.parallel import sync_buffers

        sync_buffers(self.model)  # DCP saves one copy of each buffer, from any rank: make it rank 0's
        return get_model_state_dict(self.model)

    def restore_sharded(self, load: Callable[[dict], None], saved: dict[tuple, tuple | None], context) -> None:
        """Read this rank's shards through ``load`` into the current structure; a mismatch is a CheckpointError."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        template = get_model_state_dict(self.model)
        saved_shapes = {path[0]: shape for path, shape in saved.items() if len(path) == 1}
        check_model_fits(self.model, {k: _shape(v) for k, v in template.items()}, saved_shapes, context)
        load(template)
        set_model_state_dict(self.model, template)


class ShardedOptimizerParticipant:
    """Optimizer state as sharded tensors, with the rule of
    :class:`~pimm.engines.state.participants.OptimizerParticipant`: moments and
    step counts come from the checkpoint, every param-group value from the config."""

    sharded = True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, unreported: tuple[str, ...] = ("lr",)):
        self.model, self.optimizer = model, optimizer
        self.unreported = set(unreported)

    def state_dict(self) -> dict:
        """The sharded state (Distributed Checkpoint's state-dict API)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer)

    def restore_sharded(self, load: Callable[[dict], None], saved: dict[tuple, tuple | None], context) -> None:
        """Read this rank's shards through ``load`` into the current structure; a mismatch is a CheckpointError."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        from pimm.engines.state.participants import apply_configured_groups

        configured = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        saved_groups = {path[1] for path in saved if path[0] == "param_groups"}
        if len(saved_groups) != len(configured):
            raise CheckpointError(
                f"checkpoint {context.path.name} has {len(saved_groups)} optimizer param groups, the config builds "
                f"{len(configured)} (param_dicts changed?): resume with the original optimizer config")
        template = get_optimizer_state_dict(self.model, self.optimizer)
        # Parameters that never had a gradient have no state in the checkpoint: keep them stateless.
        with_state = {path[1] for path in saved if path[0] == "state"}
        template["state"] = {k: v for k, v in template["state"].items() if k in with_state}
        try:
            load(template)
            set_optimizer_state_dict(self.model, self.optimizer, template)
        except (ValueError, KeyError, RuntimeError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CheckpointError(f"checkpoint {context.path.name}: the optimizer state does not fit ({first}); "
                                  "resume with the original model and optimizer config") from None
        apply_configured_groups(self.optimizer, configured, template["param_groups"], self.unreported, context)
