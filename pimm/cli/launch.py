"""``pimm launch``: upstream pimm's front door, run by pimm's own launcher.

``pimm launch --train.config NAME [--resources.nproc-per-node N|auto]
[--resources.nnodes M] [--run.name NAME] [--site S] [--recipe YAML]
[--dry-run] [--output PATH] -- [KEY=VALUE ...]`` resolves the launch settings
(:mod:`pimm.cli.launch_config`: defaults, site, recipe, flags, tail), finds
the config by name under ``configs/``, and runs training on this machine (or
this node of an allocation): :mod:`pimm.cli.launch_plan` writes the script and
this process becomes it. ``--dry-run`` prints the settings and the script,
checks the experiment config with its overrides at the run's world size, and
starts nothing.

Exit codes are training's (0, 2 bad input with one ``error:`` line, 75
pre-empted, 130 Ctrl-C, 1 failure); before training starts, bad input is one
``error:`` line and exit 2.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from pimm.cli import launch_args, launch_config, launch_plan
from pimm.utils.errors import UserError
from pimm.utils.redaction import redact_command, redact_secrets

__all__ = ["main", "resolve_argv", "check_experiment_config", "settings_text", "launch_command"]

EXIT_OK, EXIT_USAGE = 0, 2


def launch_command(verb: str, argv: list[str]) -> str:
    """The command line that runs this again (PIMM_LAUNCH_COMMAND): without
    ``--dry-run`` / ``--output``, secrets redacted."""
    kept, drop_next = [], False
    tail_at = argv.index("--") if "--" in argv else len(argv)
    for at, token in enumerate(argv):
        flag, sep, _ = token.partition("=")
        if drop_next:
            drop_next = False
        elif at < tail_at and flag.replace("_", "-") in ("--dry-run", "--output"):
            drop_next = flag.replace("_", "-") == "--output" and not sep
        else:
            kept.append(token)
    return shlex.join(["pimm", verb, *redact_command(kept)])


def resolve_argv(argv: list[str], verb: str) -> launch_config.Resolved:
    flags, tail = launch_args.parse(argv, f"pimm {verb}", submit=verb == "submit")
    return launch_config.resolve(flags, tail, argv, default_site="slurm" if verb == "submit" else "local")


def settings_text(resolved: launch_config.Resolved) -> str:
    """The resolved launch settings as YAML, secrets redacted."""
    import yaml

    data = redact_secrets(launch_config.launch_schema.to_dict(resolved.config))
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def check_experiment_config(config_file: Path, options: list[str], world_size: int, mode: str = "train") -> None:
    """The experiment config with its overrides, validated as the run's ranks will
    (unknown keys, types, batch sizes at ``world_size``); builds no data or model."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from pimm.cli.register import register_all
    from pimm.engines.run.launch import load_config

    register_all()
    load_config(str(config_file), options, world_size, mode, check_save_path=False)


def _write(path: str, text: str) -> Path:
    out = Path(path).expanduser()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except OSError as err:
        raise UserError(f"--output {path}: cannot write it: {err.strerror or err}") from None
    return out


def _execute(script: str, secrets: dict) -> int:
    """Become the launch script (``exec`` inside it hands the process to training);
    secrets travel in the environment, not in the script's text."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe("bash", ["bash", "-c", script], {**os.environ, **secrets})
    return EXIT_OK  # not reached


def run(argv: list[str]) -> int:
    resolved = resolve_argv(argv, "launch")
    recorded = os.environ.get("PIMM_LAUNCH_COMMAND") or launch_command("launch", argv)
    plan = launch_plan.plan_launch(resolved, launch_command=recorded)
    dry_run = resolved.flags.get("dry_run", False)
    if resolved.flags.get("output"):
        print(f"# wrote the launch script: {_write(resolved.flags['output'], plan.display_script)}")
    if dry_run or plan.world_size > 1:
        # One error line here, rather than one from every rank.
        check_experiment_config(plan.config_file, plan.options, plan.world_size,
                                "test" if resolved.config.train.test else "train")
    if dry_run:
        print(f"# pimm launch --dry-run: nothing was started\n"
              f"# launch settings ({' + '.join(resolved.layers)} + the command line):\n"
              f"{settings_text(resolved)}"
              f"# experiment config: {plan.config_file} (checked with its overrides for {plan.world_size} "
              f"process(es))\n"
              f"# run folder: {plan.save_path}\n"
              f"# {plan.nnodes} node(s) x {plan.nproc_per_node} process(es); the script this node runs:\n"
              f"{plan.display_script}", end="")
        return EXIT_OK
    return _execute(plan.script, plan.secrets)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return run(argv)
    except UserError as err:
        if os.environ.get("PIMM_DEBUG") == "1":
            raise
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
