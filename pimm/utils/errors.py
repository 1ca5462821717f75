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


class TrainingPreempted(Exception):
    """Raised once a pre-emption checkpoint is committed; the CLI exits with
    :data:`EXIT_PREEMPTED` so a job wrapper knows to requeue with ``resume=True``."""


# The command line's exit codes (the public contract, docs/contract.md).
EXIT_OK = 0
EXIT_FAILURE = 1  # a runtime failure or bug: traceback in train.log
EXIT_USAGE = 2  # bad config, option, checkpoint or data: one ``error:`` line
EXIT_PREEMPTED = 75  # pre-empted after a committed checkpoint: rerun with resume=True
