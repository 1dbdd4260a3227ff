"""The parameters of the four methods, declared once (``METHOD_PARAMETERS``) for mergekit's method specs,
the recipe checks and the in-memory API, so each is refused with the same message everywhere."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable, Literal, Optional, Sequence

from pydantic import BeforeValidator, Field, TypeAdapter, ValidationError
from typing_extensions import Annotated

from mergekit_ram.errors import RecipeError
from mergekit_ram.rescaling import RULES, Rescaling, rule_choices

#: The largest float32; a value above it becomes inf in the float32 arithmetic.
FLOAT32_MAX = float.fromhex("0x1.fffffep+127")


def _not_a_boolean(value: Any) -> Any:
    """YAML's ``true`` / ``false`` are not numbers here (pydantic would read them as 1.0 / 0.0)."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    return value


NonNegative = Annotated[float, BeforeValidator(_not_a_boolean), Field(ge=0, allow_inf_nan=False)]
Share = Annotated[float, BeforeValidator(_not_a_boolean), Field(gt=0, le=1)]


@dataclass(frozen=True)
class ParameterInfo:
    """One recipe parameter; ``per_model`` ones are set per fine-tuned model."""

    name: str
    value_type: Any
    default: Any
    requirement: str
    per_model: bool = False

    @cached_property
    def adapter(self) -> TypeAdapter:
        return TypeAdapter(self.value_type)


EPSILON = ParameterInfo("epsilon", NonNegative, 1e-5, "a finite number >= 0")
R = ParameterInfo("r", NonNegative, Rescaling.r, "a finite number >= 0")
ALPHA = ParameterInfo("alpha", NonNegative, Rescaling.alpha, "a finite number >= 0")
RULE = ParameterInfo("rule", Literal[tuple(RULES)], Rescaling.rule, rule_choices())
RHO = ParameterInfo("rho", Optional[NonNegative], None, "a finite number >= 0 (pins the model's rho)", per_model=True)
LAMBDA = ParameterInfo(
    "lambda", Optional[NonNegative], None, "a finite number >= 0 (pins the model's lambda)", per_model=True
)

#: ram_ties: the share of each model's updates at a tensor's shared positions that TIES keeps (the authors': 0.1).
DENSITY = ParameterInfo("density", Share, 0.1, "a number in (0, 1], the share of shared updates kept")
#: ram_ties rescales nothing unless asked (the authors' mode): lambda 1 for every model.
R_TIES = ParameterInfo("r", NonNegative, 0.0, "a finite number >= 0")
SCALE = ParameterInfo(
    "scale", NonNegative, 1.0, "a finite number >= 0 (the factor of the model's unique updates)", per_model=True
)

METHOD_PARAMETERS: dict[str, tuple[ParameterInfo, ...]] = {
    "ram": (EPSILON,),
    "ram_plus": (EPSILON, R, ALPHA, RULE, RHO, LAMBDA),
    "ram_ties": (EPSILON, DENSITY, R_TIES, ALPHA, RULE, RHO, LAMBDA),
    "ram_unique": (EPSILON, SCALE),
}
#: What each method does where several models changed an element (the kernel's ``shared`` rule):
#: the mean of their updates, TIES (trim to ``density``, elect a sign, average the agreeing), or the base.
SHARED_RULES: dict[str, Literal["mean", "ties", "base"]] = {
    "ram": "mean",
    "ram_plus": "mean",
    "ram_ties": "ties",
    "ram_unique": "base",
}


class ParameterError(RecipeError):
    """A recipe parameter a RAM method refuses; the message names it and where it was set."""


def declared_names(method: str) -> list[str]:
    return [info.name for info in METHOD_PARAMETERS[method]]


def close_match(name: str, candidates: Iterable[str]) -> Optional[str]:
    """The other candidate ``name`` looks like a misspelling of (difflib's default cutoff), if any."""
    hint = difflib.get_close_matches(name, [candidate for candidate in candidates if candidate != name], n=1)
    return hint[0] if hint else None


def parameter_info(method: str, name: str, where: str = "parameters") -> ParameterInfo:
    """The declaration of ``name`` for ``method``, or a ParameterError listing the valid names (and a near miss)."""
    declared = {info.name: info for info in METHOD_PARAMETERS[method]}
    if name not in declared:
        hint = close_match(name, declared)
        suggestion = f" (did you mean {hint!r}?)" if hint else ""
        raise ParameterError(
            f"{method}: unknown parameter {name!r} in {where}{suggestion}; valid names: {', '.join(sorted(declared))}"
        )
    return declared[name]


def check_parameter(method: str, name: str, value: Any, where: str = "parameters") -> Any:
    """The validated value, or a refusal naming the parameter and where it was set; a number must also fit
    float32 (the arithmetic's precision): 1e300 would become inf."""
    info = parameter_info(method, name, where)
    try:
        validated = info.adapter.validate_python(value)
    except ValidationError:
        boolean = " (true/false is a boolean, not a number)" if isinstance(value, bool) else ""
        raise ParameterError(
            f"{method}: parameter {name!r} in {where} must be {info.requirement}; got {value!r}{boolean}"
        ) from None
    if isinstance(validated, float) and validated > FLOAT32_MAX:
        raise ParameterError(
            f"{method}: parameter {name!r} in {where} is {validated:g}, above the largest float32 "
            f"({FLOAT32_MAX:g}) the merge computes in"
        )
    return validated


def check_lambda_range(method: str, r: float, alphas: Sequence[float], rules: Sequence[str], where: str) -> None:
    """The largest lambda_t these settings allow must fit float32, or the merged values overflow."""
    bound = max(Rescaling(r, alpha, rule).largest_lambda() for alpha in alphas for rule in rules)
    if bound > FLOAT32_MAX:
        raise ParameterError(
            f"{method}: r = {r:g} in {where} allows lambda up to {bound:g}, above the largest float32 "
            f"({FLOAT32_MAX:g}): lower r or alpha (the paper uses r = 0.1, alpha = 2: lambda at most 1.2)"
        )
