"""The worked example of docs/method.md, computed with the plugin's own kernel.

    python docs/scripts/worked_example.py

Three fine-tuned models (A, B, C), eight parameters, epsilon 1e-5, r 0.1, alpha 2.0.
Prints the masks, counts, rho, lambda (clip and soft) and the merged values, and checks
them against the numbers printed in docs/method.md.
"""

from __future__ import annotations

import math

import torch

from mergekit_ram.kernel import count_overlaps, merge_tensors
from mergekit_ram.rescaling import Rescaling, rho_of_histogram

EPSILON, R, ALPHA = 1e-5, 0.1, 2.0
NAMES = ("A", "B", "C")
BASE = [0.50, -0.20, 0.10, 0.30, -0.40, 0.05, 0.25, -0.15]
TASK_VECTORS = [
    [0.010, 0.0, 0.004, -0.006, 0.002, 0.0, 0.000004, 0.0],  # A (index 6: below epsilon)
    [0.006, -0.008, 0.0, -0.002, 0.0, 0.003, 0.0, 0.0],  # B
    [0.002, 0.0, 0.006, 0.0, 0.0, 0.0, 0.0, 0.005],  # C
]
# What docs/method.md shows.
EXPECTED_RHO = {"A": 3.0, "B": 1.0, "C": 2.0}
EXPECTED_LAMBDA = {"clip": {"A": 1.2, "B": 1.1, "C": 1.2}, "soft": {"A": 1.075, "B": 1.05, "C": 1.0 + 0.1 * 2 / 3}}
EXPECTED_TAU = {
    "ram": [0.006, -0.008, 0.005, -0.004, 0.002, 0.003, 0.0, 0.005],
    "clip": [0.006, -0.0088, 0.005, -0.004, 0.0024, 0.0033, 0.0, 0.006],
    "soft": [0.006, -0.0084, 0.005, -0.004, 0.00215, 0.00315, 0.0, 0.005 * (1 + 0.1 * 2 / 3)],
}


def main() -> None:
    base = torch.tensor(BASE, dtype=torch.float32)
    finetunes = [base + torch.tensor(tau, dtype=torch.float32) for tau in TASK_VECTORS]

    counted = count_overlaps(base, finetunes, EPSILON)  # eight elements: one chunk
    masks = [((finetune - base).abs() > EPSILON).int().tolist() for finetune in finetunes]
    counts = [sum(column) for column in zip(*masks)]
    print("mask", *(f"{name}={mask}" for name, mask in zip(NAMES, masks)))
    print("c   ", counts)

    lambdas: dict[str, list[float]] = {}
    for name, histogram in zip(NAMES, counted.histograms):
        unique, shared = histogram[0], sum(histogram[1:])
        rho = rho_of_histogram(histogram)
        assert math.isclose(rho, EXPECTED_RHO[name]), (name, rho)
        for rule in ("clip", "soft"):
            lam = Rescaling(R, ALPHA, rule).lambda_(rho)
            assert math.isclose(lam, EXPECTED_LAMBDA[rule][name]), (name, rule, lam)
            lambdas.setdefault(rule, []).append(lam)
        print(
            f"{name}: shared {shared}, unique {unique}, rho {rho:g}, "
            f"lambda clip {lambdas['clip'][-1]:.4f}, soft {lambdas['soft'][-1]:.4f}"
        )

    for label, values in (("ram", None), ("clip", lambdas["clip"]), ("soft", lambdas["soft"])):
        merged = merge_tensors(base, finetunes, EPSILON, values).merged
        tau = (merged - base).tolist()
        assert all(math.isclose(a, b, abs_tol=1e-7) for a, b in zip(tau, EXPECTED_TAU[label])), (label, tau)
        print(f"tau_merged ({label}):", [round(value, 6) for value in tau])
        print(f"theta_merged ({label}):", [round(value, 6) for value in merged.tolist()])
    average = [sum(column) / len(column) for column in zip(*TASK_VECTORS)]
    print("plain average of the task vectors, for comparison:", [round(value, 6) for value in average])
    print("all values match docs/method.md")


if __name__ == "__main__":
    main()
