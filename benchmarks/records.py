"""The results files of every benchmark: plain JSON documents, read and written only here.

A run's results are one dictionary, saved with its ``kind`` (``methods``, ``kernel``,
``outofcore``, ``inmemory``, ``agents``) and the schema version of its layout; files from
before the version field have the layout of version 1. The layout is the one the stored files
under ``benchmarks/results/`` and ``benchmarks/agents/results/`` have; readers take the keys
they need. This module imports nothing else of the benchmarks: they all import it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

SCHEMA_VERSION = 1
#: Where the performance runs write their results (``optimisations/`` and ``history/`` hold older ones).
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def write_json(path: Union[str, Path], payload: Any, indent: Optional[int] = 2) -> Path:
    """``payload`` as JSON and a final newline at ``path``, the folder created if need be."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=indent, default=str) + "\n", encoding="utf-8")
    return path


def read_json(path: Union[str, Path]) -> Any:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def save_result(path: Union[str, Path], kind: str, result: dict[str, Any], indent: Optional[int] = 2) -> Path:
    """Write one run's ``result`` with its ``kind`` and the schema version."""
    return write_json(path, {"kind": kind, "schema": SCHEMA_VERSION, **result}, indent)


def load_result(path: Union[str, Path]) -> dict[str, Any]:
    """The results stored at ``path``, with ``source`` (the file's name) added; refuses another schema."""
    data = read_json(path)
    if data.get("schema", 1) != SCHEMA_VERSION:
        raise ValueError(f"{path}: results schema {data['schema']}, this code reads {SCHEMA_VERSION}")
    return {**data, "source": Path(path).name}
