"""A cache of pre-pass counts, so a sweep over r, alpha or the rule reads the models once (docs/method.md,
"The cache": what the key covers). It lives in the user's cache folder, made with mode 0700 (a cache shared between
users is out of the threat model, docs/reliability.md). It only helps: any problem is one warning."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence

from mergekit_ram._version import __version__
from mergekit_ram.checks import INDEX_SUFFIX, HeaderCache, mergekit_weights, planned_numel
from mergekit_ram.errors import SettingError
from mergekit_ram.files import UnreadableFile, read_json, write_atomically
from mergekit_ram.planned import PlannedTensor
from mergekit_ram.stats.arithmetic import package_versions
from mergekit_ram.stats.data import TensorCounts
from mergekit_ram.stats.schema import counts_from_dict, counts_to_dict

LOG = logging.getLogger(__name__)

MODE_VARIABLE = "MERGEKIT_RAM_CACHE"
DIRECTORY_VARIABLE = "MERGEKIT_RAM_CACHE_DIR"
ENTRIES_DIR = "prepass"
_HEAD_BYTES, _SAMPLES, _SAMPLE_BYTES = 1 << 20, 16, 1 << 16
#: Entries hold one item per planned merge task, null where the task has no counts.
_FORMAT = "entries aligned with merge tasks, with a checksum (3)"
_ADVICE = f"{MODE_VARIABLE}=off skips the cache"


@dataclass(frozen=True)
class CacheSettings:
    """``mode`` on, off or refresh; the folder."""

    mode: str
    directory: str

    @classmethod
    def from_environment(cls, environment: Mapping[str, str] = os.environ) -> CacheSettings:
        mode = environment.get(MODE_VARIABLE, "on").strip().lower()
        if mode not in ("on", "off", "refresh"):
            raise SettingError(f"{MODE_VARIABLE} must be on, off or refresh; got {mode!r}")
        root = environment.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        directory = environment.get(DIRECTORY_VARIABLE) or os.path.join(root, "mergekit-ram")
        return cls(mode, directory)

    def entry(self, key: str) -> str:
        return os.path.join(self.directory, ENTRIES_DIR, f"{key}.json")


def fingerprint(path: str) -> str:
    """Resolved path, device, inode, size, mtime, ctime, and a hash of the head and 16 sampled blocks."""
    real = os.path.realpath(path)
    status = os.stat(real)
    identity = f"{status.st_dev}:{status.st_ino}:{status.st_size}:{status.st_mtime_ns}:{status.st_ctime_ns}"
    digest = hashlib.blake2b(digest_size=16)
    with open(real, "rb") as handle:
        digest.update(handle.read(_HEAD_BYTES))
        if status.st_size > _HEAD_BYTES:
            step = (status.st_size - _HEAD_BYTES) // _SAMPLES
            for sample in range(_SAMPLES):
                handle.seek(_HEAD_BYTES + sample * step)
                digest.update(handle.read(_SAMPLE_BYTES))
    return f"{real}:{identity}:{digest.hexdigest()}"


def cache_key(planned: Sequence[PlannedTensor]) -> str:
    """What the counts depend on: each tensor's name, epsilon, models, inputs, sub-graph, files and indexes."""
    digest = hashlib.sha256()
    versions = package_versions()
    digest.update(f"mergekit-ram {__version__}; mergekit {versions['mergekit']}; {_FORMAT}\n".encode())
    files: set[str] = set()
    for tensor in planned:
        digest.update(tensor.name.encode())
        digest.update(repr((tensor.epsilon, tensor.base, tensor.finetunes, tensor.inputs)).encode())
        digest.update(tensor.graph.encode())
        files.update(source.file for source in tensor.inputs if source.file is not None)
    indexes = {mergekit_weights(folder) for folder in {os.path.dirname(file) for file in files}}
    files.update(index for index in indexes if index is not None and index.endswith(INDEX_SUFFIX))
    for file in sorted(files):
        digest.update(fingerprint(file).encode())
    return digest.hexdigest()


