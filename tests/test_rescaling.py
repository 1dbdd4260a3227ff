"""rho and lambda (mergekit_ram/rescaling.py) against figures worked out by hand from the paper.

Paper, section 4.2, eq. 6 (RAM+, ``clip``): lambda_t = 1 + r * clip(rho_t, 0, alpha), with
r = 0.1 and alpha = 2; appendix E (RAM+s, ``soft``): lambda_t = 1 + r * rho_t / (1 + rho_t).
Its three Qwen2.5-7B agents have rho about 14.87, 1.45 and 1.11 (unique shares 6.3%,
40.8%, 47.5%), so lambda = 1 + 0.1 * 2 = 1.2 (clipped), 1 + 0.145 = 1.145, 1 + 0.111 = 1.111.
"""

from __future__ import annotations

import math
import os
import re

import pytest

from mergekit_ram.rescaling import RULES, Rescaling, overlap_ratio, rho_of_histogram, rule_choices

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
INF = math.inf


def test_rho_is_shared_over_unique() -> None:
    assert overlap_ratio(30, 2) == 15.0
    assert overlap_ratio(3, 2) == 1.5
    assert overlap_ratio(0, 0) == 0.0  # changed nothing: nothing to scale
    assert overlap_ratio(5, 0) == INF  # every change shared
    assert overlap_ratio(0, 7) == 0.0


@pytest.mark.parametrize(
    ("histogram", "rho"),
    [
        ((2, 20, 10), 15.0),  # unique 2, shared 20 + 10
        ((4, 6), 1.5),
        ((0, 5, 1), INF),
        ((7,), 0.0),  # one fine-tuned model: every change is unique
        ((0, 0, 0), 0.0),
        ((), 0.0),  # a model with no counted tensor (pinned only)
    ],
)
def test_rho_of_a_histogram(histogram: tuple[int, ...], rho: float) -> None:
    assert rho_of_histogram(histogram) == rho


@pytest.mark.parametrize(
    ("rho", "clip", "soft"),
    [
        (14.87, 1.2, 1.0937),  # the paper's coding agent: clipped at alpha = 2; soft 1 + 0.1 * 14.87 / 15.87
        (1.45, 1.145, 1.0592),  # tool use: 1 + 0.1 * 1.45; soft 1 + 0.1 * 1.45 / 2.45
        (1.11, 1.111, 1.0526),  # memory: 1 + 0.1 * 1.11; soft 1 + 0.1 * 1.11 / 2.11
        (3.0, 1.2, 1.075),  # soft: 1 + 0.1 * 3 / 4
        (1.0, 1.1, 1.05),
        (0.5, 1.05, 1.0333),
        (0.0, 1.0, 1.0),  # nothing shared (or nothing changed): no rescaling
        (INF, 1.2, 1.1),  # nothing unique: the bound, never applied
    ],
)
def test_lambda_under_each_rule_with_the_papers_settings(rho: float, clip: float, soft: float) -> None:
    assert Rescaling(0.1, 2.0, "clip").lambda_(rho) == clip
    assert round(Rescaling(0.1, 2.0, "soft").lambda_(rho), 4) == soft


def test_alpha_bounds_clip_only_and_r_zero_is_ram() -> None:
    assert Rescaling(0.2, 5.0, "clip").lambda_(3.0) == 1.6  # 1 + 0.2 * 3, under alpha = 5
    assert Rescaling(0.1, 0.2, "clip").lambda_(14.87) == 1.02  # ramplus_tl's default alpha
    assert Rescaling(0.1, 0.2, "soft").lambda_(3.0) == 1.075  # soft ignores alpha
    for rule in RULES:
        assert {Rescaling(0.0, 2.0, rule).lambda_(rho) for rho in (0.0, 1.0, 14.87, INF)} == {1.0}


def test_largest_lambda_bounds_every_rho() -> None:
    assert Rescaling(0.1, 2.0, "clip").largest_lambda() == 1.2
    assert Rescaling(0.1, 2.0, "soft").largest_lambda() == 1.1
    assert Rescaling(1e20, 1e20, "clip").largest_lambda() == 1e40
    for rule in RULES:
        for r, alpha in ((0.1, 2.0), (0.3, 0.5), (0.0, 1.0)):
            rescaling = Rescaling(r, alpha, rule)
            lambdas = [rescaling.lambda_(rho) for rho in (0.0, 0.3, 1.0, 2.0, 1e6, INF)]
            assert max(lambdas) == rescaling.largest_lambda(), (rule, r, alpha)


def test_defaults_are_the_papers() -> None:
    assert Rescaling() == Rescaling(r=0.1, alpha=2.0, rule="clip")
    assert next(iter(RULES)) == "clip"


@pytest.mark.parametrize("rho", [-1.0, math.nan])
def test_lambda_refuses_a_rho_that_is_not_a_ratio(rho: float) -> None:
    with pytest.raises(ValueError, match=r"rho must be a number >= 0 \(inf allowed\)"):
        Rescaling().lambda_(rho)


def test_rules_cannot_be_changed_at_run_time() -> None:
    with pytest.raises(TypeError):
        RULES["tanh"] = RULES["clip"]  # type: ignore[index]
    assert rule_choices() == "'clip' (RAM+) or 'soft' (RAM+s)"


def test_every_rule_is_documented() -> None:
    """docs/method.md gives each rule's formula, and README.md's parameters table names it."""
    with open(os.path.join(ROOT, "docs", "method.md"), encoding="utf-8") as handle:
        text = handle.read()
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as handle:
        readme = handle.read()
    parameters = readme.split("\n## Methods and parameters\n", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in parameters.splitlines() if line.startswith("| `rule` |"))
    _, methods, default, allowed, meaning = (cell.strip() for cell in row.strip().strip("|").split("|"))
    assert default == f"`{next(iter(RULES))}`"
    assert allowed == ", ".join(f"`{name}`" for name in RULES)
    for name, rule in RULES.items():
        assert f"`{name}`: {rule.method} " in meaning, name
        formula = re.search(rf"^lambda_t\s+=\s+(.+?)\s+rule: {name}\s+\({re.escape(rule.method)},", text, re.M)
        assert formula is not None, f"docs/method.md has no formula line for rule {name}"
        assert formula.group(1).replace("rho_t", "rho") == rule.formula
