"""What a finished RAM merge tells its user, from its statistics: the card's section and metadata, the terminal
summary; and the card as the Hub reads it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple, Optional

import click
import yaml

import mergekit_ram.bounded_yaml as bounded_yaml
from mergekit_ram.stats.data import RamStatistics
from mergekit_ram.stats.render import card_markdown, model_table
from mergekit_ram.stats.schema import STATISTICS_FILE

CARD_TAG = "mergekit-ram"  # the Hub tag of every model merged with mergekit-ram's methods
#: mergekit's "### Models Merged" heading, its intro line, then the bullets.
MODEL_LIST = re.compile(r"(^### Models Merged\n\n[^\n]*\n)((?:\* [^\n]*\n)+)", re.MULTILINE)
#: A card's front matter where the Hub finds it (``huggingface_hub.repocard.REGEX_YAML_BLOCK``): at the top,
#: between lines of ``---``, with any line ends.
FRONT_MATTER = re.compile(r"^(\s*---(?:\r\n|\r|\n))([\S\s]*?)((?:\r\n|\r|\n)---[ \t]*(\r\n|\n|$))")


def append_card_section(out_path: str, statistics: RamStatistics) -> None:
    """Make mergekit's card reproducible and tag it, then add how to reproduce the merge and its statistics."""
    card = Path(out_path, "README.md")
    if card.exists():
        text = with_card_metadata(with_sorted_model_list(card.read_text(encoding="utf-8")), CARD_TAG)
        card.write_text(text + "\n" + card_markdown(statistics), encoding="utf-8")


def with_sorted_model_list(card: str) -> str:
    """mergekit's "Models Merged" bullets sorted: it lists them from a set, in an order that changes with the seed."""
    return MODEL_LIST.sub(lambda found: found[1] + "".join(sorted(found[2].splitlines(True))), card, count=1)


def with_card_metadata(card: str, tag: str) -> str:
    """``merge_metadata`` written into the card's front matter, where it has one and it changes."""
    parsed = read_card(card)
    updated = merge_metadata(parsed.metadata, tag) if parsed.metadata is not None else None
    return card if updated == parsed.metadata else parsed._replace(metadata=updated).text()


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


class Card(NamedTuple):
    """A model card: its front matter (None: it has none), the text after it, and the front matter's line ends."""

    metadata: Optional[dict[str, Any]]
    body: str
    line_break: str = "\n"

    def text(self) -> str:
        """The card again, its front matter as mergekit dumps one (text that looks like a date quoted)."""
        if self.metadata is None:
            return self.body
        end = self.line_break
        return f"---{end}{yaml.dump(self.metadata, Dumper=yaml.SafeDumper, line_break=end)}---{end}{self.body}"


def read_card(card: str, what: str = "README.md's front matter") -> Card:
    """The front matter where the Hub finds one, read as a stranger's YAML: ``UnreadableYaml`` where it is not a
    mapping (empty is an empty one, as on the Hub)."""
    found = FRONT_MATTER.search(card)
    if found is None:
        return Card(None, card)
    metadata = bounded_yaml.load_one(found[2], what)
    if not isinstance(metadata, (dict, type(None))):
        raise bounded_yaml.UnreadableYaml(f"{what} is not a YAML mapping of keys to values")
    return Card(metadata or {}, card[found.end() :], found[1][len(found[1].rstrip("\r\n")) :])


def report_summary(out_path: str, statistics: RamStatistics) -> None:
    """Each model's figures and the legend on stderr after a merge (not under ``--quiet``, as mergekit's own)."""
    settings = ", ".join(f"{key} = {value}" for key, value in statistics.parameters.items())
    click.echo(
        f"{statistics.method} merge written to {out_path} ({settings}); "
        f"per-tensor counts in {STATISTICS_FILE}\n{model_table(statistics)}",
        err=True,
    )
