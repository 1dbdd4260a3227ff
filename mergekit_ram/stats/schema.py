"""``ram_statistics.json``, the versioned JSON of :class:`RamStatistics` (docs/method.md), as pydantic models:
written with ``model_dump``, read with ``model_validate`` (a stranger's file is refused in one line). An infinite
rho is ``"inf"`` (JSON has no infinity); every other number is finite. Fields a file left out stay out when it is
written again (``exclude_unset``): a tensor's ``module`` outside a ``modules:`` merge, ``modules``, ``by_module``.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, ValidationError, field_validator

from mergekit_ram.errors import RamError
from mergekit_ram.parameters import METHOD_NAMES, rescaling_of
from mergekit_ram.rescaling import Rescaling
from mergekit_ram.stats.arithmetic import by_merged_module, by_module
from mergekit_ram.stats.data import ModelStatistics, OverlapCounts, Pin, RamStatistics, Source, TensorCounts

STATISTICS_FILE = "ram_statistics.json"
SCHEMA_VERSION = 2
#: How schema 2 writes an infinite rho.
INFINITY: Literal["inf"] = "inf"
Ratio = Union[FiniteFloat, Literal["inf"]]


class UnreadableStatistics(RamError, ValueError):
    """A statistics file this mergekit-ram does not read; the message says where and why, in one line."""


def write_ratio(value: float) -> Ratio:
    return INFINITY if math.isinf(value) else value


def read_ratio(value: Ratio) -> float:
    return math.inf if value == INFINITY else float(value)


class _Model(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, populate_by_name=True, frozen=True)

    def data(self) -> dict[str, Any]:
        """The JSON object, as the file holds it."""
        return self.model_dump(by_alias=True, exclude_unset=True)


class TensorEntry(_Model):
    """One tensor's counts (also the pre-pass cache's format)."""

    name: str
    numel: int
    epsilon: FiniteFloat
    models: list[str]
    histograms: list[list[int]]
    module: str = ""

    @classmethod
    def of(cls, counts: TensorCounts) -> TensorEntry:
        fields = dict(name=counts.name, numel=counts.numel, epsilon=counts.epsilon, models=list(counts.models))
        module = {"module": counts.module} if counts.module else {}
        return cls.model_validate({**fields, "histograms": [list(row) for row in counts.histograms], **module})

    def counts(self) -> TensorCounts:
        histograms = tuple(tuple(row) for row in self.histograms)
        return TensorCounts(self.name, self.numel, self.epsilon, tuple(self.models), histograms, self.module)


class CountsRow(_Model):
    """A model's counts over the merge, or within a group, as numbers."""

    model: str
    parameters: int
    changed: int
    density: FiniteFloat
    unique: int
    shared: int
    overlap_histogram: dict[str, int]

    @field_validator("overlap_histogram")
    @classmethod
    def _counted_by_k(cls, histogram: dict[str, int]) -> dict[str, int]:
        if list(histogram) != [str(k) for k in range(1, len(histogram) + 1)]:
            raise ValueError("its keys must be 1, 2, ... n: the number of models that changed a parameter")
        return histogram

    @staticmethod
    def fields(counts: OverlapCounts) -> dict[str, Any]:
        return dict(
            model=counts.model,
            parameters=counts.numel,
            changed=counts.active,
            density=counts.density,
            unique=counts.unique,
            shared=counts.shared,
            overlap_histogram={str(k + 1): v for k, v in enumerate(counts.histogram)},
        )


class ModelRow(CountsRow):
    rho: Ratio
    measured_rho: Ratio
    lambda_: FiniteFloat = Field(alias="lambda")
    pinned: Optional[Pin]

    @classmethod
    def of(cls, stats: ModelStatistics) -> ModelRow:
        ratios = dict(rho=write_ratio(stats.rho), measured_rho=write_ratio(stats.measured_rho))
        return cls.model_validate({**cls.fields(stats), **ratios, "lambda": stats.lambda_, "pinned": stats.pinned})

    def statistics(self) -> ModelStatistics:
        histogram = tuple(self.overlap_histogram.values())
        return ModelStatistics(self.model, self.parameters, histogram, read_ratio(self.rho), self.lambda_, self.pinned)


class GroupRow(CountsRow):
    """Within a group (a module): its rho local to that group (which sets no lambda)."""

    local_rho: Ratio


def _groups(groups: Mapping[str, tuple[OverlapCounts, ...]]) -> dict[str, list[GroupRow]]:
    return {
        group: [
            GroupRow.model_validate({**GroupRow.fields(c), "local_rho": write_ratio(c.measured_rho)}) for c in models
        ]
        for group, models in groups.items()
    }


