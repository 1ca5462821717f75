"""Errors that mean "the user gave us something wrong".

The CLI turns a :class:`UserError` into one ``error: ...`` line on stderr and
exit code 2; anything else is a bug or a runtime failure (exit 1, traceback
in ``train.log``).
"""


class UserError(Exception):
    """Bad config, CLI option, checkpoint or data. The message is shown as is,
    so it must name the culprit and say what to do."""


class ConfigError(UserError):
    """A config file or ``--options`` entry is wrong."""


class RegistryError(UserError):
    """A ``type=`` cannot be resolved or its constructor rejected the arguments."""


class CheckpointError(UserError):
    """A checkpoint or weight file is missing, unreadable or does not fit."""


class DataSampleError(UserError):
    """Loading one sample failed. Raised in a data worker, it reaches the main
    process wrapped in the worker's traceback text; only the last line (ours)
    is kept, so the user sees one line naming the data set, index and error."""

    def __init__(self, message: str):
        self.full_text = str(message)  # with the worker's traceback, shown under PIMM_DEBUG=1
        lines = [line for line in str(message).splitlines() if line.strip()]
        if len(lines) > 1:  # re-created by torch's worker exception wrapper
            message = lines[-1].split(": ", 1)[-1] if lines[-1].startswith(type(self).__name__) else lines[-1]
        super().__init__(message)


class TrainingPreempted(BaseException):
    """Raised once a pre-emption checkpoint is committed (or by a pre-emption
    signal during start-up); the CLI exits with :data:`EXIT_PREEMPTED` so a job
    wrapper knows to requeue with ``resume=True``. A BaseException, like
    KeyboardInterrupt, so that no ``except Exception`` on the way (a registry
    wrapping constructor errors, say) turns it into a failure."""


class TrainingInterrupted(BaseException):
    """Raised once the checkpoint of a Ctrl-C (the first SIGINT) is committed;
    the CLI prints the resume command and exits with :data:`EXIT_INTERRUPTED`.
    A second Ctrl-C raises KeyboardInterrupt instead (an abort, no new checkpoint)."""


# The command line's exit codes (the public contract, docs/contract.md).
EXIT_OK = 0
EXIT_FAILURE = 1  # a runtime failure or bug: traceback in train.log
EXIT_USAGE = 2  # bad config, option, checkpoint or data: one ``error:`` line
EXIT_PREEMPTED = 75  # pre-empted after a committed checkpoint: rerun with resume=True
EXIT_INTERRUPTED = 130  # Ctrl-C: after a committed checkpoint (one press) or at once (a second press)
