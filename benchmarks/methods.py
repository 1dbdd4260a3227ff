"""The real ``mergekit-yaml`` command, method against method, as a user runs it.

Each merge is its own ``mergekit-yaml`` process (start-up, planning, the ram_plus pre-pass,
writing the output: everything a user waits for), methods in turns (A B C A B C ...) so
that load from other users of a shared machine spreads over all of them. Per method: the
median wall time, CPU time, peak RSS (kernel high-water mark, which also counts pages of the
memory-mapped input shards) and peak anonymous memory (polled), the ratio of each to
``task_arithmetic``, and for ``ram_plus`` the share of the wall time its pre-pass took
(parsed from the ``-v`` log line ``ram_plus pre-pass done in X s``).

All methods get the same options: ``--out-shard-size`` (default 1B: mergekit holds a whole
output shard in memory before writing it, 5 GB by default, which would otherwise dominate
peak memory), ``--no-copy-tokenizer`` (the synthetic models have none), ``-v``, and in the
recipe ``dtype: bfloat16`` and ``out_dtype: bfloat16`` (``ramplus_tl`` would otherwise write
float32). ``ties`` and ``dare_ties`` use ``density: 0.5``, every model ``weight: 1.0``;
``dare_ties`` runs with ``--random-seed 0``. ``ram``, ``ram_plus``, ``ram_ties`` and
``ramplus_tl`` use their defaults.

    python -m benchmarks.methods --size 120m --repeats 3
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import yaml

from benchmarks.common import (
    CACHE_DIR,
    child_env,
    fmt_bytes,
    fmt_count,
    fmt_ratio,
    fmt_seconds,
    machine_info,
    median,
    run_measured,
    setup_logging,
)
from benchmarks.models import SIZES, ensure_models
from benchmarks.records import (
    RESULTS_DIR,
    Measurement,
    MethodsOptions,
    MethodsRun,
    MethodSummary,
    ModelFigures,
    ModelSet,
    read_json,
    save_record,
)
from mergekit_ram.cli import console_script
from mergekit_ram.stats.render import markdown_table
from mergekit_ram.stats.schema import read_ratio

LOG = logging.getLogger(__name__)

REFERENCE = "task_arithmetic"
METHOD_PARAMETERS: dict[str, dict[str, float]] = {
    "task_arithmetic": {"weight": 1.0},
    "ties": {"weight": 1.0, "density": 0.5},
    "dare_ties": {"weight": 1.0, "density": 0.5},
    "ramplus_tl": {},
    "ram": {},
    "ram_plus": {},
    "ram_ties": {},
}
METHODS = tuple(METHOD_PARAMETERS)
METRIC_LABELS = {
    "wall_s": "wall time",
    "cpu_s": "CPU time",
    "max_rss_bytes": "peak RSS",
    "peak_anon_bytes": "peak anon",
}
PREPASS_LINE = re.compile(r"ram_plus pre-pass done in ([0-9.]+) s")


@dataclass(frozen=True)
class Target:
    """One of issue 5's targets: ``method``'s ``metric`` over ``reference``'s, at most (or at least) ``bound``."""

    method: str
    metric: str  # a metric of MethodSummary: wall_s, cpu_s, max_rss_bytes, peak_anon_bytes
    bound: float
    reference: str = REFERENCE
    at_least: bool = False  # reference / method >= bound (a speed-up) instead of method / reference <= bound

    def describe(self) -> str:
        metric = METRIC_LABELS.get(self.metric, self.metric)
        if self.at_least:
            return f"{metric}: `{self.reference}` / `{self.method}` >= {self.bound:g}"
        return f"{metric}: `{self.method}` / `{self.reference}` <= {self.bound:g}"

    def value(self, summary: Mapping[str, MethodSummary]) -> Optional[float]:
        if self.method not in summary or self.reference not in summary:
            return None
        method, reference = getattr(summary[self.method], self.metric), getattr(summary[self.reference], self.metric)
        if not method or not reference:
            return None
        return reference / method if self.at_least else method / reference

    def met(self, value: Optional[float]) -> Optional[bool]:
        if value is None:
            return None
        return value >= self.bound if self.at_least else value <= self.bound


