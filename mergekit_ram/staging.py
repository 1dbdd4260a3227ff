"""The output transaction: a RAM merge's output folder holds its old content or the complete new merge.

A RAM merge into ``OUT`` runs inside ``output_transaction(OUT)``, a write into a merged folder outside a merge (the
card tool) inside ``folder_writer(OUT)`` or ``replace_files``. While one runs, ``OUT`` holds besides the user's files:

    .mergekit-ram.lock               the one-writer lock, removed when the merge (or the card tool) ends
    .mergekit-ram-<random>/          this run's private folder, made by this process (mode 0700)
        staged/<name of OUT>/        where mergekit writes (the card's title is this name)
        replaced/                    OUT's files the publish replaces, until it has succeeded
    MERGE_INCOMPLETE                 only while files move into OUT
    .mergekit-ram-manifest.json      published with the merge: its files and its weights' sizes

What is guarded and what is not is docs/reliability.md's "Threat model". Invariants, each held by
tests/test_transaction.py (T) or tests/test_output.py (O):

1. No replay: what another process left is named in one warning, never completed, restored or undone. [T, O]
2. A private folder per run, of a fresh unpredictable name, written by its plain path. [T, O]
3. Nothing outside OUT: every operation is relative to a descriptor of OUT or of the private folder, with a plain
   name; the manifest is read with one size cap. [T]
4. Only ours is removed: what this run wrote, files of the names it replaces, and weights an earlier merge recorded
   whose size still matches; folders only when empty, OUT and its parents only if this run made them. [T, O]
5. One writer: an exclusive ``flock`` on ``LOCK_FILE``, opened, locked, then its name checked to still name it (else
   again); removed, still locked, at the end. A run whose OUT or lock file is gone at the publish publishes
   nothing. [T, O]
6. Old or new: the ending signals are held while files move; an error while publishing is undone. Only SIGKILL, a
   crash or a power cut stops a publish half-way: OUT is then marked MERGE_INCOMPLETE (never config.json beside a
   mix) and the next merge writes its own complete result. [T]
7. A sticky OUT (shared like /tmp, where another user's file could stop a rename) is refused before it is changed.
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
from typing import Any, Collection, Iterator, NoReturn, Optional

from mergekit_ram._version import __version__
from mergekit_ram.errors import RamError
from mergekit_ram.files import UnreadableFile, plain_name, read_json, write_new
from mergekit_ram.signals import HeldSignals

LOG = logging.getLogger(__name__)

#: The prefix of every private folder (and of the earlier design's ``.mergekit-ram-partial``).
PRIVATE_PREFIX = ".mergekit-ram-"
MARKER_FILE = "MERGE_INCOMPLETE"
MANIFEST_FILE = ".mergekit-ram-manifest.json"
#: Outside PRIVATE_PREFIX: a lock file a killed run left tells nothing (its private folder does) and stops nothing.
LOCK_FILE = ".mergekit-ram.lock"
#: The private folder's entries: OUT's name (which may be any) only inside staged/.
_STAGED, _REPLACED = "staged", "replaced"
#: Leaves OUT first and comes back last: without it no loader takes a half-published folder for a model.
_CONFIG = "config.json"
_WEIGHT = re.compile(r"(?s:.*)\.(safetensors|bin)(\.index\.json)?")
#: What transformers and mergekit load as a model's weights: a kept one may shadow the new merge.
_LOADED = re.compile(r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?")
_OUT = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_FOLDER = _OUT | os.O_NOFOLLOW
_LOCK = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
#: Tries at taking the lock while its file is replaced between the open and the lock (by another merge's end).
_LOCK_TRIES = 20
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
    folder = _Folder(out_path)
    with _held(folder) as signals:
        yield folder.staged_path()
        folder.record()  # reads every weight: a signal meanwhile leaves OUT as it was
        with signals.held():
            folder.publish()
        folder.report()


def replace_files(out_path: str, texts: dict[str, str], expected: Optional[dict[str, Optional[str]]] = None) -> None:
    """Replace the plain files ``texts`` names in OUT, all or nothing, as a merge publishes: under its lock (refused
    as ``folder_writer`` refuses), written into a private folder, then moved in with the ending signals held, under
    the marker, undone on an error. The manifest stays as it is. Ctrl-C unwinds as ``KeyboardInterrupt``.
    ``expected``: the texts (None: absent) the files had when read; if one changed meanwhile, nothing is written."""
    folder = _Folder(out_path, writer=True)
    with _held(folder) as signals:
        for name, text in (expected or {}).items():
            if _bytes_of(name, folder.out) != (None if text is None else text.encode("utf-8")):
                raise OutputFolderError(
                    f"{os.path.join(out_path, name)} changed while this ran (another merge or check): nothing "
                    "was written; run it again"
                )
        try:
            for name, text in texts.items():
                write_new(os.path.join(_STAGED, folder.name, name), text, dir_fd=folder.private)
        except OSError as error:
            raise OutputFolderError(
                f"could not write into {out_path} ({_reason(error)}); it holds what it held before"
            ) from None
        folder.names = sorted(texts)
        with signals.held():
            folder.publish()


@contextlib.contextmanager
def _held(folder: _Folder) -> Iterator[HeldSignals]:
    """One run's hold on OUT: begun and ended with the ending signals held; the first signal between unwinds it."""
    with HeldSignals() as signals:
        try:
            with signals.held():
                folder.begin()
            yield signals
        except BaseException:
            signals.unwinding = True
            raise
        finally:
            with signals.held():
                folder.end()


