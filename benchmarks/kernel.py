"""The kernel alone: time and scratch bytes per element, ours against mergekit's built-in RAM.

For N = 2, 3, 5 fine-tunes of one bfloat16 tensor (16M elements by default; agents drawn as
in the synthetic models, densities 3.2%, 46.2%, 54.3%, then 25% and 40%): ours
(``mergekit_ram.kernel.merge_tensors``, merging only for RAM and RAM+, merging and counting as
``ram`` runs it, and ``count_overlaps``, the ``ram_plus`` pre-pass, on torch's thread count as
the merge methods call them), and mergekit 0.1.5's built-in ``ram`` and ``ramplus_tl`` through
``mergekit.merge_methods.api.merge_tensors`` (taken from ``mergekit.merge_methods.ram``: the
plugin replaces the registry's ``ram``). Time: the median of several rounds of all calls in
turns, after a warm-up; the speed-up is taken on the fastest call, the least disturbed. Scratch:
:func:`benchmarks.memory.peak_allocated_bytes` of a call on one thread, output included.

Also the start-up hook: ``python -X importtime -c pass`` cumulative microseconds of the
``mergekit_ram`` modules the ``.pth`` line imports, median of several interpreters.

    python -m benchmarks.kernel --numel 16M --repeats 5
"""

from __future__ import annotations

import argparse
import logging
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from benchmarks.common import (
    child_env,
    fmt_count,
    machine_info,
    median,
    parse_size,
    plugin_checkout,
    setup_logging,
    use_plugin,
)
from benchmarks.memory import peak_allocated_bytes
from benchmarks.models import PAPER_DENSITIES, AgentDraw, base_chunk, overlap_for
from benchmarks.records import RESULTS_DIR, save_result
from mergekit_ram.stats.render import markdown_table

LOG = logging.getLogger(__name__)

EPSILON = 1e-5
DENSITIES = (*PAPER_DENSITIES, 0.25, 0.40)
#: lambda values of the paper's three agents (rho about 14.9 / 1.45 / 1.11), then two more.
LAMBDAS = (1.2, 1.145, 1.11, 1.05, 1.08)
HOOK_MODULES = ("mergekit_ram._autoload", "mergekit_ram")
#: The kernel the speed-ups are taken against.
BUILTIN_REFERENCE = "built-in ram (bf16)"


