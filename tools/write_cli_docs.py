"""Regenerate ``docs/cli.md``, the command-line reference of the documentation
site, from the commands' own argparse parsers and the runtime key table:
``python tools/write_cli_docs.py`` (``--check`` exits 1 when the page is stale;
``tests/test_docs_site.py`` runs the same comparison).

Each command is run up to the point where it parses its arguments, and the
parser it builds there is taken (``argparse.ArgumentParser.parse_args`` is
patched to hand it over), so the page describes exactly the parser each
command uses, with no second list of options to keep in step. The page is
rendered from the parsers' actions, not from ``--help`` text, so it does not
depend on the Python version's help layout or the terminal width.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET = ROOT / "docs" / "cli.md"


class _Captured(BaseException):  # not an Exception: the commands' error handlers let it through
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__()
        self.parser = parser


def captured_parser(run) -> argparse.ArgumentParser:
    """The parser that ``run()`` builds and parses its arguments with."""
    original = argparse.ArgumentParser.parse_args

    def hand_over(self, *args, **kwargs):
        raise _Captured(self)

    argparse.ArgumentParser.parse_args = hand_over
    try:
        run()
    except _Captured as captured:
        return captured.parser
    finally:
        argparse.ArgumentParser.parse_args = original
    raise RuntimeError(f"{run} returned without parsing its arguments")


def _export_pilarnet():
    spec = importlib.util.spec_from_file_location("_export_pilarnet", ROOT / "tools" / "export_pilarnet.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.parse_args([])


def _make_lucid():
    spec = importlib.util.spec_from_file_location("_make_lucid", ROOT / "tools" / "make_lucid.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.parse_args([])


def _convert_checkpoint():
    spec = importlib.util.spec_from_file_location("_convert_checkpoint", ROOT / "tools" / "convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([])


def _pimm(*argv: str):
    from pimm.cli import main

    return lambda: main(list(argv))


# -- rendering ------------------------------------------------------------------------
def _metavar(action: argparse.Action) -> str:
    if action.metavar is not None:
        return action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    return action.dest.upper() if action.option_strings else action.dest


def _argument(action: argparse.Action) -> str:
    """``--num-gpus N``, ``-o OUT, --output OUT``, ``--options [KEY=VALUE ...]``, ``RUN [RUN ...]``."""
    if action.nargs == 0:
        value = ""
    else:
        metavar = _metavar(action)
        value = {None: metavar, "?": f"[{metavar}]", "*": f"[{metavar} ...]",
                 "+": f"{metavar} [{metavar} ...]"}.get(action.nargs, metavar)
    if not action.option_strings:
        return value
    return ", ".join(f"{flag} {value}".strip() for flag in action.option_strings)


def _synopsis(name: str, parser: argparse.ArgumentParser) -> str:
    if parser.usage:  # a command with many flags states its form itself
        return parser.usage.replace("%(prog)s", name)
    parts = [name]
    for action in _actions(parser):
        if isinstance(action, argparse._SubParsersAction):
            parts.append("{" + ",".join(action.choices) + "} ...")
            continue
        text = _argument(action).split(", ")[-1]
        parts.append(text if action.required or not action.option_strings else f"[{text}]")
    return " ".join(parts)


def _actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS]


def _help(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    text = action.help or ""
    if "%" in text:
        text = text % dict(vars(action), prog=parser.prog)
    return text.replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if action.required or (not action.option_strings and action.nargs not in ("?", "*")):
        return "required"
    if action.nargs == 0 or action.default is None or action.default is argparse.SUPPRESS \
            or action.default == []:
        return ""
    return f"`{action.default}`"


def _table(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| argument | default | meaning |", "| --- | --- | --- |"]
    for action in _actions(parser):
        if isinstance(action, argparse._SubParsersAction):
            continue
        meaning = _help(action, parser)
        if isinstance(action, argparse._AppendAction) and "several times" not in meaning:
            meaning += " (may be given several times)"
        rows.append(f"| `{_argument(action)}` | {_default(action)} | {meaning} |")
    return rows if len(rows) > 2 else []


def _command(name: str, parser: argparse.ArgumentParser, intro: str, level: str = "##",
             title: str | None = None) -> list[str]:
    """A section for the command: ``intro`` (else the parser's description), synopsis, arguments."""
    intro = intro or parser.description or ""
    lines = [f"{level} `{title or name}`", "", intro, "", "```", _synopsis(name, parser), "```", ""]
    table = _table(parser)
    lines += table + [""] if table else []
    for action in _actions(parser):
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for sub, subparser in action.choices.items():
                intro = helps.get(sub) or ""
                lines += _command(f"{name} {sub}", subparser, intro[:1].upper() + intro[1:] + ".", "###")
    return lines


def _runtime_keys() -> list[str]:
    from pimm.engines.run.runtime import RUNTIME_KEYS

    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for key in RUNTIME_KEYS:
        if key.name == "default_hooks":
            default = ", ".join(f"`{name}`" for name in key.default) + " ([Hooks](hooks.md#default-hooks))"
        else:
            default = "`[]`, see [Hooks](hooks.md)" if key.name == "hooks" else f"`{key.default!r}`"
        rows.append(f"| `{key.name}` | {default} | {key.doc.replace('|', chr(92) + '|')} |")
    return rows


HEADER = """# Command-line reference

<!-- GENERATED by tools/write_cli_docs.py from the commands' argparse parsers and the
runtime key table (pimm/engines/run/runtime.py); edit those, then run that script. -->

Every command prints one `error: ...` line and exits with code 2 on bad
usage or bad input; a traceback is printed only with `PIMM_DEBUG=1`. Exit
codes of training: 0 done (or stopped on request), 2 bad input, 75
pre-empted after a checkpoint (rerun with `resume=True`), 130 Ctrl-C (one
press: after a checkpoint, and the line says how to resume; two: at once;
in the first seconds of any command, while it still imports torch and the
models: one `error:` line, nothing written), 1 any other failure ([public
contract](contract.md#exit-codes)). A run that
ends prints a summary: the headline metric's last and best values, the best
checkpoint, where checkpoints and dashboards are, and the commands that
evaluate, plot and continue it.

`pimm` is installed with the package (`pip install -e .`, which also installs
`pimm-train` and `pimm-test`, the same as `pimm train` and `pimm test`); from a
checkout without installing, `python -m pimm.cli` is the same command.
`tools/train.py` and `tools/test.py` run from a checkout as they are.
"""

INTROS = {
    "train": "Train a model from a config file. `--num-gpus N` starts N local processes "
             "(NCCL on GPUs, gloo on CPU); under `torchrun` the processes are detected instead. "
             "Also `pimm train` and `pimm-train`, with the same arguments.",
    "test": "Evaluate weights on the test split (`data.test`) with the config's tester or evaluators, and "
            "write `save_path/test_metrics.json` (an earlier one is kept aside). `pimm test RUN_DIR` scores a "
            "training run from its own `config.py`: its best checkpoint (`model/model_best.pth`) by default, "
            "or `--checkpoint last`, a weight file or a `checkpoints/step...` folder; the results go into "
            "RUN_DIR. Otherwise give `--config-file CFG --options weight=PATH`. A test takes its save_path's run "
            "lock as training does: on a run that is still training (or being tested) it stops with one line "
            "naming the holder, and `--options save_path=DIR` tests into another directory. Also `pimm test` and "
            "`pimm-test`, with the same arguments.",
    "trace": "Read a run's structured trace (recorded with `--options structured_logging.enabled=True`; "
             "[Observability](observability.md)).",
    "plot": "Draw curve pictures from the `metrics.jsonl` of one or more runs "
            "([Observability](observability.md#pimm-plot-run-run-)).",
    "submit": "Submit a training run to SLURM through submitit, requeued on pre-emption and time-out "
              "([Distributed](distributed.md#slurm-pimm-submit)). Needs the `slurm` extra "
              "(`pip install -e \".[slurm]\"`).",
    "launch": "Upstream pimm's front door: train on this machine (or this node of an allocation) with a config "
              "named under `configs/` (`--train.config tests/tiny_semseg`), the launch settings of a site profile "
              "(`--site`, `launch/sites/NAME.yaml`; pimm ships `local` and `slurm`) and a recipe (`--recipe`), "
              "and the experiment config's overrides after a bare `--` (`-- epoch=2 use_wandb=False`: YAML "
              "values, dotted keys). It runs pimm's own launcher, the one `pimm train` runs (torchrun for several "
              "processes), so every guarantee of a run holds; `--dry-run` prints the settings and the command and "
              "starts nothing ([Coming from upstream pimm](coming-from.md#upstreams-launcher)).",
    "ls": "List the training configs by the names `pimm launch --train.config` takes.",
    "submit_upstream": "Submit to SLURM with upstream pimm's flags (those of `pimm launch`; `--site` defaults to "
                       "`slurm`): a batch job through submitit, requeued after a pre-emption or time-out warning "
                       "up to `--chain.jobs` - 1 times, each attempt resuming exactly; `--interactive` runs "
                       "`salloc ... srun ... pimm launch ...` in this terminal (with `--chain.jobs` > 1 it "
                       "installs a scron supervisor, see `pimm watchdog`). Containers "
                       "(`--container.runtime apptainer|singularity|shifter|docker`) wrap the command. "
                       "`--submit.host` and Google Cloud Batch sites are refused with what to use instead. "
                       "A command line with `--config-file` is pimm's own form (next section).",
    "watchdog": "Manage the scron supervisors that `pimm submit --interactive --chain.jobs N` installs (SLURM's "
                "`scrontab`): each runs the chain of interactive slots until the run is done.",
    "convert": "Write the model weights of a checkpoint to one file in the format of `model/model_last.pth`: "
               "a sharded checkpoint of an FSDP run (any number of processes) is read in this one process, "
               "without a process group ([Distributed](distributed.md#one-file-from-a-sharded-checkpoint)).",
    "pimm_export": "Write a run's model as a portable folder (`model.safetensors`, `config.json` with secrets "
                   "and paths redacted, `README.md`) that `pimm.from_pretrained` loads anywhere, and optionally "
                   "push it to the Hugging Face Hub. Two forms: `pimm export RUN OUT` and upstream's "
                   "`pimm export --run-dir RUN [CHECKPOINT] OUT`. A `config.py` runs only when you name it "
                   "(`--config`) or it is the record of the run directory you export "
                   "([Models that travel](pretrained.md), [Security](security.md)).",
    "export": "Export synthetic LArTPC events to PILArNet-M style HDF5 files ([Data](pilarnet.md)).",
    "lucid": "Generate LUCiD-format water-Cherenkov shards from the ring simulator ([LUCiD](lucid.md)).",
}


TORCHRUN = ("torchrun's own arguments (`pimm torchrun --nnodes=2 --nproc_per_node=4 ... tools/train.py "
            "--config-file CFG`, also `python -m pimm.distributed.torchrun`): torch's launcher, run with the "
            "pre-emption signals and Ctrl-C passed to the workers by pimm, so it exits as `tools/train.py` does: "
            "75 when the workers stopped for pre-emption with a committed checkpoint, 130 on Ctrl-C, 0 done, 1 a "
            "failure (torchrun's report on stderr). Plain torchrun exits 1 in all those cases "
            "([Distributed](distributed.md#several-nodes-with-torchrun)). `--signals_to_handle` is set by "
            "pimm and refused.")


def render_cli_reference() -> str:
    """The text of ``docs/cli.md``."""
    from pimm.cli import COMMANDS

    lines = [HEADER]
    lines += ["## `pimm`", "", "```", "pimm <command> [arguments]", "pimm --help | pimm <command> --help",
              "pimm --version", "```", "", "| command | what it does |", "| --- | --- |"]
    lines += [f"| [`pimm {name}`](#pimm-{name}) | {text} |" for name, (text, _) in COMMANDS.items()]
    lines.append("")
    lines += _command("tools/train.py", captured_parser(_pimm("train")), INTROS["train"])
    lines += _command("tools/test.py", captured_parser(_pimm("test")), INTROS["test"])
    lines += ["## `pimm train`", "", "The arguments of [`tools/train.py`](#toolstrainpy).", "",
              "## `pimm test`", "", "The arguments of [`tools/test.py`](#toolstestpy).", ""]
    lines += _command("pimm launch", captured_parser(_pimm("launch")), INTROS["launch"])
    lines += _command("pimm ls", captured_parser(_pimm("ls")), INTROS["ls"])
    for name in ("trace", "plot"):
        lines += _command(f"pimm {name}", captured_parser(_pimm(name)), INTROS[name])
    lines += _command("pimm submit", captured_parser(_pimm("submit")), INTROS["submit_upstream"])
    lines += _command("pimm submit", captured_parser(_pimm("submit", "--config-file", "CFG")), INTROS["submit"],
                      title="pimm submit --config-file")
    lines += _command("pimm watchdog", captured_parser(_pimm("watchdog")), INTROS["watchdog"])
    lines += _command("pimm export", captured_parser(_pimm("export", "RUN", "OUT")), INTROS["pimm_export"])
    lines += ["## `pimm torchrun`", "", TORCHRUN, ""]
    lines += _command("tools/convert_checkpoint.py", captured_parser(_convert_checkpoint), INTROS["convert"])
    lines += _command("tools/export_pilarnet.py", captured_parser(_export_pilarnet), INTROS["export"])
    lines += _command("tools/make_lucid.py", captured_parser(_make_lucid), INTROS["lucid"])
    lines += ["## Runtime keys", "",
              "`--options KEY=VALUE` sets any config key ([Configs](config.md#command-line-overrides---options)); "
              "these are the runtime keys every config has, with their defaults:", ""]
    lines += _runtime_keys() + [""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    text = render_cli_reference()
    if argv == ["--check"]:
        if TARGET.read_text() != text:
            print(f"{TARGET.relative_to(ROOT)} is stale: run python tools/write_cli_docs.py", file=sys.stderr)
            return 1
        return 0
    if argv:
        print("usage: python tools/write_cli_docs.py [--check]", file=sys.stderr)
        return 2
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
