"""The machine's resources running out in a RAM merge (too many open files, a file size limit, a full disk,
no memory): mergekit's own cause once, in one line with its fix (``errors.resource_message``), and the output
folder as it was. The limits are lowered for the real mergekit-yaml only, in a new interpreter each
(``run_process``): the limits are the subject."""

from __future__ import annotations

import errno
import os
import resource
import subprocess
from dataclasses import dataclass

import pytest

from mergekit_ram.errors import RESOURCE_FAILURES, resource_message
from tests.conftest import ModelSet, run_process, script, write_recipe

USER_FILES = {"notes.txt": b"the user's own file\n"}


@dataclass(frozen=True)
class LimitedRun:
    """A mergekit-yaml run of a RAM recipe under a lowered resource limit, into a folder holding a user's file."""

    completed: subprocess.CompletedProcess
    limit: int
    out: str


def limited_run(models: ModelSet, root: str, which: int, limits: range) -> LimitedRun:
    """mergekit-yaml with the resource ``which`` lowered to each of ``limits`` in turn, until mergekit gets as
    far as merging (its loader warms up, or it succeeds): below that it fails earlier."""
    os.makedirs(root, exist_ok=True)
    recipe = write_recipe(os.path.join(root, "r.yml"), models.recipe("ram_plus"))
    out = os.path.join(root, "out")
    for limit in limits:
        os.makedirs(out, exist_ok=True)
        for name, data in USER_FILES.items():
            with open(os.path.join(out, name), "wb") as handle:
                handle.write(data)

        completed = run_process([script("mergekit-yaml"), recipe, out], limits={which: limit})
        if completed.returncode == 0 or "Warmup loader cache" in completed.stderr:
            return LimitedRun(completed, limit, out)
    raise AssertionError(f"mergekit-yaml did not start under any of the limits {limits}")


def assert_as_it_was(out: str) -> None:
    """The user's file alone, byte for byte: no ``.mergekit-ram*`` entry (an empty staging folder included)."""
    assert sorted(os.listdir(out)) == sorted(USER_FILES)
    for name, data in USER_FILES.items():
        with open(os.path.join(out, name), "rb") as handle:
            assert handle.read() == data


@pytest.mark.process
def test_a_limit_run_into_leaves_the_folder_as_it_was(bf16_models: ModelSet, tmp_path) -> None:
    """Too many open files: safetensors cannot open a model. ``ulimit -f`` below the weights' size (about 39 KB):
    mergekit's write fails with EFBIG, as a full disk gives ENOSPC. The library's own error ends the run, naming
    the system's text (its exception is no OSError, so nothing guesses its errno from its text); the folder holds
    the user's file alone."""
    # the search starts just below where mergekit gets as far as merging here (9; 6 to 8 stop earlier)
    run = limited_run(bf16_models, str(tmp_path / "nofile"), resource.RLIMIT_NOFILE, range(8, 24))
    assert run.completed.returncode == 1 and os.strerror(errno.EMFILE) in run.completed.stderr.strip().splitlines()[-1]
    assert_as_it_was(run.out)
    run = limited_run(bf16_models, str(tmp_path / "fsize"), resource.RLIMIT_FSIZE, range(20_000, 20_001))
    assert run.completed.returncode == 1 and os.strerror(errno.EFBIG) in run.completed.stderr.strip().splitlines()[-1]
    assert_as_it_was(run.out)


@pytest.mark.parametrize("code", sorted(RESOURCE_FAILURES), ids=lambda code: errno.errorcode[code])
def test_every_resource_failure_is_told_from_its_errno(code: int) -> None:
    """As an OSError (the file named), and at the root of a chain whose clean-up failed alike; a chain whose first
    error is another, or another exception quoting the system's text, keeps its traceback (None): no guessing."""
    what, fix = RESOURCE_FAILURES[code]
    name = errno.errorcode[code]
    failure = OSError(code, os.strerror(code), "/models/a/model.safetensors")
    assert (
        resource_message(failure, "merging")
        == f"{what} (errno {name}) while merging (/models/a/model.safetensors): {fix}"
    )
    quoted = RuntimeError(f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})")
    assert resource_message(quoted, "probing") is None
    try:
        try:
            raise failure
        except OSError:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE)) from None  # the clean-up failing after it
    except OSError as cleanup:
        assert resource_message(cleanup, "merging") == resource_message(failure, "merging")
    try:
        try:
            raise KeyError("model.norm.weight")
        except KeyError:
            raise failure  # noqa: B904 - a clean-up failing after another error
    except OSError as cleanup:
        assert resource_message(cleanup, "merging") is None


def test_memory_errors_and_other_errors() -> None:
    assert resource_message(MemoryError(), "merging") == (
        "out of memory (errno ENOMEM) while merging: free memory, or use a machine with more"
    )
    assert resource_message(ValueError("a model path does not exist"), "merging") is None
    assert resource_message(OSError(errno.ENOENT, os.strerror(errno.ENOENT), "/x"), "merging") is None
