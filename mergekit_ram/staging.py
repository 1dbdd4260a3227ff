"""The output transaction: a RAM merge's output folder holds its old content or the complete new merge.

A mergekit-ram merge (any of its four methods) into ``OUT`` (``run_merge``, so ``mergekit-yaml`` and every stage of
``mergekit-multi``; and ``mergekit-pytorch``) runs inside ``output_transaction(OUT)``: mergekit
writes into a staging folder, published into ``OUT`` once the merge is complete. The threat model
is in docs/reliability.md. Besides the user's files, ``OUT`` holds:

    .mergekit-ram-partial/<name>/       mergekit's output folder (<name>: OUT's, the card's title)
    .mergekit-ram-partial/publish.json  the journal, written once <name>/ is complete
    MERGE_INCOMPLETE                    only while files move into OUT
    .mergekit-ram-manifest.json         published with the merge: the files it wrote

Invariants, each held by tests/test_transaction.py (T) or tests/test_output.py (O):

1. Untrusted state. A name read from OUT (journal, manifest, mergekit's ``*.index.json``) is used
   only if it is a plain file name (``files.plain_name``) of the kind expected; files are read
   bounded, without blocking or following a link; anything else is ignored with a warning, and
   a link, file or folder in place of one of the names above is refused in one line. [T: crafted]
2. Nothing outside OUT. Every operation is relative to a descriptor of OUT or of the staging
   folder, with a plain name; a link is moved or removed as a link, never followed. [T: crafted]
3. Only ours is removed: what this merge wrote, a file of the same name it replaces, or a weight
   file an earlier merge wrote and recorded (manifest, mergekit's index). A folder is removed only
   when empty: OUT and its parents only if this merge created them. [T, O: user files]
4. One writer: an ``flock`` on OUT itself, which nothing inside OUT can remove; a merge whose OUT
   was removed or replaced meanwhile publishes and removes nothing there. [O: one writer]
5. Old or new. Until publishing, OUT holds its old files. Every catchable signal whose default
   action ends the process, and SIGINT, is held while this module changes files and acted on
   after; elsewhere it unwinds the merge and is re-sent, so the process ends as the signal says.
   [T: every signal at every operation]
6. Roll forward. Only SIGKILL, a crash, a power cut or a failed call can stop publishing half-way:
   MERGE_INCOMPLETE and the journal stay, and the next RAM merge into OUT completes that publish
   (its files were complete) before it starts, with the routine that publishes. [T: recovery]
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import json
import logging
import os
import signal
import stat
import threading
from typing import Any, Iterable, Iterator, Optional

from mergekit_ram._version import __version__
from mergekit_ram.errors import RamError
from mergekit_ram.files import UnreadableFile, plain_name, read_json, write_atomically

LOG = logging.getLogger(__name__)

STAGING_DIR = ".mergekit-ram-partial"
JOURNAL_FILE = "publish.json"
MARKER_FILE = "MERGE_INCOMPLETE"
MANIFEST_FILE = ".mergekit-ram-manifest.json"
#: Leaves OUT first and comes back last: without it no loader takes a half-published folder for a model.
_CONFIG = "config.json"
_WEIGHTS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json")
#: The names transformers (and ``mergekit-multi --lazy``) look for first.
_LOADER_NAMES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MARKER_TEXT = (
    "A mergekit-ram merge (merge_method ram, ram_plus, ram_ties or ram_unique) was publishing into this\n"
    "folder and did not finish: the process was killed (SIGKILL, out of memory, power loss), or a file\n"
    "operation failed, while it moved its files in. Until it is cleared, this folder holds a mix of its\n"
    "earlier files and the new merge's, without config.json, so no loader takes it for a model. The new\n"
    "merge's files were complete: run any mergekit-ram merge into this folder and it first completes the\n"
    "interrupted publish (from .mergekit-ram-partial/), then removes this file. A merge with another\n"
    "method (linear, ties, ...) does not. Deleting this file and .mergekit-ram-partial/ yourself leaves\n"
    "the mix as it is.\n"
)
#: Signals that end a process by default and can be caught. SIGSEGV, SIGBUS, SIGFPE and SIGILL mean
#: the process itself crashed: like SIGKILL, they leave the marker for the next merge.
_NOT_ENDING = "SIGKILL SIGSTOP SIGSEGV SIGBUS SIGFPE SIGILL SIGCHLD SIGCONT SIGTSTP SIGTTIN SIGTTOU SIGURG SIGWINCH"
ENDING_SIGNALS = tuple(sorted(set(signal.valid_signals()) - {getattr(signal, n, 0) for n in _NOT_ENDING.split()}))


class OutputBusyError(RamError, RuntimeError):
    """Another merge holds the output folder, or took it over while this one ran."""


class OutputFolderError(RamError, RuntimeError):
    """The output folder cannot be prepared or published into; the message says why and what to do."""


class Interrupted(BaseException):
    """A signal whose default action ends the process: unwinds the merge like Ctrl-C, then is re-sent."""

    def __init__(self, number: int) -> None:
        super().__init__(f"signal {number}")
        self.number = number


@contextlib.contextmanager
def output_transaction(out_path: str) -> Iterator[str]:
    """Yield the folder mergekit is to write into; publish it into ``out_path`` once the body returns.

    An exception or a signal before that leaves ``out_path`` as it was (invariant 5).
    """
    with _Signals() as signals:
        folder = _Folder(out_path)
        try:
            with signals.held():
                folder.begin()
            yield os.path.join(out_path, STAGING_DIR, folder.name)
            with signals.held():
                folder.publish()
        except BaseException:
            signals.unwinding = True
            raise
        finally:
            with signals.held():
                folder.end()


class _Folder:
    """One merge's hold on OUT: a locked descriptor of it and of its staging folder."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.name = os.path.basename(os.path.abspath(path)) or "merged"
        self.created: list[str] = []  # OUT and the parents this merge made, innermost first
        self.out = self.staging = -1
        self.locked = False
        self.journal = False  # a journal (this merge's, or a killed one's being completed) must stay

    def begin(self) -> None:
        """Create (if missing), open and lock OUT; complete an interrupted publish; make the staging folder."""
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
            with contextlib.suppress(FileExistsError):
                os.mkdir(STAGING_DIR, dir_fd=self.out)
            self.staging = _open_own(STAGING_DIR, self.out, self.path)
            self.journal = True
            _complete_interrupted(self.out, self.staging, self.path)
            self.journal = False
            os.mkdir(self.name, dir_fd=self.staging)
        except OSError as error:
            raise OutputFolderError(f"cannot prepare {self.path} for the merge ({_reason(error)})") from None

    def holds(self) -> bool:
        """Whether this merge locked OUT and the path still names that folder (invariant 4)."""
        with contextlib.suppress(OSError):
            return self.locked and _same(os.fstat(self.out), os.stat(self.path))
        return False

    def publish(self) -> None:
        """Journal the staged files, then move them into OUT (invariant 6)."""
        if not self.holds():
            raise OutputBusyError(
                f"{self.path} was removed or replaced while this merge ran, so another merge may be writing "
                "there: nothing was published; rerun the merge"
            )
        try:
            staged = _open_own(self.name, self.staging, self.path)
            try:
                names = _publish_order({*os.listdir(staged), MANIFEST_FILE})
            finally:
                os.close(staged)
            weights = [name for name in names if _is_weight(name)]
            manifest = {"written_by": f"mergekit-ram {__version__}", "files": names, "weights": weights}
            write_atomically(f"{self.name}/{MANIFEST_FILE}", json.dumps(manifest, indent=1) + "\n", dir_fd=self.staging)
            stale = sorted(set(recorded_weights(self.out, self.path)) - set(names))
            write_atomically(JOURNAL_FILE, json.dumps({"folder": self.name, "stale": stale}), dir_fd=self.staging)
            self.journal = True
            _sync(self.staging)
            _write_marker(self.out)
            _move_in(self.out, self.staging, self.name, stale)
            os.unlink(MARKER_FILE, dir_fd=self.out)
            os.unlink(JOURNAL_FILE, dir_fd=self.staging)
            self.journal = False
        except OSError as error:
            marked = _kind(MARKER_FILE, self.out) == "file"
            state = f"it is marked {MARKER_FILE}: fix that and rerun the merge, which completes it first"
            raise OutputFolderError(
                f"could not publish into {self.path} ({_reason(error)}); "
                + (state if marked else "it holds what it held before")
            ) from None
        _log_published(self.out, self.path, names, stale)

    def end(self) -> None:
        """Remove this merge's staging folder, and the folders it created while they are empty; let go of OUT."""
        holds, opened = self.holds(), self.out >= 0
        if holds and self.staging >= 0 and not self.journal:
            _clear(self.staging)
        if holds:
            with contextlib.suppress(OSError):  # only when empty: a journal stays for the next merge
                os.rmdir(STAGING_DIR, dir_fd=self.out)
        elif opened:
            LOG.warning("left %s in place: %s was replaced while this merge ran", STAGING_DIR, self.path)
        for handle in (self.staging, self.out):
            if handle >= 0:
                os.close(handle)
        self.staging = self.out = -1
        for path in self.created if holds or not opened else ():
            with contextlib.suppress(OSError):
                os.rmdir(path)
                LOG.info("removed %s, which the merge had created", path)


