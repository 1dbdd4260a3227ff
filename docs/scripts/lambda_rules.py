"""lambda for the paper's three Qwen2.5-7B agents under each rescaling rule.

    python docs/scripts/lambda_rules.py [--r 0.1]

Backs the lambda rows of docs/method.md (``tests/test_comparison.py`` checks the same
figures). rho comes from the paper's unique shares (section 3, Figure 2): an agent whose
changed parameters are a share ``u`` unique has ``rho = shared / unique = (1 - u) / u``.

Rules, all with ``r = 0.1`` unless ``--r`` says otherwise:
- ``ram_plus`` clip (paper eq. 6, this plugin's default): ``1 + r * clip(rho, 0, 2.0)``;
- ``ram_plus`` soft (RAM+s, appendix E): ``1 + r * rho / (1 + rho)``;
- mergekit 0.1.5 ``ramplus_tl`` with its default ``alpha = 0.2``: ``1 + r * clip(rho, 0, 0.2)``,
  evaluated here on the whole-model rho (``ramplus_tl`` itself uses each tensor's rho);
- the authors' released script (published with the paper; it has no licence, so none of its
  code is used or reproduced here; docs/method.md, row "lambda", describes it):
  ``1 + (R - 1) * min(1, rho)`` with ``R - 1 = r``: the clip bound is 1, not alpha.
"""

from __future__ import annotations

import argparse
from typing import Callable

from mergekit_ram.rescaling import Rescaling
from mergekit_ram.stats.render import markdown_table

#: Share of each agent's changed parameters that no other agent changed (paper, Figure 2).
PAPER_UNIQUE_SHARES = {"coding (CURE)": 0.063, "tool use (ToolRL)": 0.408, "memory (MemAgent)": 0.475}
RAMPLUS_TL_ALPHA = 0.2  # mergekit 0.1.5's default for ramplus_tl
PAPER_ALPHA = 2.0


def rho_from_unique_share(unique_share: float) -> float:
    return (1.0 - unique_share) / unique_share


def authors_lambda(rho: float, r: float) -> float:
    """The authors' rule as docs/method.md states it: 1 + (R - 1) * min(1, rho), R - 1 = r."""
    return 1.0 + r * min(1.0, rho)


def rules(r: float) -> dict[str, Callable[[float], float]]:
    """lambda as a function of rho under each rule, by the name the table shows."""
    return {
        f"ram_plus clip (alpha {PAPER_ALPHA:g})": Rescaling(r, PAPER_ALPHA, "clip").lambda_,
        "ram_plus soft (RAM+s)": Rescaling(r, PAPER_ALPHA, "soft").lambda_,
        f"ramplus_tl default (alpha {RAMPLUS_TL_ALPHA:g})": Rescaling(r, RAMPLUS_TL_ALPHA, "clip").lambda_,
        "authors' script (bound 1)": lambda rho: authors_lambda(rho, r),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--r", type=float, default=0.1)
    arguments = parser.parse_args()
    table = rules(arguments.r)
    print(f"r = {arguments.r:g}\n")
    rows = [["agent", "unique share", "rho", *table]]
    for agent, share in PAPER_UNIQUE_SHARES.items():
        rho = rho_from_unique_share(share)
        rows.append([agent, f"{share:.1%}", f"{rho:.3f}", *[f"{rule(rho):.4f}" for rule in table.values()]])
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
