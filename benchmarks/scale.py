"""Scale: an out-of-core merge, and ours against the whole-model-in-memory float32 approach.

``outofcore``: ``ram_plus`` through the real ``mergekit-yaml`` on a size whose inputs exceed the
machine's memory (``--size scale``; check it first on ``--size 20m``). ``inmemory``: ``ram_plus``
and the in-memory baseline (:mod:`benchmarks.inmemory`) in turns, outputs compared element for
element; the baseline's bytes per parameter (its peak anonymous memory less the interpreter's)
give the largest model it can merge here. ``--cap-gib X`` runs both under an RLIMIT_DATA of X
GiB, so the baseline fails with an allocation error instead of calling the OOM killer.

    python -m benchmarks.scale outofcore --size scale
    python -m benchmarks.scale inmemory --size 120m --repeats 2
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import psutil
import torch
from safetensors import safe_open

from benchmarks.common import (
    CACHE_DIR,
    GIB,
    child_env,
    cpu_s,
    fmt_bytes,
    fmt_count,
    fmt_seconds,
    machine_info,
    median,
    plugin_checkout,
    run_measured,
    setup_logging,
)
from benchmarks.inmemory import BASELINE_FIGURES_FILE, shard_files
from benchmarks.methods import run_merge
from benchmarks.models import SIZES, ensure_models
from benchmarks.records import RESULTS_DIR, read_json, save_result
from mergekit_ram.stats.render import markdown_table

LOG = logging.getLogger(__name__)

SHARD_SIZE = "1B"
#: The two approaches of ``inmemory``, as labelled in its results.
BASELINE = "in-memory float32"
OURS = "ram_plus (mergekit-yaml)"


def out_of_core(
    models: dict[str, Any], *, repeats: int = 1, out_shard_size: str = SHARD_SIZE, plugin: Optional[Path] = None
) -> dict[str, Any]:
    """``ram_plus`` on ``models`` through the CLI, ``repeats`` times."""
    env = child_env(plugin)
    workdir = CACHE_DIR / "runs" / f"scale-{models['size']}"
    machine = machine_info(env)
    runs = []
    for index in range(repeats):
        run = run_merge("ram_plus", models, workdir, env=env, out_shard_size=out_shard_size, tag=f"-outofcore-{index}")
        if run["returncode"]:
            raise RuntimeError(f"ram_plus failed (exit {run['returncode']}):\n{run['log_tail']}")
        runs.append(run)
    wall_s = median(run["wall_s"] for run in runs)
    return {
        "size": models["size"],
        "models": models,
        "machine": machine,
        "options": {"out_shard_size": out_shard_size, "repeats": repeats},
        "inputs_exceed_memory": models["disk_bytes"] > machine["memory_bytes"],
        "runs": runs,
        "summary": {
            "wall_s": wall_s,
            "cpu_s": median(cpu_s(run) for run in runs),
            "max_rss_bytes": median(run["max_rss_bytes"] for run in runs),
            "peak_anon_bytes": median(run["peak_anon_bytes"] for run in runs),
            "prepass_s": median(run["extra"].get("prepass_s", math.nan) for run in runs),
            "seconds_per_billion": wall_s / (models["parameters"] / 1e9),
        },
    }


def in_memory_vs_ours(
    models: dict[str, Any],
    *,
    repeats: int = 1,
    out_shard_size: str = SHARD_SIZE,
    plugin: Optional[Path] = None,
    cap_bytes: Optional[int] = None,
    check: bool = True,
) -> dict[str, Any]:
    """Both approaches in turns on ``models``; outputs compared after the last round."""
    env = child_env(plugin)
    workdir = CACHE_DIR / "runs" / f"inmemory-{models['size']}"
    machine = machine_info(env)
    # a child that only imports what the baseline imports: its peak is subtracted from the baseline's
    overhead = run_measured(
        [sys.executable, "-c", "import torch, safetensors.torch, benchmarks.inmemory"],
        env=env,
        log_path=CACHE_DIR / "logs" / "interpreter-overhead.log",
    )
    runs: dict[str, list[dict[str, Any]]] = {BASELINE: [], OURS: []}
    baseline_out = workdir / "out-inmemory"
    comparison = None
    for index in range(repeats):
        last = index == repeats - 1
        shutil.rmtree(baseline_out, ignore_errors=True)
        baseline = run_measured(
            [
                sys.executable,
                "-m",
                "benchmarks.inmemory",
                models["base"],
                *models["agents"],
                "--out",
                str(baseline_out),
            ],
            env=env,
            log_path=workdir / "logs" / f"inmemory-{index}.log",
            data_limit_bytes=cap_bytes,
        )
        if baseline["returncode"] == 0:
            baseline["extra"]["statistics"] = read_json(baseline_out / BASELINE_FIGURES_FILE)
        runs[BASELINE].append(baseline)
        keep = last and check and baseline["returncode"] == 0
        ours = run_merge(
            "ram_plus",
            models,
            workdir,
            env=env,
            out_shard_size=out_shard_size,
            tag=f"-{index}",
            data_limit_bytes=cap_bytes,
            keep_output=keep,
        )
        runs[OURS].append(ours)
        if keep and ours["returncode"] == 0:
            comparison = compare_outputs(baseline_out, workdir / "out-ram_plus")
        if ours["returncode"] and cap_bytes is None:
            raise RuntimeError(f"ram_plus failed (exit {ours['returncode']}):\n{ours['log_tail']}")
    shutil.rmtree(baseline_out, ignore_errors=True)
    shutil.rmtree(workdir / "out-ram_plus", ignore_errors=True)

    summary = {}
    for label, measurements in runs.items():
        done = [m for m in measurements if m["returncode"] == 0]
        summary[label] = {
            "completed": len(done),
            "failed": len(measurements) - len(done),
            **{key: median(m[key] for m in done) for key in ("wall_s", "max_rss_bytes", "peak_anon_bytes")},
        }
    baseline_figures = runs[BASELINE][-1]["extra"].get("statistics")
    ours_figures = runs[OURS][-1]["extra"].get("statistics") or {}
    rho = {
        BASELINE: None if baseline_figures is None else baseline_figures["rho"],
        OURS: [figures["rho"] for figures in ours_figures.values()] or None,
    }
    limit = None
    if summary[BASELINE]["completed"]:
        per_parameter = (summary[BASELINE]["peak_anon_bytes"] - overhead["peak_anon_bytes"]) / models["parameters"]
        limit = memory_limit(per_parameter, machine["memory_bytes"], overhead["peak_anon_bytes"])
    return {
        "size": models["size"],
        "models": models,
        "machine": machine,
        "options": {"repeats": repeats, "out_shard_size": out_shard_size, "cap_bytes": cap_bytes},
        "interpreter_overhead": overhead,
        "runs": runs,
        "summary": summary,
        "comparison": comparison,
        "rho": rho,
        "limit": limit,
    }


def read_tensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a checkpoint, one tensor at a time."""
    for path in shard_files(directory):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def compare_outputs(baseline: Path, ours: Path) -> dict[str, Any]:
    """Element-wise agreement of the two merged checkpoints, streamed."""
    theirs = dict(read_tensors(baseline))
    differing = total = tensors = 0
    max_abs = 0.0
    for name, tensor in read_tensors(ours):
        tensors += 1
        other = theirs.pop(name, None)
        if other is None:
            continue
        total += tensor.numel()
        different = tensor != other
        differing += int(different.sum())
        if different.any():
            max_abs = max(max_abs, float((tensor.float() - other.float()).abs().max()))
    return {
        "elements": total,
        "differing_elements": differing,
        "max_abs_difference": max_abs,
        "only_in_baseline": sorted(theirs),
        "tensors": tensors,
    }


