"""The card mergekit writes for a recipe (``mergekit.card.generate_card``, as its ``run_merge`` calls it), made
again from the recipe a merge saved: the ``--hub-id`` step compares it with the card and writes it for the ids."""

from __future__ import annotations

import yaml

from mergekit_ram.errors import MergedFolderError, one_line
from mergekit_ram.integration import register
from mergekit_ram.integration.internals import internal


def mergekit_card(recipe: str, title: str) -> str:
    """mergekit's README.md for the recipe text ``recipe`` merged into a folder named ``title``, the plugin's
    methods registered (their names and links are the card's)."""
    register()
    try:
        config = internal("mergekit.config", "MergeConfiguration").model_validate(yaml.safe_load(recipe))
    except (yaml.YAMLError, ValueError, RecursionError) as error:
        raise MergedFolderError(f"mergekit_config.yml is not a recipe mergekit reads ({one_line(error)})") from None
    return str(internal("mergekit.card", "generate_card")(config, recipe, title))
