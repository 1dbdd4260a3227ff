"""What a finished RAM merge tells its user: the card's section and the summary on the terminal.

Plain files: reads the ``ram_statistics.json`` the merge wrote beside the card mergekit wrote.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import click
import yaml

from mergekit_ram.stats import STATISTICS_FILE, RamStatistics, card_markdown, compact_table, statistics_from_dict

#: The Hub tag of every model merged with mergekit-ram's methods.
CARD_TAG = "mergekit-ram"


def read_statistics(out_path: str) -> Optional[RamStatistics]:
    """The statistics a merge wrote into ``out_path``, or None if it wrote none."""
    path = os.path.join(out_path, STATISTICS_FILE)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return statistics_from_dict(json.load(handle))


def append_card_section(out_path: str) -> None:
    """Tag the card ``mergekit-ram`` and add how to reproduce the merge and its statistics."""
    card = os.path.join(out_path, "README.md")
    statistics = read_statistics(out_path) if os.path.exists(card) else None
    if statistics is None:
        return
    with open(card, encoding="utf-8") as handle:
        text = handle.read()
    with open(card, "w", encoding="utf-8") as handle:
        handle.write(with_card_tag(text, CARD_TAG) + "\n" + card_markdown(statistics))


def with_card_tag(card: str, tag: str) -> str:
    """``card`` with ``tag`` appended to the ``tags`` of its YAML front matter (as mergekit dumps it)."""
    if not card.startswith("---\n"):
        return card
    end = card.find("\n---\n", 4)
    if end < 0:
        return card
    metadata = yaml.safe_load(card[4:end]) or {}
    if not isinstance(metadata, dict):
        return card
    tags = list(metadata.get("tags") or [])
    if tag in tags:
        return card
    metadata["tags"] = [*tags, tag]
    return "---\n" + yaml.dump(metadata) + card[end + 1 :]


def report_summary(out_path: str) -> None:
    """After a RAM merge: model, density, rho and lambda on stderr, next to mergekit's own
    progress output (the caller leaves it out under ``--quiet``, as mergekit does its own)."""
    statistics = read_statistics(out_path)
    if statistics is None:
        return
    settings = ", ".join(f"{key} = {value}" for key, value in statistics.parameters.items())
    click.echo(
        f"{statistics.method} merge written to {out_path} ({settings}); "
        f"per-tensor counts in {STATISTICS_FILE}\n{compact_table(statistics)}",
        err=True,
    )
