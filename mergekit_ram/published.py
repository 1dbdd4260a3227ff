"""What a finished RAM merge tells its user, from its statistics: the card's section, the terminal summary."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import click
import yaml

from mergekit_ram.stats.data import RamStatistics
from mergekit_ram.stats.render import card_markdown, compact_table
from mergekit_ram.stats.schema import STATISTICS_FILE

CARD_TAG = "mergekit-ram"  # the Hub tag of every model merged with mergekit-ram's methods
#: mergekit's "### Models Merged" heading, its intro line, then the bullets.
_MODEL_LIST = re.compile(r"(^### Models Merged\n\n[^\n]*\n)((?:\* [^\n]*\n)+)", re.MULTILINE)


def append_card_section(out_path: str, statistics: RamStatistics) -> None:
    """Make mergekit's card reproducible and tag it, then add how to reproduce the merge and its statistics."""
    card = Path(out_path, "README.md")
    if not card.exists():
        return
    text = with_card_metadata(with_sorted_model_list(card.read_text(encoding="utf-8")), CARD_TAG)
    card.write_text(text + "\n" + card_markdown(statistics), encoding="utf-8")


def with_sorted_model_list(card: str) -> str:
    """mergekit's "Models Merged" bullets sorted: it lists them from a set, in an order that changes with the seed."""
    return _MODEL_LIST.sub(lambda found: found[1] + "".join(sorted(found[2].splitlines(True))), card, count=1)


def with_card_metadata(card: str, tag: str) -> str:
    """``tag`` added, ``base_model`` sorted (mergekit's is a set) and ``base_model_relation: merge`` where it names
    models: the Hub's metadata for a merge (https://huggingface.co/docs/hub/model-cards#specifying-a-base-model)."""
    metadata, body = front_matter(card)
    if metadata is None:
        return card
    tags = list(metadata.get("tags") or [])
    updated = {**metadata, "tags": tags if tag in tags else [*tags, tag]}
    if isinstance(metadata.get("base_model"), list):
        updated["base_model"] = sorted(dict.fromkeys(map(str, metadata["base_model"])))
    if updated.get("base_model"):
        updated["base_model_relation"] = "merge"
    return card if updated == metadata else with_front_matter(updated, body)


def front_matter(card: str) -> tuple[Optional[dict[str, Any]], str]:
    """(its YAML mapping, the text after it), else (None, ``card``); ``yaml.YAMLError`` where it is not YAML."""
    end = card.find("\n---\n", 4) if card.startswith("---\n") else -1
    if end < 0:
        return None, card
    metadata = yaml.safe_load(card[4:end])
    return (metadata, card[end + 5 :]) if isinstance(metadata, dict) else (None, card)


def with_front_matter(metadata: dict[str, Any], body: str) -> str:
    """``metadata`` as YAML front matter (as mergekit dumps it) before ``body``."""
    return "---\n" + yaml.dump(metadata) + "---\n" + body


def report_summary(out_path: str, statistics: RamStatistics) -> None:
    """Model, density, rho and lambda on stderr after a merge (not under ``--quiet``, as mergekit's own)."""
    settings = ", ".join(f"{key} = {value}" for key, value in statistics.parameters.items())
    click.echo(
        f"{statistics.method} merge written to {out_path} ({settings}); "
        f"per-tensor counts in {STATISTICS_FILE}\n{compact_table(statistics)}",
        err=True,
    )
