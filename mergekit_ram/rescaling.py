"""RAM+'s rescaling (paper section 4.2): rho_t from a model's overlap counts, lambda_t from rho_t.

Plain numbers only (no torch, no mergekit). ``RULES`` is the one table of rescaling rules:
their names, formulas and bounds live nowhere else, so a new rule is one entry here (and its
line in docs/method.md and README.md). ``Rescaling`` holds a merge's ``r``, ``alpha`` and rule, checked once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, Sequence

#: Above this a lambda is warned about: the paper's are about 1.2 (r = 0.1, alpha = 2);
#: 4 would mean a model's unique updates are applied four-fold.
PLAUSIBLE_LAMBDA = 4.0


def overlap_ratio(shared: int, unique: int) -> float:
    """rho_t = shared_t / unique_t.

    A model that changed nothing has rho = 0 (no unique update to scale); one whose
    every change is shared has rho = inf (lambda is then never used).
    """
    if unique == 0:
        return 0.0 if shared == 0 else math.inf
    return shared / unique


def rho_of_histogram(histogram: Sequence[int]) -> float:
    """rho_t from a model's overlap histogram: ``histogram[k - 1]`` elements it changed that
    exactly k models changed, so ``histogram[0]`` is unique and the rest shared."""
    unique = histogram[0] if histogram else 0
    return overlap_ratio(sum(histogram) - unique, unique)


@dataclass(frozen=True)
class Rule:
    """One way of turning rho_t into lambda_t = 1 + r * factor(rho_t, alpha)."""

    name: str  # as the recipe's ``rule`` parameter spells it
    method: str  # the paper's name for the method it gives
    formula: str  # lambda_t in one line, for docs and messages
    factor: Callable[[float, float], float]  # (rho, alpha) -> the factor of r, for 0 <= rho <= inf
    largest_factor: Callable[[float], float]  # alpha -> the factor's largest value over every rho

    def lambda_(self, rho: float, r: float, alpha: float) -> float:
        return 1.0 + r * self.factor(rho, alpha)

    def largest_lambda(self, r: float, alpha: float) -> float:
        return 1.0 + r * self.largest_factor(alpha)


def _clip(rho: float, alpha: float) -> float:
    return min(max(rho, 0.0), alpha)


def _soft(rho: float, alpha: float) -> float:
    return 1.0 if math.isinf(rho) else rho / (1.0 + rho)


#: Every rescaling rule, by name; the first is the default.
RULES: Mapping[str, Rule] = MappingProxyType(
    {
        rule.name: rule
        for rule in (
            Rule("clip", "RAM+", "1 + r * clip(rho, 0, alpha)", _clip, lambda alpha: alpha),
            Rule("soft", "RAM+s", "1 + r * rho / (1 + rho)", _soft, lambda alpha: 1.0),
        )
    }
)


def rule_choices() -> str:
    """The rules in words, e.g. "'clip' (RAM+) or 'soft' (RAM+s)"."""
    names = [f"{rule.name!r} ({rule.method})" for rule in RULES.values()]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


@dataclass(frozen=True)
class Rescaling:
    """A merge's rescaling: lambda_t = rule(rho_t; r, alpha), one value per model (paper eq. 6).

    The defaults are the paper's: r = 0.1, alpha = 2, clip. The values are checked where they
    enter, against the parameter table (``mergekit_ram.parameters``), not here.
    """

    r: float = 0.1
    alpha: float = 2.0
    rule: str = next(iter(RULES))

    def lambda_(self, rho: float) -> float:
        """lambda_t for a model's rho_t (0 <= rho <= inf)."""
        if not rho >= 0:  # also NaN
            raise ValueError(f"rho must be a number >= 0 (inf allowed); got {rho!r}")
        return RULES[self.rule].lambda_(rho, self.r, self.alpha)

    def largest_lambda(self) -> float:
        """The largest lambda_t these settings give, over every rho."""
        return RULES[self.rule].largest_lambda(self.r, self.alpha)
