"""On-policy RL of one agent with GRPO-style group-normalised advantages, in float32.

Per step: draw ``prompts`` training problems of the agent's task, sample ``group``
completions for each at temperature 1, reward each 0/1 (exact answer), and set

    A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-4)

within each prompt's group. The loss is the policy gradient on completion tokens,

    L = -1/(P G) sum_i A_i * mean_t log pi(y_i,t | x, y_i,<t),

which is GRPO's clipped objective at its on-policy point (one update per batch, so the
ratio is 1 and nothing is clipped), without a KL term (as in DAPO and Dr. GRPO). The
float32 weights start from the bfloat16 base exactly, and snapshots are saved in
bfloat16 as released RL checkpoints are: updates smaller than half a bfloat16 step of a
weight vanish there, which is where most of the sparsity of RL task vectors comes from.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from benchmarks.agents import tokenizer
from benchmarks.agents.model import completion_text, make_batch, sample, token_logprobs
from benchmarks.agents.tasks import Problem, reward, sample_problems

if TYPE_CHECKING:  # transformers loads on first use
    from transformers import PreTrainedModel

LOG = logging.getLogger(__name__)

#: Longest answer of each task plus ``</s>`` and a little slack.
MAX_NEW_TOKENS = {"add": 7, "rev": 20, "tool": 42}


@dataclass(frozen=True)
class GrpoConfig:
    steps: int = 40
    prompts: int = 12
    group: int = 8
    lr: float = 2e-5
    #: Linear warm-up of the learning rate, in steps.
    warmup: int = 5
    temperature: float = 1.0
    seed: int = 0


def grpo_step_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Group-normalised advantages; ``rewards`` is [prompts, group]."""
    mean = rewards.mean(-1, keepdim=True)
    std = rewards.std(-1, keepdim=True)
    return (rewards - mean) / (std + 1e-4)


def train_agent(
    model: PreTrainedModel,
    task: str,
    config: GrpoConfig,
    snapshot: Callable[[int, PreTrainedModel], None],
    snapshot_steps: tuple[int, ...],
) -> list[float]:
    """Train ``model`` in place on ``task``; call ``snapshot(step, model)`` at the given steps.

    Returns the mean sampled reward of every step (the training curve).
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.99), weight_decay=0.0)
    generator = torch.Generator().manual_seed(config.seed)
    rng = random.Random(f"grpo/{task}/{config.seed}")
    curve: list[float] = []
    for step in range(1, config.steps + 1):
        for param_group in optimizer.param_groups:
            param_group["lr"] = config.lr * min(1.0, step / max(1, config.warmup))
        problems = sample_problems(task, "train", config.prompts, rng.randrange(2**31))
        prompts = [tokenizer.encode(problem.prompt) for problem in problems]
        repeated: list[Problem] = [problem for problem in problems for _ in range(config.group)]
        model.eval()
        completions = sample(
            model,
            [prompt for prompt in prompts for _ in range(config.group)],
            MAX_NEW_TOKENS[task],
            generator=generator,
            temperature=config.temperature,
        )
        rewards = torch.tensor(
            [reward(problem, completion_text(ids)) for problem, ids in zip(repeated, completions)]
        ).view(config.prompts, config.group)
        curve.append(rewards.mean().item())
        advantages = grpo_step_advantages(rewards).flatten()
        active = advantages.abs() > 0
        if active.any():
            model.train()
            index = active.nonzero().flatten().tolist()
            batch = make_batch([prompts[i // config.group] for i in index], [completions[i] for i in index])
            logprobs = token_logprobs(model, batch)
            per_sequence = logprobs.sum(-1) / batch.targets.sum(-1).clamp(min=1)
            loss = -(advantages[active] * per_sequence).sum() / advantages.numel()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        if step % 20 == 0 or step == config.steps:
            LOG.info(
                "grpo %s step %d/%d: mean reward %.3f", task, step, config.steps, sum(curve[-20:]) / len(curve[-20:])
            )
        if step in snapshot_steps:
            model.eval()
            snapshot(step, model)
    return curve
