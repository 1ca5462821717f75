"""Running the shell commands of a Markdown page, as a user would, from tests."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def fenced(text: str, language: str) -> list[str]:
    """The bodies of the page's fenced blocks of ``language``, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def commands(text: str) -> list[str]:
    """The page's shell commands in order: ``&&`` chains split, comments dropped."""
    out = []
    for block in fenced(text, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = "" if line.lstrip().startswith("#") else line.split(" # ")[0].strip()
            out += [part.strip() for part in line.split("&&") if part.strip()]
    return out


def as_argv(command: str) -> list[str]:
    """``python``/``.venv/bin/python`` and ``pimm`` as this interpreter."""
    argv = shlex.split(command)
    if argv[0] in ("python", "python3", ".venv/bin/python"):
        return [sys.executable, *argv[1:]]
    if argv[0] == "pimm":
        return [sys.executable, "-m", "pimm.cli", *argv[1:]]
    raise AssertionError(f"a command these tests do not know how to run: {command}")


def copy_checkout(destination: Path) -> Path:
    """The tracked files of this checkout (a fresh clone, without its git history)."""
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination
