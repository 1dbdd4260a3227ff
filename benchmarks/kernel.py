"""The kernel alone: time and scratch bytes per element, ours against mergekit's built-in RAM.

For N = 2, 3, 5 fine-tunes of one bfloat16 tensor (16M elements by default; agents drawn as
in the synthetic models, densities 3.2%, 46.2%, 54.3%, then 25% and 40%):

- ours: ``mergekit_ram.kernel.merge_tensors`` merging only (RAM, and RAM+ with lambdas != 1)
  and merging and counting (what ``ram`` runs, it takes its statistics during the merge), and
  ``mergekit_ram.kernel.count_overlaps`` (the ``ram_plus`` pre-pass), each on torch's thread
  count as the merge methods call them;
- mergekit 0.1.5's built-ins through ``mergekit.merge_methods.api.merge_tensors``: ``ram`` and
  ``ramplus_tl`` in the input dtype, and ``ram`` with ``dtype=float32`` (what a recipe needs
  for exact results). The objects come from ``mergekit.merge_methods.ram`` directly: the
  plugin replaces the registry's ``ram``.

Scratch is the peak of torch's CPU allocations during a call made with one thread (profiler
memory events, allocations minus frees in order; the profiler sees the calling thread only),
output included, inputs not; each further worker thread of the plugin's kernel adds one more
set of chunk buffers. A kernel that works through
a tensor in fixed-size chunks has a bounded scratch, so its bytes per element fall as the
tensor grows: the absolute figure is reported too. Time is the median of
several calls after one warm-up, with torch's default thread count; the speed-up against the
built-in is taken on the fastest call, the least disturbed by other load on a shared machine.

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
    fmt_bytes,
    fmt_count,
    machine_info,
    median,
    parse_size,
    setup_logging,
    use_plugin,
)
from benchmarks.memory import peak_allocated_bytes
from benchmarks.models import PAPER_DENSITIES, AgentDraw, base_chunk, overlap_for
from benchmarks.records import RESULTS_DIR, KernelRun, KernelTiming, StartupCost, save_record
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


def median_seconds(function: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
    """Median wall time of ``repeats`` calls after one untimed warm-up call."""
    function()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return median(times), times


def variants(base: torch.Tensor, finetunes: list[torch.Tensor]) -> dict[str, Callable[[], Any]]:
    """Every kernel call measured, by label."""
    from mergekit.merge_methods.api import merge_tensors as mergekit_merge
    from mergekit.merge_methods.ram import ram_merge as builtin_ram
    from mergekit.merge_methods.ram import ramplus_tl_merge as builtin_ramplus_tl

    from mergekit_ram.kernel import count_overlaps, merge_tensors

    n = len(finetunes)
    lambdas = list(LAMBDAS[:n])
    inputs = [base, *finetunes]

    def workers() -> int:
        return torch.get_num_threads()  # as the merge methods call the kernel (1 under the scratch measurement)

    return {
        "ours: merge, RAM": lambda: merge_tensors(base, finetunes, EPSILON, workers=workers()),
        "ours: merge, RAM+ (lambdas)": lambda: merge_tensors(base, finetunes, EPSILON, lambdas, workers=workers()),
        "ours: merge + count (ram)": lambda: merge_tensors(base, finetunes, EPSILON, workers=workers(), count=True),
        "ours: count only (pre-pass)": lambda: count_overlaps(base, finetunes, EPSILON, workers=workers()),
        BUILTIN_REFERENCE: lambda: mergekit_merge(inputs, builtin_ram, base_index=0),
        "built-in ram (dtype float32)": lambda: mergekit_merge(inputs, builtin_ram, base_index=0, dtype=torch.float32),
        "built-in ramplus_tl (bf16)": lambda: mergekit_merge(inputs, builtin_ramplus_tl, base_index=0),
    }


def benchmark_kernel(numel: int, ns: Sequence[int] = (2, 3, 5), repeats: int = 5) -> list[KernelTiming]:
    rows = []
    for n in ns:
        base, finetunes = kernel_inputs(numel, n)
        for label, function in variants(base, finetunes).items():
            seconds, times = median_seconds(function, repeats)
            scratch, _ = peak_allocated_bytes(function, threads=1)
            rows.append(
                KernelTiming(
                    n=n,
                    variant=label,
                    numel=numel,
                    seconds=seconds,
                    min_seconds=min(times),
                    times=times,
                    ns_per_element=seconds / numel * 1e9,
                    scratch_bytes=scratch,
                    scratch_bytes_per_element=scratch / numel,
                )
            )
            LOG.info("N=%d %-30s %8.1f ms  %5.1f B/element", n, label, seconds * 1e3, scratch / numel)
        del base, finetunes
    return rows


IMPORTTIME_LINE = re.compile(r"import time:\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(.+)$")


def startup_cost(repeats: int = 20, env: Optional[dict[str, str]] = None) -> StartupCost:
    """Cumulative import microseconds of the hook's modules at interpreter start, medians over interpreters."""
    env = env or child_env()
    samples: dict[str, list[int]] = {module: [] for module in HOOK_MODULES}
    walls = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True, text=True, env=env, cwd="/"
        )
        walls.append(time.perf_counter() - started)
        for line in result.stderr.splitlines():
            match = IMPORTTIME_LINE.match(line)
            if match and match.group(3).strip() in samples:
                samples[match.group(3).strip()].append(int(match.group(2)))
    return StartupCost(
        repeats=repeats,
        cumulative_us={module: median(values) if values else None for module, values in samples.items()},
        interpreter_wall_s=median(walls),
    )


