"""Measure the density RAM sees for one synthetic fine-tune, per checkpoint dtype and epsilon.

Reproduces the tables in docs/method.md:

    python docs/scripts/epsilon_densities.py

Setup (all fixed by the seed):
- a float32 "base" of 2**20 weights drawn from N(0, 0.02^2) (an assumed scale);
- an RL-like update on a random half of the elements, in one of two patterns:
  "absolute": |delta| log-uniform in [1e-7, 1e-3], whatever the weight (as with Adam steps);
  "relative": |delta| / |w| log-uniform in [1e-4, 1e-1];
- the checkpoints as they are usually published: the base is stored in dtype D, the fine-tune
  is trained from that stored base in float32 and saved in D as well;
- densities are counted by ``mergekit_ram.kernel.count_overlaps`` (the code the ``ram_plus``
  pre-pass and ``ram_statistics.json`` use), with the fine-tune as the only model.

A last table is a control with no training at all: the base kept in float32 and a copy of it
rounded to bfloat16 or float16, i.e. two checkpoints of the same model in different dtypes.
"""

from __future__ import annotations

import torch

from mergekit_ram.kernel import count_overlaps, merge_tensors
from mergekit_ram.stats.render import markdown_table

SEED = 0
SIZE = 1 << 20
UPDATED_SHARE = 0.5  # probability that an element is updated
EPSILONS = (0.0, 1e-6, 1e-5, 1e-4)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# |w| bins for the breakdown: one-ulp steps fall under 1e-5 below ~0.002 (bf16) and ~0.016 (fp16).
BINS = ((0.0, 0.002), (0.002, 0.016), (0.016, float("inf")))


def log_uniform(generator: torch.Generator, low: float, high: float) -> torch.Tensor:
    exponent = torch.rand(SIZE, generator=generator, dtype=torch.float64)
    return torch.exp(torch.log(torch.tensor(low)) + exponent * (torch.log(torch.tensor(high / low))))


def make_updates(generator: torch.Generator, base: torch.Tensor) -> dict[str, torch.Tensor]:
    """The two update patterns, zero outside a shared random half of the elements."""
    updated = torch.rand(SIZE, generator=generator) < UPDATED_SHARE
    sign = torch.where(torch.rand(SIZE, generator=generator) < 0.5, -1.0, 1.0).double()
    absolute = sign * log_uniform(generator, 1e-7, 1e-3)
    relative = sign * log_uniform(generator, 1e-4, 1e-1) * base.double().abs()
    return {
        "absolute": torch.where(updated, absolute, 0.0).float(),
        "relative": torch.where(updated, relative, 0.0).float(),
    }


def active_mask(base: torch.Tensor, finetune: torch.Tensor, epsilon: float) -> torch.Tensor:
    """The kernel's own mask, recovered as ``merged != base`` (a unit update, lambda 1)."""
    merged = merge_tensors(base.float(), [finetune.float()], epsilon).merged
    return merged != base.float()


def density(base: torch.Tensor, finetune: torch.Tensor, epsilon: float) -> float:
    """Share of elements the kernel counts as changed (its histogram, as in the pre-pass)."""
    histograms = count_overlaps(base, [finetune], epsilon).histograms
    return histograms[0][0] / base.numel()


def percent(value: float) -> str:
    return f"{100 * value:.2f}%"


def main() -> None:
    generator = torch.Generator().manual_seed(SEED)
    base32 = torch.randn(SIZE, generator=generator) * 0.02
    updates = make_updates(generator, base32)
    eps_header = [f"eps {eps:g}" for eps in EPSILONS]

    for pattern, delta in updates.items():
        rows = []
        breakdown = []
        for name, dtype in DTYPES.items():
            base = base32.to(dtype)
            finetune = (base.float() + delta).to(dtype)
            rows.append([name] + [percent(density(base, finetune, eps)) for eps in EPSILONS])
            if pattern == "absolute":
                updated = delta != 0
                magnitude = base.float().abs()
                for eps in (0.0, 1e-5):
                    kept = active_mask(base, finetune, eps)
                    cells = []
                    for low, high in BINS:
                        in_bin = updated & (magnitude >= low) & (magnitude < high)
                        cells.append(percent(int((kept & in_bin).sum()) / int(in_bin.sum())))
                    breakdown.append([name, f"{eps:g}"] + cells)
        true_density = int((delta != 0).sum()) / SIZE
        print(f"### Update pattern: {pattern} (true density {percent(true_density)})\n")
        print(markdown_table([["stored as", *eps_header], *rows]))
        print()
        if breakdown:
            print("Share of the true updates counted, by weight magnitude (absolute pattern):\n")
            bins = [f"{low:g} <= abs(w) < {high:g}" for low, high in BINS]
            print(markdown_table([["stored as", "epsilon", *bins], *breakdown]))
            print()

    rows = []
    for name in ("bfloat16", "float16"):
        copy = base32.to(DTYPES[name]).float()
        rows.append([f"float32 base vs {name} copy"] + [percent(density(base32, copy, eps)) for eps in EPSILONS])
    print("### Control: no training, the same weights in two dtypes (true density 0%)\n")
    print(markdown_table([["checkpoints", *eps_header], *rows]))


if __name__ == "__main__":
    main()
