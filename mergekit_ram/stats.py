"""RAM statistics: per-tensor counts summed per model, rho and lambda, and their renderings.

One ``RamStatistics`` object feeds the log, the JSON file beside a merged model, the
model card section and the command line, so every rendering shows the same figures.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping, Optional, Sequence

from mergekit_ram.kernel import Rule, overlap_ratio, rescale_factor
from mergekit_ram.parameters import PLAUSIBLE_LAMBDA

LOG = logging.getLogger(__name__)

STATISTICS_FILE = "ram_statistics.json"
SCHEMA_VERSION = 1

Source = Literal["pre-pass", "merge"]
Pin = Literal["rho", "lambda"]


@dataclass(frozen=True)
class TensorCounts:
    """One output tensor's overlap counts, as the kernel saw them.

    ``histograms[t][k - 1]``: elements of this tensor that ``models[t]`` changed and
    that exactly k models changed.
    """

    name: str
    numel: int
    epsilon: float
    models: tuple[str, ...]
    histograms: tuple[tuple[int, ...], ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "numel": self.numel,
            "epsilon": self.epsilon,
            "models": list(self.models),
            "histograms": [list(row) for row in self.histograms],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorCounts:
        return cls(
            name=data["name"],
            numel=int(data["numel"]),
            epsilon=float(data["epsilon"]),
            models=tuple(data["models"]),
            histograms=tuple(tuple(int(v) for v in row) for row in data["histograms"]),
        )


@dataclass(frozen=True)
class ModelStatistics:
    """One fine-tuned model's counts over the whole merge, and the lambda it was given."""

    model: str
    numel: int
    histogram: tuple[int, ...]
    rho: float
    lambda_: float
    pinned: Optional[Pin] = None

    @property
    def active(self) -> int:
        return sum(self.histogram)

    @property
    def unique(self) -> int:
        return self.histogram[0] if self.histogram else 0

    @property
    def shared(self) -> int:
        return self.active - self.unique

    @property
    def density(self) -> float:
        return self.active / self.numel if self.numel else 0.0

    @property
    def measured_rho(self) -> float:
        return overlap_ratio(self.shared, self.unique)