def kernel_table(rows: Sequence[KernelTiming]) -> str:
    reference = {row.n: row for row in rows if row.variant == BUILTIN_REFERENCE}
    table_rows = []
    for row in rows:
        builtin = reference.get(row.n)
        speed = f"{builtin.min_seconds / row.min_seconds:.2f}x" if builtin else ""
        table_rows.append(
            [
                row.n,
                row.variant,
                f"{row.seconds * 1e3:.0f} ms",
                f"{row.min_seconds * 1e3:.0f} ms",
                f"{row.ns_per_element:.2f}",
                speed,
                f"{row.scratch_bytes_per_element:.1f}",
                fmt_bytes(row.scratch_bytes),
            ]
        )
    headers = [
        "N",
        "kernel",
        "time (median)",
        "time (min)",
        "ns / element",
        "vs built-in ram",
        "scratch B / element",
        "scratch",
    ]
    return markdown_table([headers, *table_rows], "l")


def startup_table(startup: StartupCost) -> str:
    rows = []
    for module, us in startup.cumulative_us.items():
        rows.append([f"`{module}`", "not imported" if us is None else f"{us / 1000:.2f} ms"])
    rows.append(["whole interpreter (`python -c pass`, wall)", f"{startup.interpreter_wall_s * 1000:.0f} ms"])
    return markdown_table([[f"start-up, median of {startup.repeats}", "cumulative import time"], *rows], "l")


def results_path() -> Path:
    return RESULTS_DIR / "kernel.json"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", default="16M", help="elements per tensor (default 16M)")
    parser.add_argument("--n", default="2,3,5", help="numbers of fine-tuned models")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--startup-repeats", type=int, default=20)
    parser.add_argument("--plugin", type=Path, help="checkout whose mergekit_ram is measured (default: this one)")
    parser.add_argument("--json", type=Path, help="results file (default benchmarks/results/kernel.json)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    use_plugin(__spec__.name, args.plugin, sys.argv[1:] if argv is None else argv)
    numel = parse_size(args.numel)
    ns = [int(n) for n in args.n.split(",")]
    env = child_env(args.plugin)
    import mergekit_ram

    result = KernelRun(
        machine=machine_info(env),
        kernel_module=str(Path(mergekit_ram.__file__).parent),
        numel=numel,
        kernel=benchmark_kernel(numel, ns, args.repeats),
        startup=startup_cost(args.startup_repeats, env),
    )
    save_record(args.json or results_path(), result)
    print(f"kernel alone, {fmt_count(numel)} bfloat16 elements, torch threads {torch.get_num_threads()}")
    print(kernel_table(result.kernel))
    print()
    print(startup_table(result.startup))
    return 0


if __name__ == "__main__":
    sys.exit(main())
