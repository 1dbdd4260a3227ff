"""Greedy exact-match accuracy of a checkpoint on the held-out problems of every task."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from benchmarks.agents.model import greedy_correct, load_model
from benchmarks.agents.tasks import TASKS, Problem, Split, sample_problems

SPLITS: tuple[Split, ...] = ("val", "test")


@dataclass(frozen=True)
class EvalConfig:
    val: int = 150
    test: int = 400
    seed: int = 1234
    batch_size: int = 200


EvalSets = dict[str, dict[str, list[Problem]]]


def eval_sets(config: EvalConfig) -> EvalSets:
    """Distinct held-out problems: ``{split: {task: problems}}``, fixed by the seed."""
    sizes = {"val": config.val, "test": config.test}
    return {
        split: {task: sample_problems(task, split, sizes[split], config.seed, unique=True) for task in TASKS}
        for split in SPLITS
    }


def accuracy(model: torch.nn.Module, problems: Sequence[Problem], batch_size: int) -> float:
    """Share of problems whose greedy completion is exactly the answer."""
    ordered = sorted(problems, key=lambda p: len(p.prompt) + len(p.answer))  # less padding per batch
    correct = 0
    for start in range(0, len(ordered), batch_size):
        correct += int(greedy_correct(model, ordered[start : start + batch_size]).sum())
    return correct / len(problems)


def evaluate_path(path: str, sets: EvalSets, batch_size: int) -> dict[str, dict[str, float]]:
    """``{split: {task: accuracy, ..., "avg": mean over tasks}}`` for the checkpoint at ``path``."""
    model = load_model(path)
    return evaluate_model(model, sets, batch_size)


def evaluate_model(model: torch.nn.Module, sets: EvalSets, batch_size: int) -> dict[str, dict[str, float]]:
    result: dict[str, dict[str, float]] = {}
    for split, by_task in sets.items():
        scores = {task: accuracy(model, problems, batch_size) for task, problems in by_task.items()}
        scores["avg"] = sum(scores.values()) / len(scores)
        result[split] = scores
    return result


def standard_error(accuracies: Mapping[str, float], sizes: Mapping[str, int]) -> float:
    """Binomial standard error of the mean of per-task accuracies (tasks independent)."""
    variance = sum(p * (1 - p) / sizes[task] for task, p in accuracies.items() if task in sizes)
    return variance**0.5 / len(sizes)
