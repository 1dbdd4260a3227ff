"""The output transaction: a RAM merge's output folder holds the old state or the complete new merge.

A ``ram`` / ``ram_plus`` merge into ``OUT`` (``run_merge``, so ``mergekit-yaml`` and every
stage of ``mergekit-multi``; and ``mergekit-pytorch``) runs inside ``output_transaction``:

1. Refused before anything is read when ``OUT`` is an input's folder (``refuse_input_folder``).
2. An OS lock (``fcntl.flock`` on ``OUT/.mergekit-ram.lock``): a second merge into ``OUT`` is
   refused at once; the kernel drops the lock when a process dies, so it is never stale.
3. A journal a killed run left is rolled back (or forward when it had finished), then
   ``OUT/MERGE_INCOMPLETE`` is written and mergekit is given ``OUT/.mergekit-ram-partial/new/NAME``
   as its output folder (``NAME`` = the basename of ``OUT``, so the card is titled as before):
   weights, index, ``config.json``, tokenizer, card, ``mergekit_config.yml`` and
   ``ram_statistics.json`` are all written there.
4. Publish: a journal first, then one rename per file (the file it replaces moves to a backup
   folder first); ``config.json`` leaves first and comes back last, so a half-published folder
   never looks like a model to ``transformers`` or ``mergekit-multi --lazy``. Removed are only
   weight files an earlier merge recorded (its ``*.index.json`` written by mergekit, or
   ``.mergekit-ram-manifest.json``) that the new merge does not write.
5. SIGINT and SIGTERM are held while the journal, the renames and the clean-up run, and
   delivered right after; outside those, SIGTERM raises like Ctrl-C, so any failure or signal
   rolls back to the old state. Only SIGKILL or a power cut can leave ``MERGE_INCOMPLETE``;
   the next RAM merge into the folder clears it.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import logging
import os
import shutil
import signal
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

from mergekit_ram._version import __version__

try:  # POSIX; elsewhere merges run unlocked
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

from mergekit_ram.errors import InputError, RamError
from mergekit_ram.files import write_atomically

LOG = logging.getLogger(__name__)

STAGING_DIR = ".mergekit-ram-partial"
MARKER_FILE = "MERGE_INCOMPLETE"
LOCK_FILE = ".mergekit-ram.lock"
MANIFEST_FILE = ".mergekit-ram-manifest.json"
_NEW = "new"
_OLD = "old"
_JOURNAL = "journal.json"
#: Leaves first and returns last: without it no loader takes the folder for a model.
_COMMIT_LAST = "config.json"
_WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json")
#: The names transformers (and ``mergekit-multi --lazy``) look for first.
_LOADER_NAMES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
MARKER_TEXT = (
    "A mergekit-ram merge (merge_method ram or ram_plus) into this folder started and did not finish:\n"
    "the process was killed (SIGKILL, out of memory, power loss) before it could clean up.\n"
    "Until it is cleared, treat this folder's model files as unreliable: they are the folder's\n"
    "earlier content or, if the kill came while the merge was being published, a mix.\n"
    "Run the same merge again into this folder: it restores or completes the interrupted publish,\n"
    "merges, and removes this file. A later merge with another method (linear, ties, ...) does\n"
    "not remove this file. Deleting it (and .mergekit-ram-partial/) yourself is safe once you\n"
    "know what the folder holds, e.g. after another merge into it finished.\n"
)


class OutputBusyError(RamError, RuntimeError):
    """Another merge holds the output folder's lock."""


class Terminated(BaseException):
    """SIGTERM during a RAM merge: unwinds like Ctrl-C, so the output folder is rolled back."""


