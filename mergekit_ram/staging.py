"""Transactional output: a merge's weights appear in the output folder only when complete.

mergekit writes shards as it goes. For RAM merges the weight writer is pointed at
``OUT/.mergekit-ram-partial`` instead; the shards, the index and ``ram_statistics.json``
move into ``OUT`` (one rename each, same file system) only after the whole merge succeeded:
under ``run_merge`` after mergekit has also written the config, tokenizer and card,
elsewhere (``mergekit-pytorch``) as the last task of the graph. While a merge runs,
``OUT/MERGE_INCOMPLETE`` says so. A failed merge removes what it staged.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
from typing import Any

from mergekit.graph import Task

LOG = logging.getLogger(__name__)

STAGING_DIR = ".mergekit-ram-partial"
MARKER_FILE = "MERGE_INCOMPLETE"
_MARKER_TEXT = (
    "A mergekit-ram merge into this folder started and has not finished (or was interrupted).\n"
    "Its weights are not here yet; anything in .mergekit-ram-partial is partial. Run the merge again.\n"
)
_WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")


def staging_path(out_path: str) -> str:
    return os.path.join(out_path, STAGING_DIR)


def begin(out_path: str) -> bool:
    """Mark the output folder incomplete; True if this call created the folder."""
    created = not os.path.exists(out_path)
    os.makedirs(out_path, exist_ok=True)
    shutil.rmtree(staging_path(out_path), ignore_errors=True)
    with open(os.path.join(out_path, MARKER_FILE), "w", encoding="utf-8") as handle:
        handle.write(_MARKER_TEXT)
    return created


def publish(out_path: str) -> None:
    """Replace the folder's weights with the staged ones, then drop the marker."""
    staged = staging_path(out_path)
    old = [path for pattern in _WEIGHT_PATTERNS for path in glob.glob(os.path.join(out_path, pattern))]
    for path in old:
        os.remove(path)
    if old:
        LOG.info("replaced %d weight files of an earlier merge in %s", len(old), out_path)
    for name in sorted(os.listdir(staged)):
        os.replace(os.path.join(staged, name), os.path.join(out_path, name))
    os.rmdir(staged)
    marker = os.path.join(out_path, MARKER_FILE)
    if os.path.exists(marker):
        os.remove(marker)


def abandon(out_path: str, created: bool) -> None:
    """After a failure: remove the staged files and the marker, and the folder if it was ours."""
    shutil.rmtree(staging_path(out_path), ignore_errors=True)
    marker = os.path.join(out_path, MARKER_FILE)
    if os.path.exists(marker):
        os.remove(marker)
    if created and os.path.isdir(out_path):
        shutil.rmtree(out_path)
    LOG.error("the merge failed; no weights were written to %s", out_path)


class PublishOutput(Task[None]):
    """The last task of a graph whose caller cannot publish afterwards (mergekit-pytorch)."""

    out_path: str
    after: Task

    def arguments(self) -> dict[str, Task]:
        return {"after": self.after}

    def main_thread_only(self) -> bool:
        return True

    def priority(self) -> int:
        return -20000

    def execute(self, **_kwargs: Any) -> None:
        publish(self.out_path)
