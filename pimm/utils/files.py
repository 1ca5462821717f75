"""File helpers for the run directory."""

from __future__ import annotations

from pathlib import Path

__all__ = ["set_aside"]


def set_aside(path: str | Path) -> Path | None:
    """Rename an existing ``name.ext`` to the first free ``name.prevN.ext`` so a
    new file can take its place without destroying the old one."""
    path = Path(path)
    if not path.exists():
        return None
    index = 1
    while (aside := path.with_name(f"{path.stem}.prev{index}{path.suffix}")).exists():
        index += 1
    path.rename(aside)
    return aside
