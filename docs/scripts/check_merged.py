"""Check a merged model folder before uploading it (docs/publishing.md).

    python docs/scripts/check_merged.py OUT [--finite]

Problems (exit status 1):
- ``MERGE_INCOMPLETE`` or ``.mergekit-ram-partial/`` is present: the merge did not finish (or is
  still writing);
- no weights, a weight file the index names is missing, or a safetensors header is unreadable;
- no ``config.json`` (``mergekit-pytorch`` writes weights and statistics only);
- ``ram_statistics.json`` is missing or unreadable, or lists warnings (``--accept-warnings``
  to pass once they are understood);
- with ``--finite``: a tensor holding NaN or Inf (reads every tensor).

Notes (printed, exit status 0): no "RAM statistics" section in ``README.md``, local paths in the
card, no ``license`` in the card's front matter.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

STATISTICS_FILE = "ram_statistics.json"
MARKER_FILE = "MERGE_INCOMPLETE"
STAGING_DIR = ".mergekit-ram-partial"


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

    statistics = None
    try:
        with open(os.path.join(out, STATISTICS_FILE), encoding="utf-8") as handle:
            statistics = json.load(handle)
    except (OSError, ValueError) as error:
        problems.append(f"{STATISTICS_FILE} missing or unreadable ({error})")
    if statistics is not None:
        for warning in statistics.get("warnings", []):
            (notes if accept_warnings else problems).append(f"statistics warning: {warning}")

    card_path = os.path.join(out, "README.md")
    if not os.path.exists(card_path):
        notes.append("no README.md model card (merged with --no-write-model-card, or by mergekit-pytorch)")
        return problems, notes
    with open(card_path, encoding="utf-8") as handle:
        card = handle.read()
    if "## RAM statistics" not in card:
        notes.append("README.md has no RAM statistics section")
    local = sorted({m["model"] for m in (statistics or {}).get("models", []) if os.path.isabs(m["model"])})
    if local and any(path in card for path in local):
        notes.append(f"the card names local paths ({', '.join(local)}): replace them with the models' Hub ids")
    front = card.split("---")[1] if card.startswith("---") else ""
    if "license:" not in front:
        notes.append("the card's front matter has no license: add the one the input models' licences allow")
    return problems, notes


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
