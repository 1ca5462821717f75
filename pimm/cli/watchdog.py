"""``pimm watchdog ls | rm NAME [--scancel]``: the ``scron`` supervisors of
chained interactive runs.

``pimm submit --interactive --chain.jobs N`` (N > 1) does not run its chain of
``salloc`` slots from the login shell, which would take the chain down with
it: it writes a driver script and adds a block to the user's ``scrontab``
(SLURM's cron: it runs on the login nodes under ``watchdog.qos``, never two
at once, and survives a login node's reboot). Every ``watchdog.interval_min``
minutes scron starts the driver, which returns at once unless no driver is
running and the run is neither done nor failed; it then runs the same
``pimm submit`` with ``PIMM_WATCHDOG_CHILD=1`` (the slots one after another,
resuming from the run's checkpoint when there is one). A clean exit marks the
run DONE; three exits in a row without a newer checkpoint mark it FAILED.

Each block is delimited by ``# >>> pimm-watchdog: RUN >>>`` / ``# <<<
pimm-watchdog: RUN <<<`` lines, so this command changes only pimm's blocks
and keeps every other scrontab line. The driver, its log and the DONE /
FAILED markers live in ``<repo_root>/slurm_logs/watchdog/RUN/``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from pimm.cli.tool_args import ToolParser
from pimm.utils.errors import UserError

__all__ = ["main", "install", "entries", "remove", "driver_script", "state_dir"]

_BEGIN, _END = "# >>> pimm-watchdog: {} >>>", "# <<< pimm-watchdog: {} <<<"
MAX_WITHOUT_PROGRESS = 3


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, **kwargs)
    except FileNotFoundError:
        raise UserError(f"{argv[0]} is not on PATH: pimm watchdog needs SLURM's scron (scrontab); run it on a "
                        "login node of a cluster that has it") from None
    except subprocess.TimeoutExpired:
        raise UserError(f"{shlex.join(argv)} did not answer within 120 s") from None


def read_scrontab() -> str:
    done = _run(["scrontab", "-l"])
    return done.stdout if done.returncode == 0 else ""  # no scrontab yet: a non-zero exit


def write_scrontab(text: str) -> None:
    text = text.strip("\n")
    if not text:
        _run(["scrontab", "-r"])
        return
    with tempfile.NamedTemporaryFile("w", suffix=".scrontab", delete=False) as fh:
        fh.write(text + "\n")
    try:
        done = _run(["scrontab", fh.name])
    finally:
        os.unlink(fh.name)
    if done.returncode != 0:
        first = (done.stderr or done.stdout).strip().splitlines()[:1]
        raise UserError(f"scrontab refused the entry: {first[0] if first else f'exit {done.returncode}'}")


def _without(text: str, run: str) -> str:
    out, inside = [], False
    for line in text.splitlines():
        if line.strip() == _BEGIN.format(run):
            inside = True
        elif line.strip() == _END.format(run):
            inside = False
        elif not inside:
            out.append(line)
    return "\n".join(out)


def entries(text: str | None = None) -> list[dict]:
    """pimm's blocks in the scrontab: ``run``, ``job``, ``qos``, ``driver``, ``state_dir``."""
    begin, end = _BEGIN.split("{}"), _END.split("{}")
    found, current = [], None
    for line in (read_scrontab() if text is None else text).splitlines():
        s = line.strip()
        if s.startswith(begin[0]) and s.endswith(begin[1]):
            current = {"run": s[len(begin[0]):-len(begin[1])]}
        elif current is None:
            continue
        elif s.startswith(end[0]):
            current.setdefault("state_dir", str(Path(current.get("driver", "")).parent))
            found.append(current)
            current = None
        elif s.startswith("#SCRON"):
            words = s.split(None, 2)
            if len(words) == 3 and words[1] in ("-J", "--job-name"):
                current["job"] = words[2].removesuffix("-watchdog")
            elif len(words) == 3 and words[1] in ("-q", "--qos"):
                current["qos"] = words[2]
        elif s and not s.startswith("#"):
            current["driver"] = s.split()[-1]
    return found


def remove(run: str) -> bool:
    current = read_scrontab()
    if _BEGIN.format(run) not in current:
        return False
    write_scrontab(_without(current, run))
    return True


def state_dir(root: Path, run: str) -> Path:
    return root / "slurm_logs" / "watchdog" / run


