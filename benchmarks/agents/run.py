"""One command for the whole experiment: base, RL agents, merges, evaluation, report.

    python -m benchmarks.agents.run --out benchmarks/agents/results --doc docs/quality.md

It runs both regimes of RL agents (``config.REGIMES``: dense, then sparse) from one base;
``--regimes sparse`` runs one. The dense regime's agents, merges and analysis live at the top
of the cache, the sparse regime's under ``<cache>/sparse/``; the base is shared.
Every stage is cached under ``--cache`` by a key of its inputs (settings, source files,
checkpoint digests), so rerunning after a change redoes only what the change affects;
delete the cache to start over. ``--smoke`` runs the same pipeline at tiny sizes.
Work runs in ``--workers`` processes of one CPU thread each, and the base model trains
with ``pretrain_threads`` threads, so results do not depend on ``--workers``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import multiprocessing
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

import torch

from benchmarks.agents import report
from benchmarks.agents.analysis import dose_response, region_controls, where_updates_land
from benchmarks.agents.config import REGIMES, ExperimentConfig, regime_configs
from benchmarks.agents.evaluate import EvalConfig, eval_sets, evaluate_path
from benchmarks.agents.grpo import MAX_NEW_TOKENS, train_agent
from benchmarks.agents.merges import (
    FIGURE3,
    Setting,
    file_digest,
    fingerprint,
    merge_grid,
    ram_statistics,
    recipe,
    run_mergekit,
)
from benchmarks.agents.model import load_model, save_model
from benchmarks.agents.pretrain import pretrain
from benchmarks.agents.tasks import TASKS
from benchmarks.common import machine_info, machine_line
from benchmarks.records import read_json, save_result, write_json

LOG = logging.getLogger("benchmarks.agents")
HERE = os.path.dirname(os.path.abspath(__file__))
#: The sources each stage's results depend on (a change re-runs that stage and the ones after it).
BASE_CODE = ("tasks.py", "tokenizer.py", "model.py", "pretrain.py")
AGENT_CODE = (*BASE_CODE, "grpo.py")
EVAL_CODE = ("tasks.py", "tokenizer.py", "model.py", "evaluate.py")
MERGE_CODE = (*EVAL_CODE, "merges.py")
ANALYSIS_CODE = (*EVAL_CODE, "analysis.py")
#: Indentation of results.json (many, long records), the cached records and the timings.
INDENT = 1
#: ``{split: {task: accuracy, ..., "avg": mean over tasks}}`` of one checkpoint.
Scores = dict[str, dict[str, float]]
T = TypeVar("T")
R = TypeVar("R")


def code_version(files: tuple[str, ...]) -> str:
    """Digest of the sources whose change invalidates a stage's cached checkpoints or scores."""
    return fingerprint([file_digest(os.path.join(HERE, name)) for name in files])


def model_digest(path: str) -> str:
    return file_digest(os.path.join(path, "model.safetensors"))


