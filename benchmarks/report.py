"""Writes the measured figures into ``docs/performance.md``.

The page is prose with generated blocks between ``<!-- BEGIN generated:NAME -->`` and
``<!-- END generated:NAME -->``: only those blocks are rewritten, from the JSON files under
``benchmarks/results/``, so hand-written text (and the "Optimisations" table) stays.

The estimate for the paper's setting (three Qwen2.5-7B agents) extrapolates from the
measurements: wall time linearly in the parameter count (intercept: start-up and
planning), peak anonymous memory linearly in the largest tensor's element count (a
streaming merge holds one tensor group at a time) plus the output shard mergekit buffers.

    python -m benchmarks.report
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from benchmarks.common import (
    DOC_PATH,
    fmt_bytes,
    fmt_count,
    fmt_ratio,
    fmt_seconds,
    linear_fit,
    parse_size,
    setup_logging,
)
from benchmarks.kernel import kernel_table, startup_table
from benchmarks.methods import heading, methods_table, targets_table
from benchmarks.models import SIZES
from benchmarks.records import (
    RESULTS_DIR,
    InMemoryRun,
    KernelRun,
    MethodsRun,
    MethodSummary,
    OutOfCoreRun,
    OutOfCoreSummary,
    Record,
    load_record,
)
from benchmarks.scale import inmemory_table, limit_text, outofcore_table
from mergekit_ram.stats.render import markdown_table

LOG = logging.getLogger(__name__)

BLOCK = re.compile(
    r"(<!-- BEGIN generated:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- END generated:(?P=name) -->)", re.S
)
#: The paper's setting: Qwen2.5-7B, base and three agents.
PAPER_SIZE = "7b"
ESTIMATE_METHODS = ("task_arithmetic", "ties", "ram", "ram_plus")
#: The plugin's performance work, oldest first: the commit measured and what it changed.
#: Each has a results file ``optimisations/COMMIT.json`` (``benchmarks.methods --plugin``).
OPTIMISATION_STEPS = (
    ("c3deb08", "first version: whole-tensor float32 kernel (float32 copies of every input, bool masks)"),
    ("b2d18a5", "chunks of 2^18 elements with reused buffers (scratch bounded), one chunk after another"),
    ("baf47fe", "the first model initialises the accumulators; one finiteness check per chunk, not per model"),
    ("97e2093", "chunks handed to a pool of --num-threads threads, torch's intra-op threads off meanwhile"),
    (
        "20e5635",
        "float32 masks, counts and patterns (this torch's bool kernels are 3-17x slower), lerp instead of "
        "where, one long-lived pool, 2^17-element chunks",
    ),
)


@dataclass(frozen=True)
class StoredResults:
    """Every results file, by kind; methods and scale runs ordered by model size."""

    methods: list[MethodsRun]
    kernel: Optional[KernelRun]
    outofcore: list[OutOfCoreRun]
    inmemory: list[InMemoryRun]
    optimisations: dict[str, MethodsRun]  # by the commit measured

    def everything(self) -> list[Record]:
        return [*self.methods, *([self.kernel] if self.kernel else []), *self.outofcore, *self.inmemory]


def load_results(results_dir: Path = RESULTS_DIR) -> StoredResults:
    """``results_dir/*.json`` and ``results_dir/optimisations/COMMIT.json``."""
    records = [load_record(path) for path in sorted(results_dir.glob("*.json"))]
    kernels = [record for record in records if isinstance(record, KernelRun)]
    optimisations = {}
    for path in sorted((results_dir / "optimisations").glob("*.json")):
        record = load_record(path)
        if not isinstance(record, MethodsRun):
            raise ValueError(f"{path}: a methods run expected, found {record.KIND}")
        optimisations[path.stem] = record
    return StoredResults(
        methods=sorted((r for r in records if isinstance(r, MethodsRun)), key=lambda r: r.models.parameters),
        kernel=kernels[-1] if kernels else None,
        outofcore=sorted((r for r in records if isinstance(r, OutOfCoreRun)), key=lambda r: r.models.parameters),
        inmemory=sorted((r for r in records if isinstance(r, InMemoryRun)), key=lambda r: r.models.parameters),
        optimisations=optimisations,
    )


def machine_block(results: StoredResults) -> str:
    rows = []
    for result in results.everything():
        machine = result.machine
        thread_env = ", ".join(f"{key}={value}" for key, value in (machine.thread_env or {}).items())
        rows.append(
            [
                f"`{result.source}`",
                machine.time,
                f"{machine.cpu_count} x {machine.cpu}",
                fmt_bytes(machine.memory_bytes),
                f"{machine.load:.2f}",
                f"torch {machine.torch}, mergekit {machine.mergekit}",
                thread_env or "default",
                machine.plugin.label,
            ]
        )
    headers = [
        "results file",
        "measured",
        "CPUs",
        "memory",
        "load at start",
        "versions",
        "OpenMP",
        "mergekit_ram commit",
    ]
    return markdown_table([headers, *rows], "l")


def sizes_block(results: StoredResults) -> str:
    """Parameter counts of every named size and what generating the measured ones cost."""
    runs: list[MethodsRun | OutOfCoreRun | InMemoryRun] = [*results.methods, *results.outofcore, *results.inmemory]
    generated = {result.size: result.models for result in runs}
    rows = []
    for name, size in SIZES.items():
        models = generated.get(name)
        parameters = models.parameters if models else size.parameters()
        rows.append(
            [
                f"`{name}`",
                size.note,
                f"{size.hidden} / {size.intermediate} / {size.layers} / {size.vocab}",
                fmt_count(parameters),
                fmt_count(models.largest_tensor if models else size.largest_tensor()),
                fmt_bytes(4 * parameters * 2),
                fmt_seconds(models.generation_s) if models else "not generated",
                " / ".join(f"{d:.1%}" for d in models.densities) if models else "",
                " / ".join(f"{u:.1%}" for u in models.unique_shares) if models else "",
            ]
        )
    headers = [
        "size",
        "shape",
        "hidden / intermediate / layers / vocab",
        "parameters",
        "largest tensor",
        "disk, 4 models",
        "generation",
        "densities",
        "unique shares",
    ]
    return markdown_table([headers, *rows], "l")


def methods_block(results: StoredResults) -> str:
    if not results.methods:
        return "_Not measured yet: `python -m benchmarks.run --size 120m`._"
    parts = []
    for result in results.methods:
        parts += [f"#### {heading(result)}", "", methods_table(result), "", targets_table(result), ""]
    return "\n".join(parts).rstrip()


def kernel_block(results: StoredResults) -> str:
    result = results.kernel
    if not result:
        return "_Not measured yet: `python -m benchmarks.kernel`._"
    return "\n".join(
        [
            f"{fmt_count(result.numel)} bfloat16 elements per tensor, torch threads "
            f"{result.machine.torch_threads}" + result.machine.thread_settings() + ", kernel of `mergekit_ram` "
            f"{result.machine.plugin.label}.",
            "",
            kernel_table(result.kernel),
            "",
            startup_table(result.startup),
        ]
    )


def scale_block(results: StoredResults) -> str:
    parts = []
    if results.outofcore:
        parts += ["Out-of-core `ram_plus` (`mergekit-yaml`):", ""]
        for outofcore in results.outofcore:
            parts += [outofcore_table(outofcore), ""]
    else:
        parts += ["_Out-of-core run not measured yet: `python -m benchmarks.scale outofcore --size scale`._", ""]
    for result in results.inmemory:
        cap = result.options.cap_bytes
        under = f", both under an RLIMIT_DATA cap of {fmt_bytes(cap)}" if cap else ""
        parts += [f"Whole-model-in-memory float32 against ours, size `{result.size}`{under}:", ""]
        parts += [inmemory_table(result), "", limit_text(result), ""]
    if not results.inmemory:
        parts += ["_Not measured yet: `python -m benchmarks.scale inmemory --size 120m`._"]
    return "\n".join(parts).rstrip()


@dataclass(frozen=True)
class Observation:
    """One measured merge, reduced to what the extrapolation uses."""

    parameters: int
    largest_tensor: int
    wall_s: float
    cpu_s: Optional[float]
    merge_anon_bytes: float  # peak anonymous memory less the output mergekit buffered
    merge_rss_bytes: float  # peak RSS (with the mapped input pages) less the output mergekit buffered
    shard_bytes: int

    @classmethod
    def of(cls, result: MethodsRun | OutOfCoreRun, summary: MethodSummary | OutOfCoreSummary) -> Observation:
        models = result.models
        shard = parse_size(result.options.out_shard_size)
        buffered = min(shard, models.parameters * 2)
        return cls(
            parameters=models.parameters,
            largest_tensor=models.largest_tensor,
            wall_s=summary.wall_s,
            cpu_s=summary.cpu_s,
            merge_anon_bytes=summary.peak_anon_bytes - buffered,
            merge_rss_bytes=summary.max_rss_bytes - buffered,
            shard_bytes=shard,
        )


def observations(results: StoredResults, method: str) -> list[Observation]:
    """The latest measurement of ``method`` per size (methods runs; for ram_plus the out-of-core runs too).

    Only the latest per size: older runs (another plugin commit, another thread setting) stay
    listed on the page but do not feed the extrapolation.
    """
    measured: list[tuple[MethodsRun | OutOfCoreRun, MethodSummary | OutOfCoreSummary]] = [
        (result, result.summary[method]) for result in results.methods if method in result.summary
    ]
    found = latest_per_size(measured)
    if method == "ram_plus":
        found += latest_per_size([(result, result.summary) for result in results.outofcore])
    return found


def latest_per_size(
    measured: Sequence[tuple[MethodsRun | OutOfCoreRun, MethodSummary | OutOfCoreSummary]],
) -> list[Observation]:
    """One observation per size, from the run measured last."""
    latest: dict[str, tuple[MethodsRun | OutOfCoreRun, MethodSummary | OutOfCoreSummary]] = {}
    for result, summary in measured:
        if result.size not in latest or result.machine.time > latest[result.size][0].machine.time:
            latest[result.size] = (result, summary)
    return [Observation.of(result, summary) for result, summary in latest.values()]


@dataclass(frozen=True)
class Estimate:
    """One method at a size not measured, from linear fits over the measured sizes."""

    wall_s: float
    seconds_per_billion: float  # slope of wall time over parameters
    cpu_seconds_per_billion: Optional[float]  # None: CPU time measured at fewer than two sizes
    peak_anon_bytes: float
    max_rss_bytes: float
    bytes_per_largest_element: float  # slope of anonymous memory over the largest tensor's elements
    points: int  # sizes the fits use
    largest_measured: int  # parameters of the largest size measured


def estimate(results: StoredResults, size_name: str = PAPER_SIZE) -> dict[str, Estimate]:
    """Time and peak anonymous memory per method at ``size_name``, extrapolated from the measured sizes."""
    size = SIZES[size_name]
    parameters, largest = size.parameters(), size.largest_tensor()
    estimates: dict[str, Estimate] = {}
    for method in ESTIMATE_METHODS:
        points = observations(results, method)
        if len({point.parameters for point in points}) < 2:
            continue
        time_fit = linear_fit([(point.parameters, point.wall_s) for point in points])
        cpu_points = [(point.parameters, point.cpu_s) for point in points if point.cpu_s is not None]
        memory_fit = linear_fit([(point.largest_tensor, point.merge_anon_bytes) for point in points])
        rss_fit = linear_fit([(point.largest_tensor, point.merge_rss_bytes) for point in points])
        shard = points[-1].shard_bytes
        buffered = min(shard, parameters * 2)
        estimates[method] = Estimate(
            wall_s=time_fit[0] + time_fit[1] * parameters,
            seconds_per_billion=time_fit[1] * 1e9,
            cpu_seconds_per_billion=linear_fit(cpu_points)[1] * 1e9 if len(cpu_points) >= 2 else None,
            peak_anon_bytes=memory_fit[0] + memory_fit[1] * largest + buffered,
            max_rss_bytes=rss_fit[0] + rss_fit[1] * largest + buffered,
            bytes_per_largest_element=memory_fit[1],
            points=len(points),
            largest_measured=max(point.parameters for point in points),
        )
    return estimates


def estimate_block(results: StoredResults) -> str:
    size = SIZES[PAPER_SIZE]
    estimates = estimate(results)
    if not estimates:
        return "_Needs `methods` results at two sizes at least (e.g. `--size 120m --size 500m`)._"
    rows = [
        [
            f"`{method}`",
            f"{entry.seconds_per_billion:.1f} s",
            "n/a" if entry.cpu_seconds_per_billion is None else f"{entry.cpu_seconds_per_billion:.1f} s",
            fmt_seconds(entry.wall_s),
            f"{entry.bytes_per_largest_element:.1f}",
            fmt_bytes(entry.peak_anon_bytes),
            fmt_bytes(entry.max_rss_bytes),
            f"{entry.points} (up to {fmt_count(entry.largest_measured)})",
        ]
        for method, entry in estimates.items()
    ]
    headers = [
        "method",
        "wall s / 1B parameters",
        "CPU s / 1B",
        "wall, 7B",
        "anon B / element of largest tensor",
        "peak anon, 7B",
        "peak RSS, 7B",
        "fit on",
    ]
    return "\n".join(
        [
            f"Base and three agents of {fmt_count(size.parameters())} parameters, largest tensor "
            f"{fmt_count(size.largest_tensor())} elements (embeddings, untied), on this machine:",
            "",
            markdown_table([headers, *rows], "l"),
        ]
    )


def optimisations_block(results: StoredResults) -> str:
    """One row per performance change: ratios to ``task_arithmetic`` measured in that step's own run."""
    rows = []
    for commit, change in OPTIMISATION_STEPS:
        result = results.optimisations.get(commit)
        if result is None:
            rows.append([f"`{commit}`", change, *["not measured"] * 7])
            continue
        ram, ram_plus = result.summary.get("ram"), result.summary.get("ram_plus")
        prepass = ram_plus.prepass_s if ram_plus else None
        rows.append(
            [
                f"`{commit}`",
                change,
                f"{result.machine.load:.2f}",
                fmt_seconds(ram_plus.wall_s) if ram_plus else "n/a",
                fmt_ratio(ram.wall_s_ratio if ram else None),
                fmt_ratio(ram_plus.wall_s_ratio if ram_plus else None),
                fmt_ratio(ram_plus.cpu_s_ratio if ram_plus else None),
                fmt_seconds(prepass) if prepass is not None else "n/a",
                fmt_ratio(ram_plus.peak_anon_bytes_ratio if ram_plus else None),
            ]
        )
    headers = [
        "commit",
        "change",
        "load at start",
        "`ram_plus` wall",
        "`ram` wall x TA",
        "`ram_plus` wall x TA",
        "`ram_plus` CPU x TA",
        "pre-pass",
        "`ram_plus` peak anon x TA",
    ]
    first = next(iter(results.optimisations.values()), None)
    intro = ""
    if first:
        intro = (
            f"Size `{first.size}` ({fmt_count(first.models.parameters)} parameters per model), "
            f"{first.options.repeats} rounds of `task_arithmetic`, `ram`, `ram_plus` in turns, one run per commit, "
            f"{first.machine.cpu_count} CPUs ({first.machine.cpu})."
        )
    return "\n".join([intro, "", markdown_table([headers, *rows], "l")]).strip()


GENERATORS: dict[str, Callable[[StoredResults], str]] = {
    "machine": machine_block,
    "sizes": sizes_block,
    "methods": methods_block,
    "kernel": kernel_block,
    "scale": scale_block,
    "estimate": estimate_block,
    "optimisations": optimisations_block,
}


def render(text: str, results: StoredResults) -> str:
    """``text`` with every generated block replaced; unknown block names are left alone."""

    def replace(match: re.Match) -> str:
        generator = GENERATORS.get(match.group("name"))
        if generator is None:
            LOG.warning("no generator for block %r", match.group("name"))
            return match.group(0)
        return f"{match.group(1)}{generator(results)}\n{match.group(4)}"

    rendered = BLOCK.sub(replace, text)
    missing = set(GENERATORS) - {match.group("name") for match in BLOCK.finditer(text)}
    if missing:
        LOG.warning("%s has no block for %s", DOC_PATH.name, ", ".join(sorted(missing)))
    return rendered


def write_doc(doc: Path = DOC_PATH, results_dir: Path = RESULTS_DIR) -> Path:
    text = doc.read_text(encoding="utf-8")
    doc.write_text(render(text, load_results(results_dir)), encoding="utf-8")
    return doc


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--doc", type=Path, default=DOC_PATH)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    print(f"wrote {write_doc(args.doc, args.results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
