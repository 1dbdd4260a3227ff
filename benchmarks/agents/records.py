"""The agents experiment's results: the typed record ``results.json`` holds, its names, and how "best" is chosen.

Shared by :mod:`benchmarks.agents.run` (writes it), :mod:`benchmarks.agents.analysis` (its
analysis records), :mod:`benchmarks.agents.report` (tables, doc) and
:mod:`benchmarks.agents.plot` (figure); imports point one way, from those to here. Each
record's ``to_dict`` writes the layout the stored file has, so ``python -m
benchmarks.agents.records`` checks that ``results.json`` loads and saves back byte-identical.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional, Sequence

from benchmarks.agents.config import ExperimentConfig
from benchmarks.agents.merges import Setting, ram_plus_name
from benchmarks.agents.tasks import TASKS
from benchmarks.records import JSON, FlatRecord, json_text, read_json, write_json
from mergekit_ram.stats.arithmetic import module_of
from mergekit_ram.stats.schema import INFINITY

#: ``{split: {task: accuracy, ..., "avg": mean over tasks}}`` of one checkpoint.
Scores = dict[str, dict[str, float]]
BASE = "base"
#: Indentation of results.json (many, long records).
RESULTS_INDENT = 1


def variant_name(step: int) -> str:
    """The agents saved after ``step`` RL steps: ``step40``."""
    return f"step{step}"


def variant_steps(variant: str) -> str:
    """The RL steps of a variant, as written in the tables: ``step40`` -> ``40``."""
    return variant.removeprefix("step")


def checkpoint_name(variant: str, task: str) -> str:
    """The key of an agent's scores in ``checkpoint_scores``: ``step40/add``."""
    return f"{variant}/{task}"


# RAM statistics of a merge ---------------------------------------------------------


@dataclass(frozen=True)
class AgentCounts:
    """One agent in a ``ram`` / ``ram_plus`` merge's ``ram_statistics.json``: its counts, rho and lambda."""

    parameters: int
    changed: int
    density: float
    unique: int
    shared: int
    overlap_histogram: dict[str, int]  # "k": elements this agent changed that k agents changed
    rho: Optional[float]  # shared / unique; None: infinite (no unique change)
    measured_rho: Optional[float]
    lambda_: float

    FIELDS: ClassVar[tuple[str, ...]] = (
        "parameters",
        "changed",
        "density",
        "unique",
        "shared",
        "overlap_histogram",
        "rho",
        "measured_rho",
    )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AgentCounts:
        """From this experiment's results.json or a ram_statistics.json of either schema (infinity is
        ``null`` in schema 1 and here, ``"inf"`` in schema 2)."""
        fields = {name: data[name] for name in cls.FIELDS}
        for name in ("rho", "measured_rho"):
            fields[name] = None if fields[name] in (None, INFINITY) else fields[name]
        return cls(**fields, lambda_=data["lambda"])

    def to_dict(self) -> JSON:
        return {**{name: getattr(self, name) for name in self.FIELDS}, "lambda": self.lambda_}

    def changed_by(self, agents: int) -> int:
        """Elements this agent changed that exactly ``agents`` agents changed."""
        return self.overlap_histogram.get(str(agents), 0)


@dataclass(frozen=True)
class KindCounts(FlatRecord):
    """One agent's elements in one kind of weight (``mergekit_ram.stats.MODULES``)."""

    parameters: int
    changed: int
    unique: int


@dataclass(frozen=True)
class MergeStatistics:
    """The agents' counts, rho and lambda in one ``ram`` / ``ram_plus`` merge, and the counts by kind of weight."""

    parameters: dict[str, Any]  # the merge's parameters as the file reports them (epsilon; r, alpha, rule)
    models: dict[str, AgentCounts]  # by agent (task)
    by_kind: dict[str, dict[str, KindCounts]]  # by agent, then kind of weight

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MergeStatistics:
        return cls(
            parameters=dict(data["parameters"]),
            models={agent: AgentCounts.from_dict(entry) for agent, entry in data["models"].items()},
            by_kind={
                agent: {kind: KindCounts.from_dict(counts) for kind, counts in kinds.items()}
                for agent, kinds in data["by_kind"].items()
            },
        )

    def to_dict(self) -> JSON:
        return {
            "parameters": self.parameters,
            "models": {agent: counts.to_dict() for agent, counts in self.models.items()},
            "by_kind": {
                agent: {kind: counts.to_dict() for kind, counts in kinds.items()}
                for agent, kinds in self.by_kind.items()
            },
        }

    @classmethod
    def read(cls, model_dir: str, names: Mapping[str, str]) -> Optional[MergeStatistics]:
        """The ``ram_statistics.json`` mergekit-ram wrote into ``model_dir`` (None without one: not a RAM merge).

        ``names`` maps the model ids in the file (paths) to short names. The per-tensor
        histograms are summed into changed and unique counts per agent and kind of weight.
        """
        path = os.path.join(model_dir, "ram_statistics.json")
        if not os.path.exists(path):
            return None
        data = read_json(path)

        def short(model: str) -> str:
            return names.get(model, names.get(os.path.abspath(model), model))

        kinds: dict[str, dict[str, dict[str, int]]] = {}
        for tensor in data["tensors"]:
            kind = module_of(tensor["name"])
            for model, histogram in zip(tensor["models"], tensor["histograms"]):
                counts = kinds.setdefault(short(model), {}).setdefault(
                    kind, {"parameters": 0, "changed": 0, "unique": 0}
                )
                counts["parameters"] += tensor["numel"]
                counts["changed"] += sum(histogram)
                counts["unique"] += histogram[0] if histogram else 0
        return cls.from_dict(
            {
                "parameters": data["parameters"],
                "models": {short(entry["model"]): entry for entry in data["models"]},
                "by_kind": kinds,
            }
        )


