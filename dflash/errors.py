"""The errors the project raises on purpose: a problem the user can fix, with the fix in the message.

The command line reports a ``DFlashError`` in one line and exits 1; any other
exception is a bug and keeps its traceback. The subclasses also derive from the
built-in error a caller would expect (a missing file is a ``FileNotFoundError``).
"""

from __future__ import annotations


class DFlashError(Exception):
    """A deliberate, actionable error: bad config, input, environment or preflight verdict."""


class ConfigError(DFlashError, ValueError):
    """A config value that is wrong; the message names the dotted key."""


class InputError(DFlashError, ValueError):
    """Data, a checkpoint or a server answer that cannot be used as it is."""


class MissingInputError(DFlashError, FileNotFoundError):
    """A file or directory a stage reads does not exist; the message names the stage that writes it."""


class PreflightError(DFlashError, RuntimeError):
    """The environment or a preflight verdict forbids the run as configured."""


class LostRankError(DFlashError, RuntimeError):
    """A rank of a distributed run stopped answering (its process died, its node or link went down); the message
    names the rank and its host."""
