"""Checkpoints of pimm's own earlier ``detector-v5``, from before its decoder
blocks took upstream's parameter names (pimm up to commit fe84378).

Those blocks named each self-attention's key and value projections
``self_attn.k`` / ``self_attn.v`` where upstream has one ``self_attn.kv``
(the key's rows, then the value's), the cross-attention's ``cross_attn.q`` /
``k`` / ``v`` where upstream has ``q_proj`` / ``k_proj`` / ``v_proj``, and
kept the mask-bias factor as ``anneal_factor`` (always 1: v5 does not
anneal) where upstream keeps the annealing progress ``anneal_progress``
(0 for a factor of 1). The same computation under other names: the old
tensors, concatenated or renamed, are the new ones.
"""

from __future__ import annotations

import math
import re

import torch

__all__ = ["upgrade_legacy_keys"]

_LEGACY = re.compile(r"(?P<block>decoder\.blocks\.\d+\.)"
                     r"(?:(?P<self>self_attn)\.[kv]|cross_attn\.(?P<cross>[qkv])|(?P<factor>anneal_factor))"
                     r"(?:\.(?P<kind>weight|bias))?")


def upgrade_legacy_keys(state: dict, prefix: str = "") -> dict[str, list[str]]:
    """Rewrite, in place, the keys of ``state`` under ``prefix`` that pimm's
    earlier v5 wrote into upstream's; keys already in upstream's names pass
    untouched. Returns {new parameter key: the old keys it was made from} (a
    merged one lists its parts in concatenation order)."""
    sources: dict[str, list[str]] = {}
    for key in [k for k in state if k.startswith(prefix)]:
        match = _LEGACY.fullmatch(key[len(prefix):])
        if match is None or key not in state:  # not legacy, or merged already with its partner
            continue
        block, kind = prefix + match["block"], match["kind"]
        if match["factor"]:
            factor = min(max(float(state.pop(key)), 0.0), 1.0)
            state[block + "anneal_progress"] = torch.tensor(math.acos(2.0 * factor - 1.0) / math.pi)
        elif match["cross"] and kind:
            new = f"{block}cross_attn.{match['cross']}_proj.{kind}"
            state[new] = state.pop(key)
            sources[new] = [key]
        elif match["self"] and kind:
            parts = [f"{block}self_attn.k.{kind}", f"{block}self_attn.v.{kind}"]
            if all(part in state for part in parts):
                new = f"{block}self_attn.kv.{kind}"
                state[new] = torch.cat([state.pop(part) for part in parts])
                sources[new] = parts
    return sources