@dataclass(frozen=True)
class RamStatistics:
    """What a RAM / RAM+ merge computed: per-model counts, rho and lambda."""

    method: str
    parameters: dict[str, Any]
    source: Source
    models: tuple[ModelStatistics, ...]
    tensors: tuple[TensorCounts, ...]
    warnings: tuple[str, ...] = ()
    versions: dict[str, str] = field(default_factory=lambda: package_versions())

    @classmethod
    def build(
        cls,
        method: str,
        tensors: Iterable[TensorCounts],
        *,
        r: float = 0.0,
        alpha: float = 0.0,
        rule: Rule = "clip",
        pins: Optional[Mapping[str, tuple[Pin, float]]] = None,
        source: Source = "pre-pass",
        checkpoint_dtypes: Optional[Mapping[str, Iterable[str]]] = None,
    ) -> RamStatistics:
        """Sum per-tensor counts per model, then rho_t and lambda_t (pins override).

        ``checkpoint_dtypes`` (safetensors dtype names per model) only feeds the warnings.
        """
        tensors = tuple(tensors)
        numel, histograms = _aggregate(tensors)
        pins = dict(pins or {})
        models = []
        for model in list(numel) + [m for m in pins if m not in numel]:
            histogram = tuple(histograms.get(model, ()))
            unique = histogram[0] if histogram else 0
            rho = overlap_ratio(sum(histogram) - unique, unique)
            pin = pins.get(model)
            if pin is not None and pin[0] == "rho":
                rho = pin[1]
            lambda_ = pin[1] if pin is not None and pin[0] == "lambda" else rescale_factor(rho, r, alpha, rule)
            models.append(
                ModelStatistics(
                    model=model,
                    numel=numel.get(model, 0),
                    histogram=histogram,
                    rho=rho,
                    lambda_=lambda_,
                    pinned=pin[0] if pin is not None else None,
                )
            )
        epsilons = sorted({counts.epsilon for counts in tensors})
        parameters: dict[str, Any] = {"epsilon": epsilons[0] if len(epsilons) == 1 else epsilons}
        if method != "ram":
            parameters.update(r=r, alpha=alpha, rule=rule)
        return cls(
            method=method,
            parameters=parameters,
            source=source,
            models=tuple(models),
            tensors=tensors,
            warnings=_warnings(models, epsilons, checkpoint_dtypes or {}),
        )

    def by_module(self) -> dict[str, tuple[ModelStatistics, ...]]:
        """The counts split by part of the network; rho here is local to that part."""
        groups: dict[str, list[TensorCounts]] = {}
        for counts in self.tensors:
            groups.setdefault(module_of(counts.name), []).append(counts)
        result = {}
        for module in MODULES:
            if module in groups:
                numel, histograms = _aggregate(groups[module])
                result[module] = tuple(
                    ModelStatistics(
                        model=model,
                        numel=numel[model],
                        histogram=tuple(histograms[model]),
                        rho=overlap_ratio(sum(histograms[model]) - histograms[model][0], histograms[model][0]),
                        lambda_=math.nan,
                    )
                    for model in numel
                )
        return result

    def lambdas(self) -> dict[str, float]:
        return {stats.model: stats.lambda_ for stats in self.models}

    # Renderings -----------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "method": self.method,
            "parameters": self.parameters,
            "source": self.source,
            "warnings": list(self.warnings),
            "versions": self.versions,
            "models": [
                {
                    "model": stats.model,
                    "parameters": stats.numel,
                    "changed": stats.active,
                    "density": stats.density,
                    "unique": stats.unique,
                    "shared": stats.shared,
                    "overlap_histogram": {str(k + 1): v for k, v in enumerate(stats.histogram)},
                    "rho": _finite_or_none(stats.rho),
                    "measured_rho": _finite_or_none(stats.measured_rho),
                    "lambda": stats.lambda_,
                    "pinned": stats.pinned,
                }
                for stats in self.models
            ],
            "tensors": [counts.to_dict() for counts in self.tensors],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RamStatistics:
        models = tuple(
            ModelStatistics(
                model=entry["model"],
                numel=int(entry["parameters"]),
                histogram=tuple(
                    int(entry["overlap_histogram"][str(k + 1)]) for k in range(len(entry["overlap_histogram"]))
                ),
                rho=math.inf if entry["rho"] is None else float(entry["rho"]),
                lambda_=float(entry["lambda"]),
                pinned=entry["pinned"],
            )
            for entry in data["models"]
        )
        return cls(
            method=data["method"],
            parameters=dict(data["parameters"]),
            source=data["source"],
            models=models,
            tensors=tuple(TensorCounts.from_dict(entry) for entry in data["tensors"]),
            warnings=tuple(data.get("warnings", ())),
            versions=dict(data["versions"]),
        )

    def table(self) -> str:
        """A fixed-width table: model, density, changed, shared, unique, rho, lambda.

        Local paths show as their last component when that is unambiguous.
        """
        names = self.display_names()
        rows = [("model", "density", "changed", "shared", "unique", "rho", "lambda")]
        for stats in self.models:
            rows.append(
                (
                    names[stats.model],
                    f"{100 * stats.density:.2f}%",
                    f"{stats.active:,}",
                    f"{stats.shared:,}",
                    f"{stats.unique:,}",
                    _format_rho(stats.rho) + (" (pinned)" if stats.pinned == "rho" else ""),
                    f"{stats.lambda_:.4f}" + (" (pinned)" if stats.pinned == "lambda" else ""),
                )
            )
        return format_table(rows)

    def compact_table(self) -> str:
        """The table shown after a merge: model, density, rho, lambda (pins marked *)."""
        names = self.display_names()
        rows = [("model", "density", "rho", "lambda")]
        for stats in self.models:
            rows.append(
                (
                    names[stats.model],
                    f"{100 * stats.density:.2f}%",
                    _format_rho(stats.rho) + ("*" if stats.pinned == "rho" else ""),
                    f"{stats.lambda_:.4f}" + ("*" if stats.pinned == "lambda" else ""),
                )
            )
        table = format_table(rows)
        return table + ("\n* pinned in the recipe" if any(stats.pinned for stats in self.models) else "")

    def display_names(self) -> dict[str, str]:
        """Local paths as their last component when that is unambiguous."""
        models = [stats.model for stats in self.models]
        short = {model: os.path.basename(model.rstrip(os.sep)) if os.path.isabs(model) else model for model in models}
        return short if len(set(short.values())) == len(models) else {model: model for model in models}

    def markdown(self) -> str:
        """The model card's mergekit-ram sections: where the method comes from, how to rerun
        the merge, and the statistics."""
        settings = ", ".join(f"`{key}` = {value}" for key, value in self.parameters.items())
        lines = [
            "## Reproducing this merge",
            "",
            f"The `{self.method}` merge method comes from [mergekit-ram]({PROJECT_URL}), a plugin for "
            f"mergekit (here mergekit-ram {self.versions.get('mergekit-ram', '?')}, mergekit "
            f"{self.versions.get('mergekit', '?')}, torch {self.versions.get('torch', '?')}). To rerun it, "
            "install mergekit-ram into mergekit's Python environment (from a clone of the project: "
            "`pip install .`; from a built wheel: `pip install dist/mergekit_ram-*.whl`; once released: "
            "`pip install mergekit-ram`), then run `mergekit-yaml mergekit_config.yml <output folder>` "
            "with the configuration above (saved beside the weights).",
            "",
            _WITHOUT_PLUGIN.get(self.method, ""),
            "",
            "## RAM statistics",
            "",
            f"Merged with `{self.method}` ({settings}); counts from the {self.source}, "
            f"mergekit-ram {self.versions.get('mergekit-ram', '?')}, mergekit {self.versions.get('mergekit', '?')}.",
            "",
            "| model | density | changed | shared | unique | rho | lambda |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for stats in self.models:
            pin = f" ({stats.pinned} pinned)" if stats.pinned else ""
            lines.append(
                f"| {stats.model} | {100 * stats.density:.2f}% | {stats.active:,} | {stats.shared:,} | "
                f"{stats.unique:,} | {_format_rho(stats.rho)} | {stats.lambda_:.4f}{pin} |"
            )
        lines += ["", f"Full counts per tensor: `{STATISTICS_FILE}`.", ""]
        return "\n".join(lines)

    def log(self, logger: logging.Logger = LOG) -> None:
        for warning in self.warnings:
            logger.warning("%s", warning)
        for stats in self.models:
            logger.info(
                "%s: %s: density %.2f%%, shared %d, unique %d, rho %s, lambda %.4f%s",
                self.method,
                stats.model,
                100 * stats.density,
                stats.shared,
                stats.unique,
                _format_rho(stats.rho),
                stats.lambda_,
                f" ({stats.pinned} pinned)" if stats.pinned else "",
            )


#: Where the card sends readers for the plugin.
PROJECT_URL = "https://github.com/mergekit-ram/mergekit-ram"

_WITHOUT_PLUGIN = {
    "ram": "Without mergekit-ram, mergekit silently runs its own built-in `ram` instead: it computes in "
    "the checkpoints' dtype, so on bfloat16 or float16 checkpoints its numbers differ from this model's "
    "(mergekit-ram computes in float32, or the inputs' precision if wider, and rounds once) unless the "
    "recipe sets `dtype: float32`, and it writes no `ram_statistics.json`.",
    "ram_plus": "Without mergekit-ram, mergekit refuses `ram_plus` (an unknown merge method); its own "
    "`ramplus_tl` is a different, tensor-local rule.",
}

MODULES = ("embeddings", "attention", "mlp", "norms", "output head", "other")


def module_of(name: str) -> str:
    """The part of a transformer a tensor belongs to, from its name."""
    lowered = name.lower()
    if "lm_head" in lowered or lowered.startswith("output.") or "embed_out" in lowered:
        return "output head"
    if "embed" in lowered or ".wte." in lowered or ".wpe." in lowered:
        return "embeddings"
    if "norm" in lowered or ".ln_" in lowered or "layernorm" in lowered:
        return "norms"
    if "attn" in lowered or "attention" in lowered:
        return "attention"
    if "mlp" in lowered or "feed_forward" in lowered or "experts" in lowered or ".ffn" in lowered:
        return "mlp"
    return "other"


def _aggregate(tensors: Iterable[TensorCounts]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Per model: elements considered, and the histogram by overlap count, summed over tensors."""
    numel: dict[str, int] = {}
    histograms: dict[str, list[int]] = {}
    for counts in tensors:
        for model, row in zip(counts.models, counts.histograms):
            numel[model] = numel.get(model, 0) + counts.numel
            total = histograms.setdefault(model, [])
            total.extend([0] * (len(row) - len(total)))
            for index, value in enumerate(row):
                total[index] += value
    return numel, histograms


#: Above this density for every model, RAM's premise (sparse updates) does not hold.
DENSE = 0.9


def _warnings(
    models: Iterable[ModelStatistics], epsilons: list[float], checkpoint_dtypes: Mapping[str, Iterable[str]]
) -> tuple[str, ...]:
    """The statistics that predict a wasted merge, in words."""
    models = list(models)
    found = []
    half = sorted(model for model, dtypes in checkpoint_dtypes.items() if "F16" in set(dtypes))
    if half and any(epsilon > 0 for epsilon in epsilons):
        found.append(
            f"float16 checkpoints ({', '.join(half)}): a one-ulp change is below epsilon={max(epsilons):g} for "
            "|w| < about 0.016, so epsilon hides many real float16 updates; consider a smaller epsilon "
            "(see docs/epsilon.md)"
        )
    mixed = {model: sorted(set(dtypes)) for model, dtypes in checkpoint_dtypes.items()}
    if len({tuple(dtypes) for dtypes in mixed.values()}) > 1:
        listing = ", ".join(f"{model}: {'/'.join(dtypes)}" for model, dtypes in sorted(mixed.items()))
        found.append(
            f"the checkpoints are stored in different dtypes ({listing}): rounding alone makes elements look "
            "changed, so densities and overlaps are inflated; convert them to one dtype first"
        )
    counted = [stats for stats in models if stats.numel]
    if counted and all(stats.density >= DENSE for stats in counted):
        densities = ", ".join(f"{100 * stats.density:.0f}%" for stats in counted)
        found.append(
            f"every model changed at least {100 * DENSE:.0f}% of its parameters ({densities}): RAM's premise of "
            "sparse, mostly disjoint updates does not hold here; TIES or DARE suit dense task vectors better"
        )
    for stats in models:
        if stats.lambda_ > PLAUSIBLE_LAMBDA:
            found.append(
                f"{stats.model}: lambda {stats.lambda_:g} is implausibly large (the paper's are about 1.2; "
                f"above {PLAUSIBLE_LAMBDA:g} its unique updates are applied more than {PLAUSIBLE_LAMBDA:g}-fold): "
                "check r and alpha, or the pinned lambda"
            )
    for stats in counted:
        if stats.active == 0:
            found.append(
                f"{stats.model} changed no parameter by more than epsilon: is it the base model itself, "
                "or a wrong path?"
            )
    return tuple(found)


def package_versions() -> dict[str, str]:
    versions = {}
    for name in ("mergekit-ram", "mergekit", "torch"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def format_table(rows: Sequence[Sequence[str]], left_columns: int = 1) -> str:
    """Fixed-width columns; the first ``left_columns`` left-aligned, the rest right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) if i < left_columns else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _finite_or_none(value: float) -> Optional[float]:
    return value if math.isfinite(value) else None


def _format_rho(rho: float) -> str:
    return "inf" if math.isinf(rho) else f"{rho:.4f}"


def markdown_table(rows: Sequence[Sequence[object]], align: str = "lr") -> str:
    """A GitHub markdown table; ``rows[0]`` is the header, every cell goes through ``str``.

    ``align`` has one letter per column, ``l`` (``---``) or ``r`` (``---:``); its last letter
    repeats for the columns beyond it: ``"lr"``, the default, is the first column left-aligned
    and the rest right-aligned (as :func:`format_table`), ``"l"`` every column left-aligned.
    """
    width = len(rows[0])
    letters = align.ljust(width, align[-1])[:width]
    lines = ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("---:" if letter == "r" else "---" for letter in letters) + "|")
    return "\n".join(lines)
