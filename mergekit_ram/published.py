"""What a finished RAM merge tells its user, from its statistics: the card (mergekit's, through huggingface_hub's
``ModelCard``, with the plugin's metadata and sections) and the terminal summary."""

from __future__ import annotations

import re
from typing import Any, Optional

import click
from huggingface_hub import ModelCard, ModelCardData

from mergekit_ram.stats.data import RamStatistics
from mergekit_ram.stats.render import card_markdown, model_table
from mergekit_ram.stats.schema import STATISTICS_FILE

CARD_TAG = "mergekit-ram"  # the Hub tag of every model merged with mergekit-ram's methods
#: mergekit's "### Models Merged" heading, its intro line, then the bullets.
MODEL_LIST = re.compile(r"(^### Models Merged\n\n[^\n]*\n)((?:\* [^\n]*\n)+)", re.MULTILINE)


def merged_card(generated: str, statistics: Optional[RamStatistics]) -> ModelCard:
    """mergekit's card (``generated``) as a RAM merge publishes it: ``merge_metadata`` tagged, the model list
    sorted, then how to reproduce the merge and its statistics; without ``statistics`` only sorted."""
    card = ModelCard(generated)
    card.data = ModelCardData(**merge_metadata(card.data.to_dict(), CARD_TAG if statistics is not None else None))
    card.text = with_sorted_model_list(card.text) + ("\n" + card_markdown(statistics) if statistics else "")
    return card


def with_sorted_model_list(card: str) -> str:
    """mergekit's "Models Merged" bullets sorted: it lists them from a set, in an order that changes with the seed."""
    return MODEL_LIST.sub(lambda found: found[1] + "".join(sorted(found[2].splitlines(True))), card, count=1)


def merge_metadata(metadata: dict[str, Any], tag: Optional[str] = None) -> dict[str, Any]:
    """The Hub's metadata for a merge (https://huggingface.co/docs/hub/model-cards#specifying-a-base-model): ``tag``
    added, ``base_model`` sorted (mergekit's is a set) and, where it names models, ``base_model_relation: merge``."""
    tags = listed(metadata.get("tags"))
    updated = {**metadata, "tags": tags if tag in tags else [*tags, tag]} if tag is not None else dict(metadata)
    if isinstance(updated.get("base_model"), list):
        updated["base_model"] = sorted(dict.fromkeys(map(str, updated["base_model"])))
    if updated.get("base_model"):
        updated["base_model_relation"] = "merge"
    return updated


def listed(value: Any) -> list[Any]:
    """A front matter value as the list it stands for (``tags: merge`` is one tag, no value none)."""
    return value if isinstance(value, list) else [] if value is None else [value]


def report_summary(out_path: str, statistics: RamStatistics) -> None:
    """Each model's figures and the legend on stderr after a merge (not under ``--quiet``, as mergekit's own)."""
    settings = ", ".join(f"{key} = {value}" for key, value in statistics.parameters.items())
    click.echo(
        f"{statistics.method} merge written to {out_path} ({settings}); "
        f"per-tensor counts in {STATISTICS_FILE}\n{model_table(statistics)}",
        err=True,
    )