def refuse_input_folder(out_path: str, inputs: Iterable[tuple[str, str]]) -> None:
    """Refuse an output folder that is one of the inputs' folders, however it is spelled.

    ``inputs``: (the input as the recipe names it, its folder). ``os.path.samefile`` compares
    device and inode, so symbolic links, ``..`` and trailing slashes all resolve.
    """
    if not os.path.isdir(out_path):
        return
    for label, folder in inputs:
        if os.path.isdir(folder) and os.path.samefile(out_path, folder):
            raise InputError(
                f"the output folder {out_path} is the folder of the input {label}: the merge would overwrite "
                "that input; choose another output folder"
            )


@dataclass
class Transaction:
    """One RAM merge's hold on its output folder (see the module docstring)."""

    out_path: str
    staged: str
    created: bool
    lock: Optional[int]
    done: bool = False

    @property
    def root(self) -> str:
        return staging_path(self.out_path)

    def commit(self) -> None:
        """Publish the staged merge, then drop the marker, the staging folder and the lock file."""
        with signals_held():
            publish(self.out_path, self.staged)
            self.done = True
            _remove(os.path.join(self.out_path, MARKER_FILE))
            shutil.rmtree(self.root, ignore_errors=True)

    def abandon(self) -> None:
        """After a failure or a signal: the folder as it was before (or gone, if the merge made it)."""
        with signals_held():
            if self.done:
                return
            roll_back(self.out_path)
            shutil.rmtree(self.root, ignore_errors=True)
            _remove(os.path.join(self.out_path, MARKER_FILE))
            if self.created:
                shutil.rmtree(self.out_path, ignore_errors=True)
                LOG.error("the merge failed or was interrupted; removed %s, which it had created", self.out_path)
            else:
                LOG.error("the merge failed or was interrupted; %s holds what it held before", self.out_path)

    def release(self) -> None:
        """Remove the lock file while still holding the lock, then let go (see ``_lock``)."""
        if self.lock is None:
            return
        with signals_held():
            _remove(os.path.join(self.out_path, LOCK_FILE))
            os.close(self.lock)
            self.lock = None


def staging_path(out_path: str) -> str:
    return os.path.join(out_path, STAGING_DIR)


@contextlib.contextmanager
def output_transaction(out_path: str) -> Iterator[str]:
    """Yield the folder mergekit is to write into; publish it into ``out_path`` on success.

    On any exception, KeyboardInterrupt or SIGTERM the folder is rolled back and the
    exception re-raised (SIGTERM: re-sent once the folder is clean, so the exit status says so).
    """
    transaction: Optional[Transaction] = None
    try:
        with _sigterm_raises():
            with signals_held():  # a signal held here arrives once ``transaction`` is set
                transaction = begin(out_path)
            yield transaction.staged
            transaction.commit()
    except Terminated:
        if transaction is not None:
            transaction.abandon()
            transaction.release()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        raise SystemExit(128 + signal.SIGTERM) from None
    except BaseException:
        if transaction is not None:
            transaction.abandon()
        raise
    finally:
        if transaction is not None:
            transaction.release()


def begin(out_path: str) -> Transaction:
    """Lock ``out_path`` (created if missing), recover a killed run's journal, mark it incomplete."""
    created = _make_folder(out_path)
    lock = _lock(out_path)
    name = os.path.basename(out_path)
    staged = os.path.join(staging_path(out_path), _NEW, "" if name in (".", "..") else name)
    transaction = Transaction(out_path=out_path, staged=staged, created=created, lock=lock)
    try:
        recover(out_path)
        shutil.rmtree(transaction.root, ignore_errors=True)
        write_atomically(os.path.join(out_path, MARKER_FILE), MARKER_TEXT)
        os.makedirs(staged)
    except BaseException:
        transaction.abandon()
        transaction.release()
        raise
    return transaction


def _make_folder(out_path: str) -> bool:
    """Create ``out_path``; True if this call made it (``os.mkdir`` decides races)."""
    parent = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(out_path)
    except FileExistsError:
        if not os.path.isdir(out_path):
            raise
        return False
    return True