#: Issue 5: measured as ratios in one run, at about 120M parameters and up.
TARGETS = (
    Target("ram", "wall_s", 1.05),
    Target("ram_plus", "wall_s", 1.35),
    Target("ram_plus", "max_rss_bytes", 1.10),
    Target("ram_plus", "wall_s", 3.0, reference="ties", at_least=True),
    Target("ram_ties", "wall_s", 2.0, reference="ram"),  # issue 21: at most 2x ram, well under ties
    Target("ram_ties", "wall_s", 1.5, reference="ties", at_least=True),
)
TARGET_MIN_PARAMETERS = 100_000_000


def write_recipe(method: str, models: ModelSet, path: Path, out_dtype: Optional[str]) -> Path:
    """The YAML a user would write: absolute local paths, the same options for every method."""
    entries = []
    for agent in models.agents:
        entry: dict[str, Any] = {"model": agent}
        if METHOD_PARAMETERS[method]:
            entry["parameters"] = dict(METHOD_PARAMETERS[method])
        entries.append(entry)
    recipe: dict[str, Any] = {"merge_method": method, "base_model": models.base, "models": entries, "dtype": "bfloat16"}
    if out_dtype:
        recipe["out_dtype"] = out_dtype
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(recipe, handle, sort_keys=False)
    return path


def mergekit_command(recipe: Path, out: Path, *, out_shard_size: str, extra: Sequence[str] = ()) -> list[str]:
    return [
        console_script("mergekit-yaml"),
        str(recipe),
        str(out),
        "-v",
        "--out-shard-size",
        out_shard_size,
        "--no-copy-tokenizer",
        "--random-seed",
        "0",
        *extra,
    ]


def run_merge(
    method: str,
    models: ModelSet,
    workdir: Path,
    *,
    env: dict[str, str],
    out_shard_size: str,
    out_dtype: Optional[str],
    extra: Sequence[str] = (),
    tag: str = "",
    data_limit_bytes: Optional[int] = None,
    keep_output: bool = False,
) -> Measurement:
    """One measured ``mergekit-yaml`` run into ``workdir/out-METHOD``; the output is checked, its statistics
    kept, then deleted unless ``keep_output``."""
    recipe = write_recipe(method, models, workdir / f"{method}.yml", out_dtype)
    out = workdir / f"out-{method}"
    log_path = workdir / "logs" / f"{method}{tag}.log"
    shutil.rmtree(out, ignore_errors=True)
    measurement = run_measured(
        mergekit_command(recipe, out, out_shard_size=out_shard_size, extra=extra),
        env=env,
        log_path=log_path,
        data_limit_bytes=data_limit_bytes,
    )
    if measurement.ok:
        if not any(out.glob("*.safetensors")):
            raise RuntimeError(f"{method}: mergekit-yaml succeeded but wrote no weights into {out}")
        with open(log_path, encoding="utf-8", errors="replace") as handle:
            found = PREPASS_LINE.findall(handle.read())
        if found:
            measurement = replace(measurement, prepass_s=float(found[-1]))
        statistics = out / "ram_statistics.json"
        if statistics.exists():
            measurement = replace(measurement, statistics=summarise_statistics(read_json(statistics)))
    if not keep_output:
        shutil.rmtree(out, ignore_errors=True)
    return measurement


def summarise_statistics(statistics: dict[str, Any]) -> dict[str, ModelFigures]:
    """density, rho and lambda per model from ``ram_statistics.json`` (checks the models' sparsity profile).

    Either schema of the file; an infinite rho is None in the record.
    """
    figures = {}
    for entry in statistics.get("models", []):
        rho = read_ratio(entry["rho"])
        figures[Path(str(entry["model"])).name] = ModelFigures(
            density=entry["density"], rho=None if math.isinf(rho) else rho, lambda_=entry["lambda"]
        )
    return figures


