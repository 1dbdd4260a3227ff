"""A stand-in for mergekit inside the real output transaction, for tests/test_transaction.py.

    python tests/faults/transaction.py OUT GENERATION [fail] [user-file] [pause] [plain]

runs ``mergekit_ram.staging.output_transaction(OUT)`` and writes what mergekit writes into its
staging folder (shards with mergekit's index, config, tokenizer, card), each file's bytes naming
GENERATION; ``fail`` raises before publishing; ``user-file`` adds a user's file to OUT while the
"merge" runs; ``pause`` runs ``meanwhile`` (a test's function: ``main`` called in its process)
before writing, a second merge while this one holds OUT; ``plain`` writes the same files straight
into OUT with no transaction, as a merge with another mergekit method does. Faults come from
tests/faults/sitecustomize.py. Standard library and mergekit_ram.staging only, so a run takes a
few milliseconds.
"""

import json
import os
import sys
from typing import Callable

from mergekit_ram.staging import output_transaction


def write_merge(folder: str, generation: str, shards: int) -> None:
    names = [f"model-{index:05d}-of-{shards:05d}.safetensors" for index in range(1, shards + 1)]
    for name in names:
        with open(os.path.join(folder, name), "w", encoding="utf-8") as handle:
            handle.write(f"{generation} {name}\n")
    index = {"metadata": {"mergekit_version": "0.1.5"}, "weight_map": {f"t{i}": name for i, name in enumerate(names)}}
    files = {"model.safetensors.index.json": json.dumps(index), "config.json": f'{{"gen": "{generation}"}}'}
    files.update({"tokenizer.json": f"{generation} tokenizer", "README.md": f"# {generation}\n"})
    for name, text in files.items():
        with open(os.path.join(folder, name), "w", encoding="utf-8") as handle:
            handle.write(text)


def pause() -> None:
    raise SystemExit("pause: nothing to run meanwhile (call main in a test's process, with meanwhile)")


def main(out: str, generation: str, *flags: str, meanwhile: Callable[[], None] = pause) -> None:
    shards = 2 if generation == "new" else 3
    if "plain" in flags:
        os.makedirs(out, exist_ok=True)
        write_merge(out, generation, shards)
        return
    with output_transaction(out) as staged:
        if "pause" in flags:
            meanwhile()
        write_merge(staged, generation, shards)
        if "user-file" in flags:
            with open(os.path.join(out, "notes-written-during-the-merge.txt"), "w", encoding="utf-8") as handle:
                handle.write("the user's notes\n")
        if "fail" in flags:
            raise SystemExit("failed before publishing, as asked")


if __name__ == "__main__":
    main(*sys.argv[1:])
