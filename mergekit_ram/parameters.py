"""The parameters of ``ram`` and ``ram_plus``: names, types, defaults, and clear refusals.

One table serves the mergekit method specs, recipe checking, and the in-memory API, so
a parameter is declared once and refused with the same message everywhere.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from pydantic import Field, TypeAdapter, ValidationError
from typing_extensions import Annotated

from mergekit_ram.errors import RamError

NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]


@dataclass(frozen=True)
class ParameterInfo:
    """One recipe parameter; ``per_model`` ones are set per fine-tuned model."""

    name: str
    value_type: Any
    default: Any
    requirement: str
    per_model: bool = False
    _adapter: TypeAdapter = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_adapter", TypeAdapter(self.value_type))

    def validate(self, value: Any) -> Any:
        return self._adapter.validate_python(value)


EPSILON = ParameterInfo("epsilon", NonNegative, 1e-5, "a finite number >= 0")
R = ParameterInfo("r", NonNegative, 0.1, "a finite number >= 0")
ALPHA = ParameterInfo("alpha", NonNegative, 2.0, "a finite number >= 0")
RULE = ParameterInfo("rule", Literal["clip", "soft"], "clip", "'clip' (RAM+) or 'soft' (RAM+s)")
RHO = ParameterInfo("rho", Optional[NonNegative], None, "a finite number >= 0 (pins the model's rho)", per_model=True)
LAMBDA = ParameterInfo(
    "lambda", Optional[NonNegative], None, "a finite number >= 0 (pins the model's lambda)", per_model=True
)

METHOD_PARAMETERS: dict[str, tuple[ParameterInfo, ...]] = {
    "ram": (EPSILON,),
    "ram_plus": (EPSILON, R, ALPHA, RULE, RHO, LAMBDA),
}


class ParameterError(RamError, ValueError):
    """A recipe parameter a RAM method refuses; the message names it and where it was set."""


def parameter_info(method: str, name: str, where: str = "parameters") -> ParameterInfo:
    """The declaration of ``name`` for ``method``, or a ParameterError listing the valid names."""
    declared = {info.name: info for info in METHOD_PARAMETERS[method]}
    if name in declared:
        return declared[name]
    hint = difflib.get_close_matches(name, list(declared), n=1)
    suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
    raise ParameterError(
        f"{method}: unknown parameter {name!r} in {where}{suggestion}; valid names: {', '.join(sorted(declared))}"
    )


def check_parameter(method: str, name: str, value: Any, where: str = "parameters") -> Any:
    """Validate one scalar value, naming the parameter and where it was set on refusal."""
    info = parameter_info(method, name, where)
    try:
        return info.validate(value)
    except ValidationError:
        raise ParameterError(
            f"{method}: parameter {name!r} in {where} must be {info.requirement}; got {value!r}"
        ) from None
