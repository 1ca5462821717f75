"""Reading one torch weight file into a state dict, and the wrapper prefixes
(DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``) stripped from its keys.
The bottom of the weight-loading stack: the checkpoint participants, the
weight-source resolver and :mod:`pimm.engines.state.weights` all build on it,
and it imports none of them."""

from __future__ import annotations

from pathlib import Path

import torch

from pimm.engines.state.safe_load import NotACheckpointError, UnsafeCheckpointError, load_state_file
from pimm.utils.errors import CheckpointError

__all__ = ["read_weights", "strip_wrapper_prefixes", "refuse_non_finite", "CONVERT_HINT"]

# What really loads an old checkpoint folder that holds more than data as weights: train.py's
# trust_checkpoint_code covers resume and fork only, and no weight= flag exists.
CONVERT_HINT = ("if you wrote it yourself with a pimm from before checkpoints were loaded as data, convert it once "
                "(python tools/convert_checkpoint.py {source} OUT.pth --trust-checkpoint-code; that runs whatever it "
                "contains) and give weight=OUT.pth")

_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def strip_wrapper_prefixes(key: str) -> str:
    """``key`` without the leading prefixes DDP (``module.``) and
    ``torch.compile`` (``_orig_mod.``) add to a wrapped model's keys, in any order."""
    while key.startswith(_WRAPPER_PREFIXES):
        key = key.split(".", 1)[1]
    return key


def read_weights(path: str | Path) -> dict:
    """The model state dict inside a weight file (a bare state dict, or one under
    ``state_dict`` / ``model``)."""
    path = Path(path)
    try:
        obj = load_state_file(path)  # as data: a weight file never runs code
    except FileNotFoundError:
        raise CheckpointError(f"weight={str(path)!r}: no such file") from None
    except UnsafeCheckpointError as err:
        raise CheckpointError(f"weight={str(path)!r} refused: it refers to {err.global_name}, and a weight "
                              "file may hold only tensors and plain data, never code; nothing in it was loaded or "
                              "run (tools/convert_checkpoint.py writes a plain weight file from a checkpoint)") from None
    except NotACheckpointError as err:
        raise CheckpointError(f"weight={str(path)!r} is not a torch weight file: {err.reason}; give a .pth written "
                              "by torch.save (a run's model/model_best.pth), a .safetensors file, a run, checkpoint "
                              "or export folder") from None
    except Exception as err:
        first = str(err).splitlines()[0] if str(err) else ""
        raise CheckpointError(f"weight={str(path)!r} cannot be read as a torch weight file "
                              f"({err.__class__.__name__}: {first})") from None
    if isinstance(obj, dict):
        for key in ("state_dict", "model"):
            if isinstance(obj.get(key), dict):
                return obj[key]
        if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            return obj
    raise CheckpointError(f"weight={str(path)!r} holds no model weights (expected a state_dict or a dict with "
                          "'state_dict' or 'model')")


def refuse_non_finite(state: dict, what: str) -> None:
    """A CheckpointError naming the tensors of ``state`` that hold NaN or
    infinite values (``what``: the weights as the user named them). Such
    weights come from a run that diverged or a damaged file, and a model
    built from them only ever outputs NaN: loading them silently would hide
    that until every score is NaN."""
    bad = [key for key, value in state.items()
           if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())
           and not bool(torch.isfinite(value).all())]
    if bad:
        first = state[bad[0]]
        count = int((~torch.isfinite(first)).sum())
        more = f" and {len(bad) - 1} more tensor(s)" if len(bad) > 1 else ""
        raise CheckpointError(f"{what}: {bad[0]} holds {count} NaN or infinite value(s) of {first.numel()}{more}; "
                              "these weights come from a run that diverged or a damaged file: nothing was loaded "
                              "(use an earlier checkpoint of the run)")
