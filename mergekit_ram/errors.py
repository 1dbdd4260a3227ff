"""The plugin's errors share one base class, so a command tells them from mergekit's by type.

``mergekit-yaml``, ``mergekit-multi``, ``mergekit-pytorch`` and ``mergekit-ram`` show a
``RamError`` as one line (``Error: ...``, exit code 1) and its traceback only under ``-v``;
every other exception keeps mergekit's own output. Standard library only: the start-up
hook and the command wrappers import this without torch or mergekit.
"""

from __future__ import annotations

import logging
from typing import NoReturn

LOG = logging.getLogger(__name__)


class RamError(Exception):
    """Any error mergekit-ram raises for its user; its message names the cause and the fix."""


class RecipeError(RamError, ValueError):
    """A RAM recipe that cannot be read (YAML syntax, documents, schema, stages) or would silently
    merge something else; the message names the place and the fix."""


class InputError(RamError, ValueError):
    """A model or tensor a RAM merge cannot use; the message names it."""


class DeviceError(RamError, RuntimeError):
    """The torch device a RAM merge or probe was asked to use is not available."""


class SettingError(RamError, ValueError):
    """An environment variable of mergekit-ram holds a value it does not accept."""


class MergedFolderError(RamError, ValueError):
    """A merged model folder that ``mergekit-ram check`` cannot open, or whose card it cannot change."""


class MissingExtraError(RamError, ImportError):
    """An optional dependency (an extra of mergekit-ram) is not installed."""


def one_line(error: BaseException) -> str:
    """The error's message on one line: its non-empty lines joined with '; '."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines) or type(error).__name__


def exit_on_one_line(error: BaseException, verbose: bool) -> NoReturn:
    """click's ``Error: <message>`` on one line, exit code 1; under ``-v`` the traceback first.

    Call it inside the ``except`` block that caught ``error``.
    """
    import click

    if verbose:
        LOG.error("mergekit-ram: traceback of the error reported below", exc_info=error)
    raise click.ClickException(one_line(error)) from None
