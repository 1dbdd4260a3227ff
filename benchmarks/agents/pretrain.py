"""Supervised training of the base model on an mixture of the three tasks.

A fresh batch of training-split problems at every step (no repeats to memorise), AdamW
with linear warm-up and cosine decay, loss on answer tokens only. Training stops early on
purpose: the base should be partly competent at each task, so RL has room to improve.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

import torch

from benchmarks.agents.model import ModelSize, new_model, problem_batch, supervised_loss
from benchmarks.agents.tasks import GENERATORS, TASKS, Problem, restyle, split_of

if TYPE_CHECKING:  # transformers loads on first use
    from transformers import PreTrainedModel

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class PretrainConfig:
    steps: int = 600
    batch_size: int = 64
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.01
    #: Share of each task (TASKS order) in every batch: addition is learned slowest.
    mixture: tuple[float, ...] = (0.4, 0.25, 0.35)
    #: Share of supervised answers in the canonical convention; the rest use ``restyle``.
    canonical_share: float = 0.5
    seed: int = 0


def training_batch(
    rng: random.Random, batch_size: int, mixture: Sequence[float], canonical_share: float
) -> list[Problem]:
    """``batch_size`` training-split problems, ``round(share * batch_size)`` of each task.

    Each answer is in the canonical convention with probability ``canonical_share``,
    else in the other one (``restyle``).
    """
    counts = [round(share * batch_size / sum(mixture)) for share in mixture]
    problems: list[Problem] = []
    for task, count in zip(TASKS, counts):
        while count > 0:
            problem = GENERATORS[task](rng)
            if split_of(problem.prompt) == "train":
                if rng.random() >= canonical_share:
                    problem = replace(problem, answer=restyle(problem))
                problems.append(problem)
                count -= 1
    return problems


def learning_rate(step: int, config: PretrainConfig) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def pretrain(size: ModelSize, config: PretrainConfig) -> PreTrainedModel:
    """Train a base model from scratch; returns it in float32 (the caller saves it in bfloat16)."""
    model = new_model(size, config.seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    rng = random.Random(f"pretrain/{config.seed}")
    for step in range(config.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, config)
        loss = supervised_loss(
            model, problem_batch(training_batch(rng, config.batch_size, config.mixture, config.canonical_share))
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 100 == 0 or step == config.steps - 1:
            LOG.info("pretrain step %d/%d: loss %.4f", step + 1, config.steps, loss.item())
    model.eval()
    return model
