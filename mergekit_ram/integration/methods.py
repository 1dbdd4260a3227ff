"""The four methods, declared as mergekit declares its own: ``merge_method`` on typed functions whose
annotations carry each parameter's bounds (``parameters.py``), per-model values as ``PerNonBase``.

They only merge: each fine-tune's lambda arrives as its per-model ``lambda`` (written into the recipe by the
seam, or pinned). ``Kernels`` holds what one merge's seam gives them (``Session``: the output dtype, and
where the counts of a merge without a pre-pass go); the registered ones have none (a direct call through
mergekit's own API, which counts nothing and so refuses a lambda that needs the global rho).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable, Optional

import torch
from mergekit.merge_methods import BasePolicy, InputContract, MergeMethod, PerNonBase, TensorGroup, merge_method

from mergekit_ram.errors import InputError
from mergekit_ram.kernel import MergeOverflowError, NonFiniteInputError, compute_dtype, merge_tensors
from mergekit_ram.parameters import (
    DENSITY,
    EPSILON,
    METHOD_NAMES,
    METHODS,
    LambdaPin,
    NonNegative,
    ParameterError,
    RhoPin,
    RuleName,
    Scale,
    Share,
)
from mergekit_ram.rescaling import Rescaling
from mergekit_ram.stats.arithmetic import model_lambda
from mergekit_ram.stats.data import Pin, TensorCounts

REFERENCE_URL = "https://arxiv.org/abs/2601.13572"
#: Python cannot name an argument ``lambda``: a kernel's ``lambda_`` is the recipe's ``lambda``.
RECIPE_NAMES = {"lambda_": "lambda"}


@dataclass
class Session:
    """What one merge's seam gives its methods for that merge: the output dtype the result is rounded to once,
    and whether each merged group's counts go into ``counts`` (a merge without a pre-pass)."""

    out_dtype: Optional[torch.dtype] = None
    counting: bool = False
    counts: list[TensorCounts] = field(default_factory=list)


class Kernels:
    """The four methods' functions; ``session`` None for the registered ones."""

    def __init__(self, session: Optional[Session] = None) -> None:
        self.session = session

    def ram(self, group: TensorGroup, epsilon: NonNegative = EPSILON) -> torch.Tensor:
        """The paper's RAM: lambda 1 for every model."""
        return self.merge("ram", group, epsilon, None)

    def ram_plus(
        self,
        group: TensorGroup,
        epsilon: NonNegative = EPSILON,
        r: NonNegative = Rescaling.r,
        alpha: NonNegative = Rescaling.alpha,
        rule: RuleName = Rescaling.rule,
        rho: PerNonBase[RhoPin] = None,
        lambda_: PerNonBase[LambdaPin] = None,
    ) -> torch.Tensor:
        """RAM+: unique updates scaled by lambda_t = 1 + r * clip(rho_t, 0, alpha) (or the soft rule)."""
        lambdas = self.lambdas("ram_plus", group, Rescaling(r, alpha, rule), rho, lambda_)
        return self.merge("ram_plus", group, epsilon, lambdas)

    def ram_ties(
        self,
        group: TensorGroup,
        epsilon: NonNegative = EPSILON,
        density: Share = DENSITY,
        r: NonNegative = 0.0,
        alpha: NonNegative = Rescaling.alpha,
        rule: RuleName = Rescaling.rule,
        rho: PerNonBase[RhoPin] = None,
        lambda_: PerNonBase[LambdaPin] = None,
    ) -> torch.Tensor:
        """The authors' arm-ties: the shared region TIES-resolved at ``density``; no rescaling unless r > 0."""
        lambdas = self.lambdas("ram_ties", group, Rescaling(r, alpha, rule), rho, lambda_)
        return self.merge("ram_ties", group, epsilon, lambdas, density)

    def ram_unique(
        self, group: TensorGroup, epsilon: NonNegative = EPSILON, scale: PerNonBase[Scale] = 1.0
    ) -> torch.Tensor:
        """The unique regions alone, each model's scaled (the paper's Figure 3); shared positions keep the base."""
        return self.merge("ram_unique", group, epsilon, [scale[entry.id] for entry in group.non_base])

    def lambdas(self, method: str, group: TensorGroup, rescaling: Rescaling, rho: Any, lambda_: Any) -> list[float]:
        """Each fine-tune's lambda from its pin; one that needs the global rho is refused (nothing counted it)."""
        found = []
        for entry in group.non_base:
            pins: list[tuple[Pin, Optional[float]]] = [("lambda", lambda_[entry.id]), ("rho", rho[entry.id])]
            pin = next(((kind, value) for kind, value in pins if value is not None), None)
            if pin is None and rescaling.r != 0:
                raise ParameterError(
                    f"{method}: tensor {group.metadata.name}: the lambda of {entry.id} needs the global rho, "
                    "counted over the whole merge before it, which this way of calling mergekit does not count; "
                    "merge with mergekit-yaml, mergekit.merge.run_merge or mergekit_ram.merge_state_dicts, or pin "
                    "`lambda` or `rho` for every model, or set `r: 0`"
                )
            found.append(model_lambda(0.0, rescaling, pin))
        return found

    def merge(
        self, method: str, group: TensorGroup, epsilon: float, lambdas: Optional[list[float]], density: float = 1.0
    ) -> torch.Tensor:
        """One group merged in the arithmetic dtype and rounded once; counted where the session asks."""
        base, finetunes = group.base, group.non_base
        assert base is not None  # the contract requires a base
        session = self.session or Session()
        try:
            result = merge_tensors(
                base.tensor,
                [entry.tensor for entry in finetunes],
                epsilon,
                lambdas,
                count=session.counting,
                out_dtype=session.out_dtype,
                shared=METHODS[method].shared,
                density=density,
            )
        except NonFiniteInputError as error:
            entry = base if error.index is None else finetunes[error.index]
            dtype = entry.tensor.dtype
            raise non_finite_error(entry.id, group.metadata.name, dtype, dtype, error.value) from None
        except MergeOverflowError as error:
            arithmetic = compute_dtype(base.tensor.dtype, *(entry.tensor.dtype for entry in finetunes))
            update_of = None if error.index is None else finetunes[error.index].id
            raise overflow_error(method, group.metadata.name, error.dtype, arithmetic, update_of) from None
        if session.counting:
            session.counts.append(
                TensorCounts(
                    name=group.metadata.name or "",
                    numel=base.tensor.numel(),
                    epsilon=epsilon,
                    models=tuple(str(entry.id) for entry in finetunes),
                    histograms=result.histograms or (),
                )
            )
        return result.merged


