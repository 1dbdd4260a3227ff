"""The suite's own rules: the process audit (tests/conftest.py) refuses a test that starts a process unmarked, but
not a library that starts one while it is imported (matplotlib's font cache on a fresh machine)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest


def test_an_unmarked_test_that_starts_a_process_is_refused() -> None:
    with pytest.raises(RuntimeError, match="starts a process .*mark it @pytest.mark.process"):
        subprocess.run(["true"], check=True)


def test_a_library_starting_a_process_while_imported_is_not_the_tests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "starts_at_import.py").write_text(
        "import subprocess\nSTATUS = subprocess.run(['true']).returncode\n", encoding="utf-8"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "starts_at_import", raising=False)
    assert importlib.import_module("starts_at_import").STATUS == 0
