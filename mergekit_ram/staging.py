"""The output transaction: a RAM merge's output folder holds its old content or the complete new merge.

A RAM merge into ``OUT`` (``run_merge``, ``mergekit-pytorch``) runs inside ``output_transaction(OUT)``; the
threat model is in docs/reliability.md. While it runs, ``OUT`` holds besides the user's files:

    .mergekit-ram-<random>/          this run's private folder, made by this process (mode 0700)
        staged/<name of OUT>/        where mergekit writes (the card's title is this name)
        replaced/                    OUT's files the publish replaces, until it has succeeded
    MERGE_INCOMPLETE                 only while files move into OUT
    .mergekit-ram-manifest.json      published with the merge: its files, its weights' identities

Invariants, each held by tests/test_transaction.py (T) or tests/test_output.py (O):

1. No replay: what another process left is named in one warning, never completed, restored or undone. [T, O]
2. A private folder per run, of a fresh unpredictable name; mergekit writes through ``/proc/self/fd``, so
   after ``rm -rf OUT`` or a swapped parent its writes fail instead of landing elsewhere. [T, O]
3. Nothing outside OUT: every operation is relative to a descriptor of OUT or of the private folder, with a
   plain name; links are moved or removed, never followed; the manifest is read bounded. [T]
4. Only ours is removed: what this run wrote, files of the names it replaces, and weights an earlier merge
   recorded whose (device, inode, size, mtime) still match; folders only when empty, OUT and its parents
   only if this run created them. [T, O]
5. One writer: an ``flock`` on OUT itself; a merge whose OUT was removed or replaced publishes nothing. [O]
6. Old or new: the ending signals are held while files move; an error while publishing is undone. Only
   SIGKILL, a crash or a power cut stops a publish half-way: OUT is then marked MERGE_INCOMPLETE (never
   config.json beside a mix) and the next merge writes its own complete result. [T]
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import stat
from typing import Iterable, Iterator, Optional

from mergekit_ram._version import __version__
from mergekit_ram.errors import RamError
from mergekit_ram.files import UnreadableFile, plain_name, read_json
from mergekit_ram.signals import HeldSignals

LOG = logging.getLogger(__name__)

#: The prefix of every private folder (and of the earlier design's ``.mergekit-ram-partial``).
PRIVATE_PREFIX = ".mergekit-ram-"
MARKER_FILE = "MERGE_INCOMPLETE"
MANIFEST_FILE = ".mergekit-ram-manifest.json"
#: The private folder's entries: OUT's name (which may be any) only inside staged/.
_STAGED, _REPLACED = "staged", "replaced"
#: Leaves OUT first and comes back last: without it no loader takes a half-published folder for a model.
_CONFIG = "config.json"
_WEIGHT = re.compile(r"(?s:.*)\.(safetensors|bin)(\.index\.json)?")
#: What transformers and mergekit load as a model's weights: a kept one may shadow the new merge.
_LOADED = re.compile(r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?")
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MARKER_TEXT = (
    "A mergekit-ram merge was killed (SIGKILL, out of memory, power loss) while it moved its files into\n"
    "this folder: it holds the earlier files, the new merge's or a mix, never config.json beside a mix.\n"
    "Nothing completes that publish: rerun the merge (it writes its own complete result and removes this\n"
    "file). The killed merge's .mergekit-ram-<random>/ holds the rest of its files and those it had moved\n"
    "out of the way; remove it once you have what you need.\n"
)


class OutputBusyError(RamError, RuntimeError):
    """Another merge holds the output folder, or took it over while this one ran."""


class OutputFolderError(RamError, RuntimeError):
    """The output folder cannot be prepared or published into; the message says why and what to do."""


@contextlib.contextmanager
def output_transaction(out_path: str) -> Iterator[str]:
    """Yield the folder mergekit writes into; publish it into ``out_path`` once the body returns (invariant 6)."""
    with HeldSignals() as signals:
        folder = _Folder(out_path)
        try:
            with signals.held():
                folder.begin()
            yield folder.staged_path()
            with signals.held():
                folder.publish()
        except BaseException:
            signals.unwinding = True
            raise
        finally:
            with signals.held():
                folder.end()


@contextlib.contextmanager
def folder_writer(out_path: str) -> Iterator[int]:
    """OUT opened and locked as a merge locks it, for a write into a merged folder outside a merge (the card
    tool): ``OutputBusyError`` while a merge holds it, ``OutputFolderError`` while ``MARKER_FILE`` or a private
    folder is there (a killed or running merge's). Yields OUT's descriptor; write only plain names through it."""
    try:
        out = os.open(out_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as error:
        raise OutputFolderError(f"cannot open {out_path} ({_reason(error)})") from None
    try:
        _lock(out, out_path)
        left = sorted(name for name in os.listdir(out) if name == MARKER_FILE or name.startswith(PRIVATE_PREFIX))
        if left := [name for name in left if name != MANIFEST_FILE]:
            raise OutputFolderError(
                f"{out_path} holds {', '.join(left)}: a merge into it was killed or has not finished; merge into it "
                "again (or wait for that merge) before changing its files"
            )
        yield out
    finally:
        os.close(out)


class _Folder:
    """One run's hold on OUT: a locked descriptor of it, and of the private folder this run made."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.name = os.path.basename(os.path.abspath(path)) or "merged"
        self.created: list[str] = []  # OUT and the parents this run made, innermost first
        self.out = self.private = -1
        self.private_name = ""
        self.locked = False
        self.moves: list[tuple[int, int, str]] = []  # this publish's renames: (from folder, to folder, name)
        self.keep = False  # a publish that could not be undone: its private folder holds OUT's old files
        self.spare: list[int] = []  # descriptors held for the clean-up, which needs 3 at most: after EMFILE too

    def begin(self) -> None:
        """Create (if missing), open and lock OUT; report what earlier runs left; make the private folder."""
        path = os.path.abspath(self.path)
        while not os.path.isdir(path):
            self.created.append(path)
            path = os.path.dirname(path)
        try:
            if self.created:
                os.makedirs(self.path, exist_ok=True)
            self.out = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            _lock(self.out, self.path)
            self.locked = True
            self.spare = [os.dup(self.out) for _ in range(3)]
            _check_left_over(self.out, self.path)
            self.private_name = _make_private(self.out)
            self.private = os.open(self.private_name, _FOLDER, dir_fd=self.out)
            for folder in (_REPLACED, _STAGED, os.path.join(_STAGED, self.name)):
                os.mkdir(folder, 0o700, dir_fd=self.private)
        except OSError as error:
            raise OutputFolderError(f"cannot prepare {self.path} for the merge ({_reason(error)})") from None

    def staged_path(self) -> str:
        """The path mergekit writes into: through ``/proc/self/fd`` where it exists (invariant 2)."""
        pinned = f"/proc/self/fd/{self.private}"
        if os.path.isdir(pinned) and _same(os.stat(pinned), os.fstat(self.private)):
            return os.path.join(pinned, _STAGED, self.name)
        return os.path.join(self.path, self.private_name, _STAGED, self.name)

    def holds(self) -> bool:
        """Whether this run locked OUT and the path still names that folder (invariant 5)."""
        with contextlib.suppress(OSError):
            return self.locked and _same(os.fstat(self.out), os.stat(self.path))
        return False

    def publish(self) -> None:
        """Move the staged files into OUT under a marker; on an error, move everything back (invariant 6)."""
        if not self.holds():
            raise OutputBusyError(
                f"{self.path} was removed or replaced while this merge ran, so another merge may be writing "
                "there: nothing was published; rerun the merge"
            )
        handles: list[int] = []
        marker: Optional[os.stat_result] = None
        try:
            for name in (_STAGED, _REPLACED, os.path.join(_STAGED, self.name)):
                handles.append(os.open(name, _FOLDER, dir_fd=self.private))
            replaced, staged = handles[1:]
            names = _publish_order({*os.listdir(staged), MANIFEST_FILE})
            weights = {name: _identity(os.stat(name, dir_fd=staged, follow_symlinks=False))
                       for name in names if name != MANIFEST_FILE and _WEIGHT.fullmatch(name)}  # fmt: skip
            manifest = {"written_by": f"mergekit-ram {__version__}", "files": names, "weights": weights}
            _write_new(MANIFEST_FILE, json.dumps(manifest, indent=1), staged)
            stale = sorted(set(recorded_weights(self.out, self.path)) - set(names))
            if _kind(MARKER_FILE, self.out) == "file":  # a killed run's, kept aside (a link: OUT stays marked)
                os.link(MARKER_FILE, MARKER_FILE, src_dir_fd=self.out, dst_dir_fd=replaced, follow_symlinks=False)
                self.moves.append((self.out, replaced, MARKER_FILE))
            marker = _write_new(MARKER_FILE, MARKER_TEXT, self.private)
            self._move(self.private, self.out, MARKER_FILE)
            _sync(self.out)
            for name in _aside_order(names, stale):
                if _kind(name, self.out) == "file":
                    self._move(self.out, replaced, name)
            for name in names:
                self._move(staged, self.out, name)
            _sync(self.out)
            _remove_marker(self.out, marker)
        except BaseException as error:
            self._undo(marker)
            if not isinstance(error, OSError):
                raise
            kept = f"it is marked {MARKER_FILE}; the files it held are in {os.path.join(self.path, self.private_name)}"
            raise OutputFolderError(
                f"could not publish into {self.path} ({_reason(error)}); "
                + (kept if self.keep else "it holds what it held before")
            ) from None
        finally:
            for handle in handles:
                os.close(handle)
        _log_published(self.out, self.path, names, stale)

    def _move(self, source: int, target: int, name: str) -> None:
        os.rename(name, name, src_dir_fd=source, dst_dir_fd=target)
        self.moves.append((source, target, name))

    def _undo(self, marker: Optional[os.stat_result]) -> None:
        """This publish's renames backwards, then this run's marker removed: OUT as it was, marked until it is."""
        try:
            for source, target, name in reversed(self.moves):
                os.rename(name, name, src_dir_fd=target, dst_dir_fd=source)
            _sync(self.out)
            if marker is not None:
                _remove_marker(self.out, marker)
        except OSError as error:
            self.keep = True
            LOG.error("could not undo the publish into %s (%s)", self.path, _reason(error))

    def end(self) -> None:
        """Remove this run's private folder and the empty folders it created; let go of OUT. Never raises."""
        holds, opened = self.holds(), self.out >= 0
        for handle in self.spare:
            os.close(handle)
        if self.private_name and not self.keep:
            try:
                if self.private >= 0:
                    _clear(self.private)
                os.rmdir(self.private_name, dir_fd=self.out)
            except OSError as error:
                LOG.warning(
                    "could not remove %s (%s): remove it", os.path.join(self.path, self.private_name), _reason(error)
                )
        for handle in (self.private, self.out):
            if handle >= 0:
                with contextlib.suppress(OSError):
                    os.close(handle)
        self.private = self.out = -1
        for path in self.created if holds or not opened else ():
            with contextlib.suppress(OSError):
                os.rmdir(path)
                LOG.info("removed %s, which the merge had created", path)


def _lock(out: int, out_path: str) -> None:
    """An exclusive ``flock`` on OUT, refused at once if another merge holds it (invariant 5)."""
    try:
        fcntl.flock(out, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise OutputBusyError(
            f"another merge is writing to {out_path}; wait for it to finish or choose another output folder"
        ) from None
    except OSError as error:  # a file system without locks
        LOG.warning("could not lock %s (%s): nothing keeps a second merge out of it", out_path, error.strerror)


def _check_left_over(out: int, out_path: str) -> None:
    """Refuse a folder of the marker's or the manifest's name; name what killed runs left (invariant 1)."""
    for name in (MARKER_FILE, MANIFEST_FILE):
        if _kind(name, out) == "folder":
            raise OutputFolderError(
                f"{os.path.join(out_path, name)} is a folder: it is mergekit-ram's own name; remove it or choose "
                "another output folder"
            )
    left = (name for name in sorted(os.listdir(out)) if name.startswith(PRIVATE_PREFIX) or name == MARKER_FILE)
    if found := [name for name in left if name != MANIFEST_FILE]:
        LOG.warning(
            "%s holds %s, left by a mergekit-ram merge that did not finish (killed, or its clean-up failed): this "
            "merge neither uses nor removes them; remove them once you have checked them (a hidden folder may hold "
            "that merge's files and files the folder held before)",
            out_path,
            ", ".join(found),
        )


def _make_private(out: int) -> str:
    """A new folder of a fresh unpredictable name in OUT, made by this process."""
    while True:
        name = PRIVATE_PREFIX + secrets.token_hex(8)
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=out)
            return name


def _identity(status: os.stat_result) -> dict[str, int]:
    """What lets a later merge remove a weight this merge wrote (invariant 4)."""
    return {"device": status.st_dev, "inode": status.st_ino, "size": status.st_size, "mtime_ns": status.st_mtime_ns}


def recorded_weights(out: int, out_path: str) -> list[str]:
    """Plain weight file names an earlier merge recorded in OUT's manifest, still as it left them (invariant 4)."""
    try:
        manifest = read_json(MANIFEST_FILE, dir_fd=out, follow_symlinks=False)
    except FileNotFoundError:
        return []
    except UnreadableFile as reason:
        LOG.warning("ignored %s: %s", os.path.join(out_path, MANIFEST_FILE), reason)
        return []
    weights = manifest.get("weights") if isinstance(manifest, dict) else None
    found = []
    for name, identity in weights.items() if isinstance(weights, dict) else ():
        if plain_name(name) and _WEIGHT.fullmatch(name):
            with contextlib.suppress(OSError):
                if _identity(os.stat(name, dir_fd=out, follow_symlinks=False)) == identity:
                    found.append(name)
    return sorted(found)


def _log_published(out: int, out_path: str, names: list[str], stale: list[str]) -> None:
    """Say what was published and removed; warn once about weights kept that a loader may read."""
    removed = f"; removed {', '.join(stale)}, which an earlier merge recorded" if stale else ""
    LOG.info("published %s into %s%s", ", ".join(names), out_path, removed)
    if kept := sorted(name for name in os.listdir(out) if _LOADED.fullmatch(name) and name not in names):
        LOG.warning(
            "kept %s in %s: this merge did not write them and no earlier mergekit-ram merge recorded them as they "
            "are, but a loader may read them instead of the new weights; remove them if they belong to an old model",
            ", ".join(kept),
            out_path,
        )


def _write_new(name: str, text: str, folder: int) -> os.stat_result:
    """A new file ``name`` in ``folder`` (never through a link or over a file), synced; its status."""
    handle = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=folder)
    try:
        os.write(handle, text.encode())
        os.fsync(handle)
        return os.fstat(handle)
    finally:
        os.close(handle)