def benchmark_methods(
    models: ModelSet,
    *,
    methods: Sequence[str] = METHODS,
    repeats: int = 3,
    out_shard_size: str = "1B",
    out_dtype: Optional[str] = "bfloat16",
    extra: Sequence[str] = (),
    plugin: Optional[Path] = None,
    warmup: bool = True,
    workdir: Optional[Path] = None,
) -> MethodsRun:
    """Every method ``repeats`` times in turns."""
    env = child_env(plugin)
    workdir = workdir or CACHE_DIR / "runs" / models.size
    workdir.mkdir(parents=True, exist_ok=True)
    machine = machine_info(env)
    options = MethodsOptions(
        repeats=repeats,
        out_shard_size=out_shard_size,
        out_dtype=out_dtype,
        extra_args=list(extra),
        warmup=warmup,
        method_parameters={method: METHOD_PARAMETERS[method] for method in methods},
    )
    if warmup:
        LOG.info("warm-up: one untimed %s run (page cache, bytecode)", methods[0])
        run_merge(
            methods[0], models, workdir, env=env, out_shard_size=out_shard_size, out_dtype=out_dtype, tag="-warmup"
        )
    runs: dict[str, list[Measurement]] = {method: [] for method in methods}
    for round_index in range(repeats):
        for method in methods:
            measurement = run_merge(
                method,
                models,
                workdir,
                env=env,
                out_shard_size=out_shard_size,
                out_dtype=out_dtype,
                extra=extra,
                tag=f"-{round_index}",
            )
            if not measurement.ok:
                raise RuntimeError(f"{method} failed (exit {measurement.returncode}):\n{measurement.log_tail}")
            LOG.info(
                "round %d %-15s %7.2f s  peak RSS %s  anon %s",
                round_index + 1,
                method,
                measurement.wall_s,
                fmt_bytes(measurement.max_rss_bytes),
                fmt_bytes(measurement.peak_anon_bytes),
            )
            runs[method].append(measurement)
    return MethodsRun(
        size=models.size, models=models, options=options, machine=machine, runs=runs, summary=summarise(runs)
    )


def summarise(runs: Mapping[str, Sequence[Measurement]]) -> dict[str, MethodSummary]:
    """Medians per method, ratios to the reference method, the ram_plus pre-pass share."""
    summary: dict[str, MethodSummary] = {}
    for method, measurements in runs.items():
        prepass = [(m.prepass_s, m.wall_s) for m in measurements if m.prepass_s is not None]
        statistics = [m.statistics for m in measurements if m.statistics is not None]
        summary[method] = MethodSummary(
            runs=len(measurements),
            wall_s=median(m.wall_s for m in measurements),
            wall_min_s=min(m.wall_s for m in measurements),
            cpu_s=median(m.cpu_s for m in measurements),
            max_rss_bytes=median(m.max_rss_bytes for m in measurements),
            peak_anon_bytes=median(m.peak_anon_bytes for m in measurements),
            prepass_s=median(seconds for seconds, _ in prepass) if prepass else None,
            prepass_share=median(seconds / wall for seconds, wall in prepass) if prepass else None,
            statistics=statistics[-1] if statistics else None,
        )
    reference = summary.get(REFERENCE)
    if reference:
        summary = {method: entry.with_ratios(reference) for method, entry in summary.items()}
    return summary


