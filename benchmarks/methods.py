"""The real ``mergekit-yaml`` command, method against method, as a user runs it.

Each merge is its own ``mergekit-yaml`` process (start-up, planning, the ram_plus pre-pass,
writing the output: everything a user waits for), methods in turns (A B C A B C ...) so
that load from other users of a shared machine spreads over all of them. Per method: the
median wall time, CPU time, peak RSS and peak anonymous memory, the ratio of each to
``task_arithmetic``, and for ``ram_plus`` the share of the wall time its pre-pass took
(parsed from the ``-v`` log line ``ram_plus pre-pass done in X s``). The options every
method gets are listed in docs/performance.md ("How to run").

With ``--load N`` every merge runs beside N busy background processes (a loaded machine: a
laptop with a browser open, a shared box), results in ``methods-SIZE-loadN.json``.

    python -m benchmarks.methods --size 120m --repeats 3
    python -m benchmarks.methods --size 120m --repeats 3 --load 4
"""

from __future__ import annotations

import argparse
import functools
import logging
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import yaml

from benchmarks.common import (
    CACHE_DIR,
    background_load,
    child_env,
    console_script,
    cpu_s,
    fmt_bytes,
    fmt_count,
    fmt_ratio,
    fmt_seconds,
    machine_info,
    machine_line,
    median,
    plugin_checkout,
    ratio_or_none,
    run_measured,
    setup_logging,
)
from benchmarks.models import SIZES, ensure_models
from benchmarks.records import RESULTS_DIR, read_json, save_result
from mergekit_ram.stats.render import markdown_table

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
METRICS = ("wall_s", "cpu_s", "max_rss_bytes", "peak_anon_bytes")
LABELS = {"wall_s": "wall", "cpu_s": "CPU", "max_rss_bytes": "peak RSS", "peak_anon_bytes": "peak anon"}
#: What each target is also read in: CPU time is steadier on a loaded machine, anonymous memory leaves
#: out the page cache of the mapped inputs.
COUNTERPART = {"wall_s": "cpu_s", "max_rss_bytes": "peak_anon_bytes"}
PREPASS_LINE = re.compile(r"ram_plus pre-pass done in ([0-9.]+) s")
#: Issue 5's targets (and issue 21's for ram_ties), as ratios in one run, binding from 100M parameters:
#: (numerator, denominator, metric, bound); the ratio must stay at most the bound, or at least it
#: when the numerator is the slower method (a speed-up).
TARGETS = (
    ("ram", "task_arithmetic", "wall_s", 1.05),
    ("ram_plus", "task_arithmetic", "wall_s", 1.10),
    ("ram_plus", "task_arithmetic", "max_rss_bytes", 1.10),
    ("ties", "ram_plus", "wall_s", 3.0),
    ("ram_ties", "ram", "wall_s", 2.0),
    ("ties", "ram_ties", "wall_s", 1.5),
)
AT_LEAST = {"ties"}  # a target whose numerator is ties is a speed-up
#: Issue 51's bounds beside four busy background processes, where they differ from the quiet ones.
LOADED_BOUNDS = {("ram", "task_arithmetic", "wall_s"): 1.15, ("ram_plus", "task_arithmetic", "wall_s"): 1.25}
TARGET_MIN_PARAMETERS = 100_000_000


def write_recipe(method: str, models: Mapping[str, Any], path: Path, out_dtype: Optional[str]) -> Path:
    """The YAML a user would write: absolute local paths, the same options for every method."""
    parameters = METHOD_PARAMETERS[method]
    entries = [
        {"model": agent, **({"parameters": dict(parameters)} if parameters else {})} for agent in models["agents"]
    ]
    recipe = {"merge_method": method, "base_model": models["base"], "models": entries, "dtype": "bfloat16"}
    if out_dtype:
        recipe["out_dtype"] = out_dtype
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    return path


def run_merge(
    method: str,
    models: Mapping[str, Any],
    workdir: Path,
    *,
    env: dict[str, str],
    out_shard_size: str,
    out_dtype: Optional[str] = "bfloat16",
    extra: Sequence[str] = (),
    tag: str = "",
    data_limit_bytes: Optional[int] = None,
    keep_output: bool = False,
) -> dict[str, Any]:
    """One measured ``mergekit-yaml`` run into ``workdir/out-METHOD``: its pre-pass time and RAM statistics
    kept under ``extra``, then the output deleted unless ``keep_output``."""
    recipe = write_recipe(method, models, workdir / f"{method}.yml", out_dtype)
    out = workdir / f"out-{method}"
    log_path = workdir / "logs" / f"{method}{tag}.log"
    shutil.rmtree(out, ignore_errors=True)
    command = [console_script("mergekit-yaml"), str(recipe), str(out), "-v", "--out-shard-size", out_shard_size]
    command += ["--no-copy-tokenizer", "--random-seed", "0", *extra]
    measurement = run_measured(command, env=env, log_path=log_path, data_limit_bytes=data_limit_bytes)
    if measurement["returncode"] == 0:
        if not any(out.glob("*.safetensors")):
            raise RuntimeError(f"{method}: mergekit-yaml succeeded but wrote no weights into {out}")
        found = PREPASS_LINE.findall(log_path.read_text(encoding="utf-8", errors="replace"))
        if found:
            measurement["extra"]["prepass_s"] = float(found[-1])
        if (out / "ram_statistics.json").exists():
            measurement["extra"]["statistics"] = model_figures(read_json(out / "ram_statistics.json"))
    if not keep_output:
        shutil.rmtree(out, ignore_errors=True)
    return measurement


