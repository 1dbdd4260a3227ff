"""The plugin's errors share one base class, ``click.ClickException``: every console script (mergekit's and
``mergekit-ram``) prints one as one ``Error:`` line with exit status 1, without any wrap of click.
"""

from __future__ import annotations

import errno
import logging
from typing import IO, Any, Optional

import click

LOG = logging.getLogger(__name__)


class RamError(click.ClickException):
    """Any error mergekit-ram raises for its user; its message, one line, names the cause and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(_joined(message) or type(self).__name__)


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
    """An optional dependency (an extra of mergekit-ram) or mergekit itself is not installed."""


class MergekitMovedError(RamError, RuntimeError):
    """The installed mergekit is not one the plugin supports, or an internal it uses has moved."""


class MergeInterrupted(RamError):
    """Ctrl-C during a RAM merge; the message says what the output folder holds (shown without ``Error:``)."""

    exit_code = 130  # 128 + SIGINT, as a shell reports a command that Ctrl-C ended

    def show(self, file: Optional[IO[Any]] = None) -> None:
        click.echo(self.format_message(), err=True, file=file)


class ResourceError(RamError, OSError):
    """The machine ran out of something (files, memory, disk) while a command of the plugin ran."""


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
    """The resource that ran out while ``doing`` and its fix, when the chain's first error is such an ``OSError``
    (its path named) or a ``MemoryError``."""
    root = _root(error)
    if isinstance(root, OSError) and root.errno in RESOURCE_FAILURES:
        code, detail = root.errno, " -> ".join(str(name) for name in (root.filename, root.filename2) if name)
    elif isinstance(root, MemoryError):
        code, detail = errno.ENOMEM, ""
    else:
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


def reported(error: BaseException, doing: str) -> Optional[RamError]:
    """The one-line error for ``error``: itself if it is a ``RamError``, a ``ResourceError`` for a resource
    failure (the traceback logged at debug level), else None (not the plugin's to report)."""
    if isinstance(error, RamError):
        return error
    message = resource_message(error, doing)
    if message is None:
        return None
    LOG.debug("traceback of the resource failure reported below", exc_info=error)
    return ResourceError(message)
