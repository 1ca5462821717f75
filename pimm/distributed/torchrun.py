"""``pimm torchrun`` (also ``python -m pimm.distributed.torchrun``): torchrun
with pimm's exit codes and signal semantics. It takes exactly torchrun's
arguments and runs torch's own launcher in this process, untouched.

What plain torchrun does on a signal: it turns SIGTERM, SIGINT, SIGHUP and
SIGQUIT into its own ``SignalException``, sends the signal on to its
workers, kills them after ``--shutdown-timeout`` (30 s) and exits 1,
whatever the workers did; a second signal makes it exit at once. A
pre-empted run is therefore exit 1 there, not 75, and the ranks' own answer
(checkpoint committed, 75) is only in ``train.log``.

Here torchrun is told to handle SIGQUIT only (``--signals_to_handle``), and
this process forwards SIGTERM, SIGHUP, SIGINT, SIGUSR1 and SIGUSR2 to each
worker's process group itself (torchrun makes every worker a session
leader), each time one arrives. The workers then do what they do under
``--num-gpus``: agree on a step, commit a checkpoint and exit 75 (a
pre-emption) or 130 (Ctrl-C; a second Ctrl-C aborts), and torchrun reports
their exits as a ``ChildFailedError``, which is mapped back:

* every failed worker exited 75 (or 75 and 130): exit 75, "rerun with resume=True";
* every failed worker exited 130: exit 130;
* anything else: torchrun's failure report on stderr, exit 1.

A worker that torchrun itself stopped with its closing SIGTERM (exit -15)
after another one had exited does not change the verdict: a worker exits
75 or 130 only after the checkpoint is committed on every rank (the commit
is collective), so the slower rank was past its part and only finishing up.

No timeout kills the workers while they save, however long the checkpoint
takes.
"""

from __future__ import annotations

import os
import signal
import sys

from pimm.distributed.slurm_task import child_pids
from pimm.utils.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_USAGE

__all__ = ["main", "FORWARDED"]

#: Signals this process forwards to the workers (torchrun itself handles none of them).
FORWARDED = ("SIGTERM", "SIGHUP", "SIGINT", "SIGUSR1", "SIGUSR2")


def _forward(signum, frame) -> None:
    for pid in child_pids(os.getpid()):
        try:
            os.killpg(pid, signum)  # the worker's session: it and its data-loader workers (which ignore it)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, signum)
            except (ProcessLookupError, PermissionError):
                pass


def exit_code_of(worker_codes: list[int]) -> int:
    """This launcher's exit code from the exit codes of the workers that failed."""
    codes = set(worker_codes)
    if codes & {EXIT_PREEMPTED, EXIT_INTERRUPTED}:
        codes.discard(-signal.SIGTERM)  # torchrun's closing signal to the workers still running
    if codes and codes <= {EXIT_PREEMPTED, EXIT_INTERRUPTED}:
        return EXIT_PREEMPTED if EXIT_PREEMPTED in codes else EXIT_INTERRUPTED
    return EXIT_FAILURE


def main(argv: list[str] | None = None, prog: str = "pimm torchrun") -> int:
    """Run torchrun with ``argv`` (its own arguments); return pimm's exit code (0, 75, 130, 1; 2 bad usage).
    ``prog``: the command named in ``--help`` and usage errors (torch's parser would name ``sys.argv[0]``)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a.split("=", 1)[0] in ("--signals_to_handle", "--signals-to-handle") for a in argv):
        print("error: pimm torchrun sets --signals_to_handle itself (it forwards the pre-emption signals and "
              "Ctrl-C to the workers); drop the option", file=sys.stderr)
        return EXIT_USAGE
    parser = get_args_parser()
    parser.prog = prog
    args = parser.parse_args(["--signals_to_handle=SIGQUIT", *argv])
    previous = {}
    for name in FORWARDED:
        if hasattr(signal, name):
            signum = getattr(signal, name)
            previous[signum] = signal.signal(signum, _forward)
    try:
        run(args)
        return 0
    except ChildFailedError as err:
        code = exit_code_of([failure.exitcode for failure in err.failures.values()])
        if code == EXIT_FAILURE:
            print(err.format_msg(), file=sys.stderr)
        elif code == EXIT_PREEMPTED:
            print(f"pimm torchrun: the workers stopped for pre-emption with a committed checkpoint (exit "
                  f"{EXIT_PREEMPTED}): rerun with resume=True to continue", file=sys.stderr)
        return code
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