def checksum(tensors: Any) -> str:
    """The sha256 of an entry's counts as canonical JSON."""
    return hashlib.sha256(json.dumps(tensors, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@contextlib.contextmanager
def opened(settings: CacheSettings, planned: Sequence[PlannedTensor]) -> Iterator[Optional[CacheEntry]]:
    """The merge's entry, its folder made (mode 0700) if missing; None where the merge goes on without the cache."""
    entry = None
    if settings.mode != "off":
        path = settings.entry(cache_key(planned))
        try:
            for folder in (settings.directory, os.path.dirname(path)):
                os.makedirs(folder, mode=0o700, exist_ok=True)
            entry = CacheEntry(settings.mode, path)
        except OSError as error:
            _not_written(path, error)
    yield entry


def _not_written(path: str, error: OSError) -> None:
    LOG.warning("could not write the pre-pass cache entry %s (%s); the merge goes on (%s)", path, error, _ADVICE)


@dataclass(frozen=True)
class CacheEntry:
    """One merge's entry file."""

    mode: str
    path: str

    def load(self, planned: Sequence[PlannedTensor], headers: HeaderCache) -> Optional[list[Optional[TensorCounts]]]:
        """The cached counts (one per merge task), or None: missing, refreshing, or unusable."""
        if self.mode != "on":
            return None
        try:
            data = read_json(self.path)
        except FileNotFoundError:
            return None
        except (OSError, UnreadableFile) as error:
            LOG.warning("ignoring unreadable pre-pass cache entry %s (%s); %s", self.path, error, _ADVICE)
            return None
        try:
            counts = _matching_counts(data, planned, headers)
        except (TypeError, ValueError, KeyError, AttributeError) as error:
            LOG.warning("ignoring pre-pass cache entry %s: %s; counting afresh (%s)", self.path, error, _ADVICE)
            return None
        LOG.info("ram_plus pre-pass: using cached counts %s (%s=refresh recomputes)", self.path, MODE_VARIABLE)
        return counts

    def store(self, counts: Sequence[Optional[TensorCounts]]) -> None:
        """Write the entry atomically; a cache that cannot be written is skipped with a warning."""
        tensors = [None if c is None else counts_to_dict(c) for c in counts]
        text = json.dumps({"tensors": tensors, "sha256": checksum(tensors)})
        try:
            write_atomically(self.path, text)
        except OSError as error:
            return _not_written(self.path, error)
        LOG.info("ram_plus pre-pass: counts cached in %s", self.path)


def _matching_counts(data: Any, planned: Sequence[PlannedTensor], headers: HeaderCache) -> list[Optional[TensorCounts]]:
    """The entry's counts if they fit the planned merge tensor by tensor (untrusted input); ValueError otherwise."""
    if not isinstance(data, dict) or not isinstance(data.get("tensors"), list):
        raise ValueError("it is not an object with a list of tensors")
    entries = data["tensors"]
    if data.get("sha256") != checksum(entries):
        raise ValueError("its counts do not match its checksum (the entry was edited or damaged)")
    if len(entries) != len(planned):
        raise ValueError(f"it lists {len(entries)} tensors, the merge has {len(planned)}")
    return [None if entry is None else _fitting(entry, tensor, headers) for entry, tensor in zip(entries, planned)]


def _fitting(entry: Any, tensor: PlannedTensor, headers: HeaderCache) -> TensorCounts:
    """One tensor's cached counts if they fit ``tensor``; ValueError otherwise."""
    if not isinstance(entry, dict):
        raise ValueError(f"the entry for {tensor.name} is not an object")
    found = counts_from_dict(entry)
    if found.name != tensor.name:
        raise ValueError(f"it has {found.name!r} where the merge has {tensor.name!r}")
    if found.models != tensor.finetunes:
        raise ValueError(f"its models for {found.name} are not the merge's")
    numel = planned_numel(tensor, headers)
    n = len(found.models)
    if (numel is not None and found.numel != numel) or found.numel < 0:
        raise ValueError(f"its element count for {found.name} is {found.numel}, the tensor has {numel}")
    if len(found.histograms) != n or any(
        len(row) != n or min(row, default=0) < 0 or sum(row) > found.numel for row in found.histograms
    ):
        raise ValueError(f"its histograms for {found.name} do not fit {n} models and {found.numel} elements")
    return found
