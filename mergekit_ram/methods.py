"""The ``ram`` and ``ram_plus`` merge methods as mergekit sees them: specs and kernels.

Only mergekit's public method API is used here. The pre-pass reaches the kernel through
``count_request``: a task that runs a merge task's own inputs sets it, so the counts are
taken from exactly what the kernel receives (slices, filters, dtype casts, tokenizer
alignment included).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from mergekit.merge_methods.base import (
    BasePolicy,
    GroupMergeMethod,
    InputContract,
    MergeMethodSpec,
    ParameterScope,
    ParameterSpec,
    TensorGroup,
)

from mergekit_ram.checks import InputError
from mergekit_ram.errors import RamError
from mergekit_ram.kernel import NonFiniteInputError, ram_merge, rescale_factor
from mergekit_ram.parameters import METHOD_PARAMETERS
from mergekit_ram.stats import TensorCounts

REFERENCE_URL = "https://arxiv.org/abs/2601.13572"
PRETTY_NAMES = {
    "ram": "Reinforced Agent Merging (RAM, mergekit-ram)",
    "ram_plus": "Reinforced Agent Merging Plus (RAM+, global rho, mergekit-ram)",
}


@dataclass
class CountRequest:
    """Asks the kernel for the overlap counts of the group it is given.

    ``merge=False`` is the pre-pass: count only and return the base unchanged.
    """

    merge: bool
    counts: Optional[TensorCounts] = None


_COUNT_REQUEST: ContextVar[Optional[CountRequest]] = ContextVar("mergekit_ram_count_request", default=None)


@contextlib.contextmanager
def count_request(merge: bool) -> Iterator[CountRequest]:
    request = CountRequest(merge=merge)
    token = _COUNT_REQUEST.set(request)
    try:
        yield request
    finally:
        _COUNT_REQUEST.reset(token)


class MissingStatisticsError(RamError, RuntimeError):
    """ram_plus was asked to merge without a model's global rho or lambda."""


class RamMergeMethod(GroupMergeMethod):
    """RAM (``ram``) or RAM+ (``ram_plus``) on one tensor group, float32 inside."""

    def __init__(self, name: str):
        self.spec = MergeMethodSpec(
            name=name,
            pretty_name=PRETTY_NAMES[name],
            reference_url=REFERENCE_URL,
            contract=InputContract(base=BasePolicy.REQUIRED),
            parameters=tuple(
                ParameterSpec(
                    name=info.name,
                    value_type=info.value_type,
                    scope=ParameterScope.NON_BASE if info.per_model else ParameterScope.SHARED,
                    default=info.default,
                )
                for info in METHOD_PARAMETERS[name]
            ),
        )

    def merge_group(self, group: TensorGroup, /, **parameters: Any) -> torch.Tensor:
        base = group.base.tensor
        finetunes = group.non_base
        request = _COUNT_REQUEST.get()
        lambdas = None
        if request is None or request.merge:
            lambdas = self.lambdas(group, parameters)
        try:
            result = ram_merge(
                base,
                [entry.tensor for entry in finetunes],
                parameters["epsilon"],
                lambdas,
                merge=request is None or request.merge,
                count=request is not None,
            )
        except NonFiniteInputError as error:
            model = group.base.id if error.index is None else finetunes[error.index].id
            raise InputError(f"{model}: tensor {group.metadata.name} contains NaN or Inf") from None
        if request is not None:
            request.counts = TensorCounts(
                name=group.metadata.name or "",
                numel=base.numel(),
                epsilon=parameters["epsilon"],
                models=tuple(str(entry.id) for entry in finetunes),
                histograms=result.histograms or (),
            )
        return base if result.merged is None else result.merged

    def lambdas(self, group: TensorGroup, parameters: dict[str, Any]) -> Optional[list[float]]:
        """lambda_t per fine-tune: pinned, else from its global rho (1 when r = 0); None for RAM."""
        if self.spec.name == "ram":
            return None
        values = []
        for entry in group.non_base:
            pinned = parameters["lambda"].get(entry.id)
            rho = parameters["rho"].get(entry.id)
            if pinned is not None:
                values.append(pinned)
            elif rho is not None:
                values.append(rescale_factor(rho, parameters["r"], parameters["alpha"], parameters["rule"]))
            elif parameters["r"] == 0:
                values.append(1.0)
            else:
                raise MissingStatisticsError(
                    f"ram_plus has no global rho for {entry.id} while merging {group.metadata.name}: "
                    "the whole-model pre-pass did not run on this path. Merge with mergekit-yaml, "
                    "mergekit-multi, mergekit-pytorch or mergekit.merge.run_merge with mergekit-ram "
                    "registered, use mergekit_ram.merge_state_dicts for in-memory models, or pin "
                    "`rho` or `lambda` for each model in the recipe."
                )
        return values


RAM = RamMergeMethod("ram")
RAM_PLUS = RamMergeMethod("ram_plus")
METHODS = {method.spec.name: method for method in (RAM, RAM_PLUS)}
