"""The ``pimm`` command (pimm.cli.main): dispatch, help, bad commands, lazy imports."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pimm.cli as cli  # noqa: E402
from pimm.cli import main  # noqa: E402
from tests.support import forkserver  # noqa: E402
from tests.support.run import env as tool_env  # noqa: E402
from tests.support.run import train_losses, write_toy_config  # noqa: E402


def run_pimm(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return forkserver.run([sys.executable, "-m", "pimm.cli", *args], env=tool_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_help_lists_every_command():
    proc = run_pimm("--help")
    assert proc.returncode == 0
    for command in ("train", "test", "trace", "plot", "submit", "export"):
        assert f"\n  {command} " in proc.stdout
    bare = run_pimm()
    assert bare.returncode == 2 and "usage: pimm <command>" in bare.stderr


def test_unknown_command_is_one_error_line_and_exit_2():
    proc = run_pimm("trian", "--config-file", "x.py")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: unknown command 'trian'; did you mean 'train'? (commands: launch, ls, train, test, trace, plot, "
        "submit, watchdog, export, torchrun; see pimm --help)"]
    assert proc.stdout == ""


def test_trace_and_plot_start_without_torch_or_matplotlib(tmp_path):
    (tmp_path / "run" / "trace").mkdir(parents=True)
    script = ("import sys; from pimm.cli import main; rc = main(['trace', 'summarize', sys.argv[1]]); "
              "heavy = [m for m in ('torch', 'matplotlib', 'pimm.engines') if m in sys.modules]; "
              "print('heavy:', heavy); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run")], env=tool_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "heavy: []" in proc.stdout  # no trace files yet: a clear error
    assert proc.stderr.splitlines()[0].startswith("error: ") and len(proc.stderr.splitlines()) == 1
    assert "structured_logging.enabled=True" in proc.stderr


@pytest.mark.parametrize("verb", ["train", "test"])
def test_train_and_test_dispatch_with_their_arguments(monkeypatch, verb):
    seen = {}

    def fake(argv):
        seen["argv"], seen["argv0"] = argv, sys.argv[0]
        return 75

    monkeypatch.setattr(cli, f"{verb}_main", fake)
    before = sys.argv[0]
    assert main([verb, "--config-file", "c.py", "--options", "epoch=2"]) == 75  # the verb's exit code
    assert seen["argv"] == ["--config-file", "c.py", "--options", "epoch=2"]
    # --num-gpus re-runs sys.argv[0] per worker: it must name the verb's module, not `pimm`.
    assert seen["argv0"] == f"-mpimm.cli.{verb}"
    assert sys.argv[0] == before


def test_train_help_shows_the_tool_arguments(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("pimm train: the same arguments as tools/train.py")
    assert "--config-file" in out and "--num-gpus" in out and "--options" in out


def test_trace_and_plot_errors_are_one_line(tmp_path, capsys):
    assert main(["trace", "summarize", str(tmp_path / "missing")]) == 2
    assert main(["trace", "bogus"]) == 2
    assert main(["plot"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and all(line.startswith("error: ") for line in lines)
    assert "no such run directory" in lines[0] and "invalid choice: 'bogus'" in lines[1]
    assert "RUN" in lines[2]


def test_submit_dispatches_to_the_submit_tool(monkeypatch):
    from pimm.cli import submit

    calls = []
    monkeypatch.setattr(submit, "main", lambda argv: calls.append(argv) or 0)
    assert main(["submit", "--config-file", "c.py", "--nodes", "2"]) == 0
    assert calls == [["--config-file", "c.py", "--nodes", "2"]]


def test_the_tools_entry_points_stay_importable():
    from pimm.cli import test_main, train_main  # what tools/*.py and pimm-train/pimm-test import

    assert train_main.__module__ == test_main.__module__ == "pimm.cli"


def test_console_scripts_are_registered():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"pimm": "pimm.cli:main", "pimm-train": "pimm.cli:train_main", "pimm-test": "pimm.cli:test_main"}
    assert "matplotlib>=3.7" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["plot"]


@pytest.mark.slow
def test_pimm_train_with_two_local_workers(tmp_path):
    save_path = tmp_path / "run"
    config = write_toy_config(tmp_path, save_path)
    proc = run_pimm("train", "--config-file", str(config), "--num-gpus", "2", "--options", "epoch=1", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "world size 2" in (save_path / "train.log").read_text()
    assert [step for step, _ in train_losses(save_path)] == list(range(1, 11))
