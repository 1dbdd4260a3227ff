"""A cache of pre-pass counts, so a sweep over r, alpha or the rule reads the models once.

The key covers everything the counts depend on and nothing else: every merge task's
input sub-graph as planned (models, tensor names after slices and layer remapping,
dtype casts, tokenizer alignment settings, LoRA references), its resolved epsilon, a
fingerprint of every file read, and the versions of mergekit-ram and mergekit. r, alpha,
the rule and pinned values are not in it.

A file's fingerprint is its resolved path, size, modification time and a hash of its
first megabyte (the safetensors header) and 16 blocks spread over the rest: rewriting,
replacing or editing a model changes it without hashing whole checkpoints.

Environment: ``MERGEKIT_RAM_CACHE`` = ``on`` (default), ``off``, or ``refresh`` (recompute
and overwrite); ``MERGEKIT_RAM_CACHE_DIR`` (default ``$XDG_CACHE_HOME/mergekit-ram`` or
``~/.cache/mergekit-ram``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any, Mapping, Optional, Sequence

from mergekit.common import ImmutableMap
from mergekit.merge_methods.task_adapter import ExecuteMergeMethodTask
from pydantic import BaseModel

from mergekit_ram import __version__
from mergekit_ram.checks import task_inputs
from mergekit_ram.errors import SettingError
from mergekit_ram.stats import TensorCounts, package_versions

LOG = logging.getLogger(__name__)

MODE_VARIABLE = "MERGEKIT_RAM_CACHE"
DIRECTORY_VARIABLE = "MERGEKIT_RAM_CACHE_DIR"
_HEAD_BYTES = 1 << 20
_SAMPLES = 16
_SAMPLE_BYTES = 1 << 16


def mode() -> str:
    value = os.environ.get(MODE_VARIABLE, "on").strip().lower()
    if value not in ("on", "off", "refresh"):
        raise SettingError(f"{MODE_VARIABLE} must be on, off or refresh; got {value!r}")
    return value


def directory() -> str:
    if os.environ.get(DIRECTORY_VARIABLE):
        return os.environ[DIRECTORY_VARIABLE]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "mergekit-ram")


def fingerprint(path: str) -> str:
    """Resolved path, size, mtime, and a hash of the head and 16 sampled blocks."""
    real = os.path.realpath(path)
    status = os.stat(real)
    digest = hashlib.blake2b(digest_size=16)
    with open(real, "rb") as handle:
        digest.update(handle.read(_HEAD_BYTES))
        if status.st_size > _HEAD_BYTES:
            step = (status.st_size - _HEAD_BYTES) // _SAMPLES
            for sample in range(_SAMPLES):
                handle.seek(_HEAD_BYTES + sample * step)
                digest.update(handle.read(_SAMPLE_BYTES))
    return f"{real}:{status.st_size}:{status.st_mtime_ns}:{digest.hexdigest()}"


def describe(value: Any) -> str:
    """A canonical text for a planned task graph (pydantic models, mergekit's maps, scalars)."""
    if isinstance(value, BaseModel):
        fields = ", ".join(f"{name}={describe(getattr(value, name))}" for name in type(value).model_fields)
        return f"{type(value).__name__}({fields})"
    if isinstance(value, (Mapping, ImmutableMap)):
        items = sorted((describe(key), describe(value[key])) for key in value)
        return "{" + ", ".join(f"{key}: {item}" for key, item in items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(describe(item) for item in value) + "]"
    return repr(value)


def cache_key(merge_tasks: Sequence[ExecuteMergeMethodTask]) -> str:
    digest = hashlib.sha256()
    versions = package_versions()
    digest.update(f"mergekit-ram {__version__}; mergekit {versions['mergekit']}\n".encode())
    files: set[str] = set()
    for task in merge_tasks:
        digest.update(task.output_weight.name.encode())
        digest.update(
            repr((task.parameters["epsilon"], [str(m) for m in task.model_order], str(task.base_model))).encode()
        )
        digest.update(describe(task.gather_tensors).encode())
        files.update(file for _, file, _ in task_inputs(task) if file is not None)
    for file in sorted(files):
        digest.update(fingerprint(file).encode())
    return digest.hexdigest()


def _entry_path(key: str) -> str:
    return os.path.join(directory(), "prepass", f"{key}.json")


def load(key: str) -> Optional[list[TensorCounts]]:
    path = _entry_path(key)
    if mode() != "on" or not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            entries = json.load(handle)["tensors"]
        counts = [TensorCounts.from_dict(entry) for entry in entries]
    except (OSError, ValueError, KeyError) as error:
        LOG.warning("ignoring unreadable pre-pass cache entry %s: %s", path, error)
        return None
    LOG.info("ram_plus pre-pass: using cached counts %s (%s=refresh recomputes)", path, MODE_VARIABLE)
    return counts


def store(key: str, counts: Sequence[TensorCounts]) -> None:
    if mode() == "off":
        return
    path = _entry_path(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w", encoding="utf-8") as handle:
        json.dump({"tensors": [c.to_dict() for c in counts]}, handle)
    os.replace(partial, path)
    LOG.info("ram_plus pre-pass: counts cached in %s", path)
