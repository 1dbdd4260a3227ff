"""The parameters' types, each with its bounds and the words that say them, declared once: the methods'
signatures use them (``integration/methods.py``), so mergekit, the recipe checks, the in-memory API and the
statistics file all validate a value alike and refuse it with the same message."""

from __future__ import annotations

import difflib
from types import MappingProxyType
from typing import Any, Iterable, Literal, Mapping, NamedTuple, Optional, Sequence, get_args

from pydantic import AfterValidator, BeforeValidator, Field, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from typing_extensions import Annotated

from mergekit_ram.errors import RecipeError
from mergekit_ram.rescaling import RULES, Rescaling, rule_choices


class Method(NamedTuple):
    """What a method is beside its signature (a ``Kernels`` function in ``integration/methods.py``, which declares
    its parameters): its name in mergekit's card, the kernel's rule where several models changed an element, the
    name of each model's factor in the tables, and what the card says of its recipe run by mergekit alone."""

    pretty_name: str
    shared: Literal["mean", "ties", "base"]
    factor: Literal["lambda", "scale"]
    without_plugin: str


_UNKNOWN = "Without mergekit-ram, mergekit refuses `{}` (an unknown merge method)."
#: The plugin's methods, in the order they are documented: adding one is an entry here and its ``Kernels`` function.
METHODS: Mapping[str, Method] = MappingProxyType(
    {
        "ram": Method(
            "Reinforced Agent Merging (RAM, mergekit-ram)",
            "mean",
            "lambda",
            "Without mergekit-ram, mergekit silently runs its own built-in `ram` instead: it computes in the "
            "checkpoints' dtype, so on bfloat16 or float16 checkpoints its numbers differ from this model's "
            "(mergekit-ram computes in float32, or the inputs' precision if wider, and rounds once) unless the "
            "recipe sets `dtype: float32`, and it writes no `ram_statistics.json`.",
        ),
        "ram_plus": Method(
            "Reinforced Agent Merging Plus (RAM+, global rho, mergekit-ram)",
            "mean",
            "lambda",
            "Without mergekit-ram, mergekit refuses `ram_plus` (an unknown merge method); its own `ramplus_tl` is a "
            "different, tensor-local rule.",
        ),
        "ram_ties": Method(
            "Reinforced Agent Merging with a TIES shared region (mergekit-ram)",
            "ties",
            "lambda",
            _UNKNOWN.format("ram_ties"),
        ),
        "ram_unique": Method(
            "Reinforced Agent Merging, unique regions only (mergekit-ram)",
            "base",
            "scale",
            _UNKNOWN.format("ram_unique"),
        ),
    }
)
METHOD_NAMES = tuple(METHODS)
#: The largest float32; a value above it becomes inf in the float32 arithmetic.
FLOAT32_MAX = float.fromhex("0x1.fffffep+127")


def _not_a_boolean(value: Any) -> Any:
    """YAML's ``true`` / ``false`` are not numbers here (pydantic would read them as 1.0 / 0.0)."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    return value


def _known_rule(value: str) -> str:
    if value not in RULES:
        raise ValueError(f"not one of {', '.join(RULES)}")
    return value


# Each type: a finite number (no boolean) within its bounds, and its words (``requirement``).
NotBool = BeforeValidator(_not_a_boolean)
NonNegative = Annotated[float, NotBool, Field(ge=0, allow_inf_nan=False, description="a finite number >= 0")]
Share = Annotated[
    float,
    NotBool,
    Field(gt=0, le=1, allow_inf_nan=False, description="a number in (0, 1], the share of shared updates kept"),
]
RuleName = Annotated[str, AfterValidator(_known_rule), Field(description=rule_choices())]
RhoPin = Optional[
    Annotated[
        float, NotBool, Field(ge=0, allow_inf_nan=False, description="a finite number >= 0 (pins the model's rho)")
    ]
]
LambdaPin = Optional[
    Annotated[
        float, NotBool, Field(ge=0, allow_inf_nan=False, description="a finite number >= 0 (pins the model's lambda)")
    ]
]
Scale = Annotated[
    float,
    NotBool,
    Field(ge=0, allow_inf_nan=False, description="a finite number >= 0 (the factor of the model's unique updates)"),
]

#: The defaults of the paper (section 4.2), for the signatures and the statistics file.
EPSILON = 1e-5
DENSITY = 0.1  # ram_ties: the share of each model's updates at a tensor's shared positions TIES keeps


class ParameterError(RecipeError):
    """A recipe parameter a RAM method refuses; the message names it and where it was set."""


def close_match(name: str, candidates: Iterable[str]) -> Optional[str]:
    """The other candidate ``name`` looks like a misspelling of (difflib's default cutoff), if any."""
    hint = difflib.get_close_matches(name, [candidate for candidate in candidates if candidate != name], n=1)
    return hint[0] if hint else None


def requirement(value_type: Any) -> str:
    """The words of a declared type (the description of its ``Field``)."""
    for argument in get_args(value_type):
        if isinstance(argument, FieldInfo) and argument.description:
            return argument.description
        found = requirement(argument)
        if found:
            return found
    return ""


def check_value(method: str, name: str, value_type: Any, value: Any, where: str = "parameters") -> Any:
    """The validated value, or a refusal naming the parameter and where it was set; a number must also fit
    float32 (the arithmetic's precision): 1e300 would become inf."""
    try:
        validated = TypeAdapter(value_type).validate_python(value)
    except ValidationError:
        boolean = " (true/false is a boolean, not a number)" if isinstance(value, bool) else ""
        raise ParameterError(
            f"{method}: parameter {name!r} in {where} must be {requirement(value_type)}; got {value!r}{boolean}"
        ) from None
    if isinstance(validated, float) and validated > FLOAT32_MAX:
        raise ParameterError(
            f"{method}: parameter {name!r} in {where} is {validated:g}, above the largest float32 "
            f"({FLOAT32_MAX:g}) the merge computes in"
        )
    return validated


def rescaling_of(method: str, r: Any, alpha: Any, rule: Any, where: str) -> Rescaling:
    """r, alpha and the rule read from elsewhere than a recipe (the statistics file), checked as in a recipe."""
    return Rescaling(
        check_value(method, "r", NonNegative, r, where),
        check_value(method, "alpha", NonNegative, alpha, where),
        check_value(method, "rule", RuleName, rule, where),
    )


def check_lambda_range(method: str, r: float, alphas: Sequence[float], rules: Sequence[str], where: str) -> None:
    """The largest lambda_t these settings allow must fit float32, or the merged values overflow."""
    bound = max(Rescaling(r, alpha, rule).largest_lambda() for alpha in alphas for rule in rules)
    if bound > FLOAT32_MAX:
        raise ParameterError(
            f"{method}: r = {r:g} in {where} allows lambda up to {bound:g}, above the largest float32 "
            f"({FLOAT32_MAX:g}): lower r or alpha (the paper uses r = 0.1, alpha = 2: lambda at most 1.2)"
        )
