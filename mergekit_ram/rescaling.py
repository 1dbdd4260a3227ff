"""PROVISIONAL (replaced by the statistics helper's module at merge)."""

from __future__ import annotations

from dataclasses import dataclass

from mergekit_ram.kernel import rescale_factor


@dataclass(frozen=True)
class Rescaling:
    r: float = 0.1
    alpha: float = 2.0
    rule: str = "clip"

    def lambda_(self, rho: float) -> float:
        return rescale_factor(rho, self.r, self.alpha, self.rule)  # type: ignore[arg-type]