def cached(path: str, key: str, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The JSON record at ``path`` if it was written for ``key``; else ``compute()``'s, written there with ``key``."""
    if os.path.exists(path):
        record = read_json(path)
        if record.get("key") == key:
            return record
    record = {"key": key, **compute()}
    write_json(path, record, indent=INDENT)
    return record


class StageTimings:
    """Wall time of each stage when it last did work, kept in ``<cache>/timings.json``.

    A stage served entirely from the cache keeps the time it took when it ran, so the
    report shows what building everything from scratch took, not how long a rerun took.
    """

    def __init__(self, cache: str):
        self.path = os.path.join(cache, "timings.json")
        self.timings: dict[str, float] = {}
        if os.path.exists(self.path):
            self.timings = read_json(self.path)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start_wall, start = time.time(), time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        cache = os.path.dirname(self.path)
        if name not in self.timings or _written_since(cache, start_wall):
            if os.path.exists(self.path):  # another run on this cache may have recorded other stages since
                self.timings = {**read_json(self.path), **self.timings}
            self.timings[name] = seconds
            write_json(self.path, self.timings, indent=INDENT)
        LOG.info("stage %s: %.1f s (as built: %.1f s)", name, seconds, self.timings[name])

    def as_built(self) -> dict[str, float]:
        stages = {name: seconds for name, seconds in self.timings.items() if name != "total"}
        return {**stages, "total": sum(stages.values())}


def _written_since(directory: str, since: float) -> bool:
    """Whether any file under ``directory`` (but timings.json) was written after ``since``."""
    for root, _, files in os.walk(directory):
        for name in files:
            if name != "timings.json" and os.path.getmtime(os.path.join(root, name)) >= since:
                return True
    return False


# Worker processes --------------------------------------------------------------------


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``count`` for the block, then restored."""
    saved = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _init_worker() -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(processName)s %(name)s: %(message)s")


class Workers:
    """``map`` over ``count`` spawned single-thread processes, started once (in-process if ``count`` is 1)."""

    def __init__(self, count: int):
        self.count = count
        self._pool: Optional[multiprocessing.pool.Pool] = None

    def __enter__(self) -> Workers:
        if self.count > 1:
            self._pool = multiprocessing.get_context("spawn").Pool(self.count, initializer=_init_worker)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool.join()

    def map(self, function: Callable[[T], R], jobs: Iterable[T]) -> list[R]:
        jobs = list(jobs)
        if self._pool is not None:
            return self._pool.map(function, jobs, chunksize=1)
        with torch_threads(1):
            return [function(job) for job in jobs]


@dataclass(frozen=True)
class AgentJob:
    task: str
    base: str
    directory: str
    config: ExperimentConfig
    key: str


def agent_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step{step}")


def train_agent_job(job: AgentJob) -> dict[str, Any]:
    """RL-train one agent from the base; save a bfloat16 checkpoint at every snapshot step.

    Returns its training: the mean sampled reward of every step, and its wall time.
    """

    def train() -> dict[str, Any]:
        start = time.perf_counter()
        model = load_model(job.base)  # float32 copy of the bfloat16 base: exact
        curve = train_agent(
            model,
            job.task,
            replace(job.config.grpo, seed=job.config.grpo.seed + TASKS.index(job.task)),
            lambda step, trained: save_model(trained, agent_dir(job.directory, step), torch.bfloat16),
            job.config.snapshots,
        )
        return {"task": job.task, "reward_curve": curve, "seconds": time.perf_counter() - start}

    run = cached(os.path.join(job.directory, "meta.json"), job.key, train)
    return {"reward_curve": run["reward_curve"], "seconds": run["seconds"]}


@dataclass(frozen=True)
class EvalJob:
    path: str
    evaluation: EvalConfig
    key: str


def evaluate_job(job: EvalJob) -> Scores:
    def evaluate() -> dict[str, Any]:
        return {"scores": evaluate_path(job.path, eval_sets(job.evaluation), job.evaluation.batch_size)}

    return cached(os.path.join(job.path, "eval.json"), job.key, evaluate)["scores"]


@dataclass(frozen=True)
class MergeJob:
    setting: Setting
    variant: str
    base: str
    agents: dict[str, str]
    directory: str
    evaluation: EvalConfig
    seed: int
    key: str


def merge_job(job: MergeJob) -> dict[str, Any]:
    """Merge with ``mergekit-yaml``, evaluate, keep the RAM statistics; drop the weights."""

    def merge() -> dict[str, Any]:
        seconds = run_mergekit(recipe(job.setting, job.base, job.agents), job.directory, job.seed)
        model_dir = os.path.join(job.directory, "model")
        scores = evaluate_path(model_dir, eval_sets(job.evaluation), job.evaluation.batch_size)
        statistics = ram_statistics(model_dir, {path: task for task, path in job.agents.items()})
        shutil.rmtree(model_dir)
        return {
            "variant": job.variant,
            "setting": asdict(job.setting),
            "merge_seconds": seconds,
            "scores": scores,
            "ram_statistics": statistics,
        }

    return cached(os.path.join(job.directory, "result.json"), job.key, merge)


# Stages ----------------------------------------------------------------------------


def base_key(config: ExperimentConfig) -> str:
    """The base's cache key: its own settings and sources only, so the RL settings of a regime never change it."""
    return fingerprint("base", config.size, config.pretrain, config.pretrain_threads, code_version(BASE_CODE))


def regime_cache(cache: str, regime: str) -> str:
    """Where a regime's agents, merges and analysis are cached: the dense (first) one at the top, as before."""
    return cache if regime == REGIMES[0] else os.path.join(cache, regime)


def build_base(config: ExperimentConfig, cache: str) -> str:
    """Pretrain the base (or reuse the cached one) and save it in bfloat16."""
    path = os.path.join(cache, "base")
    key = base_key(config)

    def train() -> dict[str, Any]:
        shutil.rmtree(path, ignore_errors=True)
        start = time.perf_counter()
        with torch_threads(config.pretrain_threads):
            model = pretrain(config.size, config.pretrain)
        save_model(model, path, torch.bfloat16)
        return {"seconds": time.perf_counter() - start, "parameters": sum(p.numel() for p in model.parameters())}

    cached(os.path.join(path, "meta.json"), key, train)
    return path


def build_agents(config: ExperimentConfig, cache: str, base: str, workers: Workers) -> dict[str, dict[str, Any]]:
    """One RL agent per task, trained in parallel (one thread each); returns their training by task."""
    base_key = model_digest(base)
    jobs = [
        AgentJob(
            task,
            base,
            os.path.join(cache, "agents", task),
            config,
            fingerprint("agent", task, base_key, config.grpo, config.snapshots, code_version(AGENT_CODE)),
        )
        for task in sorted(TASKS, key=lambda task: -MAX_NEW_TOKENS[task])  # longest rollouts first
    ]
    return {job.task: run for job, run in zip(jobs, workers.map(train_agent_job, jobs))}


def variants(config: ExperimentConfig) -> list[str]:
    """The agents saved after each snapshot's RL steps: ``step40``."""
    return [f"step{step}" for step in config.snapshots]


def agent_paths(config: ExperimentConfig, cache: str, variant: str) -> dict[str, str]:
    return {task: os.path.join(cache, "agents", task, variant) for task in TASKS}


def evaluate_checkpoints(paths: dict[str, str], config: ExperimentConfig, workers: Workers) -> dict[str, Scores]:
    jobs = [
        EvalJob(
            path, config.evaluation, fingerprint("eval", model_digest(path), config.evaluation, code_version(EVAL_CODE))
        )
        for path in paths.values()
    ]
    return dict(zip(paths, workers.map(evaluate_job, jobs)))


def variant_analysis(base: str, agents: dict[str, str], evaluation: EvalConfig) -> dict[str, Any]:
    sets = eval_sets(evaluation)
    return {
        "updates": where_updates_land(base, agents),
        "dose_response": dose_response(base, agents, sets, evaluation.batch_size),
        "controls": region_controls(base, agents, sets, evaluation.batch_size),
    }


def analyse(config: ExperimentConfig, cache: str, base: str) -> dict[str, dict[str, Any]]:
    """Per variant: where the agents' updates land, each agent's dose-response and its regions alone (cached)."""
    result = {}
    for variant in variants(config):
        agents = agent_paths(config, cache, variant)
        key = fingerprint(
            "analysis",
            model_digest(base),
            [model_digest(p) for p in agents.values()],
            config.evaluation,
            code_version(ANALYSIS_CODE),
        )
        measure = functools.partial(variant_analysis, base, agents, config.evaluation)
        analysis = cached(os.path.join(cache, "analysis", f"{variant}.json"), key, measure)
        result[variant] = {name: analysis[name] for name in ("updates", "dose_response", "controls")}
    return result


def merge_settings(config: ExperimentConfig, variant: str) -> list[Setting]:
    main = variant == variants(config)[-1]
    if config.smoke:  # the defaults of a baseline, RAM+ and RAM-TIES, and Figure 3, on the last snapshot only
        smoke = ("task_arithmetic", "ram_plus", "ram_ties")
        grid = merge_grid(pinned_lambdas=False)
        return [s for s in grid if main and (s.default and s.family in smoke or s.family == FIGURE3)]
    grid = merge_grid(pinned_lambdas=config.pinned_lambdas and main)
    if main or config.full_grid_on_snapshots:
        return grid
    return [s for s in grid if s.default] if config.defaults_on_snapshots else []


def run_merges(config: ExperimentConfig, cache: str, base: str, workers: Workers) -> list[dict[str, Any]]:
    jobs = []
    base_digest = model_digest(base)
    for variant in variants(config):
        agents = agent_paths(config, cache, variant)
        digests = [model_digest(path) for path in agents.values()]
        for index, setting in enumerate(merge_settings(config, variant)):
            seed = 1000 + index
            key = fingerprint("merge", setting, base_digest, digests, config.evaluation, seed, code_version(MERGE_CODE))
            jobs.append(
                MergeJob(
                    setting,
                    variant,
                    base,
                    agents,
                    os.path.join(cache, "merges", variant, setting.name),
                    config.evaluation,
                    seed,
                    key,
                )
            )
    LOG.info("merges: %d mergekit-yaml runs on %d workers", len(jobs), workers.count)
    return workers.map(merge_job, jobs)


def run_regime(
    name: str, config: ExperimentConfig, cache: str, base: str, workers: Workers, timings: StageTimings
) -> dict[str, Any]:
    """One regime's agents, their evaluation and analysis, and its merges: its part of results.json."""
    here = regime_cache(cache, name)
    prefix = "" if name == REGIMES[0] else f"{name}: "
    with timings.stage(f"{prefix}agents"):
        agents = build_agents(config, here, base, workers)

    with timings.stage(f"{prefix}evaluate base and agents"):
        checkpoints = {"base": base}  # and the agents as "step40/add"
        for variant in variants(config):
            for task, path in agent_paths(config, here, variant).items():
                checkpoints[f"{variant}/{task}"] = path
        scores = evaluate_checkpoints(checkpoints, config, workers)

    with timings.stage(f"{prefix}analysis"), torch_threads(1):
        analysis = analyse(config, here, base)

    with timings.stage(f"{prefix}merges and their evaluation"):
        merges = run_merges(config, here, base, workers)

    return {
        "config": asdict(config),
        "checkpoint_scores": scores,
        "agents": agents,
        "merges": merges,
        "analysis": analysis,
        "main_variant": variants(config)[-1],
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="results directory (JSON, tables)")
    parser.add_argument("--cache", default=None, help="checkpoints and per-merge records (default: <out>/../.cache)")
    parser.add_argument("--doc", default=None, help="markdown file whose generated section is (re)written")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and a few steps")
    parser.add_argument("--workers", type=int, default=2, help="parallel single-thread processes")
    parser.add_argument(
        "--regimes", nargs="+", choices=REGIMES, default=list(REGIMES), help="which regimes of RL agents to run"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    configs = regime_configs(args.smoke, tuple(name for name in REGIMES if name in args.regimes))
    if len({base_key(config) for config in configs.values()}) > 1:
        raise ValueError(f"the regimes {', '.join(configs)} must share the base's settings (size, pretrain)")
    cache = args.cache or os.path.join(
        os.path.dirname(os.path.abspath(args.out)), ".cache" + ("-smoke" if args.smoke else "")
    )
    torch.manual_seed(0)
    timings = StageTimings(cache)

    with timings.stage("base"):
        base = build_base(next(iter(configs.values())), cache)

    with Workers(args.workers) as workers:
        regimes = {name: run_regime(name, config, cache, base, workers, timings) for name, config in configs.items()}

    command = "python -m benchmarks.agents.run " + " ".join(argv if argv is not None else sys.argv[1:])
    results = {
        "command": command.strip(),
        "machine": machine_line(machine_info()),
        "workers": args.workers,
        "timings": timings.as_built(),
        "parameters": read_json(os.path.join(base, "meta.json"))["parameters"],
        "regimes": regimes,
    }
    save_result(os.path.join(args.out, "results.json"), "agents", results, indent=INDENT)
    print(report.render(results, args.out, args.doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
