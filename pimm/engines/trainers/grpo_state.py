"""GRPOTrainer's checkpointed state: the rollout being trained on, and the
data position counted in the batches that rollouts consumed."""

from __future__ import annotations

import copy
import math
import sys

import torch

from pimm.engines.state.participants import LoaderParticipant
from pimm.utils import comm
from pimm.utils.errors import CheckpointError

__all__ = ["RolloutCache", "RolloutLoaderParticipant"]


def _move(obj, device):
    """``obj`` with every tensor moved to ``device``: through dicts, lists, tuples
    and the attributes of plain objects (upstream's trajectory objects)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move(v, device) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        moved = copy.copy(obj)
        moved.__dict__.update({k: _move(v, device) for k, v in vars(obj).items()})
        return moved
    return obj


_OBJECT = "__object__"  # marks a plain-data record of an object (upstream's trajectory objects)


def _plain(obj):
    """``obj`` on the CPU as plain data: an object with attributes (an upstream
    policy's trajectory) becomes ``{"__object__": "module:qualname", "attrs": {...}}``,
    so the checkpoint loads as data (pimm.engines.state.safe_load)."""
    if isinstance(obj, torch.Tensor):
        return obj.to("cpu")
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        cls = type(obj)
        return {_OBJECT: f"{cls.__module__}:{cls.__qualname__}", "attrs": _plain(vars(obj))}
    return obj


def _trusted_class(name: str, modules: tuple[str, ...]) -> type:
    """The class ``module:qualname`` names, if it is defined in one of ``modules``
    (the policy's own module and the config's ``custom_imports``: code the
    config already runs), already imported, and builds without code of its own
    (no ``__new__``); otherwise a CheckpointError: a checkpoint never picks
    which code runs."""
    module_name, _, qualname = name.partition(":")
    cls = sys.modules.get(module_name) if module_name in modules else None
    for part in qualname.split(".") if cls is not None else ():
        cls = getattr(cls, "__dict__", {}).get(part)  # own attributes only: no __getattr__ runs
    if not isinstance(cls, type) or cls.__module__ != module_name or cls.__new__ is not object.__new__:
        raise CheckpointError(
            f"the checkpoint's GRPO rollout holds a {name} object, which is not a plain class of the policy's "
            f"module or of custom_imports ({', '.join(modules) or 'none'}); a checkpoint may rebuild only those. "
            "Resume with the policy and custom_imports that wrote it")
    return cls


class DamagedRecord(CheckpointError):
    """A GRPO rollout record in a checkpoint is not what :func:`_plain` writes."""


def _rebuild(obj, device, modules: tuple[str, ...], where: str = "rollout"):
    """:func:`_plain`'s result back: tensors on ``device``, objects rebuilt
    (``object.__new__`` and their attributes: no ``__init__`` runs). A record
    that :func:`_plain` cannot have written is a :class:`DamagedRecord` naming
    where in the rollout it is (``where``)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict) and _OBJECT in obj:
        name, attrs = obj[_OBJECT], obj.get("attrs")
        if not isinstance(name, str) or ":" not in name or set(obj) != {_OBJECT, "attrs"} or \
                not isinstance(attrs, dict) or not all(isinstance(k, str) for k in attrs):
            raise DamagedRecord(f"the object record at {where} is damaged (it needs {_OBJECT!r} = 'module:class' "
                                "and 'attrs', a dict of attribute names)")
        rebuilt = object.__new__(_trusted_class(name, modules))
        rebuilt.__dict__.update(_rebuild(attrs, device, modules, f"{where}.{name.partition(':')[2]}"))
        return rebuilt
    if isinstance(obj, dict):
        return {k: _rebuild(v, device, modules, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuild(v, device, modules, f"{where}[{i}]") for i, v in enumerate(obj))
    return _move(obj, device)  # a checkpoint from before states were plain (trust_checkpoint_code)


class RolloutCache:
    """The rollout being trained on and its updates' metrics so far; a per-rank
    checkpoint participant (with ``step_per="update"`` a checkpoint may fall
    between two updates of a rollout)."""

    def __init__(self, device: torch.device, step_per: str = "update", trusted_modules: tuple[str, ...] = ()):
        self.device, self.step_per = device, step_per
        # Where the classes of a rollout's objects may come from on restore (see _trusted_class).
        self.trusted_modules = tuple(trusted_modules)
        self.rollout: dict | None = None
        self.batch: dict | None = None  # for hooks' input_dict only; not checkpointed
        self.history: list[dict[str, torch.Tensor]] = []
        self.all_nan_run = 0  # rollouts in a row whose rewards were all NaN
        self.useless_run = 0  # rollouts in a row with nothing to learn (all NaN, or no group with a spread)

    def start(self, rollout: dict, batch) -> None:
        """Train on ``rollout`` (sampled from ``batch``) from now on."""
        self.rollout, self.batch, self.history = rollout, batch, []

    def clear(self) -> None:
        """Forget the rollout (its last update is done)."""
        self.rollout = self.batch = None
        self.history = []

    def state_dict(self) -> dict:
        """The rollout and history on the CPU as plain data (None when between rollouts)."""
        return {"rollout": _plain(self.rollout), "history": _plain(self.history),
                "step_per": self.step_per, "all_nan_run": self.all_nan_run, "useless_run": self.useless_run}

    def load_state_dict(self, state: dict) -> None:
        """Restore the rollout onto this trainer's device (refused when the
        checkpoint counted steps otherwise: its step numbers mean other things)."""
        if not isinstance(state, dict) or "rollout" not in state or "history" not in state:
            raise DamagedRecord("the GRPO rollout record is damaged (it needs 'rollout' and 'history')")
        saved = state.get("step_per", "update")
        if saved != self.step_per:
            raise CheckpointError(f"this run was checkpointed with train.step_per={saved!r} and resumes with "
                                  f"{self.step_per!r}: its step numbers, epoch length and data position count "
                                  f"differently; resume with step_per={saved!r}")
        history = state["history"]
        try:
            counts = [int(state.get(key, 0)) for key in ("all_nan_run", "useless_run")]  # absent from older ones
        except (TypeError, ValueError):
            counts = [-1]
        if not isinstance(history, (list, tuple)) or min(counts) < 0:
            raise DamagedRecord("the GRPO rollout record is damaged ('history' must be a list, 'all_nan_run' and "
                                "'useless_run' counts)")
        self.rollout = _rebuild(state["rollout"], self.device, self.trusted_modules)
        self.history = _rebuild(list(history), self.device, self.trusted_modules, "history")
        self.all_nan_run, self.useless_run = counts
        self.batch = None

    def restore(self, state, context) -> None:
        """:meth:`load_state_dict` as a checkpoint participant (per rank): a
        damaged record is one line naming the checkpoint file and what to do."""
        if state is None:
            return
        try:
            self.load_state_dict(state)
        except DamagedRecord as err:
            raise CheckpointError(f"{context.path / f'rank{comm.get_rank():05d}.pth'}: {err}; nothing was resumed: "
                                  "resume from an earlier checkpoint (resume='<its folder>')") from None


class RolloutLoaderParticipant(LoaderParticipant):
    """The data position in batches consumed: a rollout's batch is taken at its
    first step, so after ``i`` steps ``ceil(i / steps_per_rollout)`` batches are gone."""

    def state_dict(self) -> dict:
        """The loader's state, with the position counted in rollouts' batches."""
        state = super().state_dict()
        if state["kind"] == "position":
            trainer = self.trainer
            batches = math.ceil(trainer.train_state.iter_in_epoch / trainer.steps_per_rollout)
            state["samples_in_epoch"] = batches * trainer.batch_size_per_rank * trainer.world_size
        return state

    def restore(self, state, context) -> None:
        """Refuse a different process layout (each rank's rollout is its own)."""
        if context.layout_changed:
            raise CheckpointError(
                f"checkpoint {context.path.name}: a GRPO run resumes with the process layout that saved it "
                f"(changed: {', '.join(context.layout_changed)}); resume with the same number of processes, "
                "batch size and workers")
        super().restore(state, context)
