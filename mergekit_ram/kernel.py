"""RAM / RAM+ tensor math (paper section 4, Algorithm 1). Knows torch only.

For one tensor with base ``theta_pre`` and fine-tunes ``theta_t``, ``t = 1..N``:

    tau_t = theta_t - theta_pre
    m_t   = |tau_t| > epsilon                   (strict, compared in float32)
    c     = sum_t m_t                           (how many models changed an element)
    tau_merged = 0                 where c == 0
               = lambda_t * tau_t  where c == 1 and m_t
               = mean of active tau where c >= 2
    theta_merged = theta_pre + tau_merged

All arithmetic is float32 whatever the input dtype; the result has the base's dtype.
Scratch memory is about 19 bytes per element for bfloat16 inputs, independent of N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import torch

Rule = Literal["clip", "soft"]

#: Histograms are gathered from a bit pattern per element (bit t set when model t is
#: active): int16 patterns up to 15 models, a bincount over 2**N bins up to 20.
_INT16_MAX_MODELS = 15
_BINCOUNT_MAX_MODELS = 20
_PATTERN_MAX_MODELS = 62


def overlap_ratio(shared: int, unique: int) -> float:
    """rho_t = shared_t / unique_t.

    A model that changed nothing has rho = 0 (no unique update to scale); one whose
    every change is shared has rho = inf (lambda is then never used).
    """
    if unique == 0:
        return 0.0 if shared == 0 else math.inf
    return shared / unique


def rescale_factor(rho: float, r: float, alpha: float, rule: Rule) -> float:
    """lambda_t from rho_t.

    clip (RAM+, eq. 4):           1 + r * clip(rho, 0, alpha)
    soft (RAM+s, appendix E):     1 + r * rho / (1 + rho)
    """
    if rule == "clip":
        return 1.0 + r * min(max(rho, 0.0), alpha)
    if rule == "soft":
        return 1.0 + r * (1.0 if math.isinf(rho) else rho / (1.0 + rho))
    raise ValueError(f"unknown rescaling rule {rule!r}; expected 'clip' or 'soft'")


class NonFiniteInputError(ValueError):
    """An input holds NaN or Inf; ``index`` is the fine-tune's position, or None for the base."""

    def __init__(self, index: Optional[int]):
        self.index = index
        where = "base" if index is None else f"fine-tuned input {index}"
        super().__init__(f"{where} contains NaN or Inf")


@dataclass(frozen=True)
class KernelResult:
    """The merged tensor (None when only counting) and, if asked, per-model histograms.

    ``histograms[t][k - 1]`` is the number of elements model t changed that exactly k
    models changed (k = 1 is unique, k >= 2 shared).
    """

    merged: Optional[torch.Tensor]
    histograms: Optional[tuple[tuple[int, ...], ...]]


def ram_merge(
    base: torch.Tensor,
    finetunes: Sequence[torch.Tensor],
    epsilon: float,
    lambdas: Optional[Sequence[float]] = None,
    *,
    merge: bool = True,
    count: bool = False,
) -> KernelResult:
    """Merge one tensor group with the RAM rule, and/or count its overlap histograms.

    ``lambdas`` scales each model's unique updates (None or all ones: plain RAM).
    ``merge=False, count=True`` is the statistics pre-pass: same masks, no merge.
    """
    n = len(finetunes)
    if lambdas is not None and len(lambdas) != n:
        raise ValueError(f"expected {n} lambda values, got {len(lambdas)}")
    for finetune in finetunes:
        if finetune.shape != base.shape:
            raise ValueError(f"shape {tuple(finetune.shape)} differs from the base's {tuple(base.shape)}")
    if merge and n > 254:
        raise ValueError(f"the merge kernel supports at most 254 fine-tuned models, got {n}")
    if count and n > _PATTERN_MAX_MODELS:
        raise ValueError(f"overlap statistics support at most {_PATTERN_MAX_MODELS} fine-tuned models, got {n}")

    base32 = base.float()
    tau = torch.empty_like(base32)
    magnitude = torch.empty_like(base32)
    active = torch.empty(base.shape, dtype=torch.bool, device=base.device)

    scale_unique = merge and lambdas is not None and any(lam != 1.0 for lam in lambdas)
    if merge:
        total = torch.zeros_like(base32)  # sum of active deltas
        counts = torch.zeros(base.shape, dtype=torch.uint8, device=base.device)  # c
        # 1 + index of the last active model: where c == 1, the only one.
        owner = torch.zeros(base.shape, dtype=torch.uint8, device=base.device) if scale_unique else None
    if count:
        pattern_dtype = torch.int16 if n <= _INT16_MAX_MODELS else torch.int64
        pattern = torch.zeros(base.shape, dtype=pattern_dtype, device=base.device)

    for index, finetune in enumerate(finetunes):
        torch.sub(finetune, base32, out=tau)
        torch.abs(tau, out=magnitude)
        if not math.isfinite(magnitude.sum().item()):
            _raise_non_finite(base, finetunes, index)
        torch.gt(magnitude, epsilon, out=active)
        if merge:
            tau.mul_(active)
            total.add_(tau)
            counts.add_(active)
            if owner is not None:
                owner.masked_fill_(active, index + 1)
        if count:
            pattern.add_(active, alpha=1 << index)

    histograms = _histograms(pattern, n) if count else None
    if not merge:
        return KernelResult(merged=None, histograms=histograms)

    # Mean over active models; c == 1 divides by one, c == 0 leaves total at zero.
    total.div_(counts.clamp_(min=1))
    if owner is not None:
        torch.ne(counts, 1, out=active)
        owner.masked_fill_(active, 0)
        factor = magnitude.fill_(1.0)
        for index, lam in enumerate(lambdas or ()):
            if lam != 1.0:
                torch.eq(owner, index + 1, out=active)
                factor.masked_fill_(active, lam)
        total.mul_(factor)
    total.add_(base32)
    merged = total if base.dtype == torch.float32 else total.to(base.dtype)
    return KernelResult(merged=merged, histograms=histograms)


def _raise_non_finite(base: torch.Tensor, finetunes: Sequence[torch.Tensor], index: int) -> None:
    """Name the offending input; a finite overflow of the magnitude sum is not an error."""
    if not bool(torch.isfinite(base).all()):
        raise NonFiniteInputError(None)
    if not bool(torch.isfinite(finetunes[index]).all()):
        raise NonFiniteInputError(index)


def _histograms(pattern: torch.Tensor, n: int) -> tuple[tuple[int, ...], ...]:
    """Per-model histograms by overlap count, from one bit pattern per element."""
    flat = pattern.reshape(-1)
    if n <= _BINCOUNT_MAX_MODELS:
        frequencies = torch.bincount(flat, minlength=1 << n).tolist()
        items = ((code, freq) for code, freq in enumerate(frequencies) if freq and code)
    else:
        codes, freqs = torch.unique(flat, return_counts=True)
        items = ((code, freq) for code, freq in zip(codes.tolist(), freqs.tolist()) if code)
    histograms = [[0] * n for _ in range(n)]
    for code, freq in items:
        overlap = code.bit_count()
        for index in range(n):
            if code >> index & 1:
                histograms[index][overlap - 1] += freq
    return tuple(tuple(row) for row in histograms)