def model_figures(statistics: Mapping[str, Any]) -> dict[str, dict[str, Optional[float]]]:
    """density, rho (None: infinite) and lambda per model from a ``ram_statistics.json`` of either schema."""
    return {
        Path(str(entry["model"])).name: {
            "density": entry["density"],
            "rho": ratio_or_none(entry["rho"]),
            "lambda": entry["lambda"],
        }
        for entry in statistics.get("models", [])
    }


def benchmark_methods(
    models: Mapping[str, Any],
    *,
    methods: Sequence[str] = METHODS,
    repeats: int = 3,
    out_shard_size: str = "1B",
    out_dtype: Optional[str] = "bfloat16",
    extra: Sequence[str] = (),
    plugin: Optional[Path] = None,
    warmup: bool = True,
    load: int = 0,
) -> dict[str, Any]:
    """Every method ``repeats`` times in turns, after one untimed warm-up run (page cache, bytecode), beside
    ``load`` busy background processes."""
    env = child_env(plugin)
    workdir = CACHE_DIR / "runs" / models["size"]
    machine = machine_info(env)
    merge = functools.partial(
        run_merge,
        models=models,
        workdir=workdir,
        env=env,
        out_shard_size=out_shard_size,
        out_dtype=out_dtype,
        extra=extra,
    )
    runs: dict[str, list[dict[str, Any]]] = {method: [] for method in methods}
    with background_load(load):
        if warmup:
            merge(methods[0], tag="-warmup")
        for round_index in range(repeats):
            for method in methods:
                measurement = merge(method, tag=f"-{round_index}")
                if measurement["returncode"]:
                    tail = measurement["log_tail"]
                    raise RuntimeError(f"{method} failed (exit {measurement['returncode']}):\n{tail}")
                LOG.info("round %d %-15s %7.2f s", round_index + 1, method, measurement["wall_s"])
                runs[method].append(measurement)
    return {
        "size": models["size"],
        "models": models,
        "options": {
            "repeats": repeats,
            "out_shard_size": out_shard_size,
            "out_dtype": out_dtype,
            "extra_args": list(extra),
            "warmup": warmup,
            "background_processes": load,
            "method_parameters": {method: METHOD_PARAMETERS[method] for method in methods},
        },
        "machine": machine,
        "runs": runs,
        "summary": summarise(runs),
    }