def memory_limit(bytes_per_parameter: float, memory_bytes: int, overhead_bytes: int) -> dict[str, Any]:
    """The largest model the in-memory approach merges within ``memory_bytes``, and the first named size beyond."""
    largest = (memory_bytes - overhead_bytes) / bytes_per_parameter
    beyond = [
        (name, size.parameters()) for name, size in SIZES.items() if size.parameters() > largest and name != "scale"
    ]
    first = min(beyond, key=lambda item: item[1]) if beyond else None
    return {
        "bytes_per_parameter": bytes_per_parameter,
        "memory_bytes": memory_bytes,
        "largest_parameters": largest,
        "first_size_beyond": first[0] if first else None,
        "first_size_beyond_parameters": first[1] if first else None,
        "needed_for_first_size_bytes": overhead_bytes + bytes_per_parameter * first[1] if first else None,
    }


def outofcore_table(result: dict[str, Any]) -> str:
    summary, models = result["summary"], result["models"]
    row = [
        f"`{result['size']}`",
        fmt_count(models["parameters"]),
        fmt_bytes(models["disk_bytes"]),
        fmt_bytes(result["machine"]["memory_bytes"]),
        *(fmt_seconds(summary[key]) for key in ("wall_s", "prepass_s")),
        *(fmt_bytes(summary[key]) for key in ("max_rss_bytes", "peak_anon_bytes")),
    ]
    headers = ["size", "parameters / model", "inputs on disk", "machine memory", "wall", "pre-pass", "peak RSS"]
    return markdown_table([[*headers, "peak anon"], row], "l")


