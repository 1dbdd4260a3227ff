"""An independent implementation of the paper's equations (section 4, Algorithm 1).

Written from the paper, not from the plugin: whole tensors, one step per equation, no
buffers reused, differentiable (torch autograd gives the reference gradients). Arithmetic
is float32, or float64 when an input is float64 (the project's rule: the wider of float32
and the inputs' precision). Tests compare the plugin's outputs with this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class ReferenceCounts:
    """Per fine-tune: active, shared (c >= 2), unique (c == 1), and histogram by c."""

    active: list[int]
    shared: list[int]
    unique: list[int]
    histograms: list[list[int]]


def arithmetic_dtype(base: torch.Tensor, finetunes: Sequence[torch.Tensor]) -> torch.dtype:
    """float64 if any input is float64, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in [base, *finetunes]) else torch.float32


def masks(base: torch.Tensor, finetunes: Sequence[torch.Tensor], epsilon: float) -> list[torch.Tensor]:
    """m_t = 1[|theta_t - theta_pre| > epsilon], in the arithmetic dtype."""
    dtype = arithmetic_dtype(base, finetunes)
    base32 = base.detach().to(dtype)
    return [(finetune.detach().to(dtype) - base32).abs() > epsilon for finetune in finetunes]


def counts(base: torch.Tensor, finetunes: Sequence[torch.Tensor], epsilon: float) -> ReferenceCounts:
    m = masks(base, finetunes, epsilon)
    overlap = torch.stack([mask.to(torch.int64) for mask in m]).sum(0)  # c_i
    n = len(finetunes)
    histograms = [[int((mask & (overlap == k)).sum()) for k in range(1, n + 1)] for mask in m]
    return ReferenceCounts(
        active=[int(mask.sum()) for mask in m],
        shared=[int((mask & (overlap >= 2)).sum()) for mask in m],
        unique=[int((mask & (overlap == 1)).sum()) for mask in m],
        histograms=histograms,
    )


def rho(shared: int, unique: int) -> float:
    """rho_t = shared_t / unique_t (inf when unique is 0 and shared > 0; 0 when nothing changed)."""
    if unique == 0:
        return math.inf if shared else 0.0
    return shared / unique


def lambda_clip(rho_value: float, r: float, alpha: float) -> float:
    """Paper eq. 6: lambda = 1 + r * clip(rho, 0, alpha)."""
    return 1.0 + r * min(max(rho_value, 0.0), alpha)


def lambda_soft(rho_value: float, r: float) -> float:
    """Appendix E (RAM+s): lambda = 1 + r * rho / (1 + rho)."""
    return 1.0 + r * (1.0 if math.isinf(rho_value) else rho_value / (1.0 + rho_value))


def merge(
    base: torch.Tensor, finetunes: Sequence[torch.Tensor], epsilon: float, lambdas: Sequence[float]
) -> torch.Tensor:
    """theta_pre + tau_merged: 0 where c = 0, lambda_t tau_t where only t, mean where c >= 2."""
    dtype = arithmetic_dtype(base, finetunes)
    base32 = base.to(dtype)
    taus = [finetune.to(dtype) - base32 for finetune in finetunes]
    m = masks(base, finetunes, epsilon)
    overlap = torch.zeros(base.shape, dtype=torch.int64)
    for mask in m:
        overlap = overlap + mask.to(torch.int64)
    active_sum = torch.zeros_like(base32)
    for tau, mask in zip(taus, m):
        active_sum = active_sum + torch.where(mask, tau, torch.zeros_like(tau))
    mean = active_sum / overlap.clamp(min=1).to(dtype)
    single = torch.zeros_like(base32)
    for tau, mask, lam in zip(taus, m, lambdas):
        single = torch.where(mask & (overlap == 1), torch.tensor(lam, dtype=dtype) * tau, single)
    tau_merged = torch.where(overlap >= 2, mean, torch.where(overlap == 1, single, torch.zeros_like(base32)))
    return base32 + tau_merged
