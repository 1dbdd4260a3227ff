"""The plugin's errors share one base class, so the console scripts tell them from mergekit's by type and show
them (and a resource failure) as one ``Error:`` line, exit 1. Standard library only: the start-up hook imports it.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from typing import NoReturn, Optional

LOG = logging.getLogger(__name__)


class RamError(Exception):
    """Any error mergekit-ram raises for its user; its message names the cause and the fix."""


class RecipeError(RamError, ValueError):
    """A RAM recipe that cannot be read or would silently merge something else."""


class InputError(RamError, ValueError):
    """A model or tensor a RAM merge cannot use."""


class DeviceError(RamError, RuntimeError):
    """The torch device asked for is not available."""


class SettingError(RamError, ValueError):
    """An environment variable of mergekit-ram holds a value it does not accept."""


class MergedFolderError(RamError, ValueError):
    """A folder ``mergekit-ram check`` cannot open, or whose card it cannot change."""


class MissingExtraError(RamError, ImportError):
    """An optional dependency (an extra of mergekit-ram) is not installed."""


def one_line(error: BaseException) -> str:
    """The error's message on one line: its non-empty lines joined with '; '."""
    return _joined(str(error)) or type(error).__name__


def _joined(text: str) -> str:
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


#: Failures of the machine's resources, not of the recipe or the models: errno -> (what ran out, the fix).
RESOURCE_FAILURES = {
    errno.EMFILE: ("too many open files", "raise the limit (ulimit -n)"),
    errno.ENFILE: (
        "too many open files in the system",
        "close other programs' files, or raise the system's limit (fs.file-max)",
    ),
    errno.ENOMEM: ("out of memory", "free memory, or use a machine with more"),
    errno.ENOSPC: ("no space left on the device", "free space on that disk, or choose an output folder on another"),
    errno.EDQUOT: ("disk quota exceeded", "free space within your quota, or choose an output folder outside it"),
    errno.EROFS: ("read-only file system", "choose an output folder on a writable file system"),
    errno.EFBIG: (
        "file too large",
        "raise the file size limit (ulimit -f), or write smaller shards (--out-shard-size)",
    ),
}


def resource_message(error: BaseException, doing: str) -> Optional[str]:
    """The resource that ran out while ``doing`` and its fix, when the chain's first error is such an ``OSError``,
    a ``MemoryError``, or quotes the system's text for one."""
    root = _root(error)
    code: Optional[int]
    if isinstance(root, OSError) and root.errno in RESOURCE_FAILURES:
        code, detail = root.errno, " -> ".join(str(name) for name in (root.filename, root.filename2) if name)
    elif isinstance(root, MemoryError):
        code, detail = errno.ENOMEM, ""
    else:
        code, detail = _quoted_failure(str(root))
    if code is None:
        return None
    what, fix = RESOURCE_FAILURES[code]
    where = f" ({detail})" if detail else ""
    return f"{what} (errno {errno.errorcode[code]}) while {doing}{where}: {fix}"


def _root(error: BaseException) -> BaseException:
    """The first exception of ``error``'s chain (causes and contexts)."""
    seen = {id(error)}
    while (earlier := error.__cause__ or error.__context__) is not None and id(earlier) not in seen:
        seen.add(id(earlier))
        error = earlier
    return error


def _quoted_failure(message: str) -> tuple[Optional[int], str]:
    """(errno, the message before the system's text) for a quoted resource failure, else (None, "")."""
    for code in sorted(RESOURCE_FAILURES, key=lambda code: -len(os.strerror(code))):  # ENFILE's text holds EMFILE's
        found = re.search(re.escape(os.strerror(code)), message, re.IGNORECASE)
        if found:
            return code, _joined(re.sub(r"\[Errno \d+\]", "", message[: found.start()]).rstrip(" :(-"))
    return None, ""


def exit_on_one_line(error: BaseException, verbose: bool, message: Optional[str] = None) -> NoReturn:
    """click's ``Error: <message>`` (the error's own by default), exit 1; the traceback first under ``-v``."""
    import click

    if verbose:
        LOG.error("mergekit-ram: traceback of the error reported below", exc_info=error)
    raise click.ClickException(message or one_line(error)) from None


def exit_if_reported(error: BaseException, verbose: bool, doing: str) -> None:
    """``exit_on_one_line`` for a ``RamError`` or a resource failure; returns for any other (the caller re-raises)."""
    message = one_line(error) if isinstance(error, RamError) else resource_message(error, doing)
    if message is not None:
        exit_on_one_line(error, verbose, message)
