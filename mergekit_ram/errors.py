"""The plugin's errors share one base class, so a command tells them from mergekit's by type.

``mergekit-yaml``, ``mergekit-multi``, ``mergekit-pytorch`` and ``mergekit-ram`` show a
``RamError`` as one line (``Error: ...``, exit code 1) and its traceback only under ``-v``;
so is a resource failure (too many open files, no memory, a full disk: ``resource_message``)
in a RAM merge or probe. Every other exception keeps mergekit's own output. Standard library
only: the start-up hook and the command wrappers import this without torch or mergekit.
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
    return _joined(str(error)) or type(error).__name__


def _joined(text: str) -> str:
    """The non-empty lines of ``text``, stripped, joined with '; '."""
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
    """One line naming the resource that ran out while ``doing`` (``merging``) and its fix, when the error
    at the root of ``error``'s chain is such a failure; None for any other error.

    The root is the first failure: an error raised while cleaning up after it (which may fail alike)
    is not the cause. It counts as a resource failure as an ``OSError`` with one of the errno values of
    ``RESOURCE_FAILURES``, a ``MemoryError``, or another exception (safetensors', torch's) whose message
    holds the system's text for one of them (``Too many open files (os error 24)``); the line quotes
    the failing file, or that message without the system's text.
    """
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
    """The first exception of ``error``'s chain: its cause, or the one it was raised while handling, and so on."""
    seen = {id(error)}
    while True:
        earlier = error.__cause__ or error.__context__
        if earlier is None or id(earlier) in seen:
            return error
        seen.add(id(earlier))
        error = earlier


def _quoted_failure(message: str) -> tuple[Optional[int], str]:
    """(errno, the message without the system's text and its code) for a message quoting a resource
    failure (the longest text first: ENFILE's holds EMFILE's); (None, "") for any other."""
    for code in sorted(RESOURCE_FAILURES, key=lambda code: -len(os.strerror(code))):
        found = re.search(re.escape(os.strerror(code)), message, re.IGNORECASE)
        if found:
            return code, _joined(re.sub(r"\[Errno \d+\]", "", message[: found.start()]).rstrip(" :(-"))
    return None, ""


def exit_on_one_line(error: BaseException, verbose: bool, message: Optional[str] = None) -> NoReturn:
    """click's ``Error: <message>`` on one line (the error's own by default), exit code 1; under ``-v`` the
    traceback first.

    Call it inside the ``except`` block that caught ``error``.
    """
    import click

    if verbose:
        LOG.error("mergekit-ram: traceback of the error reported below", exc_info=error)
    raise click.ClickException(message or one_line(error)) from None


def exit_if_reported(error: BaseException, verbose: bool, doing: str) -> None:
    """``exit_on_one_line`` for a ``RamError`` or a resource failure while ``doing`` (``resource_message``);
    returns for any other error, which the caller re-raises as it is.

    Call it inside the ``except`` block that caught ``error``.
    """
    message = one_line(error) if isinstance(error, RamError) else resource_message(error, doing)
    if message is not None:
        exit_on_one_line(error, verbose, message)