def _remove_marker(out: int, marker: os.stat_result) -> None:
    """Remove this run's marker: only the file it wrote, not one put there since."""
    with contextlib.suppress(FileNotFoundError):
        if _same(os.stat(MARKER_FILE, dir_fd=out, follow_symlinks=False), marker):
            os.unlink(MARKER_FILE, dir_fd=out)


def _clear(folder: int) -> None:
    """Remove everything in this run's private ``folder``, without following any link."""
    for entry in os.listdir(folder):
        if _kind(entry, folder) == "folder":
            inner = os.open(entry, _FOLDER, dir_fd=folder)
            try:
                _clear(inner)
            finally:
                os.close(inner)
            os.rmdir(entry, dir_fd=folder)
        else:
            os.unlink(entry, dir_fd=folder)


def _sync(folder: int) -> None:
    """Make the renames in ``folder`` durable (a no-op where a file system cannot sync a folder)."""
    with contextlib.suppress(OSError):
        os.fsync(folder)


def _kind(name: str, folder: int) -> Optional[str]:
    """``folder`` or ``file`` (a link is a file: moved or removed, never followed); None if absent."""
    try:
        return "folder" if stat.S_ISDIR(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode) else "file"
    except FileNotFoundError:
        return None


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _publish_order(names: Iterable[str]) -> list[str]:
    """The manifest first (once it is in, it records every new weight present), config.json last."""
    return sorted(names, key=lambda name: (name != MANIFEST_FILE, name == _CONFIG, name))


def _aside_order(names: list[str], stale: list[str]) -> list[str]:
    """config.json first, the earlier manifest last (until then it records every old weight present)."""
    others = sorted((set(names) | set(stale)) - {_CONFIG, MANIFEST_FILE})
    return [_CONFIG] * (_CONFIG in names) + others + [MANIFEST_FILE]


def _reason(error: OSError) -> str:
    return f"{error.strerror or error}: {error.filename}" if error.filename else str(error.strerror or error)