# Analysis of the checkpoints -------------------------------------------------------


@dataclass(frozen=True)
class Binade(FlatRecord):
    """Weights with |w_base| in [2^exponent, 2^(exponent + 1)) (the first and last binades pool the rest)."""

    exponent: int
    share_of_weights: float
    half_step: float  # half a bfloat16 step there: smaller changes are not recorded


@dataclass(frozen=True)
class AgentUpdates(FlatRecord):
    """Where one agent's changes (|tau| > epsilon) land."""

    density: float
    density_by_binade: list[Optional[float]]  # None: no weight in that binade
    unique_share: float
    unique_share_if_independent: float  # prod over the other agents of (1 - their density)


@dataclass(frozen=True)
class UpdateAnalysis:
    """``analysis.where_updates_land`` for one variant's agents."""

    binades: list[Binade]
    agents: dict[str, AgentUpdates]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> UpdateAnalysis:
        return cls(
            binades=[Binade.from_dict(binade) for binade in data["binades"]],
            agents={task: AgentUpdates.from_dict(entry) for task, entry in data["agents"].items()},
        )

    def to_dict(self) -> JSON:
        return {
            "binades": [binade.to_dict() for binade in self.binades],
            "agents": {task: entry.to_dict() for task, entry in self.agents.items()},
        }


@dataclass(frozen=True)
class VariantAnalysis:
    """Both analyses of one variant's agents (:mod:`benchmarks.agents.analysis`)."""

    updates: UpdateAnalysis
    dose_response: dict[str, dict[str, float]]  # by agent: lambda (``f"{lambda:.3g}"``) -> own-task test accuracy

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> VariantAnalysis:
        return cls(updates=UpdateAnalysis.from_dict(data["updates"]), dose_response=dict(data["dose_response"]))

    def to_dict(self) -> JSON:
        return {"updates": self.updates.to_dict(), "dose_response": self.dose_response}


# The results -----------------------------------------------------------------------


@dataclass(frozen=True)
class AgentRun(FlatRecord):
    """One agent's RL training: mean sampled reward per step, and its wall time."""

    reward_curve: list[float]
    seconds: float


@dataclass(frozen=True)
class MergeRecord:
    """One merge of the grid: its setting, time, scores and (``ram`` / ``ram_plus``) RAM statistics."""

    key: str  # the cache key it was computed under
    variant: str
    setting: Setting
    merge_seconds: float
    scores: Scores
    ram_statistics: Optional[MergeStatistics]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MergeRecord:
        statistics = data["ram_statistics"]
        return cls(
            key=data["key"],
            variant=data["variant"],
            setting=Setting(**data["setting"]),
            merge_seconds=data["merge_seconds"],
            scores=data["scores"],
            ram_statistics=None if statistics is None else MergeStatistics.from_dict(statistics),
        )

    def to_dict(self) -> JSON:
        return {
            "key": self.key,
            "variant": self.variant,
            "setting": self.setting.to_dict(),
            "merge_seconds": self.merge_seconds,
            "scores": self.scores,
            "ram_statistics": None if self.ram_statistics is None else self.ram_statistics.to_dict(),
        }


