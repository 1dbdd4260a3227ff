"""Check a merged model folder before uploading it (docs/reliability.md).

    python docs/scripts/check_merged.py OUT [--finite]

Problems (exit status 1), each with its fix:
- ``MERGE_INCOMPLETE`` or ``.mergekit-ram-partial/`` is present: the merge did not finish (or is
  still writing);
- no weights, a weight file the index names is missing, or a safetensors header is unreadable;
- no ``config.json`` (``mergekit-pytorch`` writes weights and statistics only);
- no tokenizer (mergekit copies the base model's, and says "Failed to copy tokenizer" when it
  cannot);
- ``ram_statistics.json`` is missing or unreadable, or lists warnings (``--accept-warnings``
  to pass once they are understood);
- no ``README.md`` card, or one without ``license`` in its front matter;
- local paths in ``README.md``, ``mergekit_config.yml`` or ``ram_statistics.json`` (readers of
  the model cannot find those models);
- with ``--finite``: a tensor holding NaN or Inf (reads every tensor).

Notes (printed, exit status 0): no "RAM statistics" section in ``README.md``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Any, Iterator

import yaml

STATISTICS_FILE = "ram_statistics.json"
MARKER_FILE = "MERGE_INCOMPLETE"
STAGING_DIR = ".mergekit-ram-partial"
#: Files that make a tokenizer transformers can load (with ``tokenizer_config.json``).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
#: The files that name the merged models, in the order they are reported.
NAMING_FILES = ("README.md", "mergekit_config.yml", STATISTICS_FILE)


def check(out: str, finite: bool = False, accept_warnings: bool = False) -> tuple[list[str], list[str]]:
    """(problems, notes) for the merged folder ``out``."""
    from safetensors import safe_open

    problems: list[str] = []
    notes: list[str] = []
    for name in (MARKER_FILE, STAGING_DIR):
        if os.path.exists(os.path.join(out, name)):
            problems.append(f"{name} is present: the merge did not finish (or is still running); run it again")

    weights = sorted(glob.glob(os.path.join(out, "*.safetensors")))
    index = os.path.join(out, "model.safetensors.index.json")
    if not weights:
        problems.append("no *.safetensors weights")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as handle:
            named = set(json.load(handle)["weight_map"].values())
        for file in sorted(named):
            if not os.path.exists(os.path.join(out, file)):
                problems.append(f"{file} is named in the index but missing")
    for file in weights:
        try:
            with safe_open(file, framework="pt") as handle:
                if finite:
                    for key in handle.keys():
                        if not bool(handle.get_tensor(key).float().isfinite().all()):
                            problems.append(f"{os.path.basename(file)}: {key} holds NaN or Inf")
                else:
                    list(handle.keys())
        except Exception as error:  # any unreadable file is a problem to report, not a crash
            problems.append(f"{os.path.basename(file)} cannot be read: {error}")
    if not os.path.exists(os.path.join(out, "config.json")):
        problems.append("no config.json: not loadable with transformers (merge with mergekit-yaml)")
    if not any(os.path.exists(os.path.join(out, name)) for name in TOKENIZER_FILES):
        problems.append(
            "no tokenizer (tokenizer.json, tokenizer.model or vocab.json): copy the base model's tokenizer files "
            "(tokenizer_config.json and the others) into the folder"
        )

    statistics = None
    try:
        with open(os.path.join(out, STATISTICS_FILE), encoding="utf-8") as handle:
            statistics = json.load(handle)
    except (OSError, ValueError) as error:
        problems.append(f"{STATISTICS_FILE} missing or unreadable ({error})")
    if statistics is not None:
        for warning in statistics.get("warnings", []):
            (notes if accept_warnings else problems).append(f"statistics warning: {warning}")

    card = read_text(os.path.join(out, "README.md"))
    if card is None:
        problems.append("no README.md model card: merge with mergekit-yaml (without --no-write-model-card)")
    else:
        if "## RAM statistics" not in card:
            notes.append("README.md has no RAM statistics section")
        front = yaml.safe_load(card[4 : card.find("\n---\n", 4)]) if card.startswith("---\n") else None
        if not (isinstance(front, dict) and front.get("license")):
            problems.append(
                "the card's front matter has no license: add a `license:` line that the input models' licences "
                "allow (an id such as apache-2.0, or other with license_name and license_link)"
            )
    local = sorted(set(local_models(read_text(os.path.join(out, "mergekit_config.yml")), statistics)))
    for name in NAMING_FILES:
        text = read_text(os.path.join(out, name)) or ""
        paths = [path for path in local if path in text]
        if paths:
            problems.append(
                f"{name} names local paths ({', '.join(paths)}): merge again with the models' Hub ids in the "
                f"recipe, or replace the paths with them in {', '.join(NAMING_FILES)} alike"
            )
    return problems, notes


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError:
        return None


def local_models(recipe: str | None, statistics: Any) -> Iterator[str]:
    """The models the recipe (``mergekit_config.yml``) and the statistics name by a local path: one that
    starts with / ~ or ., has more than one /, or is a folder here (a Hub id is ``name`` or ``org/name``)."""
    names = [model["model"] for model in (statistics or {}).get("models", []) if isinstance(model, dict)]
    names += list(recipe_models(yaml.safe_load(recipe) if recipe else None))
    for name in names:
        for path in str(name).split("+"):  # a model and its LoRA
            path = path.split("@")[0]
            if path and (path[0] in "/~." or path.count("/") > 1 or os.path.isdir(path)):
                yield path


def recipe_models(node: Any) -> Iterator[str]:
    """Every ``model`` and ``base_model`` a recipe names, at any depth (models, slices, modules)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("model", "base_model") and isinstance(value, str):
                yield value
            else:
                yield from recipe_models(value)
    elif isinstance(node, list):
        for item in node:
            yield from recipe_models(item)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--finite", action="store_true", help="read every tensor and check for NaN or Inf")
    parser.add_argument("--accept-warnings", action="store_true", help="statistics warnings are notes, not problems")
    arguments = parser.parse_args()
    problems, notes = check(arguments.out, arguments.finite, arguments.accept_warnings)
    for note in notes:
        print(f"note: {note}")
    for problem in problems:
        print(f"problem: {problem}")
    print("ready to upload" if not problems else f"{len(problems)} problem(s): do not upload yet")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
