"""docs/hooks.md: every hook that ships with pimm has a section, and every
section's example works.

Each ```python block of a section is executed as a config fragment; its
``hooks`` list must build (options checked exactly as in a real config) and
name the section's hook. Every example whose hooks fit a small
classification task is also trained with, in-process, on the toy task (one
epoch of 4 steps). Hooks documented in the other hooks pages
(docs/hooks-*.md) count as documented.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pimm.engines import HOOKS  # noqa: E402
from pimm.engines.hooks.base import build_hooks  # noqa: E402
from tests.support.inprocess import make_trainer  # noqa: E402

DOC = ROOT / "docs" / "hooks.md"
# Evaluators that need other data (point clouds, tracks): their examples are built, not trained with.
NOT_ON_THE_TOY_TASK = {"SemSegEvaluator", "InsSegEvaluator", "ProposalEvaluator"}


def sections(text: str) -> dict[str, list[str]]:
    """``{heading: [python blocks]}`` for every ``##`` / ``###`` heading."""
    found: dict[str, list[str]] = {}
    heading = None
    for part in re.split(r"^(#{2,3} .+)$", text, flags=re.M):
        if re.match(r"#{2,3} ", part):
            heading = part.lstrip("#").strip()
            found[heading] = []
        elif heading is not None:
            found[heading] += re.findall(r"```python\n(.*?)```", part, flags=re.S)
    return found


def example_hooks(block: str) -> list[dict]:
    namespace: dict = {}
    exec(block, {"dict": dict}, namespace)  # a config fragment: plain assignments
    return namespace["hooks"]


DOCUMENTED = sections(DOC.read_text())
EXAMPLES = [(heading, index, block) for heading, blocks in DOCUMENTED.items() for index, block in enumerate(blocks)
            if heading in HOOKS]


def test_every_shipped_hook_has_a_section_with_an_example():
    shipped = {name for name in HOOKS.keys() if HOOKS.get(name).__module__.startswith("pimm.")}
    headings = set()
    for page in sorted((ROOT / "docs").glob("hooks*.md")):
        headings |= set(sections(page.read_text()))
    assert shipped - headings == set(), "hooks without a section in docs/hooks*.md"
    for name in shipped & set(DOCUMENTED):
        assert any(f'type="{name}"' in block for block in DOCUMENTED[name]), f"{name}: no example"


@pytest.mark.parametrize("heading,index,block", EXAMPLES, ids=[f"{h}-{i}" for h, i, _ in EXAMPLES])
def test_each_example_builds_and_trains(tmp_path, heading, index, block):
    hooks = example_hooks(block)
    built = build_hooks(hooks)
    assert heading in {type(hook).__name__ for hook in built}
    if {h["type"] for h in hooks} & NOT_ON_THE_TOY_TASK:
        return
    trainer = make_trainer(tmp_path, repr(hooks), epoch=1)
    trainer.train()
    assert trainer.outcome == "completed" and trainer.global_step == 4


def test_the_shipped_ema_and_early_stopping_config_loads_with_its_hooks(tmp_path):
    from pimm.engines.launch import load_config

    cfg, hooks = load_config(str(ROOT / "configs" / "rings" / "cls-cnn-ema-earlystop.py"),
                             [f"save_path={tmp_path / 'run'}"], world_size=1)
    by_type = {type(hook).__name__: hook for hook in hooks}
    assert {"ClsEvaluator", "EMAHook", "EarlyStopping", "CheckpointSaver"} <= set(by_type)
    assert by_type["EarlyStopping"].monitor == "val/acc" and cfg.epoch > 4  # a budget early stopping cuts short