def run_state(entry: dict) -> str:
    folder = Path(entry.get("state_dir", ""))
    if (folder / "DONE").exists():
        return "done"
    if (folder / "FAILED").exists():
        return "FAILED"
    try:
        done = subprocess.run(["squeue", "-h", "-o", "%T", "-u", os.environ.get("USER", ""), "-n",
                               f"{entry.get('job', entry['run'])}-watchdog,{entry.get('job', entry['run'])}"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    states = set(done.stdout.split())
    return "running" if "RUNNING" in states else "queued" if states else "idle"


def driver_script(*, run: str, root: Path, save_path: Path, state: Path, command: list[str],
                  tail: list[str]) -> str:
    """The script scron starts: one driver at a time, done/failed markers, the
    chain resumed when the run has a checkpoint."""
    from pimm.cli.launch_plan import IMPORT_ROOT as import_root

    q = shlex.quote
    return f"""#!/bin/bash
# The scron driver of pimm run {run}, written by `pimm submit --interactive --chain.jobs N`.
# Submit again to rewrite it; `pimm watchdog rm {run}` removes the scron entry.
set -uo pipefail
state={q(str(state))}
run_dir={q(str(save_path))}
mkdir -p "$state"
log() {{ echo "[$(date '+%F %T')] $*" >>"$state/driver.log"; }}
cd {q(str(root))} || exit 1
export PYTHONPATH={q(str(import_root))}${{PYTHONPATH:+:$PYTHONPATH}}  # this pimm, installed or not
[ -e "$state/DONE" ] && exit 0
[ -e "$state/FAILED" ] && {{ log "FAILED: remove $state/FAILED to try again"; exit 0; }}
exec 9>"$state/driver.lock"
flock -n 9 || exit 0  # a driver is running
newest() {{ find "$run_dir/model" "$run_dir/checkpoints" -type f -printf '%T@\\n' 2>/dev/null | sort -n | tail -n 1; }}
before=$(newest)
resume=()
[ -n "$before" ] && resume=(--chain.resume-first)
# A fresh allocation, not a step of scron's own job.
for name in ${{!SLURM@}}; do [ "$name" = SLURM_CONF ] || unset "$name"; done
command=({" ".join(q(w) for w in command)})
tail=({" ".join(q(w) for w in tail)})
log "starting the chain (resume: ${{resume[*]:-no}})"
PIMM_WATCHDOG_CHILD=1 "${{command[@]}}" "${{resume[@]}}" -- "${{tail[@]}}" >>"$state/driver.log" 2>&1
code=$?
after=$(newest)
log "the chain exited $code"
if [ "$code" -eq 0 ]; then
  touch "$state/DONE"
elif [ "$code" -eq 130 ]; then
  log "interrupted: the next check starts it again"
elif [ -n "$after" ] && [ "$after" != "$before" ]; then
  rm -f "$state/without_progress"
else
  count=$(( $(cat "$state/without_progress" 2>/dev/null || echo 0) + 1 ))
  echo "$count" >"$state/without_progress"
  if [ "$count" -ge {MAX_WITHOUT_PROGRESS} ]; then
    touch "$state/FAILED"
    log "$count exits in a row without a new checkpoint: FAILED"
  fi
fi
exit 0
"""


def _block(resolved, run: str, job: str, driver: Path, state: Path) -> str:
    cfg = resolved.config
    if not cfg.resources.account:
        raise UserError("a chained --interactive run installs a scron entry, and scron needs an account: "
                        "--resources.account ACCOUNT (or the site's resources.account)")
    wd = cfg.watchdog
    if wd.interval_min < 1:
        raise UserError(f"--watchdog.interval-min {wd.interval_min} is invalid: give 1 or more minutes")
    return "\n".join([_BEGIN.format(run), f"#SCRON -q {wd.qos}", f"#SCRON -A {cfg.resources.account}",
                      f"#SCRON -t {wd.time}", f"#SCRON -J {job}-watchdog", f"#SCRON -o {state / 'scron.%j.out'}",
                      "#SCRON --open-mode=append", f"*/{wd.interval_min} * * * * {driver}", _END.format(run)])


def _driver_command(argv: list[str], run: str) -> tuple[list[str], list[str]]:
    """``(submit command, tail)`` the driver runs: this command line without what
    only installing needs (``--dry-run``, ``--output``) and without
    ``--chain.resume-first`` (the driver decides from the run's checkpoint), with
    the run's name pinned."""
    head = argv[:argv.index("--")] if "--" in argv else list(argv)
    tail = argv[argv.index("--") + 1:] if "--" in argv else []
    kept, skip = [], False
    for token in head:
        flag = token.split("=", 1)[0].replace("_", "-")
        if skip:
            skip = False
        elif flag in ("--dry-run", "--chain.resume-first", "--chain.no-resume-first"):
            pass
        elif flag == "--output":
            skip = "=" not in token
        else:
            kept.append(token)
    command = [sys.executable, "-m", "pimm.cli", "submit", *kept, "--interactive", "--run.name", run,
               "--run.no-timestamp"]
    return command, tail


def install(resolved, run: str, argv: list[str], *, dry_run: bool, output: str | None) -> int:
    """Write the driver and add (or replace) this run's scrontab block."""
    from pimm.cli import launch_plan

    cfg = resolved.config
    if "run.wandb_api_key" in resolved.flags:
        raise UserError("--run.wandb-api-key would be written into the scron driver of a chained --interactive "
                        "run: log in once with `wandb login` (or export WANDB_API_KEY in the site's setup) instead")
    root = launch_plan.repo_root(resolved)
    save_path = launch_plan.locate(resolved)[2]
    state = state_dir(root, run).absolute()
    driver = state / "driver.sh"
    command, tail = _driver_command(argv, run)
    script = driver_script(run=run, root=root, save_path=save_path, state=state, command=command, tail=tail)
    block = _block(resolved, run, launch_plan.job_name(resolved, run), driver, state)
    if output:
        from pimm.cli.launch import _write

        print(f"# wrote the watchdog driver: {_write(output, script)}")
    if dry_run:
        print(f"# pimm submit --interactive --chain.jobs {cfg.chain.jobs} --dry-run: nothing was installed\n"
              f"# the scron driver ({driver}):\n{script}# the scrontab block:\n{block}")
        return 0
    try:
        state.mkdir(parents=True, exist_ok=True)
        driver.write_text(script)
        driver.chmod(0o755)
        for marker in ("DONE", "FAILED", "without_progress"):
            (state / marker).unlink(missing_ok=True)
    except OSError as err:
        raise UserError(f"cannot write the watchdog driver in {state}: {err.strerror or err}") from None
    current = _without(read_scrontab(), run).strip("\n")
    write_scrontab(f"{current}\n\n{block}" if current else block)
    print(f"Installed the scron watchdog of run {run}: every {cfg.watchdog.interval_min} min (QOS "
          f"{cfg.watchdog.qos}) it runs the chain of {cfg.chain.jobs} interactive slots until the run is done.\n"
          f"  driver: {driver}\n  log:    {state / 'driver.log'}\n"
          f"  pimm watchdog ls | pimm watchdog rm {run} [--scancel]")
    return 0


def _parser() -> ToolParser:
    parser = ToolParser(prog="pimm watchdog", description="Manage the scron supervisors of chained interactive "
                        "runs (pimm submit --interactive --chain.jobs N installs them).")
    sub = parser.add_subparsers(dest="action", required=True, parser_class=ToolParser)
    sub.add_parser("ls", help="list the installed supervisors and their state",
                   description="List the installed supervisors and their state.")
    rm = sub.add_parser("rm", help="remove a run's supervisor (its scrontab block)",
                        description="Remove a run's supervisor (its scrontab block).")
    rm.add_argument("run", metavar="NAME", help="the run's name, as pimm watchdog ls shows it")
    rm.add_argument("--scancel", action="store_true",
                    help="also cancel the running driver and its interactive allocation (scancel by job name)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.action == "ls":
        found = entries()
        if not found:
            print("no pimm watchdog is installed")
            return 0
        width = max(len(e["run"]) for e in found)
        for entry in found:
            print(f"{entry['run']:<{width}}  {run_state(entry):<7}  {entry.get('state_dir', '')}")
        return 0
    entry = next((e for e in entries() if e["run"] == args.run), None)
    if entry is None or not remove(args.run):
        names = ", ".join(e["run"] for e in entries()) or "none is installed"
        raise UserError(f"no pimm watchdog for run {args.run!r} (installed: {names})")
    print(f"removed the scron watchdog of run {args.run}")
    if args.scancel:
        job = entry.get("job", args.run)
        for name in (f"{job}-watchdog", job):
            _run(["scancel", "--name", name])
        print(f"cancelled the jobs named {job}-watchdog and {job}")
    return 0
