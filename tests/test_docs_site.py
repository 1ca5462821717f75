"""The documentation site (mkdocs.yml, docs/): it builds in strict mode (a
broken link or anchor, a page missing from the nav, a docstring the API pages
cannot render fails the build), its key pages and the API reference are
there, the CLI reference is current, and the trainer pages document every
option."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Pages the nav promises, as built files (use_directory_urls: false).
KEY_PAGES = [
    "index.html", "getting-started.html", "engine.html", "concepts/lifecycle.html", "concepts/hooks.html",
    "concepts/registries.html", "config.html", "checkpoints.html", "trainers/index.html", "hooks.html",
    "hooks/checkpoint-saver.html", "cli.html", "examples.html", "contract.html", "api/index.html",
]
# Objects each API page must render (mkdocstrings anchors them by their import path).
API_OBJECTS = {
    "api/trainers.html": ["pimm.engines.loop.trainer_base.TrainerBase", "pimm.engines.trainers.default.DefaultTrainer",
                          "pimm.engines.trainers.grpo.GRPOTrainer"],
    "api/hooks.html": ["pimm.engines.hooks.base.HookBase", "pimm.engines.hooks.evaluator.EvaluatorBase"],
    "api/optim-step.html": ["pimm.engines.optim.step.OptimStep"],
    "api/metrics.html": ["pimm.engines.observe.metrics.MetricChannel"],
    "api/checkpoints.html": ["pimm.engines.state.manager.CheckpointManager"],
    "api/config.html": ["pimm.utils.config.Config"],
    "api/registry.html": ["pimm.utils.registry.Registry"],
    "api/errors.html": ["pimm.utils.errors.ConfigError"],
    "api/datasets.html": ["pimm.datasets.rings.CherenkovRingDataset"],
    "api/models.html": ["pimm.models.ring_cnn.RingCNN"],
    "api/evaluation.html": ["pimm.evaluation.cls.ClsEvaluator"],
}


def _python_env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env["NO_MKDOCS_2_WARNING"] = "1"  # Material's end-of-life banner, printed on every build
    return env


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, env=_python_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (
        "the documentation site does not build (python -m mkdocs build --strict; the docs tools come with "
        f'pip install -e ".[docs]"):\n{done.stdout}\n{done.stderr}')
    assert "WARNING" not in done.stderr
    return out


@pytest.mark.slow
def test_the_site_builds_strictly_with_its_key_pages(site):
    missing = [page for page in KEY_PAGES if not (site / page).is_file()]
    assert not missing, f"pages missing from the built site: {missing}"
    for page in sorted((DOCS / "hooks").glob("*.md")) + sorted((DOCS / "trainers").glob("*.md")):
        assert (site / page.relative_to(DOCS).with_suffix(".html")).is_file()
    for image in sorted((DOCS / "images").glob("*.png")):
        assert (site / "images" / image.name).stat().st_size == image.stat().st_size
    examples = (site / "examples.html").read_text()
    assert 'src="images/rings-cls-cnn.png"' in examples and 'src="images/grpo-tracks.png"' in examples


@pytest.mark.slow
def test_the_api_reference_is_rendered_from_the_docstrings(site):
    for page, objects in API_OBJECTS.items():
        html = (site / page).read_text()
        for name in objects:
            assert f'id="{name}"' in html, f"{page}: {name} is not rendered"
    # reST roles in docstrings become links or code, never raw markup
    trainers = (site / "api" / "trainers.html").read_text()
    assert ":class:" not in trainers and ":meth:" not in trainers
    assert 'href="#pimm.engines.loop.trainer_base.TrainerBase"' in trainers


def test_the_cli_reference_is_current():
    done = subprocess.run([sys.executable, "tools/write_cli_docs.py", "--check"], cwd=ROOT, env=_python_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{done.stderr}\n(run: python tools/write_cli_docs.py)"


def test_the_cli_reference_lists_every_option_of_the_real_parsers():
    """The generated page against the parsers themselves: a changed flag shows up."""
    text = (DOCS / "cli.md").read_text()
    from pimm.engines.run.launch import _parser

    for action in _parser("train")._actions:
        for flag in action.option_strings if action.dest != "help" else ():
            assert f"`{flag}" in text or f", {flag}" in text, f"docs/cli.md lacks {flag}"
    for command in ("pimm trace summarize", "pimm trace export", "pimm plot", "pimm submit",
                    "tools/train.py", "tools/test.py", "tools/convert_checkpoint.py", "tools/export_pilarnet.py"):
        assert f"`{command}`" in text
    from pimm.engines.run.runtime import RUNTIME_KEYS

    for key in RUNTIME_KEYS:
        assert f"| `{key.name}` |" in text, f"docs/cli.md lacks the runtime key {key.name}"


def _trainer_pages() -> dict[str, str]:
    pages = {}
    for path in sorted((DOCS / "trainers").glob("*.md")):
        title = re.match(r"# (\w+)\n", path.read_text())
        if title:
            pages[title.group(1)] = path.read_text()
    return pages


def test_every_trainer_has_a_page_documenting_its_options():
    from pimm.engines import TRAINERS

    pages = _trainer_pages()
    internal = {"self", "cfg", "hooks", "mode", "tracer"}  # set by the launcher, not by a config
    for name in TRAINERS.keys():
        cls = TRAINERS.get(name)
        if not cls.__module__.startswith("pimm."):
            continue
        assert name in pages, f"no page docs/trainers/<name>.md titled '# {name}'"
        table = "\n".join(line for line in pages[name].splitlines() if line.startswith("| `"))
        documented = {m for row in table.splitlines() for m in re.findall(r"`(\w+)`", row.split("|")[1])}
        for klass in cls.__mro__:  # its own options and those it passes on with **options
            if klass.__module__.startswith("pimm.engines.trainers") and "__init__" in vars(klass):
                params = [p.name for p in inspect.signature(klass.__init__).parameters.values()
                          if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in internal]
                missing = [p for p in params if p not in documented]
                assert not missing, f"docs/trainers: {name}'s options table lacks {missing}"
        assert f'type="{name}"' in pages[name], f"docs/trainers: {name}'s page has no example config"


def test_config_files_named_in_the_docs_exist():
    """Every ``--config-file configs/...`` of a command in the docs, and every
    shipped config the examples and trainer pages show, is a real file."""
    named = set()
    for page in [ROOT / "README.md", *DOCS.rglob("*.md")]:
        text = page.read_text()
        named |= set(re.findall(r"--config-file (configs/[\w/.-]+\.py)", text))
        if page.name == "examples.md" or page.parent.name == "trainers":
            named |= set(re.findall(r"`(configs/[\w/.-]+\.py)`", text))
    assert len(named) >= 5, f"too few configs found in the docs: {sorted(named)}"
    missing = sorted(path for path in named if not (ROOT / path).is_file())
    assert not missing, f"config files named in the docs that do not exist: {missing}"