def kernel_inputs(numel: int, n: int, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A bfloat16 base and n sparse fine-tunes with the benchmark densities."""
    generator = torch.Generator().manual_seed(seed)
    base = base_chunk("kernel.weight", numel, generator)
    finetunes, _ = AgentDraw(overlap_for("independent", DENSITIES[:n])).draw(base, generator)
    return base, finetunes


def measure(labelled: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Seconds per call: one warm-up each, then ``repeats`` rounds of every call in turn (all see the same load)."""
    for function in labelled.values():
        function()
    times: dict[str, list[float]] = {label: [] for label in labelled}
    for _ in range(repeats):
        for label, function in labelled.items():
            started = time.perf_counter()
            function()
            times[label].append(time.perf_counter() - started)
    return times


def variants(base: torch.Tensor, finetunes: list[torch.Tensor]) -> dict[str, Callable[[], Any]]:
    """Every kernel call measured, by label."""
    from mergekit.merge_methods.api import merge_tensors as mergekit_merge
    from mergekit.merge_methods.ram import ram_merge as builtin_ram
    from mergekit.merge_methods.ram import ramplus_tl_merge as builtin_ramplus_tl

    from mergekit_ram.kernel import count_overlaps, merge_tensors

    n = len(finetunes)
    lambdas = list(LAMBDAS[:n])
    inputs = [base, *finetunes]

    return {
        "ours: merge, RAM": lambda: merge_tensors(base, finetunes, EPSILON),
        "ours: merge, RAM+ (lambdas)": lambda: merge_tensors(base, finetunes, EPSILON, lambdas),
        "ours: merge + count (ram)": lambda: merge_tensors(base, finetunes, EPSILON, count=True),
        "ours: count only (pre-pass)": lambda: count_overlaps(base, finetunes, EPSILON),
        BUILTIN_REFERENCE: lambda: mergekit_merge(inputs, builtin_ram, base_index=0),
        "built-in ram (dtype float32)": lambda: mergekit_merge(inputs, builtin_ram, base_index=0, dtype=torch.float32),
        "built-in ramplus_tl (bf16)": lambda: mergekit_merge(inputs, builtin_ramplus_tl, base_index=0),
    }


def benchmark_kernel(numel: int, ns: Sequence[int] = (2, 3, 5), repeats: int = 5) -> list[dict[str, Any]]:
    rows = []
    for n in ns:
        base, finetunes = kernel_inputs(numel, n)
        calls = variants(base, finetunes)
        for label, times in measure(calls, repeats).items():
            seconds = median(times)
            scratch, _ = peak_allocated_bytes(calls[label], threads=1)
            rows.append(
                {
                    "n": n,
                    "variant": label,
                    "numel": numel,
                    "seconds": seconds,
                    "min_seconds": min(times),
                    "times": times,
                    "ns_per_element": seconds / numel * 1e9,
                    "scratch_bytes": scratch,
                    "scratch_bytes_per_element": scratch / numel,
                }
            )
            LOG.info("N=%d %-30s %8.1f ms  %5.1f B/element", n, label, seconds * 1e3, scratch / numel)
        del base, finetunes
    return rows


IMPORTTIME_LINE = re.compile(r"import time:\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(.+)$")


def startup_cost(repeats: int = 20, env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Cumulative import microseconds of the hook's modules at interpreter start, medians over interpreters."""
    samples: dict[str, list[int]] = {module: [] for module in HOOK_MODULES}
    walls = []
    for _ in range(repeats):
        started = time.perf_counter()
        command = [sys.executable, "-X", "importtime", "-c", "pass"]
        result = subprocess.run(command, capture_output=True, text=True, env=env or child_env(), cwd="/")
        walls.append(time.perf_counter() - started)
        for line in result.stderr.splitlines():
            match = IMPORTTIME_LINE.match(line)
            if match and match.group(3).strip() in samples:
                samples[match.group(3).strip()].append(int(match.group(2)))
    return {
        "repeats": repeats,
        "cumulative_us": {module: median(values) if values else None for module, values in samples.items()},
        "interpreter_wall_s": median(walls),
    }


def kernel_table(rows: Sequence[dict[str, Any]]) -> str:
    """A row per kernel, for each N: ns per element (median), speed-up on the built-in ram (fastest calls),
    scratch bytes per element."""
    ns = sorted({row["n"] for row in rows})
    builtin = {row["n"]: row["min_seconds"] for row in rows if row["variant"] == BUILTIN_REFERENCE}
    by_variant: dict[str, dict[int, dict[str, Any]]] = {}
    for row in rows:
        by_variant.setdefault(row["variant"], {})[row["n"]] = row
    table = []
    for variant, by_n in by_variant.items():
        cells = [variant]
        for n in ns:
            if n not in by_n:
                cells += ["", "", ""]
                continue
            row = by_n[n]
            speed = f"{builtin[n] / row['min_seconds']:.2f}x" if n in builtin else ""
            cells += [f"{row['ns_per_element']:.2f}", speed, f"{row['scratch_bytes_per_element']:.1f}"]
        table.append(cells)
    headers = ["kernel"] + [
        f"N = {n}: {what}" for n in ns for what in ("ns / element", "x built-in", "scratch B / el.")
    ]
    return markdown_table([headers, *table], "l")


def startup_line(startup: dict[str, Any]) -> str:
    modules = ", ".join(
        f"`{module}` " + ("not imported" if us is None else f"{us / 1000:.2f} ms")
        for module, us in startup["cumulative_us"].items()
    )
    return (
        f"Start-up hook, cumulative import time (median of {startup['repeats']} interpreters): {modules}; "
        f"a whole `python -c pass` takes {startup['interpreter_wall_s'] * 1000:.0f} ms."
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", default="16M", help="elements per tensor (default 16M)")
    parser.add_argument("--n", default="2,3,5", help="numbers of fine-tuned models")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--startup-repeats", type=int, default=20)
    parser.add_argument(
        "--plugin", type=plugin_checkout, help="checkout whose mergekit_ram is measured (default: this one)"
    )
    parser.add_argument("--json", type=Path, help="results file (default benchmarks/results/kernel.json)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    use_plugin(__spec__.name, args.plugin, sys.argv[1:] if argv is None else argv)
    numel = parse_size(args.numel)
    env = child_env(args.plugin)
    import mergekit_ram

    result: dict[str, Any] = {
        "machine": machine_info(env),
        "kernel_module": str(Path(mergekit_ram.__file__).parent),
        "numel": numel,
        "kernel": benchmark_kernel(numel, [int(n) for n in args.n.split(",")], args.repeats),
        "startup": startup_cost(args.startup_repeats, env),
    }
    save_result(args.json or RESULTS_DIR / "kernel.json", "kernel", result)
    print(f"kernel alone, {fmt_count(numel)} bfloat16 elements, torch threads {torch.get_num_threads()}")
    print(f"{kernel_table(result['kernel'])}\n\n{startup_line(result['startup'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
