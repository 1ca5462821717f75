"""A feature whose optional package is missing says which extra to install:
one line, exit 2 (issue 22). The package is hidden by a stand-in that fails
to import, as a missing one does."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

from tests.support.run import ROOT, env, write_toy_config


def _without(tmp_path, module: str) -> dict:
    shadow = tmp_path / "shadow" / module
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(f"raise ModuleNotFoundError(\"No module named {module!r}\", name={module!r})\n")
    environment = env()
    environment["PYTHONPATH"] = f"{tmp_path / 'shadow'}:{environment['PYTHONPATH']}"
    return environment


def test_pimm_plot_without_matplotlib_names_the_extra(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 1.0}) + "\n")
    out = subprocess.run([sys.executable, "-m", "pimm.cli", "plot", str(run)], capture_output=True, text=True,
                         env=_without(tmp_path, "matplotlib"), cwd=ROOT, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == ('error: pimm plot needs matplotlib, which is not installed: pip install '
                                  '"pimm[plot]" (or pip install matplotlib)')
    assert not (run / "plots").exists()


def test_use_wandb_without_wandb_names_the_extra(tmp_path):
    cfg = write_toy_config(tmp_path, tmp_path / "run")
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "train.py"), "--config-file", str(cfg), "--options",
                          "use_wandb=true"], capture_output=True, text=True, env=_without(tmp_path, "wandb"),
                         cwd=ROOT, timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip().startswith('error: use_wandb=True needs wandb, which is not installed: pip install '
                                         '"pimm[wandb]"')
    assert len(out.stderr.strip().splitlines()) == 1


def test_the_core_install_leaves_the_heavy_packages_to_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    assert "wandb" not in core and "matplotlib" not in core and "mkdocs" not in core
    extras = project["optional-dependencies"]
    assert extras["plot"] == ["matplotlib>=3.7"] and extras["wandb"] == ["wandb>=0.16"]
    assert any(d.startswith("tensorboard") for d in extras["tensorboard"])
    assert all(d.startswith("mkdocs") for d in extras["docs"])
    assert any("docs" in d and "plot" in d and "wandb" in d for d in extras["test"])  # the suite builds the docs


def test_the_quickstart_trains_without_matplotlib_skipping_event_displays_with_one_warning(tmp_path):
    """The core install (no `plot` extra) trains the README's example: the
    classification evaluator's event displays are skipped, with one warning
    naming the extra, and everything else is written as usual."""
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "train.py"), "--config-file",
                          str(ROOT / "configs" / "rings" / "cls-cnn.py"), "--options", f"save_path={run}", "epoch=2",
                          "data.train.num_events=128", "data.val.num_events=64", "data.test.num_events=64"],
                         capture_output=True, text=True, env=_without(tmp_path, "matplotlib"), cwd=tmp_path,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    warnings = [line for line in out.stderr.splitlines() if "matplotlib" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0], out.stderr[-3000:]
    assert warnings[0].endswith('event displays skipped: matplotlib is not installed (pip install "pimm[plot]" to '
                                'get them); training goes on')
    assert (run / "model" / "model_last.pth").is_file() and (run / "model" / "model_best.pth").is_file()
    evaluations = [json.loads(line) for line in open(run / "metrics.jsonl") if '"val/acc"' in line]
    assert len(evaluations) == 2  # both epochs evaluated: the skipped displays cost no evaluation
    assert "Traceback" not in out.stderr
