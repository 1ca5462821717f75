"""docs/own-data.md end to end: its files written as the page shows them, its
commands run in order in a fresh copy of the repository (nothing shortened:
the page's task is small by design)."""

from __future__ import annotations

import json

import pytest

from tests.support import forkserver
from tests.support.doc_commands import ROOT, as_argv, commands, copy_checkout, fenced
from tests.support.run import env

PAGE = ROOT / "docs" / "own-data.md"


def test_the_page_has_its_files_and_commands():
    files = [block.splitlines()[0] for block in fenced(PAGE.read_text(), "python")]
    assert files == ["# make_data.py", "# my_data.py", "# my_config.py"]
    assert any(c.startswith("pimm test") for c in commands(PAGE.read_text()))


@pytest.mark.slow
def test_train_on_your_own_data_end_to_end(tmp_path):
    clone = copy_checkout(tmp_path / "clone")
    for block in fenced(PAGE.read_text(), "python"):
        name = block.splitlines()[0].removeprefix("# ").strip()
        (clone / name).write_text(block)
    environment = env()
    environment["PYTHONPATH"] = str(clone)
    with forkserver.server_in(clone, environment) as server:  # torch and pimm imported from the copy once
        for command in commands(PAGE.read_text()):
            done = forkserver.run(as_argv(command), cwd=clone, env=environment, timeout=900, server=server)
            assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stderr[-3000:]}"
            if "--print-config" in command:
                assert "type='FeatureFileDataset'" in done.stdout and "custom_imports = ['my_data']" in done.stdout
    run = clone / "exp" / "my-task"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    accuracies = [r["val/acc"] for r in records if "val/acc" in r]
    assert len(accuracies) == 10 and max(accuracies) > 0.9  # a learnable task, learnt; 8 epochs + 2 resumed
    assert max(r["step"] for r in records) == 10 * 2048 // 64
    test = json.loads((clone / "exp" / "my-task-test" / "test_metrics.json").read_text())
    assert test["metrics"]["ClsEvaluator"]["acc"] > 0.9
    assert "Resumed from step000000256-epoch0008" in (run / "train.log").read_text()