def _lock(out_path: str) -> Optional[int]:
    """An exclusive ``flock`` on ``OUT/.mergekit-ram.lock``, refused at once if held.

    The holder removes the file before letting go, so a waiter that locked the removed
    file sees that the path now names another file (or none) and tries again.
    """
    if fcntl is None:  # pragma: no cover
        return None
    path = os.path.join(out_path, LOCK_FILE)
    for _attempt in range(100):
        handle = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(handle)
            if error.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            raise OutputBusyError(
                f"another merge is writing to {out_path} (it holds {path}); wait for it to finish or choose "
                "another output folder"
            ) from None
        opened = os.fstat(handle)
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        if current is not None and (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino):
            return handle
        os.close(handle)
    raise OutputBusyError(f"could not lock {path}: other merges keep replacing it; try again")


# Publishing ---------------------------------------------------------------------------


def publish(out_path: str, staged: str) -> None:
    """Move every staged file into ``out_path``, journalled so that it can be undone.

    Files the new merge writes replace those of the same name (moved to a backup first);
    weight files an earlier merge recorded and the new one does not write are removed;
    everything else stays.
    """
    root = staging_path(out_path)
    backup = os.path.join(root, _OLD)
    names = _publish_order({*os.listdir(staged), MANIFEST_FILE})
    manifest = {"written_by": f"mergekit-ram {__version__}", "files": names, "weights": _weights(names)}
    write_atomically(os.path.join(staged, MANIFEST_FILE), json.dumps(manifest, indent=1) + "\n")
    stale = sorted(set(recorded_weights(out_path)) - set(names))
    replaced = [name for name in names if os.path.lexists(os.path.join(out_path, name))]
    journal = {"staged": os.path.relpath(staged, root), "names": names, "replaced": replaced, "stale": stale}
    os.makedirs(backup, exist_ok=True)
    write_atomically(os.path.join(root, _JOURNAL), json.dumps(journal))
    try:
        first = [_COMMIT_LAST] if _COMMIT_LAST in replaced else []
        for name in first + stale + [n for n in replaced if n != _COMMIT_LAST]:
            os.replace(os.path.join(out_path, name), os.path.join(backup, name))
        for name in names:
            os.replace(os.path.join(staged, name), os.path.join(out_path, name))
        _sync_folder(out_path)
    except BaseException:
        roll_back(out_path)
        raise
    _remove(os.path.join(root, _JOURNAL))
    _log_published(out_path, replaced, stale)


def _publish_order(names: Iterable[str]) -> list[str]:
    """Sorted, ``config.json`` last."""
    return sorted(names, key=lambda name: (name == _COMMIT_LAST, name))


def _is_weight(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in _WEIGHT_PATTERNS)


def _weights(names: Iterable[str]) -> list[str]:
    return [name for name in names if _is_weight(name)]


def recorded_weights(out_path: str) -> list[str]:
    """Weight files in ``out_path`` that an earlier merge wrote and recorded.

    Recorded are: the weights listed in the plugin's manifest, and each ``*.index.json``
    that mergekit wrote (its metadata names ``mergekit_version``) with the shards in its
    ``weight_map``. Only plain names of files directly in ``out_path`` count.
    """
    found: set[str] = set()
    manifest = _read_json(os.path.join(out_path, MANIFEST_FILE))
    if isinstance(manifest, dict) and isinstance(manifest.get("weights"), list):
        found.update(name for name in manifest["weights"] if isinstance(name, str))
    for name in os.listdir(out_path):
        if not name.endswith(".index.json"):
            continue
        index = _read_json(os.path.join(out_path, name))
        if not (isinstance(index, dict) and isinstance(index.get("metadata"), dict)):
            continue
        if "mergekit_version" not in index["metadata"] or not isinstance(index.get("weight_map"), dict):
            continue
        found.add(name)
        found.update(shard for shard in index["weight_map"].values() if isinstance(shard, str))
    return sorted(
        name
        for name in found
        if name == os.path.basename(name)
        and not name.startswith(".")
        and _is_weight(name)
        and os.path.isfile(os.path.join(out_path, name))
    )