def declared(kernels: Kernels) -> dict[str, MergeMethod]:
    """The four methods of ``kernels``, by name: ``merge_method`` on each, the recipe's names for its arguments."""
    methods = {}
    for name in METHOD_NAMES:
        kernel = getattr(kernels, name)
        method = merge_method(
            kernel,
            name=name,
            pretty_name=METHODS[name].pretty_name,
            reference_url=REFERENCE_URL,
            contract=InputContract(base=BasePolicy.REQUIRED),
        )
        named = tuple(replace(spec, name=RECIPE_NAMES.get(spec.name, spec.name)) for spec in method.spec.parameters)
        methods[name] = type(method)(replace(method.spec, parameters=named), partial(_with_python_names, kernel))
    return methods


def _with_python_names(kernel: Callable[..., torch.Tensor], group: TensorGroup, /, **values: Any) -> torch.Tensor:
    python = {recipe: name for name, recipe in RECIPE_NAMES.items()}
    return kernel(group, **{python.get(name, name): value for name, value in values.items()})


def kernels_of(method: Any) -> Optional[Kernels]:
    """The ``Kernels`` behind a method ``declared`` made; None for anyone else's."""
    implementation = getattr(method, "implementation", None)
    kernel = implementation.args[0] if isinstance(implementation, partial) and implementation.args else None
    owner = getattr(kernel, "__self__", None)
    return owner if isinstance(owner, Kernels) else None


def non_finite_error(
    model: Any, name: Optional[str], dtype: torch.dtype, original: torch.dtype, value: str
) -> InputError:
    """An Inf in float16 is most likely the recipe's cast to it."""
    if value == "Inf" and dtype == torch.float16:
        if original != dtype:
            cause = f"after the cast from {str(original).removeprefix('torch.')} to float16 (dtype)"
        else:
            cause = "as float16 (after the recipe's `dtype: float16` cast, if the checkpoint is wider)"
        return InputError(
            f"{model}: tensor {name} is Inf {cause}; values above 65504 do not fit float16: "
            "merge with `dtype: bfloat16` or `float32`"
        )
    return InputError(f"{model}: tensor {name} contains NaN or Inf")


def overflow_error(
    method: str, name: Optional[str], dtype: torch.dtype, arithmetic: torch.dtype, update_of: Any = None
) -> ParameterError:
    """Finite inputs, a NaN or Inf result: a wider out_dtype where only the rounding to it overflowed (``dtype``
    is then the output's, not the ``arithmetic`` dtype), else float64 arithmetic; the model ``update_of`` where
    its update itself overflows."""
    where = str(dtype).removeprefix("torch.")
    if dtype != arithmetic:
        return ParameterError(
            f"{method}: tensor {name}: the merged values do not fit the output dtype {where} (out_dtype); "
            "choose a wider out_dtype"
        )
    fix = "merge with `dtype: float64` (arithmetic is then float64)"
    if update_of is not None:
        return ParameterError(
            f"{method}: tensor {name}: the update of {update_of} (its value minus the base's) overflows {where}; {fix}"
        )
    return ParameterError(f"{method}: tensor {name}: the merged values overflow {where}; {fix}")
