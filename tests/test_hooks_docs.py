"""The hook pages (docs/hooks/<name>.md, one per hook; docs/hooks.md is the
overview): every hook that ships with pimm has a page, the page's options
table names every constructor parameter, and every example works.

A hook's page is the one whose title (``# Name``) is the hook's registered
name. Each ```python block of such a page is executed as a config fragment;
its ``hooks`` list must build (options checked exactly as in a real config)
and name the page's hook. Every example whose hooks fit a small
classification task is also trained with, in-process, on the toy task (one
epoch of 4 steps).
"""

from __future__ import annotations

import inspect
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

PAGES = ROOT / "docs" / "hooks"
OVERVIEW = ROOT / "docs" / "hooks.md"
# Evaluators that need other data or models (point clouds, tracks, a GAN): their examples are built, not trained with.
NOT_ON_THE_TOY_TASK = {"SemSegEvaluator", "InsSegEvaluator", "ProposalEvaluator", "ClusterPolicyEvaluator",
                       "RingGANEvaluator", "PretrainEvaluator", "PrototypeUsageLogger", "FeatureStdMonitor",
                       "EventLinearProbeEvaluator", "PushToHub", "MAEEvaluator",
                       "InstanceSegmentationEvaluator"}  # (PushToHub: would reach for the network)


def pages() -> dict[str, tuple[Path, str]]:
    """``{title: (path, text)}`` for every page under docs/hooks/."""
    found = {}
    for path in sorted(PAGES.glob("*.md")):
        text = path.read_text()
        title = re.match(r"# (.+)\n", text)
        assert title, f"{path.relative_to(ROOT)}: no '# Title' on the first line"
        found[title.group(1).strip()] = (path, text)
    return found


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def option_names(text: str) -> set[str]:
    """The names in the first column of the page's ``| option | ...`` tables
    (a cell may name several: ``| `a`, `b` | ...``)."""
    names = set()
    for table in re.findall(r"^\| option \|.*\n\|[- |]+\n((?:\|.*\n?)+)", text, flags=re.M):
        for row in table.splitlines():
            names |= set(re.findall(r"`(\w+)`", row.split("|")[1]))
    return names


def example_hooks(block: str) -> list[dict]:
    namespace: dict = {}
    exec(block, {"dict": dict}, namespace)  # a config fragment: plain assignments
    return namespace["hooks"]


def shipped_hooks() -> set[str]:
    return {name for name in HOOKS.keys() if HOOKS.get(name).__module__.startswith("pimm.")}


PAGES_BY_TITLE = pages()
EXAMPLES = [(title, index, block) for title, (_, text) in PAGES_BY_TITLE.items() if title in HOOKS
            for index, block in enumerate(python_blocks(text))]


def test_every_shipped_hook_has_a_page_with_an_example():
    missing = shipped_hooks() - set(PAGES_BY_TITLE)
    assert missing == set(), "hooks without a page docs/hooks/<name>.md titled '# <Hook>'"
    for name in shipped_hooks():
        blocks = python_blocks(PAGES_BY_TITLE[name][1])
        assert any(f'type="{name}"' in block for block in blocks), f"{name}: no example"


def test_the_overview_links_every_hook_page():
    overview = OVERVIEW.read_text()
    for name in shipped_hooks():
        page = PAGES_BY_TITLE[name][0].relative_to(ROOT / "docs").as_posix()
        assert f"[{name}]({page})" in overview, f"docs/hooks.md: no link to {name}'s page ({page})"


@pytest.mark.parametrize("name", sorted(shipped_hooks()))
def test_each_option_of_a_hook_is_documented(name):
    parameters = [p.name for p in inspect.signature(HOOKS.get(name).__init__).parameters.values()
                  if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    documented = option_names(PAGES_BY_TITLE[name][1])
    undocumented = [p for p in parameters if p not in documented]
    assert not undocumented, f"docs/hooks/: {name}'s options table lacks {undocumented}"
    if not parameters:
        assert "No options" in PAGES_BY_TITLE[name][1]


@pytest.mark.parametrize("title,index,block", EXAMPLES, ids=[f"{t}-{i}" for t, i, _ in EXAMPLES])
def test_each_example_builds_and_trains(tmp_path, title, index, block):
    hooks = example_hooks(block)
    built = build_hooks(hooks)
    assert title in {type(hook).__name__ for hook in built}
    if {h["type"] for h in hooks} & NOT_ON_THE_TOY_TASK:
        return
    trainer = make_trainer(tmp_path, repr(hooks), epoch=1)
    trainer.train()
    assert trainer.outcome == "completed" and trainer.global_step == 4


def test_the_shipped_ema_and_early_stopping_config_loads_with_its_hooks(tmp_path):
    from pimm.engines.run.launch import load_config

    cfg, hooks = load_config(str(ROOT / "configs" / "rings" / "cls-cnn-ema-earlystop.py"),
                             [f"save_path={tmp_path / 'run'}"], world_size=1)
    by_type = {type(hook).__name__: hook for hook in hooks}
    assert {"ClsEvaluator", "EMAHook", "EarlyStopping", "CheckpointSaver"} <= set(by_type)
    assert by_type["EarlyStopping"].monitor == "val_ema/acc" and cfg.epoch > 4  # a budget early stopping cuts short
