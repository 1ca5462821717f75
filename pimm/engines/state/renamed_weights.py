"""Checkpoints of a model whose parameter names changed since they were saved.

A model may define ``upgrade_state_dict(state) -> sources``: it rewrites, in
place, a state dict in its older names into its current ones and returns
``{new parameter name: [the old names it was made from]}`` (one for a
rename; several for tensors concatenated along their first dimension, in
that order). The engine calls it on every checkpoint's weights before it
checks them against the model (resume, ``weight=``, ``tools/test.py``), so
an older checkpoint still fits; on resume the optimizer's per-parameter state
(moments, step counts) follows its parameters the same way
(:meth:`RenamedParameters.optimizer_state`), so the run continues as if the
names had never changed. A model without the method is left alone.
"""

from __future__ import annotations

import torch

__all__ = ["RenamedParameters", "upgrade_model_state"]


class RenamedParameters:
    """What an upgrade did to a checkpoint's parameters: the names in the
    order the checkpoint had them and where each new parameter came from."""

    def __init__(self, model: torch.nn.Module, saved_names: list[str], sources: dict[str, list[str]]):
        self.model, self.saved_names, self.sources = model, saved_names, sources
        self.new_name = {old: new for new, olds in sources.items() for old in olds}

    def optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> dict:
        """A ``torch.optim`` state dict saved with the old parameters ->
        the same state for ``optimizer``'s. The saved groups list their
        parameters in the old model's order; a state that does not add up is
        returned as it is, for the optimizer's own check to refuse."""
        name_of = {id(p): name for name, p in self.model.named_parameters()}
        groups = state.get("param_groups", [])
        if len(groups) != len(optimizer.param_groups) or any(id(p) not in name_of
                                                              for g in optimizer.param_groups for p in g["params"]):
            return state
        saved_order = [self.new_name.get(name, name) for name in self.saved_names]
        per_param, new_groups, next_id = {}, [], 0
        for group, saved in zip(optimizer.param_groups, groups):
            names = [name_of[id(p)] for p in group["params"]]
            members = set(names)
            # the old parameters of this group, in the order the old model listed them
            old = [n for n, new in zip(self.saved_names, saved_order) if new in members]
            if len(old) != len(saved["params"]):
                return state
            saved_id = dict(zip(old, saved["params"]))
            ids = []
            for name in names:
                parts = [state["state"].get(saved_id[o]) for o in self.sources.get(name, [name])]
                if all(part is not None for part in parts):
                    per_param[next_id] = _joined(parts)
                ids.append(next_id)
                next_id += 1
            new_groups.append({**saved, "params": ids})
        return {**state, "state": per_param, "param_groups": new_groups}


def _joined(parts: list[dict]) -> dict:
    """One parameter's optimizer state from its parts' (concatenated like the
    parameter; a scalar such as Adam's step count is the first part's)."""
    if len(parts) == 1:
        return parts[0]
    out = {}
    for key, value in parts[0].items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            out[key] = torch.cat([part[key] for part in parts])
        else:
            out[key] = value
    return out


def upgrade_model_state(model: torch.nn.Module, state: dict) -> tuple[dict, RenamedParameters | None]:
    """``state`` in the model's current names (a new dict; the input is not
    changed), and what was renamed (None when nothing was)."""
    upgrade = getattr(model, "upgrade_state_dict", None)
    if upgrade is None:
        return state, None
    upgraded = dict(state)
    sources = upgrade(upgraded)
    if not sources and list(upgraded) == list(state):
        return state, None
    return upgraded, RenamedParameters(model, list(state), sources)
