"""Entry points for ``tools/train.py`` and ``tools/test.py`` (and the console
scripts ``pimm-train`` / ``pimm-test``): import every registering package,
then hand over to the engine's launcher."""

from __future__ import annotations

import sys

import pimm.datasets  # noqa: F401  (registers data sets, transforms, collate functions)
import pimm.evaluation  # noqa: F401  (registers evaluators)
import pimm.models  # noqa: F401  (registers models)
from pimm.engines.launch import main

__all__ = ["train_main", "test_main"]


def train_main(argv: list[str] | None = None) -> int:
    return main(sys.argv[1:] if argv is None else argv, mode="train")


def test_main(argv: list[str] | None = None) -> int:
    return main(sys.argv[1:] if argv is None else argv, mode="test")