def summarise(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Medians per method, ratios to the reference method, the ram_plus pre-pass share."""
    summary = {}
    for method, measurements in runs.items():
        prepass = [(m["extra"]["prepass_s"], m["wall_s"]) for m in measurements if "prepass_s" in m["extra"]]
        statistics = [m["extra"]["statistics"] for m in measurements if "statistics" in m["extra"]]
        summary[method] = {
            "runs": len(measurements),
            "wall_s": median(m["wall_s"] for m in measurements),
            "wall_min_s": min(m["wall_s"] for m in measurements),
            "cpu_s": median(cpu_s(m) for m in measurements),
            "max_rss_bytes": median(m["max_rss_bytes"] for m in measurements),
            "peak_anon_bytes": median(m["peak_anon_bytes"] for m in measurements),
            "prepass_s": median(seconds for seconds, _ in prepass) if prepass else None,
            "prepass_share": median(seconds / wall for seconds, wall in prepass) if prepass else None,
            "statistics": statistics[-1] if statistics else None,
        }
    if REFERENCE in summary:
        reference = summary[REFERENCE]
        for entry in summary.values():
            entry.update({f"{key}_ratio": entry[key] / reference[key] if reference[key] else None for key in METRICS})
    return summary


def methods_table(results: Sequence[Mapping[str, Any]]) -> str:
    """Every method of every run: medians, and ratios to ``task_arithmetic`` ("x TA") in the same run."""
    rows = []
    for result in results:
        for method, entry in result["summary"].items():
            prepass = entry.get("prepass_share")
            cells = [run_label(result), f"`{method}`"]
            for metric in METRICS:
                value = entry[metric]
                cells += [fmt_bytes(value) if "bytes" in metric else fmt_seconds(value)]
                cells += [fmt_ratio(entry.get(f"{metric}_ratio"))]
            rows.append([*cells, "" if prepass is None else f"{prepass:.0%} ({fmt_seconds(entry['prepass_s'])})"])
    headers = ["size", "method", "wall (median)", "x TA", "CPU", "x TA", "peak RSS", "x TA", "peak anon", "x TA"]
    return markdown_table([[*headers, "pre-pass share"], *rows], "l")


def run_label(result: Mapping[str, Any]) -> str:
    """The size, and the background load where there was one."""
    load = result["options"].get("background_processes", 0)
    return f"`{result['size']}`" + (f", {load} busy processes" if load else "")


def target_ratio(summary: Mapping[str, Any], target: tuple, metric: str) -> Optional[float]:
    numerator, denominator = summary.get(target[0]), summary.get(target[1])
    if not numerator or not denominator or not numerator[metric] or not denominator[metric]:
        return None
    return numerator[metric] / denominator[metric]


def targets_table(results: Sequence[Mapping[str, Any]]) -> str:
    """One row per run: each target's ratio (and in CPU time or anonymous memory), met or missed.

    Targets that no run measured are left out; below 100M parameters a target is not binding.
    """
    targets = [t for t in TARGETS if any(target_ratio(r["summary"], t, t[2]) for r in results)]

    def cell(value: Optional[float], target: tuple, loaded: bool) -> str:
        if value is None:
            return "not run"
        bound = LOADED_BOUNDS.get(target[:3], target[3]) if loaded else target[3]
        met = value >= bound if target[0] in AT_LEAST else value <= bound
        return fmt_ratio(value) + ("" if met else " (missed)")

    rows = []
    for result in results:
        models = result["models"]
        loaded = result["options"].get("background_processes", 0)
        label = f"{fmt_count(models['parameters'])} (`{result['size']}`)" + (
            f", {loaded} busy processes" if loaded else ""
        )
        if models["disk_bytes"] > result["machine"]["memory_bytes"]:
            label += ", inputs larger than memory"
        if models["parameters"] < TARGET_MIN_PARAMETERS:
            label += ", not binding"
        cells = []
        for target in targets:
            main, other = (target_ratio(result["summary"], target, m) for m in (target[2], COUNTERPART[target[2]]))
            cells.append(
                cell(main, target, bool(loaded)) + ("" if other is None else f" ({cell(other, target, bool(loaded))})")
            )
        rows.append([label, *cells])
    bounds = [
        ("at least " if t[0] in AT_LEAST else "at most ")
        + f"{t[3]:g}x"
        + (f" ({LOADED_BOUNDS[t[:3]]:g}x loaded)" if t[:3] in LOADED_BOUNDS else "")
        for t in targets
    ]
    headers = [f"`{t[0]}` / `{t[1]}` {LABELS[t[2]]} ({LABELS[COUNTERPART[t[2]]]})" for t in targets]
    return markdown_table([["parameters per model", *headers], *rows, ["target", *bounds]], "l")


def heading(result: Mapping[str, Any]) -> str:
    models = result["models"]
    return (
        f"`{result['size']}`: {fmt_count(models['parameters'])} parameters per model, largest tensor "
        f"{fmt_count(models['largest_tensor'])} elements; {result['options']['repeats']} rounds; "
        + (f"{load} busy background processes; " if (load := result["options"].get("background_processes")) else "")
        + machine_line(result["machine"])
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="120m", choices=sorted(SIZES))
    parser.add_argument("--repeats", type=int, default=3, help="rounds of all methods (default 3)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated, first is the warm-up")
    parser.add_argument("--out-shard-size", default="1B", help="passed to every mergekit-yaml (default 1B)")
    parser.add_argument("--out-dtype", default="bfloat16", help="recipe out_dtype for every method; 'none' to omit")
    parser.add_argument("--mergekit-args", default="", help="extra arguments for every run, e.g. '--cuda' or '-j 2'")
    parser.add_argument(
        "--plugin", type=plugin_checkout, help="checkout whose mergekit_ram the merges use (default: this one)"
    )
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--load", type=int, default=0, help="busy background processes during the runs (default 0)")
    parser.add_argument("--json", type=Path, help="results file (default benchmarks/results/methods-SIZE.json)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    methods = [method.strip() for method in args.methods.split(",") if method.strip()]
    if set(methods) - set(METHODS):
        raise SystemExit(f"unknown methods: {sorted(set(methods) - set(METHODS))}")
    result = benchmark_methods(
        ensure_models(args.size),
        methods=methods,
        repeats=args.repeats,
        out_shard_size=args.out_shard_size,
        out_dtype=None if args.out_dtype.lower() == "none" else args.out_dtype,
        extra=args.mergekit_args.split(),
        plugin=args.plugin,
        warmup=not args.no_warmup,
        load=args.load,
    )
    name = f"methods-{args.size}" + (f"-load{args.load}" if args.load else "")
    save_result(args.json or RESULTS_DIR / f"{name}.json", "methods", result)
    print(f"{heading(result)}\n\n{methods_table([result])}\n\n{targets_table([result])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