@contextlib.contextmanager
def folder_writer(out_path: str) -> Iterator[int]:
    """OUT opened and locked as a merge locks it, for a write outside a merge (the card tool): ``OutputBusyError``
    while a merge holds it, ``OutputFolderError`` while a killed or running merge's files are there or where this
    user may not write OUT. Yields OUT's descriptor; write only plain names through it."""
    try:
        out = os.open(out_path, _OUT)
    except OSError as error:
        raise OutputFolderError(f"cannot open {out_path} ({_reason(error)})") from None
    lock = -1
    try:
        try:
            lock = _take_lock(out, out_path)
        except OSError as error:
            raise OutputFolderError(f"cannot change {out_path} ({_reason(error)})") from None
        if left := _left_over(out):
            _refuse_left_over(out_path, left)
        yield out
    finally:
        if lock >= 0:
            _release_lock(out, lock, out_path)
        os.close(out)


class _Folder:
    """One run's hold on OUT: a descriptor of it, of its locked lock file, and of the private folder this run made."""

    def __init__(self, path: str, writer: bool = False) -> None:
        self.path = path
        self.writer = writer  # a write outside a merge: OUT must exist, and what a killed merge left refuses it
        self.name = os.path.basename(os.path.abspath(path)) or "merged"
        self.created: list[str] = []  # OUT and the parents this run made, innermost first
        self.out = self.lock = self.private = -1
        self.private_name = ""
        self.moves: list[tuple[int, int, str]] = []  # this publish's renames: (from folder, to folder, name)
        self.names: list[str] = []  # the files to publish, in order (``record``)
        self.stale: list[str] = []  # the earlier merge's weights to remove, as it left them (``record``)
        self.keep = False  # a publish that could not be undone: its private folder holds OUT's old files
        self.spare: list[int] = []  # descriptors held for the clean-up, which needs 3 at most: after EMFILE too

    def begin(self) -> None:
        """Create (if missing), open and lock OUT (refused where it is sticky); report what earlier runs left (a
        writer's refusal); make the private folder."""
        path = os.path.abspath(self.path)
        while not os.path.isdir(path) and not self.writer:
            self.created.append(path)
            path = os.path.dirname(path)
        try:
            if self.created:
                os.makedirs(self.path, exist_ok=True)
            self.out = os.open(self.path, _OUT)
            if os.fstat(self.out).st_mode & stat.S_ISVTX:
                raise OutputFolderError(
                    f"{self.path} is shared with the sticky bit (as /tmp is), where another user's file could stop "
                    "the merge: merge into a folder of your own inside it"
                )
            self.lock = _take_lock(self.out, self.path)
            self.spare = [os.dup(self.out) for _ in range(3)]
            for name in (MARKER_FILE, MANIFEST_FILE):
                if _kind(name, self.out) == "folder":
                    raise OutputFolderError(
                        f"{os.path.join(self.path, name)} is a folder: it is mergekit-ram's own name; remove it or "
                        "choose another output folder"
                    )
            if (left := _left_over(self.out)) and self.writer:
                _refuse_left_over(self.path, left)
            if left:
                LOG.warning(
                    "%s holds %s, left by a mergekit-ram merge that did not finish (killed, or its clean-up failed): "
                    "this merge neither uses nor removes them; remove them once you have checked them (a hidden "
                    "folder may hold that merge's files and files the folder held before)",
                    self.path,
                    ", ".join(left),
                )
            while True:  # a fresh unpredictable name, made by this process
                name = PRIVATE_PREFIX + secrets.token_hex(8)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=self.out)
                    break
            self.private_name = name
            self.private = os.open(self.private_name, _FOLDER, dir_fd=self.out)
            for folder in (_REPLACED, _STAGED, os.path.join(_STAGED, self.name)):
                os.mkdir(folder, 0o700, dir_fd=self.private)
        except OSError as error:
            if self.writer:
                raise OutputFolderError(f"cannot change {self.path} ({_reason(error)})") from None
            raise OutputFolderError(f"cannot prepare {self.path} for the merge ({_reason(error)})") from None

    def staged_path(self) -> str:
        """The path mergekit writes into (invariant 2)."""
        return os.path.join(self.path, self.private_name, _STAGED, self.name)

    def holds(self) -> bool:
        """Whether the path still names the folder this run opened (invariant 5)."""
        with contextlib.suppress(OSError):
            return self.out >= 0 and os.path.samestat(os.fstat(self.out), os.stat(self.path))
        return False

    def record(self) -> None:
        """The manifest written beside the staged files, the earlier merge's weights to remove found (invariant 4)."""
        staged = -1
        try:
            staged = os.open(os.path.join(_STAGED, self.name), _FOLDER, dir_fd=self.private)
            # The manifest first (once in, it records every new weight present), config.json last.
            names = {*os.listdir(staged), MANIFEST_FILE}
            self.names = sorted(names, key=lambda name: (name != MANIFEST_FILE, name == _CONFIG, name))
            weights = {name: os.stat(name, dir_fd=staged) for name in self.names if _WEIGHT.fullmatch(name)}
            manifest = {
                "written_by": f"mergekit-ram {__version__}",
                "files": self.names,
                "weights": {name: {"size": found.st_size} for name, found in weights.items()},
            }
            write_new(MANIFEST_FILE, json.dumps(manifest, indent=1), dir_fd=staged)
            self.stale = _recorded_weights(self.out, self.path, skip=set(self.names))
        except OSError as error:
            raise OutputFolderError(
                f"could not publish into {self.path} ({_reason(error)}); it holds what it held before"
            ) from None
        finally:
            if staged >= 0:
                os.close(staged)

    def publish(self) -> None:
        """Move the staged files into OUT under a marker; on an error, move everything back (invariant 6)."""
        if not self.holds() or not _is_lock(self.out, self.lock):
            what = f"{self.path}" if not self.holds() else f"the lock file {os.path.join(self.path, LOCK_FILE)}"
            raise OutputBusyError(
                f"{what} was removed or replaced while this merge ran, so another merge may be writing there: "
                "nothing was published; rerun the merge"
            )
        handles: list[int] = []
        marker: Optional[os.stat_result] = None
        names, stale = self.names, self.stale
        marked = _kind(MARKER_FILE, self.out) == "file"  # by a killed run: an undo leaves this run's (the same text)
        try:
            for name in (_REPLACED, os.path.join(_STAGED, self.name)):
                handles.append(os.open(name, _FOLDER, dir_fd=self.private))
            replaced, staged = handles
            marker = write_new(MARKER_FILE, MARKER_TEXT, dir_fd=self.private)
            os.rename(MARKER_FILE, MARKER_FILE, src_dir_fd=self.private, dst_dir_fd=self.out)  # not undone: see _undo
            _sync(self.out)
            # config.json first, the earlier manifest last (until then it records every old weight present).
            others = sorted((set(names) | set(stale)) - {_CONFIG, MANIFEST_FILE})
            for name in [_CONFIG] * (_CONFIG in names) + others + [MANIFEST_FILE] * (MANIFEST_FILE in names):
                if _kind(name, self.out) == "file":
                    self._move(self.out, replaced, name)
            for name in names:
                self._move(staged, self.out, name)
            _sync(self.out)
            _remove_marker(self.out, marker)
        except BaseException as error:
            self._undo(None if marked else marker)
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

    def report(self) -> None:
        """What the merge's publish did, and the weights it kept that a loader may read instead."""
        names, stale = self.names, self.stale
        removed = f"; removed {', '.join(stale)}, which an earlier merge recorded" if stale else ""
        LOG.info("published %s into %s%s", ", ".join(names), self.path, removed)
        if loaded := sorted(name for name in os.listdir(self.out) if _LOADED.fullmatch(name) and name not in names):
            LOG.warning(
                "kept %s in %s: this merge did not write them and no earlier mergekit-ram merge recorded them as they "
                "are, but a loader may read them instead of the new weights; remove them if they belong to an old "
                "model",
                ", ".join(loaded),
                self.path,
            )

    def _move(self, source: int, target: int, name: str) -> None:
        os.rename(name, name, src_dir_fd=source, dst_dir_fd=target)
        self.moves.append((source, target, name))

    def _undo(self, marker: Optional[os.stat_result]) -> None:
        """This publish's renames backwards, then this run's ``marker`` removed if still there; without it (OUT was
        marked before) this run's stays."""
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
        """Remove this run's private folder, lock file and the empty folders it made; let go of OUT. Never raises."""
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
        if self.lock >= 0:
            _release_lock(self.out, self.lock, self.path)
        for handle in (self.private, self.out):
            if handle >= 0:
                with contextlib.suppress(OSError):
                    os.close(handle)
        for path in self.created if holds or not opened else ():
            with contextlib.suppress(OSError):
                os.rmdir(path)
                LOG.info("removed %s, which the merge had created", path)


