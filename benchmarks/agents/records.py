"""The agents experiment's results: the record ``results.json`` holds, its names, and how "best" is chosen.

Shared by :mod:`benchmarks.agents.run` (writes it), :mod:`benchmarks.agents.report` (tables,
doc) and :mod:`benchmarks.agents.plot` (figure); imports point one way, from those to here.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional, Sequence

from benchmarks.agents.merges import Setting, ram_plus_name
from benchmarks.agents.tasks import TASKS
from benchmarks.records import write_json

#: ``{split: {task: accuracy, ..., "avg": mean over tasks}}`` of one checkpoint.
Scores = dict[str, dict[str, float]]
BASE = "base"


def variant_name(step: int) -> str:
    """The agents saved after ``step`` RL steps: ``step40``."""
    return f"step{step}"


def variant_steps(variant: str) -> str:
    """The RL steps of a variant, as written in the tables: ``step40`` -> ``40``."""
    return variant.removeprefix("step")


def checkpoint_name(variant: str, task: str) -> str:
    """The key of an agent's scores in ``checkpoint_scores``: ``step40/add``."""
    return f"{variant}/{task}"


@dataclass(frozen=True)
class MergeRecord:
    """One merge of the grid: its setting, time, scores and (``ram`` / ``ram_plus``) RAM statistics."""

    key: str  # the cache key it was computed under
    variant: str
    setting: Setting
    merge_seconds: float
    scores: Scores
    ram_statistics: Optional[dict[str, Any]]  # merges.ram_statistics_summary of its ram_statistics.json

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MergeRecord:
        return cls(**{**data, "setting": Setting(**data["setting"])})


@dataclass
class Results:
    """Everything ``results.json`` holds; the figures and tables are rendered from it alone."""

    config: dict[str, Any]
    command: str
    machine: str
    workers: int
    timings: dict[str, float]
    parameters: int
    checkpoint_scores: dict[str, Scores]
    agents: dict[str, Any]
    merges: list[MergeRecord]
    analysis: dict[str, Any]
    main_variant: str

    @classmethod
    def load(cls, path: str) -> Results:
        """The record ``benchmarks.agents.run`` wrote to ``path``."""
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        return cls(**{**data, "merges": [MergeRecord.from_dict(merge) for merge in data["merges"]]})

    def save(self, path: str) -> None:
        write_json(path, asdict(self), indent=1)

    @property
    def variants(self) -> list[str]:
        return [variant_name(step) for step in self.config["snapshots"]]

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
        return {task: self.config["evaluation"]["test"] for task in TASKS}


def best_and_default(records: Sequence[MergeRecord]) -> tuple[Optional[MergeRecord], Optional[MergeRecord]]:
    """The validation-best tuned record (ties: default first, then grid order) and the default one."""
    tuned = [r for r in records if r.setting.tuned]
    default = next((r for r in tuned if r.setting.default), None)
    if not tuned:
        return None, default
    order = sorted(range(len(tuned)), key=lambda i: (-tuned[i].scores["val"]["avg"], not tuned[i].setting.default, i))
    return tuned[order[0]], default


def agent_statistics(results: Results, variant: str) -> Optional[dict[str, Any]]:
    """RAM statistics of the agents of ``variant``, with lambdas of the default RAM+ and RAM+s."""
    counted = {m.setting.name: m.ram_statistics for m in results.merges_of(variant) if m.ram_statistics is not None}
    if not counted:
        return None
    # The counts are the same in every ram / ram_plus merge of these agents; lambdas are not.
    statistics = copy.deepcopy(counted.get("ram") or next(iter(counted.values())))
    for name, key in ((ram_plus_name("clip", 0.1), "lambda_clip"), (ram_plus_name("soft", 0.1), "lambda_soft")):
        for task, entry in counted.get(name, {"models": {}})["models"].items():
            statistics["models"][task][key] = entry["lambda"]
    return statistics
