"""The small Llama model: building, saving, loading, batching, sampling and scoring.

Sequences are ``<s> prompt answer </s>``. Batches are left-padded (the prompt ends at
the same column for every row, so sampling can append one column per step) with an
attention mask and position ids counted from each row's first real token, so padding
changes nothing a row computes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from benchmarks.agents import tokenizer
from benchmarks.agents.tasks import Problem

if TYPE_CHECKING:  # transformers loads on first use
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class ModelSize:
    hidden_size: int = 192
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 6
    num_kv_heads: int = 2


def new_model(size: ModelSize, seed: int) -> PreTrainedModel:
    """A freshly initialised float32 ``LlamaForCausalLM`` over the character vocabulary."""
    from transformers import AutoModelForCausalLM

    from mergekit_ram.synthetic import tiny_config

    config = tiny_config(
        "llama",
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_layers=size.num_layers,
        num_heads=size.num_heads,
        num_kv_heads=size.num_kv_heads,
        vocab_size=tokenizer.VOCAB_SIZE,
    )
    config.bos_token_id, config.eos_token_id, config.pad_token_id = tokenizer.BOS_ID, tokenizer.EOS_ID, tokenizer.PAD_ID
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def save_model(model: PreTrainedModel, path: str, dtype: torch.dtype) -> None:
    """Save as safetensors in ``dtype`` (bfloat16 for base and agents), with the tokenizer."""
    os.makedirs(path, exist_ok=True)
    copy = type(model)(model.config)
    copy.load_state_dict(model.state_dict())
    copy.to(dtype)  # type: ignore[arg-type]  # transformers types its wrapped to() as if unbound
    copy.save_pretrained(path, safe_serialization=True)
    tokenizer.save_tokenizer(path)


def load_model(path: str) -> PreTrainedModel:
    """Load any checkpoint (bfloat16 or float32) into float32: upcasting bfloat16 is exact."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    return model


def state_in_bfloat16_grid(model: torch.nn.Module) -> None:
    """Round every parameter to bfloat16 and back: the float32 start of an agent is the saved base."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).float())


# Batching -------------------------------------------------------------------------


@dataclass
class Batch:
    """Left-padded ``<s> prompt [completion]`` rows; ``targets`` marks scored (completion) tokens."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor  # bool, same shape: token at this column is a completion token


def make_batch(prompts: Sequence[Sequence[int]], completions: Optional[Sequence[Sequence[int]]] = None) -> Batch:
    """Left-pad prompts to one width; completions (if any) follow the prompt and are right-padded."""
    completions = completions if completions is not None else [[] for _ in prompts]
    prompt_width = max(len(p) for p in prompts) + 1
    completion_width = max((len(c) for c in completions), default=0)
    rows, masks, targets = [], [], []
    for prompt, completion in zip(prompts, completions):
        pad_left = prompt_width - 1 - len(prompt)
        pad_right = completion_width - len(completion)
        rows.append(
            [tokenizer.PAD_ID] * pad_left + [tokenizer.BOS_ID, *prompt, *completion] + [tokenizer.PAD_ID] * pad_right
        )
        masks.append([0] * pad_left + [1] * (1 + len(prompt) + len(completion)) + [0] * pad_right)
        targets.append([False] * prompt_width + [True] * len(completion) + [False] * pad_right)
    attention_mask = torch.tensor(masks)
    return Batch(
        input_ids=torch.tensor(rows),
        attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
        targets=torch.tensor(targets),
    )


def problem_batch(problems: Sequence[Problem]) -> Batch:
    """Prompts with their canonical answers and ``</s>`` as the scored completion."""
    return make_batch(
        [tokenizer.encode(p.prompt) for p in problems],
        [tokenizer.encode(p.answer) + [tokenizer.EOS_ID] for p in problems],
    )


def token_logprobs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """log pi(token | prefix) for every column after the first (zero where not a target)."""
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
    ).logits[:, :-1]
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    return logprobs * batch.targets[:, 1:]


def supervised_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Mean cross-entropy over answer tokens (prompts are given, not learned)."""
    return -token_logprobs(model, batch).sum() / batch.targets.sum()


@torch.no_grad()
def greedy_correct(model: torch.nn.Module, problems: Sequence[Problem]) -> torch.Tensor:
    """Whether greedy decoding reproduces each canonical answer exactly, in one forward pass.

    Greedy decoding emits ``answer </s>`` iff the argmax at every answer position, given
    the correct prefix, is the next answer token: the first wrong argmax is where greedy
    decoding would leave the answer. So teacher forcing gives exact-match greedy accuracy
    without sequential decoding (the smoke test checks this against ``sample(greedy=True)``).
    """
    batch = problem_batch(problems)
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
    ).logits[:, :-1]
    hits = logits.argmax(-1) == batch.input_ids[:, 1:]
    return (hits | ~batch.targets[:, 1:]).all(-1)


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    generator: Optional[torch.Generator] = None,
    temperature: float = 1.0,
    greedy: bool = False,
) -> list[list[int]]:
    """Completions (ending in ``</s>`` unless cut at ``max_new_tokens``), with a KV cache."""
    batch = make_batch(prompts)
    input_ids, attention_mask, position_ids = batch.input_ids, batch.attention_mask, batch.position_ids
    past = None
    done = torch.zeros(len(prompts), dtype=torch.bool)
    columns: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        output = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past,
            use_cache=True,
        )
        past = output.past_key_values
        logits = output.logits[:, -1].float()
        if greedy:
            token = logits.argmax(-1)
        else:
            token = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator).squeeze(-1)
        token = torch.where(done, tokenizer.PAD_ID, token)
        columns.append(token)
        done |= token == tokenizer.EOS_ID
        if done.all():
            break
        attention_mask = torch.cat([attention_mask, torch.ones(len(prompts), 1, dtype=attention_mask.dtype)], -1)
        input_ids = token[:, None]
        position_ids = position_ids[:, -1:] + 1
    completions = torch.stack(columns, -1).tolist()
    result = []
    for row in completions:
        if tokenizer.EOS_ID in row:
            row = row[: row.index(tokenizer.EOS_ID) + 1]
        result.append(row)
    return result


def completion_text(ids: Sequence[int]) -> str:
    """The text of a completion; a completion cut before ``</s>`` never matches an answer."""
    text = tokenizer.decode(ids)
    return text if tokenizer.EOS_ID in ids else text + "\x00"
