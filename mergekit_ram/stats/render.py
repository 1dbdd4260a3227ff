"""Statistics for people: fixed-width tables, the model card's markdown and the log, all from one
:class:`Row` per model."""

from __future__ import annotations

import logging
import math
import os
from typing import Mapping, NamedTuple, Sequence

from mergekit_ram.parameters import METHODS
from mergekit_ram.rescaling import RULES
from mergekit_ram.stats.arithmetic import by_merged_module, by_module
from mergekit_ram.stats.data import ModelStatistics, OverlapCounts, RamStatistics
from mergekit_ram.stats.schema import STATISTICS_FILE

LOG = logging.getLogger("mergekit_ram.stats")

#: Where the card sends readers for the plugin.
PROJECT_URL = "https://github.com/mergekit-ram/mergekit-ram"

#: The full table's columns before the factor's (``factor_name``).
COLUMNS = ("model", "density", "changed", "shared", "unique", "rho")


def terminal_text(text: str) -> str:
    """Unprintable characters escaped: a model path cannot break a table's rows or drive the terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def format_table(rows: Sequence[Sequence[str]], left_columns: int = 1) -> str:
    """Fixed-width columns; the first ``left_columns`` left-aligned, the rest right-aligned."""
    rows = [[terminal_text(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) if i < left_columns else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: Sequence[Sequence[object]], align: str = "lr") -> str:
    """A GitHub table, ``rows[0]`` the header; ``align`` ``l`` or ``r`` per column, the last one repeated."""
    letters = align.ljust(len(rows[0]), align[-1])[: len(rows[0])]
    cells = [["<br>".join(str(cell).replace("|", "\\|").splitlines()) for cell in row] for row in rows]
    lines = ["| " + " | ".join(row) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("---:" if letter == "r" else "---" for letter in letters) + "|")
    return "\n".join(lines)


def format_rho(rho: float) -> str:
    return "inf" if math.isinf(rho) else f"{rho:.4f}"


def display_names(statistics: RamStatistics) -> dict[str, str]:
    """Local paths as their last component when that is unambiguous."""
    models = [stats.model for stats in statistics.models]
    short = {model: os.path.basename(model.rstrip(os.sep)) if os.path.isabs(model) else model for model in models}
    return short if len(set(short.values())) == len(models) else {model: model for model in models}


def factor_name(statistics: RamStatistics) -> str:
    """The recipe's name of each model's factor (``ram_unique``'s ``scale``, else ``lambda``)."""
    return METHODS[statistics.method].factor


def figures(counts: OverlapCounts) -> tuple[str, str, str, str]:
    """Density, changed, shared and unique as every table shows them (a model's or a module's)."""
    return f"{100 * counts.density:.2f}%", f"{counts.active:,}", f"{counts.shared:,}", f"{counts.unique:,}"


class Row(NamedTuple):
    """One model's figures, formatted once; ``name`` as the terminal shows it, ``factor`` lambda or scale."""

    stats: ModelStatistics
    name: str
    figures: tuple[str, str, str, str]
    rho: str
    factor: str
    capped: bool  # lambda at its cap, 1 + r * alpha (``capped``)

    def marked(self) -> tuple[str, str]:
        """rho and the factor, "(pinned)" after the one the recipe pinned (a ``scale`` is a setting, never marked),
        "(cap)" after a lambda at its cap."""
        pinned = self.stats.pinned
        rho = self.rho + (" (pinned)" if pinned == "rho" else "")
        return rho, self.factor + (" (pinned)" if pinned == "lambda" else " (cap)" if self.capped else "")

    @property
    def pins(self) -> str:
        return f" ({self.stats.pinned} pinned)" if self.stats.pinned in ("rho", "lambda") else " (cap)" * self.capped


def capped(stats: ModelStatistics, statistics: RamStatistics) -> bool:
    """lambda_t from rho_t at the largest value the rule gives (1 + r * alpha for clip): rho_t >= alpha."""
    rescaling = statistics.rescaling
    if rescaling is None or rescaling.r == 0 or stats.pinned in ("lambda", "scale"):
        return False
    return stats.lambda_ == rescaling.largest_lambda()


def rows(statistics: RamStatistics) -> list[Row]:
    names = display_names(statistics)
    return [
        Row(
            stats,
            names[stats.model],
            figures(stats),
            format_rho(stats.rho),
            f"{stats.lambda_:.4f}",
            capped(stats, statistics),
        )
        for stats in statistics.models
    ]


def model_table(statistics: RamStatistics) -> str:
    """A fixed-width table: model, density, changed, shared, unique, rho, lambda (or scale); then its legend."""
    table = [(*COLUMNS, factor_name(statistics))]
    table += [(row.name, *row.figures, *row.marked()) for row in rows(statistics)]
    return format_table(table) + "\n" + legend(statistics)


def legend(statistics: RamStatistics) -> str:
    """Two lines saying what the columns are: the counts, then rho and the factor (with the cap, and pins)."""
    counts = (
        "density: the share of its parameters a model changed (by more than epsilon); shared: also changed by another "
        "model; unique: by it alone"
    )
    rescaling, pinned = statistics.rescaling, any(stats.pinned in ("rho", "lambda") for stats in statistics.models)
    if factor_name(statistics) == "scale":
        factor = "scale: the recipe's factor of its unique changes (shared positions keep the base)"
    elif rescaling is None:
        factor = "lambda = 1: RAM keeps unique changes at full strength and averages shared ones"
    else:
        rule = RULES[rescaling.rule]
        factor = (
            f"lambda = {rule.formula} scales its unique changes, at most {rule.cap} = "
            f"{rescaling.largest_lambda():.4f} (cap)"
        )
    pins = "; (pinned): set in the recipe" if pinned else ""
    return f"{counts}\nrho = shared / unique; {factor}{pins}"


def histogram_table(statistics: RamStatistics) -> str:
    """Per model: how many of its changed parameters k models changed, k = 1..N."""
    width = max((len(stats.histogram) for stats in statistics.models), default=0)
    table = [["model", *(f"k={k}" for k in range(1, width + 1))]]
    for row in rows(statistics):
        active, histogram = row.stats.active, row.stats.histogram + (0,) * (width - len(row.stats.histogram))
        table.append(
            [row.name, *(f"{value:,} ({100 * (value / active if active else 0.0):.1f}%)" for value in histogram)]
        )
    return format_table(table)


def module_table(statistics: RamStatistics) -> str:
    """Density, shared, unique and local rho per part of the network and model."""
    return format_table(_module_rows(by_module(statistics), display_names(statistics)), left_columns=2)


def _module_rows(groups: Mapping[str, Sequence[OverlapCounts]], names: Mapping[str, str]) -> list[list[str]]:
    table = [["module", "model", "density", "changed", "shared", "unique", "local rho"]]
    for module, models in groups.items():
        table += [[module, names[stats.model], *figures(stats), format_rho(stats.measured_rho)] for stats in models]
    return table


def card_markdown(statistics: RamStatistics) -> str:
    """The model card's sections: where the method comes from, how to rerun the merge, the statistics."""
    versions = statistics.versions
    settings = ", ".join(f"`{key}` = {value}" for key, value in statistics.parameters.items())
    lines = [
        "## Reproducing this merge",
        "",
        f"The `{statistics.method}` merge method comes from [mergekit-ram]({PROJECT_URL}), a plugin for "
        f"mergekit (here mergekit-ram {versions.get('mergekit-ram', '?')}, mergekit "
        f"{versions.get('mergekit', '?')}, torch {versions.get('torch', '?')}). To rerun it, "
        "install mergekit-ram into mergekit's Python environment (from a clone of the project: "
        "`pip install .`; from a built wheel: `pip install dist/mergekit_ram-*.whl`; once released: "
        "`pip install mergekit-ram`), then run `mergekit-yaml mergekit_config.yml <output folder>` "
        "with the configuration above (saved beside the weights).",
        "",
        METHODS[statistics.method].without_plugin,
        "",
        "## RAM statistics",
        "",
        f"Merged with `{statistics.method}` ({settings}); counts from the {statistics.source}, "
        f"mergekit-ram {versions.get('mergekit-ram', '?')}, mergekit {versions.get('mergekit', '?')}.",
        "",
    ]
    table = [(*COLUMNS, factor_name(statistics))]
    table += [(row.stats.model, *row.figures, row.rho, row.factor + row.pins) for row in rows(statistics)]
    lines += [markdown_table(table), "", *(line for text in legend(statistics).splitlines() for line in (text, ""))]
    merged_modules = by_merged_module(statistics)
    if merged_modules:
        lines += [
            "Per module (rho local to the module; lambda uses the rho over every module):",
            "",
            markdown_table(_module_rows(merged_modules, {stats.model: stats.model for stats in statistics.models})),
            "",
        ]
    lines += [f"Full counts per tensor: `{STATISTICS_FILE}`.", ""]
    return "\n".join(lines)


def log_statistics(statistics: RamStatistics, logger: logging.Logger = LOG) -> None:
    """The warnings, then one line per model."""
    for warning in statistics.warnings:
        logger.warning("%s", warning)
    for row in rows(statistics):
        logger.info(
            "%s: %s: density %s, shared %d, unique %d, rho %s, %s %s%s",
            statistics.method,
            row.stats.model,
            row.figures[0],
            row.stats.shared,
            row.stats.unique,
            row.rho,
            factor_name(statistics),
            row.factor,
            row.pins,
        )
