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


def _unique_region(
    base: torch.Tensor, finetunes: Sequence[torch.Tensor], epsilon: float, lambdas: Sequence[float]
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """theta_pre in the arithmetic dtype, tau_t, m_t, c, and lambda_t * tau_t where only t changed (0 elsewhere)."""
    dtype = arithmetic_dtype(base, finetunes)
    base32 = base.to(dtype)
    taus = [finetune.to(dtype) - base32 for finetune in finetunes]
    m = masks(base, finetunes, epsilon)
    overlap = torch.zeros(base.shape, dtype=torch.int64)
    for mask in m:
        overlap = overlap + mask.to(torch.int64)
    single = torch.zeros_like(base32)
    for tau, mask, lam in zip(taus, m, lambdas):
        single = torch.where(mask & (overlap == 1), torch.tensor(lam, dtype=dtype) * tau, single)
    return base32, taus, m, overlap, single


def merge(
    base: torch.Tensor, finetunes: Sequence[torch.Tensor], epsilon: float, lambdas: Sequence[float]
) -> torch.Tensor:
    """theta_pre + tau_merged: 0 where c = 0, lambda_t tau_t where only t, mean where c >= 2."""
    base32, taus, m, overlap, single = _unique_region(base, finetunes, epsilon, lambdas)
    active_sum = torch.zeros_like(base32)
    for tau, mask in zip(taus, m):
        active_sum = active_sum + torch.where(mask, tau, torch.zeros_like(tau))
    mean = active_sum / overlap.clamp(min=1).to(base32.dtype)
    tau_merged = torch.where(overlap >= 2, mean, torch.where(overlap == 1, single, torch.zeros_like(base32)))
    return base32 + tau_merged


def unique_merge(
    base: torch.Tensor, finetunes: Sequence[torch.Tensor], epsilon: float, scales: Sequence[float]
) -> torch.Tensor:
    """ram_unique: theta_pre + scale_t tau_t where only t changed an element; the base everywhere else."""
    base32, _, _, _, single = _unique_region(base, finetunes, epsilon, scales)
    return base32 + single


def ties_keep(
    base: torch.Tensor, finetunes: Sequence[torch.Tensor], epsilon: float, density: float
) -> list[torch.Tensor]:
    """ram_ties' kept entries per model: at the P shared positions (c >= 2), the model's update (0 where
    inactive) kept where its magnitude is at least the k-th smallest of those P magnitudes,
    k = floor(P * (1 - density)), every one when k = 0; only nonzero entries count."""
    base32, taus, m, overlap, _ = _unique_region(base, finetunes, epsilon, [1.0] * len(finetunes))
    shared = overlap >= 2
    positions = int(shared.sum())
    k = math.floor(positions * (1 - density))
    kept = []
    for tau, mask in zip(taus, m):
        entries = torch.where(mask, tau, torch.zeros_like(tau)).detach()[shared]
        keep = entries != 0
        if k > 0:
            keep = keep & (entries.abs() >= entries.abs().kthvalue(k).values)
        full = torch.zeros(base.shape, dtype=torch.bool)
        full[shared] = keep
        kept.append(full)
    return kept


def ties_merge(
    base: torch.Tensor,
    finetunes: Sequence[torch.Tensor],
    epsilon: float,
    density: float,
    lambdas: Sequence[float] | None = None,
) -> torch.Tensor:
    """ram_ties: lambda_t tau_t where only t changed an element; where several did, the kept entries
    (``ties_keep``) elect a sign, (sum of kept positive) - (sum of kept negative magnitudes), none
    where it is 0, and tau_merged is the mean of the kept entries with that sign (0 if none)."""
    base32, taus, _, overlap, single = _unique_region(base, finetunes, epsilon, lambdas or [1.0] * len(finetunes))
    kept = ties_keep(base, finetunes, epsilon, density)
    zero = torch.zeros_like(base32)
    positive_mass, negative_mass = zero, zero
    for tau, keep in zip(taus, kept):
        positive_mass = positive_mass + torch.where(keep & (tau > 0), tau, zero)
        negative_mass = negative_mass + torch.where(keep & (tau < 0), -tau, zero)
    elected = torch.sign(positive_mass - negative_mass).detach()
    agreeing_sum, agreeing = zero, torch.zeros(base.shape, dtype=torch.int64)
    for tau, keep in zip(taus, kept):
        agrees = keep & (elected != 0) & (torch.sign(tau.detach()) == elected)
        agreeing_sum = agreeing_sum + torch.where(agrees, tau, zero)
        agreeing = agreeing + agrees.to(torch.int64)
    mean = agreeing_sum / agreeing.clamp(min=1).to(base32.dtype)
    return base32 + torch.where(overlap >= 2, mean, torch.where(overlap == 1, single, zero))