def _take_lock(out: int, out_path: str) -> int:
    """OUT's lock file, opened read-write and locked, then checked to be what its name still names, else again
    (invariant 5); ``OutputBusyError`` at once while another merge holds it."""
    for _ in range(_LOCK_TRIES):
        lock = os.open(LOCK_FILE, _LOCK, 0o600, dir_fd=out)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            raise OutputBusyError(
                f"another merge is writing to {out_path}; wait for it to finish or choose another output folder"
            ) from None
        except OSError as error:  # a file system without locks
            LOG.warning("could not lock %s (%s): nothing keeps a second merge out of it", out_path, _reason(error))
        if _is_lock(out, lock):
            return lock
        os.close(lock)  # removed or replaced since it was opened: by the end of the merge that held it
    raise OutputBusyError(
        f"{os.path.join(out_path, LOCK_FILE)} is replaced again and again: something else is changing {out_path}; "
        "stop it, or choose another output folder"
    )


def _is_lock(out: int, lock: int) -> bool:
    """Whether OUT's lock file is still the file ``lock`` has open."""
    with contextlib.suppress(OSError):
        return lock >= 0 and os.path.samestat(os.stat(LOCK_FILE, dir_fd=out, follow_symlinks=False), os.fstat(lock))
    return False


def _release_lock(out: int, lock: int, out_path: str) -> None:
    """Remove the lock file while still locked (one who opened it meanwhile finds it replaced and tries again), then
    unlock it."""
    try:
        if _is_lock(out, lock):
            os.unlink(LOCK_FILE, dir_fd=out)
    except FileNotFoundError:
        pass
    except OSError as error:
        LOG.warning("could not remove %s (%s): remove it", os.path.join(out_path, LOCK_FILE), _reason(error))
    finally:
        os.close(lock)