def methods_table(result: MethodsRun) -> str:
    rows = []
    for method, entry in result.summary.items():
        rows.append(
            [
                f"`{method}`",
                fmt_seconds(entry.wall_s),
                fmt_ratio(entry.wall_s_ratio),
                fmt_seconds(entry.cpu_s),
                fmt_ratio(entry.cpu_s_ratio),
                fmt_bytes(entry.max_rss_bytes),
                fmt_ratio(entry.max_rss_bytes_ratio),
                fmt_bytes(entry.peak_anon_bytes),
                fmt_ratio(entry.peak_anon_bytes_ratio),
                f"{entry.prepass_share:.0%} ({fmt_seconds(entry.prepass_s)})"
                if entry.prepass_share is not None
                else "",
            ]
        )
    headers = [
        "method",
        "wall (median)",
        "x TA",
        "CPU",
        "x TA",
        "peak RSS",
        "x TA",
        "peak anon",
        "x TA",
        "pre-pass share",
    ]
    return markdown_table([headers, *rows], "l")


def targets_table(result: MethodsRun) -> str:
    """Each target's ratio and verdict, and the same ratio in CPU time (steadier on a loaded machine) or in
    anonymous memory (without the page cache of mapped inputs)."""
    rows = []
    applies = result.models.parameters >= TARGET_MIN_PARAMETERS
    for target in TARGETS:
        value = target.value(result.summary)
        met = target.met(value)
        verdict = "n/a" if met is None else ("met" if met else "missed")
        if not applies and met is not None:
            verdict += " (below 100M parameters: not binding)"
        other = ""
        counterpart = {"wall_s": "cpu_s", "max_rss_bytes": "peak_anon_bytes"}.get(target.metric)
        if counterpart:
            other_target = replace(target, metric=counterpart)
            other_value = other_target.value(result.summary)
            if other_value:
                verdict_other = "met" if other_target.met(other_value) else "missed"
                other = f"{METRIC_LABELS[counterpart]} {fmt_ratio(other_value)} ({verdict_other})"
        rows.append([target.describe(), fmt_ratio(value), verdict, other])
    return markdown_table([["target", "measured", "verdict", "in CPU time / anonymous memory"], *rows], "l")


def heading(result: MethodsRun) -> str:
    models, options, machine = result.models, result.options, result.machine
    return (
        f"size `{result.size}`: {fmt_count(models.parameters)} parameters per model, "
        f"largest tensor {fmt_count(models.largest_tensor)} elements; {options.repeats} rounds, "
        f"--out-shard-size {options.out_shard_size}; {machine.cpu_count} CPUs "
        f"({machine.cpu}), load average at start {machine.load:.2f}" + machine.thread_settings()
    )


def results_path(size: str) -> Path:
    return RESULTS_DIR / f"methods-{size}.json"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    result = run_from_args(args)
    print(heading(result))
    print(methods_table(result))
    print()
    print(targets_table(result))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="120m", choices=sorted(SIZES))
    parser.add_argument("--repeats", type=int, default=3, help="rounds of all methods (default 3)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated, first is the warm-up")
    parser.add_argument("--out-shard-size", default="1B", help="passed to every mergekit-yaml (default 1B)")
    parser.add_argument("--out-dtype", default="bfloat16", help="recipe out_dtype for every method; 'none' to omit")
    parser.add_argument("--mergekit-args", default="", help="extra arguments for every run, e.g. '--cuda' or '-j 2'")
    parser.add_argument("--plugin", type=Path, help="checkout whose mergekit_ram the merges use (default: this one)")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--json", type=Path, help="results file (default benchmarks/results/methods-SIZE.json)")
    parser.add_argument("-v", "--verbose", action="store_true")


def run_from_args(args: argparse.Namespace) -> MethodsRun:
    models = ensure_models(args.size)
    methods = [method.strip() for method in args.methods.split(",") if method.strip()]
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise SystemExit(f"unknown methods: {sorted(unknown)}")
    result = benchmark_methods(
        models,
        methods=methods,
        repeats=args.repeats,
        out_shard_size=args.out_shard_size,
        out_dtype=None if args.out_dtype.lower() == "none" else args.out_dtype,
        extra=args.mergekit_args.split(),
        plugin=args.plugin,
        warmup=not args.no_warmup,
    )
    save_record(args.json or results_path(args.size), result)
    return result


if __name__ == "__main__":
    sys.exit(main())
