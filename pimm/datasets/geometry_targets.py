"""Targets that must follow a geometric transform of ``coord``.

An event may carry geometry besides its points: the interaction ``vertex``
of each point's particle, an event-level ``primary_vertex``, a unit
``primary_direction``, a ``momentum_vec`` whose length means something.
When ``NormalizeCoord``, ``RandomRotate``, ``RandomScale`` or ``RandomFlip``
move the points, these targets have to move the same way, or an augmented
event's regression targets point somewhere its points are not.

Three kinds, as upstream pimm declares them:

* **positions** get the whole affine map ``coord`` gets (centering,
  translation, scale, rotation, flip). ``vertex`` counts as one when it
  is (M, 3) and no list declares it otherwise (upstream's default); more
  are listed in ``aux_position_keys``.
* **directions** (``aux_direction_keys``) are unit vectors: only the linear
  part (rotation, flip) applies, and the result is renormalised.
* **vectors** (``aux_vector_keys``) carry a magnitude (momentum in GeV): the
  linear part applies and the length is kept.

Lists come from the event itself (``data["aux_position_keys"]`` etc., set
with ``Update``, upstream's mechanism) and from the transform's own
constructor arguments of the same names (pimm's addition). A key declared
in the event but absent from it is skipped, as upstream does (one config may
serve data sets that lack a target); a key a transform's own arguments
name must be present, so a typo is an error rather than a no-op.

Rows equal to the all ``-1`` "missing" sentinel are left as they are in
``vertex``, directions and vectors (upstream's rule), so sentinel masking in
the losses still fires after augmentation.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from pimm.utils.errors import UserError

KINDS = ("position", "direction", "vector")
# Upstream moves the per-point particle vertex with the points without being asked.
DEFAULT_POSITION_KEYS = ("vertex",)


def declared_keys(names: Sequence[str] | str | None, owner: str, kind: str) -> tuple[str, ...]:
    """Validate a transform's ``aux_<kind>_keys`` argument."""
    if names is None:
        return ()
    names = (names,) if isinstance(names, str) else tuple(names)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise UserError(f"{owner}: aux_{kind}_keys must name event entries (strings), got {bad!r}")
    return names


def own_targets(owner: str, positions, directions, vectors) -> dict[str, tuple[str, ...]]:
    """A transform's ``aux_position_keys`` / ``aux_direction_keys`` /
    ``aux_vector_keys`` arguments, checked, by kind."""
    return {"position": declared_keys(positions, owner, "position"),
            "direction": declared_keys(directions, owner, "direction"),
            "vector": declared_keys(vectors, owner, "vector")}


def _targets(data: dict, kind: str, own: tuple[str, ...], owner: str) -> list[str]:
    from_event = data.get(f"aux_{kind}_keys") or ()
    if isinstance(from_event, str):
        from_event = (from_event,)
    missing = [k for k in own if k not in data]
    if missing:
        raise UserError(f"{owner}: aux_{kind}_keys names {missing}, which the event does not have "
                        f"(keys: {sorted(data)}); fix the name or drop it from the transform's arguments")
    names = [k for k in (*from_event, *own) if k in data and data[k] is not None]
    return list(dict.fromkeys(names))  # once each, even when declared twice


def _is_rows_of_3(value) -> bool:
    shape = np.shape(value)
    return len(shape) == 2 and shape[1] == 3


def _apply_rows(value, key: str, owner: str, fn: Callable[[np.ndarray], np.ndarray],
                keep_sentinel: bool, renormalise: bool) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim == 0 or array.shape[-1] != 3:
        raise UserError(f"{owner}: geometric target {key!r} has shape {array.shape}; it needs 3 components "
                        "in its last dimension (x, y, z)")
    dtype = array.dtype if array.dtype.kind == "f" else np.dtype(np.float32)
    rows = array.reshape(-1, 3).astype(np.float64)
    moved = rows.copy()
    live = ~(rows == -1).all(axis=1) if keep_sentinel else np.ones(len(rows), bool)
    if live.any():
        out = fn(rows[live])
        if renormalise:
            out = out / np.clip(np.linalg.norm(out, axis=1, keepdims=True), 1e-9, None)
        moved[live] = out
    return moved.reshape(array.shape).astype(dtype)


def move_targets(data: dict, out: dict, owner: str, own: dict[str, tuple[str, ...]],
                 affine: Callable[[np.ndarray], np.ndarray] | None,
                 linear: Callable[[np.ndarray], np.ndarray] | None) -> None:
    """Write into ``out`` every declared target of ``data`` moved by the map.

    ``affine`` maps positions (rows of 3); ``linear`` maps directions and
    vectors (the map without translation or centering). ``None`` leaves that
    kind where it is (e.g. scaling does not turn a direction). ``own`` holds
    the transform's constructor lists by kind."""
    by_kind = {kind: _targets(data, kind, own.get(kind, ()), owner) for kind in KINDS}
    seen: dict[str, str] = {}
    for kind, names in by_kind.items():
        for key in names:
            if key in seen:
                raise UserError(f"{owner}: {key!r} is declared both as a {seen[key]} and as a {kind} target; "
                                "a target moves one way: keep it in one of the aux_*_keys lists")
            seen[key] = kind
    # Upstream's default position, ``vertex``, when no list declares it otherwise and it is (M, 3).
    by_kind["position"][:0] = [k for k in DEFAULT_POSITION_KEYS
                               if k not in seen and data.get(k) is not None and _is_rows_of_3(data[k])]
    for kind, names in by_kind.items():
        fn = affine if kind == "position" else linear
        if fn is None:
            continue
        for key in names:
            # Upstream moves every row of a declared position; only ``vertex`` uses the sentinel.
            sentinel = kind != "position" or key == "vertex"
            out[key] = _apply_rows(data[key], key, owner, fn, keep_sentinel=sentinel,
                                   renormalise=kind == "direction")