def inmemory_table(results: Sequence[dict[str, Any]]) -> str:
    rows = []
    for result in results:
        for label, entry in result["summary"].items():
            status = f"{entry['completed']} ok" + (f", {entry['failed']} failed" if entry["failed"] else "")
            per_parameter = entry["peak_anon_bytes"] / result["models"]["parameters"]
            rows.append(
                [
                    f"`{result['size']}`",
                    label,
                    status,
                    fmt_seconds(entry["wall_s"]),
                    *(fmt_bytes(entry[key]) for key in ("max_rss_bytes", "peak_anon_bytes")),
                    f"{per_parameter:.1f}" if entry["completed"] else "n/a",
                ]
            )
    headers = ["size", "approach", "runs", "wall", "peak RSS", "peak anon", "anon B / parameter"]
    return markdown_table([headers, *rows], "l")


def limit_text(result: dict[str, Any]) -> str:
    lines = []
    comparison, limit, rho = result["comparison"], result["limit"], result["rho"]
    if comparison:
        lines.append(
            f"Outputs: {comparison['differing_elements']:,} of {comparison['elements']:,} elements differ "
            f"(largest difference {comparison['max_abs_difference']:g})."
        )
    if rho and all(rho.values()):
        values = "; ".join(f"{label} " + " / ".join(f"{value:.4f}" for value in rho[label]) for label in rho)
        lines.append(f"rho per agent: {values}.")
    if limit:
        line = (
            f"The in-memory approach needs {limit['bytes_per_parameter']:.1f} bytes per parameter beyond the "
            f"interpreter, so {fmt_bytes(limit['memory_bytes'])} of memory holds at most "
            f"{fmt_count(limit['largest_parameters'])} parameters per model"
        )
        if limit["first_size_beyond"]:
            line += (
                f"; from `{limit['first_size_beyond']}` ({fmt_count(limit['first_size_beyond_parameters'])}, "
                f"about {fmt_bytes(limit['needed_for_first_size_bytes'])}) only the streaming merge runs here"
            )
        lines.append(line + ".")
    for label, measurements in result["runs"].items():
        failed = [m for m in measurements if m["returncode"]]
        if failed:
            tail = failed[-1]["log_tail"].strip()
            reason = tail.splitlines()[-1] if tail else "no output"
            lines.append(f"{label} failed {len(failed)} of {len(measurements)} runs: `{reason[:160]}`")
    return " ".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=["outofcore", "inmemory"])
    parser.add_argument("--size", required=True, choices=sorted(SIZES))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out-shard-size", default=SHARD_SIZE)
    parser.add_argument(
        "--plugin", type=plugin_checkout, help="checkout whose mergekit_ram the merges use (default: this one)"
    )
    parser.add_argument("--cap-gib", type=float, help="inmemory: RLIMIT_DATA for both children, in GiB")
    parser.add_argument("--no-check", action="store_true", help="inmemory: skip the element-wise comparison")
    parser.add_argument("--json", type=Path)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    models = ensure_models(args.size)
    path = args.json or RESULTS_DIR / f"scale-{args.part}-{args.size}.json"
    options = dict(repeats=args.repeats, out_shard_size=args.out_shard_size, plugin=args.plugin)
    if args.part == "outofcore":
        outofcore = out_of_core(models, **options)
        save_result(path, "outofcore", outofcore)
        print(outofcore_table(outofcore))
        return 0
    need = 40 * models["parameters"]
    if args.cap_gib is None and need > psutil.virtual_memory().available:
        raise SystemExit(
            f"the in-memory baseline needs about {fmt_bytes(need)} at {args.size}, more than is available; "
            "pass --cap-gib to run it under a limit"
        )
    cap = int(args.cap_gib * GIB) if args.cap_gib else None
    inmemory = in_memory_vs_ours(models, **options, cap_bytes=cap, check=not args.no_check)
    save_result(path, "inmemory", inmemory)
    print(f"{inmemory_table([inmemory])}\n{limit_text(inmemory)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