def _lock(out: int, out_path: str) -> None:
    """An exclusive ``flock`` on OUT, refused at once if another merge holds it (invariant 4)."""
    try:
        fcntl.flock(out, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise OutputBusyError(
            f"another merge is writing to {out_path}; wait for it to finish or choose another output folder"
        ) from None
    except OSError as error:  # a file system without locks
        LOG.warning("could not lock %s (%s): nothing keeps a second merge out of it", out_path, error.strerror)


def _open_own(name: str, parent: int, out_path: str) -> int:
    """A descriptor of this module's folder ``name`` in ``parent``; refused if a link or a file has its name."""
    try:
        return os.open(name, _FOLDER, dir_fd=parent)
    except OSError as error:
        if error.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise OutputFolderError(
            f"{os.path.join(out_path, name)} is not a folder mergekit-ram made ({error.strerror}): it is "
            "mergekit-ram's own name; remove it or choose another output folder"
        ) from None


def _complete_interrupted(out: int, staging: int, out_path: str) -> None:
    """Complete the publish a killed merge left (its journal), then drop whatever else earlier merges staged."""
    journal = _read_state(JOURNAL_FILE, staging, os.path.join(out_path, STAGING_DIR))
    if isinstance(journal, dict) and plain_name(journal.get("folder")) and isinstance(journal.get("stale"), list):
        stale = [name for name in journal["stale"] if plain_name(name) and _is_weight(name)]
        _move_in(out, staging, journal["folder"], stale)
        LOG.warning("completed the publish of an interrupted merge into %s", out_path)
    _clear(staging)
    for name in (MARKER_FILE, MANIFEST_FILE):
        if _kind(name, out) == "folder":
            raise OutputFolderError(
                f"{os.path.join(out_path, name)} is a folder: it is mergekit-ram's own name; remove it or choose "
                "another output folder"
            )
    if _kind(MARKER_FILE, out) == "file":
        os.unlink(MARKER_FILE, dir_fd=out)


def _move_in(out: int, staging: int, folder: str, stale: list[str]) -> None:
    """Publish what a journal names, or finish publishing it: config.json (if replaced) and the stale
    weights leave OUT first, then every staged file still waiting moves in, config.json last."""
    if _kind(folder, staging) != "folder":
        return
    staged = os.open(folder, _FOLDER, dir_fd=staging)
    try:
        waiting = _publish_order(os.listdir(staged))
        for name in ([_CONFIG] if _CONFIG in waiting else []) + stale:
            if _kind(name, out) == "file":
                os.unlink(name, dir_fd=out)
        for name in waiting:
            os.replace(name, name, src_dir_fd=staged, dst_dir_fd=out)
        _sync(out)
    finally:
        os.close(staged)


def _clear(folder: int) -> None:
    """Remove everything in this module's ``folder``, without following any link."""
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


def recorded_weights(out: int, out_path: str) -> list[str]:
    """Weight files of OUT that an earlier merge wrote and recorded (invariant 3): the weights its
    manifest lists, and each ``*.index.json`` mergekit wrote (its metadata names ``mergekit_version``)
    with the shards of its ``weight_map``. Names that are not plain weight file names are ignored."""
    found: dict[str, str] = {}
    manifest = _read_state(MANIFEST_FILE, out, out_path)
    if isinstance(manifest, dict) and isinstance(manifest.get("weights"), list):
        found.update((name, MANIFEST_FILE) for name in manifest["weights"] if isinstance(name, str))
    for name in sorted(os.listdir(out)):
        index = _read_state(name, out, out_path) if name.endswith(".index.json") else None
        index = _as_dict(index)
        shards = index.get("weight_map")
        if isinstance(shards, dict) and "mergekit_version" in _as_dict(index.get("metadata")):
            found[name] = name
            found.update((shard, name) for shard in shards.values() if isinstance(shard, str))
    for source in sorted({source for name, source in found.items() if not (plain_name(name) and _is_weight(name))}):
        LOG.warning("ignored names in %s that are not weight files of that folder", os.path.join(out_path, source))
    return sorted(name for name in found if plain_name(name) and _is_weight(name) and _kind(name, out) == "file")


def _log_published(out: int, out_path: str, names: list[str], stale: list[str]) -> None:
    """Say what was published and removed; warn about loader entry points left in place."""
    removed = f"; removed {', '.join(stale)}, which an earlier merge recorded" if stale else ""
    LOG.info("published %s into %s%s", ", ".join(names), out_path, removed)
    for name in _LOADER_NAMES:
        if name not in names and _kind(name, out) is not None:
            LOG.warning(
                "kept %s in %s: this merge did not write it and no earlier merge recorded it, but a loader may "
                "read it instead of the new weights; remove it if it belongs to an old model",
                name,
                out_path,
            )


def _read_state(name: str, folder: int, where: str) -> Any:
    """The JSON in this module's (or mergekit's) file ``name`` of ``folder``; None, warned, if unusable."""
    try:
        return read_json(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except UnreadableFile as reason:
        LOG.warning("ignored %s: %s", os.path.join(where, name), reason)
        return None


def _write_marker(out: int) -> None:
    """MERGE_INCOMPLETE, created new (never through a link); a kill mid-write still leaves a marker."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    handle = os.open(MARKER_FILE, flags, 0o644, dir_fd=out)
    try:
        os.write(handle, MARKER_TEXT.encode())
        os.fsync(handle)
    finally:
        os.close(handle)


def _as_dict(value: Any) -> dict[Any, Any]:
    return value if isinstance(value, dict) else {}


def _sync(folder: int) -> None:
    """Make the renames in ``folder`` durable (a no-op where a file system cannot sync a folder)."""
    with contextlib.suppress(OSError):
        os.fsync(folder)


def _kind(name: str, folder: int) -> Optional[str]:
    """``folder`` or ``file`` (a link counts as a file: it is moved or removed, never followed); None if absent."""
    try:
        return "folder" if stat.S_ISDIR(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode) else "file"
    except FileNotFoundError:
        return None


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _is_weight(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in _WEIGHTS)


def _publish_order(names: Iterable[str]) -> list[str]:
    """Sorted, config.json last."""
    return sorted(names, key=lambda name: (name == _CONFIG, name))


def _reason(error: OSError) -> str:
    return f"{error.strerror or error}: {error.filename}" if error.filename else str(error.strerror or error)


class _Signals:
    """Every catchable signal that ends a process by default, and SIGINT, for one transaction's life.

    Outside ``held()`` the first one unwinds the merge: SIGINT raises KeyboardInterrupt (as Python's
    own handler does), any other ``Interrupted``, re-sent at the end with its default action, so the
    process ends as it would have. Inside ``held()``, and once the merge is unwinding, signals wait
    and are delivered afterwards. Signals with another handler (ignored, or a program's own) are
    left alone; Python runs handlers in the main thread only, so elsewhere nothing changes.
    """

    def __init__(self) -> None:
        self.previous: dict[int, Any] = {}
        self.pending: list[int] = []
        self.depth = 0
        self.unwinding = False

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for number in ENDING_SIGNALS:
                if signal.getsignal(number) in (signal.SIG_DFL, signal.default_int_handler):
                    self.previous[number] = signal.signal(number, self._arrived)
        return self

    def _arrived(self, number: int, _frame: Any) -> None:
        if self.depth or self.unwinding:
            self.pending.append(number)
        else:
            self._act(number)

    def _act(self, number: int) -> None:
        self.unwinding = True
        if self.previous[number] is signal.default_int_handler:
            raise KeyboardInterrupt
        raise Interrupted(number)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if self.pending and not self.depth and not self.unwinding:
            self._act(self.pending.pop(0))

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        for number in ([error.number] if isinstance(error, Interrupted) else []) + self.pending:
            os.kill(os.getpid(), number)
        if isinstance(error, Interrupted):
            raise SystemExit(128 + error.number) from None
