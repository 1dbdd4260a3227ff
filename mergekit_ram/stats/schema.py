"""``ram_statistics.json``, the versioned JSON of :class:`RamStatistics` (docs/method.md); an infinite rho
is ``"inf"`` (JSON has no infinity)."""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Optional, Union

from mergekit_ram.parameters import METHOD_NAMES, rescaling_of
from mergekit_ram.rescaling import Rescaling
from mergekit_ram.stats.arithmetic import by_merged_module, by_module
from mergekit_ram.stats.data import ModelStatistics, OverlapCounts, RamStatistics, TensorCounts

STATISTICS_FILE = "ram_statistics.json"
SCHEMA_VERSION = 2
#: How schema 2 writes an infinite rho.
INFINITY = "inf"


def write_ratio(value: float) -> Union[float, str]:
    return INFINITY if math.isinf(value) else value


def read_ratio(value: Union[float, str]) -> float:
    if value == INFINITY:
        return math.inf
    if isinstance(value, str):
        raise ValueError(f"{STATISTICS_FILE}: a rho is {value!r}; expected a number or {INFINITY!r}")
    return float(value)


def counts_to_dict(counts: TensorCounts) -> dict[str, Any]:
    """One tensor's counts (also the pre-pass cache's format)."""
    return {
        "name": counts.name,
        "numel": counts.numel,
        "epsilon": counts.epsilon,
        "models": list(counts.models),
        "histograms": [list(row) for row in counts.histograms],
        **({"module": counts.module} if counts.module else {}),
    }


def counts_from_dict(data: Mapping[str, Any]) -> TensorCounts:
    return TensorCounts(
        name=data["name"],
        numel=int(data["numel"]),
        epsilon=float(data["epsilon"]),
        models=tuple(data["models"]),
        histograms=tuple(tuple(int(v) for v in row) for row in data["histograms"]),
        module=str(data.get("module", "")),
    )


def _row(counts: OverlapCounts) -> dict[str, Any]:
    """A model's counts (over the merge, or within a group) as numbers."""
    return {
        "model": counts.model,
        "parameters": counts.numel,
        "changed": counts.active,
        "density": counts.density,
        "unique": counts.unique,
        "shared": counts.shared,
        "overlap_histogram": {str(k + 1): v for k, v in enumerate(counts.histogram)},
    }


def _local(groups: Mapping[str, tuple[OverlapCounts, ...]]) -> dict[str, list[dict[str, Any]]]:
    """Per group, each model's counts and its rho local to that group (which sets no lambda)."""
    return {
        group: [{**_row(counts), "local_rho": write_ratio(counts.measured_rho)} for counts in models]
        for group, models in groups.items()
    }


def statistics_to_dict(statistics: RamStatistics, *, with_modules: bool = False) -> dict[str, Any]:
    """The JSON object (schema ``SCHEMA_VERSION``); ``with_modules`` adds the probe's ``by_module``."""
    data: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "method": statistics.method,
        "parameters": statistics.parameters,
        "source": statistics.source,
        "warnings": list(statistics.warnings),
        "versions": dict(statistics.versions),
        "models": [
            {
                **_row(stats),
                "rho": write_ratio(stats.rho),
                "measured_rho": write_ratio(stats.measured_rho),
                "lambda": stats.lambda_,
                "pinned": stats.pinned,
            }
            for stats in statistics.models
        ],
        "tensors": [counts_to_dict(counts) for counts in statistics.tensors],
    }
    merged_modules = by_merged_module(statistics)
    if merged_modules:
        data["modules"] = _local(merged_modules)
    if with_modules:
        data["by_module"] = _local(by_module(statistics))
    return data


def statistics_to_json(statistics: RamStatistics) -> str:
    """The text of ``ram_statistics.json``."""
    return json.dumps(statistics_to_dict(statistics), indent=2, allow_nan=False) + "\n"


def statistics_from_dict(data: Mapping[str, Any]) -> RamStatistics:
    """Read a ``ram_statistics.json`` object (schema ``SCHEMA_VERSION``)."""
    schema = data.get("schema")
    if schema != SCHEMA_VERSION:
        raise ValueError(
            f"{STATISTICS_FILE} has schema {schema!r}; this mergekit-ram reads schema {SCHEMA_VERSION} "
            "(another mergekit-ram wrote it?)"
        )
    parameters = data["parameters"]
    epsilon = parameters["epsilon"]
    models = tuple(
        ModelStatistics(
            model=entry["model"],
            numel=int(entry["parameters"]),
            histogram=tuple(
                int(entry["overlap_histogram"][str(k + 1)]) for k in range(len(entry["overlap_histogram"]))
            ),
            rho=read_ratio(entry["rho"]),
            lambda_=float(entry["lambda"]),
            pinned=entry["pinned"],
        )
        for entry in data["models"]
    )
    return RamStatistics(
        method=data["method"],
        source=data["source"],
        epsilons=tuple(epsilon) if isinstance(epsilon, list) else (epsilon,),
        rescaling=_rescaling(data["method"], parameters),
        models=models,
        tensors=tuple(counts_from_dict(entry) for entry in data["tensors"]),
        warnings=tuple(data.get("warnings", ())),
        versions=dict(data["versions"]),
        density=parameters.get("density"),
    )


def _rescaling(method: str, parameters: Mapping[str, Any]) -> Optional[Rescaling]:
    """The file's r, alpha and rule (absent for ``ram``), checked against the parameter table."""
    if "r" not in parameters:
        return None
    if method not in METHOD_NAMES:
        raise ValueError(f"{STATISTICS_FILE}: unknown method {method!r}; expected one of {', '.join(METHOD_NAMES)}")
    return rescaling_of(method, parameters["r"], parameters["alpha"], parameters["rule"], STATISTICS_FILE)
