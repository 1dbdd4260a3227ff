"""Files a merge reads: a name read from a manifest or an index must be ``plain_name`` (it never leaves its folder);
an input's file must be regular (a FIFO in a model's folder is bad input, refused without waiting); JSON is read
with one size cap. Hostile content in the user's own folders is out of the threat model (docs/reliability.md).
Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from typing import Any, Iterator, Optional

JSON_LIMIT = 64 << 20  # the largest JSON file read (manifest, index, cache entry, config): above any real one


class UnreadableFile(ValueError):
    """Not a regular file within the size limit, or not JSON; says why."""


def plain_name(name: object) -> bool:
    """An entry directly inside a folder: no separator or NUL, not ``.`` or ``..``."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


@contextlib.contextmanager
def open_regular(path: str, *, dir_fd: Optional[int] = None, follow_symlinks: bool = True) -> Iterator[tuple[int, int]]:
    """(descriptor, size), opened non-blocking; ``UnreadableFile`` for a FIFO (not waited on), another file
    that is not regular, or a link without ``follow_symlinks``."""
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow_symlinks else os.O_NOFOLLOW), dir_fd=dir_fd)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UnreadableFile("it is a symbolic link") from None
        raise
    try:
        status = os.fstat(handle)
        if not stat.S_ISREG(status.st_mode):
            raise UnreadableFile("it is not a regular file")
        yield handle, status.st_size
    finally:
        os.close(handle)


def read_regular(path: str, limit: int, *, dir_fd: Optional[int] = None, follow_symlinks: bool = True) -> bytes:
    """At most ``limit`` bytes (see ``open_regular``)."""
    with open_regular(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks) as (handle, size):
        if size > limit:
            raise UnreadableFile(f"it is {size:,} bytes, more than the {limit:,} expected at most")
        with open(handle, "rb", closefd=False) as stream:
            return stream.read(size)


def read_json(path: str, *, dir_fd: Optional[int] = None, follow_symlinks: bool = True) -> Any:
    """``read_regular``, as JSON."""
    data = read_regular(path, JSON_LIMIT, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise UnreadableFile(f"it is not valid JSON ({error})") from None


def write_new(name: str, text: str, *, dir_fd: Optional[int] = None) -> os.stat_result:
    """A new file (never through a link or over a file), synced; its status."""
    handle = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    with open(handle, "w", encoding="utf-8") as stream:
        stream.write(text)
        stream.flush()
        os.fsync(handle)
        return os.fstat(handle)


def write_atomically(path: str, text: str, *, dir_fd: Optional[int] = None) -> None:
    """A new file renamed onto ``path``: all or nothing, a link there replaced, not followed."""
    partial = f"{path}.{os.getpid()}.partial"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(partial, dir_fd=dir_fd)  # left by a killed process that had this pid
    try:
        write_new(partial, text, dir_fd=dir_fd)
        os.replace(partial, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial, dir_fd=dir_fd)
        raise