class Settings(_Model):
    """The settings as a recipe writes them; r, alpha and rule are checked by the parameter table."""

    epsilon: Union[FiniteFloat, list[FiniteFloat]]
    density: Optional[FiniteFloat] = None
    r: Any = None
    alpha: Any = None
    rule: Any = None


class StatisticsFile(_Model):
    """The file's object (schema ``SCHEMA_VERSION``); ``by_module`` is the probe's."""

    version: int = Field(alias="schema")
    method: str
    parameters: Settings
    source: Source
    warnings: list[str]
    versions: dict[str, str]
    models: list[ModelRow]
    tensors: list[TensorEntry]
    modules: Optional[dict[str, list[GroupRow]]] = None
    by_module: Optional[dict[str, list[GroupRow]]] = None

    @field_validator("version")
    @classmethod
    def _this_schema(cls, version: int) -> int:
        if version != SCHEMA_VERSION:
            raise ValueError(f"schema {version}; this mergekit-ram reads schema {SCHEMA_VERSION} (another wrote it?)")
        return version

    @classmethod
    def of(cls, statistics: RamStatistics, with_modules: bool = False) -> StatisticsFile:
        merged_modules = by_merged_module(statistics)
        return cls.model_validate(
            {
                "schema": SCHEMA_VERSION,
                "method": statistics.method,
                "parameters": Settings.model_validate(statistics.parameters),
                "source": statistics.source,
                "warnings": list(statistics.warnings),
                "versions": dict(statistics.versions),
                "models": [ModelRow.of(stats) for stats in statistics.models],
                "tensors": [TensorEntry.of(counts) for counts in statistics.tensors],
                **({"modules": _groups(merged_modules)} if merged_modules else {}),
                **({"by_module": _groups(by_module(statistics))} if with_modules else {}),
            }
        )

    def statistics(self) -> RamStatistics:
        """The statistics; r, alpha and the rule checked against the parameter table (``ParameterError``)."""
        settings, epsilon = self.parameters, self.parameters.epsilon
        return RamStatistics(
            method=self.method,
            source=self.source,
            epsilons=tuple(epsilon) if isinstance(epsilon, list) else (epsilon,),
            rescaling=self._rescaling(),
            models=tuple(row.statistics() for row in self.models),
            tensors=tuple(entry.counts() for entry in self.tensors),
            warnings=tuple(self.warnings),
            versions=dict(self.versions),
            density=settings.density,
        )

    def _rescaling(self) -> Optional[Rescaling]:
        settings = self.parameters
        if "r" not in settings.model_fields_set:
            return None
        if self.method not in METHOD_NAMES:
            raise UnreadableStatistics(
                f"{STATISTICS_FILE}: unknown method {self.method!r}; expected one of {', '.join(METHOD_NAMES)}"
            )
        return rescaling_of(self.method, settings.r, settings.alpha, settings.rule, STATISTICS_FILE)

    def to_json(self) -> str:
        """The text of ``ram_statistics.json``."""
        return json.dumps(self.data(), indent=2, allow_nan=False) + "\n"


def read_statistics(text: Union[str, bytes, Mapping[str, Any]], what: str = STATISTICS_FILE) -> StatisticsFile:
    """A statistics file's text (or parsed object), validated, its settings checked: ``UnreadableStatistics`` (or
    the parameter table's ``ParameterError``) in one line."""
    try:
        found = StatisticsFile.model_validate(text) if isinstance(text, Mapping) else None
        found = found or StatisticsFile.model_validate_json(text)  # type: ignore[arg-type]
    except ValidationError as error:
        first = error.errors()[0]
        place = ".".join(str(part) for part in first["loc"]) or "the file"
        raise UnreadableStatistics(
            f"{what} is not the statistics file a merge writes ({place}: {first['msg'].removeprefix('Value error, ')})"
        ) from None
    found.statistics()  # r, alpha and rule checked
    return found


def statistics_to_dict(statistics: RamStatistics, *, with_modules: bool = False) -> dict[str, Any]:
    return StatisticsFile.of(statistics, with_modules).data()


def statistics_to_json(statistics: RamStatistics) -> str:
    return StatisticsFile.of(statistics).to_json()


def statistics_from_dict(data: Mapping[str, Any]) -> RamStatistics:
    return read_statistics(data).statistics()


def counts_to_dict(counts: TensorCounts) -> dict[str, Any]:
    return TensorEntry.of(counts).data()


def counts_from_dict(data: Mapping[str, Any]) -> TensorCounts:
    return TensorEntry.model_validate(data).counts()
