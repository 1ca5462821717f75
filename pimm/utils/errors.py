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
