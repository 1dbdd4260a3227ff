"""Writes the measured tables into ``docs/performance.md``.

The page is prose with generated blocks between ``<!-- BEGIN generated:NAME -->`` and
``<!-- END generated:NAME -->``; only those are rewritten, from the results files directly
under ``benchmarks/results/`` (the older runs in ``optimisations/`` and ``history/`` are quoted
by hand on the page).

    python -m benchmarks.report
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from benchmarks.common import REPO_ROOT, fmt_bytes, fmt_count, machine_line
from benchmarks.kernel import kernel_table, startup_line
from benchmarks.methods import heading, methods_table, targets_table
from benchmarks.records import RESULTS_DIR, load_result
from benchmarks.scale import inmemory_table, limit_text, outofcore_table

DOC_PATH = REPO_ROOT / "docs" / "performance.md"
BLOCK = re.compile(r"(<!-- BEGIN generated:(?P<name>[\w-]+) -->\n).*?(<!-- END generated:(?P=name) -->)", re.S)
Results = dict[str, list[dict[str, Any]]]


def load_results(results_dir: Path = RESULTS_DIR) -> Results:
    """The results files by kind, each kind ordered by model size (the kernel runs by date)."""
    by_kind: Results = {"methods": [], "kernel": [], "outofcore": [], "inmemory": []}
    for path in sorted(results_dir.glob("*.json")):
        result = load_result(path)
        by_kind[result["kind"]].append(result)
    for kind, results in by_kind.items():
        results.sort(
            key=lambda r: (
                (r["machine"]["time"],)
                if kind == "kernel"
                else (r["models"]["parameters"], r.get("options", {}).get("background_processes", 0))
            )
        )
    return by_kind


def methods_block(results: Results) -> str:
    if not results["methods"]:
        return "_Not measured yet: `python -m benchmarks.run --size 120m`._"
    runs = "\n".join(f"- {heading(result)}" for result in results["methods"])
    return f"{runs}\n\n{methods_table(results['methods'])}"


def kernel_block(results: Results) -> str:
    if not results["kernel"]:
        return "_Not measured yet: `python -m benchmarks.kernel`._"
    result = results["kernel"][-1]
    return (
        f"{fmt_count(result['numel'])} bfloat16 elements per tensor, {result['machine']['torch_threads']} torch "
        f"threads; {machine_line(result['machine'])}.\n\n{kernel_table(result['kernel'])}\n\n"
        + startup_line(result["startup"])
    )


def scale_block(results: Results) -> str:
    parts = []
    for result in results["outofcore"]:
        parts.append(f"Out-of-core `ram_plus`; {machine_line(result['machine'])}:\n\n{outofcore_table(result)}")
    if results["inmemory"]:
        runs = []
        for result in results["inmemory"]:
            cap = result["options"].get("cap_bytes")
            under = f", both under an RLIMIT_DATA cap of {fmt_bytes(cap)}" if cap else ""
            runs.append(f"- `{result['size']}`{under}; {machine_line(result['machine'])}. {limit_text(result)}")
        table = inmemory_table(results["inmemory"])
        parts.append(f"Whole-model-in-memory float32 against ours:\n\n{table}\n\n" + "\n".join(runs))
    return "\n\n".join(parts) or "_Not measured yet: `python -m benchmarks.scale inmemory --size 120m`._"


GENERATORS: dict[str, Callable[[Results], str]] = {
    "targets": lambda results: targets_table(results["methods"]),
    "methods": methods_block,
    "kernel": kernel_block,
    "scale": scale_block,
}


def write_doc(doc: Path = DOC_PATH, results_dir: Path = RESULTS_DIR) -> Path:
    """Rewrite every generated block of ``doc``; a block of an unknown name is an error."""
    results = load_results(results_dir)

    def replace(match: re.Match) -> str:
        return f"{match.group(1)}{GENERATORS[match.group('name')](results)}\n{match.group(3)}"

    doc.write_text(BLOCK.sub(replace, doc.read_text(encoding="utf-8")), encoding="utf-8")
    return doc


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--doc", type=Path, default=DOC_PATH)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    print(f"wrote {write_doc(args.doc, args.results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
