"""RAM+'s rescaling (paper section 4.2): rho_t = shared_t / unique_t, lambda_t = 1 + r * factor(rho_t, alpha).

Plain numbers only. ``RULES`` is the one table of rules: a new rule is one entry here (and its line in
docs/method.md and README.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, NamedTuple, Sequence

#: Above this a lambda is warned about: the paper's are about 1.2 (r = 0.1, alpha = 2).
PLAUSIBLE_LAMBDA = 4.0


def overlap_ratio(shared: int, unique: int) -> float:
    """rho_t = shared_t / unique_t: 0 for a model that changed nothing, inf where every change is shared."""
    if unique == 0:
        return 0.0 if shared == 0 else math.inf
    return shared / unique


def rho_of_histogram(histogram: Sequence[int]) -> float:
    """rho_t from ``histogram[k - 1]``, the elements a model changed that exactly k models changed."""
    unique = histogram[0] if histogram else 0
    return overlap_ratio(sum(histogram) - unique, unique)


class Rule(NamedTuple):
    """lambda_t = 1 + r * factor(rho_t, alpha), factor non-decreasing in 0 <= rho <= inf."""

    method: str  # the paper's name for the method it gives
    formula: str  # lambda_t in one line, for docs and messages
    factor: Callable[[float, float], float]
    cap: str  # the largest lambda_t, in words


#: Every rescaling rule, by the name the recipe's ``rule`` gives it; the first is the default.
RULES: Mapping[str, Rule] = MappingProxyType(
    {
        "clip": Rule(
            "RAM+", "1 + r * clip(rho, 0, alpha)", lambda rho, alpha: min(max(rho, 0.0), alpha), "1 + r * alpha"
        ),
        "soft": Rule(
            "RAM+s", "1 + r * rho / (1 + rho)", lambda rho, _: rho / (1.0 + rho) if rho < math.inf else 1.0, "1 + r"
        ),
    }
)


def rule_choices() -> str:
    """The rules in words: "'clip' (RAM+) or 'soft' (RAM+s)"."""
    names = [f"{name!r} ({rule.method})" for name, rule in RULES.items()]
    return ", ".join(names[:-1]) + " or " + names[-1]


@dataclass(frozen=True)
class Rescaling:
    """A merge's r, alpha and rule (the paper's defaults), checked where they enter (``parameters``)."""

    r: float = 0.1
    alpha: float = 2.0
    rule: str = next(iter(RULES))

    def lambda_(self, rho: float) -> float:
        """lambda_t for a model's rho_t (paper eq. 6): the one place lambda is computed."""
        if not rho >= 0:  # also NaN
            raise ValueError(f"rho must be a number >= 0 (inf allowed); got {rho!r}")
        return 1.0 + self.r * RULES[self.rule].factor(rho, self.alpha)

    def largest_lambda(self) -> float:
        """The largest lambda_t these settings give: every factor grows with rho."""
        return self.lambda_(math.inf)