@dataclass(frozen=True)
class Results:
    """Everything ``results.json`` holds; the figures and tables are rendered from it alone."""

    config: ExperimentConfig
    command: str
    machine: str  # records.Machine.description() of the machine it ran on
    workers: int
    timings: dict[str, float]  # stage -> seconds as built
    parameters: int
    checkpoint_scores: dict[str, Scores]  # BASE and checkpoint_name(variant, task)
    agents: dict[str, AgentRun]  # by task
    merges: list[MergeRecord]
    analysis: dict[str, VariantAnalysis]  # by variant
    main_variant: str

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Results:
        return cls(
            config=ExperimentConfig.from_dict(data["config"]),
            command=data["command"],
            machine=data["machine"],
            workers=data["workers"],
            timings=data["timings"],
            parameters=data["parameters"],
            checkpoint_scores=data["checkpoint_scores"],
            agents={task: AgentRun.from_dict(run) for task, run in data["agents"].items()},
            merges=[MergeRecord.from_dict(merge) for merge in data["merges"]],
            analysis={variant: VariantAnalysis.from_dict(entry) for variant, entry in data["analysis"].items()},
            main_variant=data["main_variant"],
        )

    def to_dict(self) -> JSON:
        return {
            "config": self.config.to_dict(),
            "command": self.command,
            "machine": self.machine,
            "workers": self.workers,
            "timings": self.timings,
            "parameters": self.parameters,
            "checkpoint_scores": self.checkpoint_scores,
            "agents": {task: run.to_dict() for task, run in self.agents.items()},
            "merges": [merge.to_dict() for merge in self.merges],
            "analysis": {variant: entry.to_dict() for variant, entry in self.analysis.items()},
            "main_variant": self.main_variant,
        }

    @classmethod
    def load(cls, path: str) -> Results:
        """The record ``benchmarks.agents.run`` wrote to ``path``."""
        return cls.from_dict(read_json(path))

    def save(self, path: str) -> None:
        write_json(path, self.to_dict(), indent=RESULTS_INDENT)

    @property
    def variants(self) -> list[str]:
        return [variant_name(step) for step in self.config.snapshots]

    def base_scores(self, split: str = "test") -> dict[str, float]:
        return self.checkpoint_scores[BASE][split]

    def agent_scores(self, variant: str, task: str, split: str = "test") -> dict[str, float]:
        return self.checkpoint_scores[checkpoint_name(variant, task)][split]

    def specialists_average(self, variant: str) -> float:
        """Mean over tasks of each agent's accuracy on its own task (test split)."""
        return sum(self.agent_scores(variant, task)[task] for task in TASKS) / len(TASKS)

    def merges_of(self, variant: str, family: Optional[str] = None) -> list[MergeRecord]:
        return [m for m in self.merges if m.variant == variant and (family is None or m.setting.family == family)]

    def merge(self, variant: str, name: str) -> Optional[MergeRecord]:
        return next((m for m in self.merges_of(variant) if m.setting.name == name), None)

    def test_size(self) -> dict[str, int]:
        return {task: self.config.evaluation.test for task in TASKS}


def best_and_default(records: Sequence[MergeRecord]) -> tuple[Optional[MergeRecord], Optional[MergeRecord]]:
    """The validation-best tuned record (ties: default first, then grid order) and the default one."""
    tuned = [r for r in records if r.setting.tuned]
    default = next((r for r in tuned if r.setting.default), None)
    if not tuned:
        return None, default
    order = sorted(range(len(tuned)), key=lambda i: (-tuned[i].scores["val"]["avg"], not tuned[i].setting.default, i))
    return tuned[order[0]], default


@dataclass(frozen=True)
class AgentStatistics:
    """The agents of one variant: their counts (the same in every ``ram`` / ``ram_plus`` merge of them)
    and the lambdas the default RAM+ (clip) and RAM+s (soft), r = 0.1, gave them."""

    counts: MergeStatistics
    lambda_clip: dict[str, float]  # by agent; empty without that merge
    lambda_soft: dict[str, float]

    def lambda_of(self, rule: str, agent: str) -> float:
        """lambda of ``agent`` under ``rule`` (``clip`` or ``soft``); NaN without that merge."""
        return (self.lambda_clip if rule == "clip" else self.lambda_soft).get(agent, math.nan)


def agent_statistics(results: Results, variant: str) -> Optional[AgentStatistics]:
    """RAM statistics of the agents of ``variant``, with lambdas of the default RAM+ and RAM+s."""
    counted = {m.setting.name: m.ram_statistics for m in results.merges_of(variant) if m.ram_statistics is not None}
    if not counted:
        return None

    def lambdas(rule: str) -> dict[str, float]:
        merge = counted.get(ram_plus_name(rule, 0.1))
        return {} if merge is None else {agent: counts.lambda_ for agent, counts in merge.models.items()}

    return AgentStatistics(
        counts=counted.get("ram") or next(iter(counted.values())),
        lambda_clip=lambdas("clip"),
        lambda_soft=lambdas("soft"),
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Check that ``results.json`` (default: the stored one) loads into :class:`Results` and saves back unchanged."""
    path = argv[0] if argv else os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "results.json")
    with open(path, encoding="utf-8") as handle:
        same = json_text(Results.load(path).to_dict(), RESULTS_INDENT) == handle.read()
    print(f"{path}: {'loads and saves back byte-identical' if same else 'does not save back to the same bytes'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
