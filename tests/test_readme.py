"""The README runs top to bottom (issue 22): its ```bash blocks, in order, in a
fresh copy of the repository, each command as written except that

* installs are skipped (the test runs in the installed environment) and
  ``python``/``.venv/bin/python``/``pimm`` are this interpreter;
* the test suite and the documentation server are not started from inside
  the test suite (``pytest``, ``mkdocs``);
* a fresh training (or an evaluation) gets ``--options`` appended that make
  its data small and its epochs few. A resume gets nothing appended: it must
  continue its run from what the run recorded.

Each command is a process forked from a server that imported torch and
pimm from the copy (tests/support/forkserver.py's ``server_in``), not a
fresh interpreter: the same code, without ~2 CPU-s of start-up each.

Every command must exit 0. So the README cannot drift from what pimm does.
"""

from __future__ import annotations

import sys

import pytest

from tests.support import forkserver
from tests.support.doc_commands import ROOT, as_argv, commands, copy_checkout
from tests.support.run import env

README = ROOT / "README.md"
SHORTER = {
    "configs/rings/cls-cnn.py": ["epoch=2", "data.train.num_events=256", "data.val.num_events=64",
                                 "data.test.num_events=64"],
    "configs/grpo/tracks-grpo.py": ["data.train.num_events=64", "data.val.num_events=32", "data.test.num_events=32"],
}
NOT_HERE = ("pip install", "python3 -m venv", "pytest", "mkdocs")


def runnable(command: str) -> list[str] | None:
    """The argv this test runs for a README command, or None when it is skipped here."""
    if any(skip in command for skip in NOT_HERE):
        return None
    argv = as_argv(command)
    trains = any(a.endswith(("tools/train.py", "tools/test.py")) for a in argv) or argv[3:4] in (["train"], ["test"])
    if trains and "--print-config" not in argv and not any("resume" in a for a in argv):
        config = argv[argv.index("--config-file") + 1] if "--config-file" in argv else None
        assert config in SHORTER, f"README trains {config}: add how to shorten it to SHORTER"
        shorter = SHORTER[config]
        if argv[-1].endswith("test.py") or "tools/test.py" in argv[1]:
            shorter = [o for o in shorter if o.startswith("data.")]
        argv += ["--options", *shorter]
    return argv


def test_the_readme_commands_are_all_known():
    found = commands(README.read_text())
    assert any("resume=True" in c for c in found) and any("--dry-run" in c for c in found)
    for command in found:
        runnable(command)  # raises on a command the test cannot run


@pytest.mark.slow
def test_the_readme_runs_top_to_bottom(tmp_path):
    clone = copy_checkout(tmp_path / "clone")
    environment = env()
    environment["PYTHONPATH"] = str(clone)
    ran = []
    # Each command is a process forked from a server that imported torch and pimm from the copy once.
    with forkserver.server_in(clone, environment) as server:
        where = forkserver.run([sys.executable, "-c", "import pimm, torch; print(pimm.__file__)"], cwd=clone,
                               env=environment, timeout=120, server=server)
        assert where.stdout.strip() == str(clone / "pimm" / "__init__.py"), where  # the copy's pimm, not ours
        for command in commands(README.read_text()):
            argv = runnable(command)
            if argv is None:
                continue
            done = forkserver.run(argv, cwd=clone, env=environment, timeout=900, server=server)
            assert done.returncode == 0, f"README command failed ({done.returncode}): {command}\n{done.stderr[-3000:]}"
            ran.append((command, done))
    outputs = {c: d for c, d in ran}
    # The resume continued the run it names (the overrides it was started with applied again) ...
    resume = next(c for c in outputs if "resume=True" in c)
    assert "applied again: epoch=20 optimizer.lr=0.002" in (clone / "exp/rings/long/train.log").read_text()
    assert "Traceback" not in outputs[resume].stderr
    # ... the dry run printed a script, and every run has its own directory, none inside another.
    dry = next(d for c, d in outputs.items() if "--dry-run" in c)
    assert "#SBATCH" in dry.stdout and "torchrun" in dry.stdout
    runs = sorted(p.parent for p in (clone / "exp").rglob("config.py"))
    assert len(runs) >= 4
    for run in runs:
        assert not any(other != run and other in run.parents for other in runs), run