def _log_published(out_path: str, replaced: list[str], stale: list[str]) -> None:
    """Say what was replaced and removed; warn about old loader entry points left in place."""
    if replaced:
        LOG.info("published the merge into %s; replaced its earlier %s", out_path, ", ".join(replaced))
    if stale:
        LOG.info(
            "removed %s from %s: weight files an earlier merge recorded (index or manifest) that this merge "
            "does not write",
            ", ".join(stale),
            out_path,
        )
    kept = [name for name in _LOADER_NAMES if os.path.exists(os.path.join(out_path, name))]
    manifest = _read_json(os.path.join(out_path, MANIFEST_FILE)) or {}
    ours = set(manifest.get("files", [])) if isinstance(manifest, dict) else set()
    for name in kept:
        if name not in ours:
            LOG.warning(
                "kept %s in %s: this merge did not write it and no earlier merge recorded it, but a loader may "
                "read it instead of the new weights; remove it if it belongs to an old model",
                name,
                out_path,
            )


def recover(out_path: str) -> None:
    """Finish what a killed publish left: forward if every file had moved, else back."""
    root = staging_path(out_path)
    journal = _read_journal(root)
    if journal is None:
        return
    staged = os.path.join(root, journal["staged"])
    moved = all(
        not os.path.lexists(os.path.join(staged, name)) and os.path.lexists(os.path.join(out_path, name))
        for name in journal["names"]
    )
    if moved:
        LOG.warning("completed the publish of an interrupted merge into %s (it had moved every file)", out_path)
        _remove(os.path.join(root, _JOURNAL))
    else:
        roll_back(out_path)
        LOG.warning("rolled %s back to its content before an interrupted merge", out_path)


def roll_back(out_path: str) -> None:
    """Undo a journalled publish: new files back to staging, old files back from the backup."""
    root = staging_path(out_path)
    journal = _read_journal(root)
    if journal is None:
        return
    staged = os.path.join(root, journal["staged"])
    backup = os.path.join(root, _OLD)
    os.makedirs(staged, exist_ok=True)
    for name in reversed(journal["names"]):
        target = os.path.join(out_path, name)
        if not os.path.lexists(os.path.join(staged, name)) and os.path.lexists(target):
            if name in journal["replaced"] and not os.path.lexists(os.path.join(backup, name)):
                continue  # the old file was never moved away: it is still the one in place
            os.replace(target, os.path.join(staged, name))
    for name in journal["replaced"] + journal["stale"]:
        if os.path.lexists(os.path.join(backup, name)):
            os.replace(os.path.join(backup, name), os.path.join(out_path, name))
    _sync_folder(out_path)
    _remove(os.path.join(root, _JOURNAL))


def _read_journal(root: str) -> Optional[dict[str, Any]]:
    journal = _read_json(os.path.join(root, _JOURNAL))
    if not isinstance(journal, dict):
        return None
    return journal


# Signals ------------------------------------------------------------------------------


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM (main thread only) and deliver the first one afterwards.

    Other threads cannot receive Python signal handlers, so nothing is needed there.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {
        number: handler
        for number in (signal.SIGINT, signal.SIGTERM)
        if (handler := signal.getsignal(number)) is not None
    }

    def hold(number: int, _frame: Any) -> None:
        pending.append(number)

    for number in previous:
        signal.signal(number, hold)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if pending:
            os.kill(os.getpid(), pending[0])


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` (when it would otherwise kill the process on the spot)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) not in (
        signal.SIG_DFL,
        None,
    ):
        yield
        return

    def terminate(_number: int, _frame: Any) -> None:
        raise Terminated()

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


# Files --------------------------------------------------------------------------------


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _sync_folder(path: str) -> None:
    """Make the renames in ``path`` durable (a no-op where folders cannot be opened)."""
    with contextlib.suppress(OSError):
        handle = os.open(path, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)