def _refuse_left_over(out_path: str, left: list[str]) -> NoReturn:
    """The refusal of a write outside a merge (which holds the lock: no merge runs) over what a killed one left;
    its advice clears it: merging again removes the marker, the user a private folder."""
    if MARKER_FILE in left:
        raise OutputFolderError(
            f"{out_path} is marked {MARKER_FILE}: a merge into it was killed while publishing; merge into it again "
            "before changing its files"
        )
    paths = ", ".join(os.path.join(out_path, name) for name in left)
    raise OutputFolderError(
        f"{out_path} holds {paths}, left by a merge that was killed (the files it wrote or moved aside): remove "
        f"{'them' if len(left) > 1 else 'it'} once you have what you need, then run this again"
    )


def _left_over(out: int) -> list[str]:
    """What a killed or running merge leaves in OUT: its marker and private folder (not the manifest)."""
    found = (name for name in os.listdir(out) if name == MARKER_FILE or name.startswith(PRIVATE_PREFIX))
    return sorted(name for name in found if name != MANIFEST_FILE)


def _manifest(out: int, out_path: str) -> dict[str, Any]:
    """OUT's manifest, read bounded; empty if absent, not an object or unreadable (said in a warning)."""
    try:
        manifest = read_json(MANIFEST_FILE, dir_fd=out, follow_symlinks=False)
    except FileNotFoundError:
        return {}
    except UnreadableFile as reason:
        LOG.warning("ignored %s: %s", os.path.join(out_path, MANIFEST_FILE), reason)
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _recorded_weights(out: int, out_path: str, skip: Collection[str]) -> list[str]:
    """Plain weight names OUT's manifest records whose size is still as recorded (invariant 4), but for ``skip``
    (replaced anyway). An error but a missing file is raised: nothing is published."""
    weights = _manifest(out, out_path).get("weights")
    found = []
    for name, recorded in weights.items() if isinstance(weights, dict) else ():
        if name in skip or not (plain_name(name) and _WEIGHT.fullmatch(name)) or not isinstance(recorded, dict):
            continue
        with contextlib.suppress(FileNotFoundError):
            status = os.stat(name, dir_fd=out, follow_symlinks=False)
            if stat.S_ISREG(status.st_mode) and status.st_size == recorded.get("size"):
                found.append(name)
    return sorted(found)


def _bytes_of(name: str, folder: int) -> Optional[bytes]:
    """A file's bytes; None where it is absent."""
    try:
        handle = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=folder)
    except FileNotFoundError:
        return None
    with open(handle, "rb") as stream:
        return stream.read()


def _remove_marker(out: int, marker: os.stat_result) -> None:
    """Remove this run's marker: only the file it wrote, not one put there since."""
    with contextlib.suppress(FileNotFoundError):
        if os.path.samestat(os.stat(MARKER_FILE, dir_fd=out, follow_symlinks=False), marker):
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


def _reason(error: OSError) -> str:
    return f"{error.strerror or error}: {error.filename}" if error.filename else str(error.strerror or error)
