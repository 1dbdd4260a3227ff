"""``mergekit-ram check OUT``: what stops sharing a merged model, through the real console script.

The clean folder is the shared ``ram_plus`` merge (tests/conftest.py) made shareable the way the
messages say: Hub ids for the local paths, the card's ``base_model`` and ``base_model_relation``,
a tokenizer, and the licence written by ``--set-license``. Each problem is then introduced alone
into a copy of it, and must be the one line reported.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import pytest
import yaml
from safetensors.torch import load_file, save_file

from tests.conftest import Merged, ModelSet, run_script

FIX = (
    "merge again with the models' Hub ids in the recipe, or replace the paths with them in README.md, "
    "mergekit_config.yml, ram_statistics.json alike"
)


def check(folder: Path, *options: str) -> tuple[int, list[str]]:
    completed = run_script("mergekit-ram", "check", str(folder), *options, check=False)
    assert "Traceback" not in completed.stderr, completed.stderr
    return completed.returncode, completed.stdout.splitlines()


def edit_card(folder: Path, change: Callable[[dict], None]) -> None:
    """Change the card's front matter (parsed), keeping the rest of the card."""
    card = (folder / "README.md").read_text(encoding="utf-8")
    end = card.index("\n---\n", 4)
    metadata = yaml.safe_load(card[4:end])
    change(metadata)
    (folder / "README.md").write_text("---\n" + yaml.dump(metadata) + card[end + 1 :], encoding="utf-8")


@pytest.fixture(scope="module")
def clean(bf16_models: ModelSet, ram_plus_merge: Merged, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared merge made shareable as the messages say; checked clean (once, with --set-license)."""
    folder = tmp_path_factory.mktemp("check") / "clean"
    shutil.copytree(ram_plus_merge.out, folder)
    paths = sorted([bf16_models.base, *bf16_models.agents], key=len, reverse=True)
    for name in ("README.md", "mergekit_config.yml", "ram_statistics.json"):
        text = (folder / name).read_text(encoding="utf-8")
        for path in paths:
            text = text.replace(path, f"org/{os.path.basename(path)}")
        (folder / name).write_text(text, encoding="utf-8")

    def hub_metadata(metadata: dict) -> None:
        metadata["base_model"] = [f"org/{os.path.basename(path)}" for path in sorted(paths)]
        metadata["base_model_relation"] = "merge"

    edit_card(folder, hub_metadata)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text("{}", encoding="utf-8")
    status, lines = check(folder)
    assert status == 1 and lines == [
        "problem: the card's front matter has no license: mergekit-ram check OUT --set-license ID, with an id the "
        "input models' licences allow (apache-2.0, mit, ...)",
        "1 problem(s): do not upload yet",
    ]
    card = (folder / "README.md").read_text(encoding="utf-8")
    assert check(folder, "--set-license", "apache-2.0") == (0, ["ready to upload"])
    written = (folder / "README.md").read_text(encoding="utf-8")
    assert yaml.safe_load(written[4 : written.index("\n---\n", 4)])["license"] == "apache-2.0"
    assert written.split("\n---\n", 1)[1] == card.split("\n---\n", 1)[1]  # the rest of the card as it was
    return folder


def _nan(folder: Path) -> None:
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][3, 4] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def _truncate(folder: Path) -> None:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


def _link(folder: Path, name: str) -> None:
    outside = folder.parent / f"outside-{name}"
    shutil.move(folder / name, outside)
    os.symlink(outside, folder / name)


def _replace(name: str, old: str, new: str) -> Callable[[Path], None]:
    def replace(folder: Path) -> None:
        text = (folder / name).read_text(encoding="utf-8")
        assert old in text
        (folder / name).write_text(text.replace(old, new, 1), encoding="utf-8")

    return replace


def _statistics(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        data = json.loads((folder / "ram_statistics.json").read_text(encoding="utf-8"))
        change(data)
        (folder / "ram_statistics.json").write_text(json.dumps(data), encoding="utf-8")

    return edit


#: (problem introduced into a copy of the clean folder, the one line reported; "..." ends a prefix)
CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "merge not finished": (
        lambda f: (f / "MERGE_INCOMPLETE").write_text("interrupted\n", encoding="utf-8"),
        "MERGE_INCOMPLETE is present: a merge into this folder was killed while publishing; merge into it again "
        "(it writes its own complete result)",
    ),
    "merge running": (
        lambda f: (f / ".mergekit-ram-0123456789abcdef").mkdir(),
        ".mergekit-ram-0123456789abcdef is present: a merge is writing into this folder, or one was killed; wait "
        "for it to finish, or check that hidden folder and remove it",
    ),
    "no weights": (
        lambda f: (f / "model.safetensors").unlink(),
        "no weights (*.safetensors): merge again with mergekit-yaml",
    ),
    "truncated weights": (_truncate, "model.safetensors does not load with safetensors (..."),
    "weights through a link": (
        lambda f: _link(f, "model.safetensors"),
        "model.safetensors cannot be read (it is a symbolic link): merge again",
    ),
    "NaN in the weights": (
        _nan,
        "model.safetensors: 1 tensor(s) hold NaN or Inf (model.layers.1.mlp.down_proj.weight): do not share it; "
        "check the inputs and merge again (a wider out_dtype where values overflow it)",
    ),
    "an index naming a file outside": (
        lambda f: (f / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"lm_head.weight": "../model.safetensors"}}), encoding="utf-8"
        ),
        "model.safetensors.index.json names '../model.safetensors', which is not a file of this folder: merge again",
    ),
    "no config": (
        lambda f: (f / "config.json").unlink(),
        "no config.json: transformers cannot load the folder (mergekit-pytorch writes weights only): merge with "
        "mergekit-yaml",
    ),
    "no tokenizer": (
        lambda f: (f / "tokenizer.json").unlink(),
        "no tokenizer (tokenizer.json, tokenizer.model or vocab.json): copy the base model's tokenizer files "
        "(tokenizer_config.json and the others) into the folder",
    ),
    "a tokenizer through a link": (
        lambda f: _link(f, "tokenizer.json"),
        "tokenizer.json cannot be read (it is a symbolic link): copy the file itself into the folder",
    ),
    "no card": (
        lambda f: (f / "README.md").unlink(),
        "no README.md model card: merge with mergekit-yaml (without --no-write-model-card)",
    ),
    "a card without front matter": (
        lambda f: (f / "README.md").write_text("# A model\n\n## RAM statistics\n", encoding="utf-8"),
        "README.md has no YAML front matter (between --- lines at its top): merge again with mergekit-yaml",
    ),
    "license other, unnamed": (
        lambda f: edit_card(f, lambda m: m.update(license="other")),
        "the card says license: other without license_name and license_link: add both to its front matter",
    ),
    "no base_model": (
        lambda f: edit_card(f, lambda m: m.pop("base_model")),
        "the card's front matter has no base_model (mergekit lists only Hub ids there): merge again with the "
        "models' Hub ids in the recipe, or list them under base_model",
    ),
    "no base_model_relation": (
        lambda f: edit_card(f, lambda m: m.pop("base_model_relation")),
        "the card's front matter has base_model_relation None: set base_model_relation: merge (the Hub's relation "
        "for a merge of the base_model models)",
    ),
    "no merge tag": (
        lambda f: edit_card(f, lambda m: m.update(tags=["mergekit", "mergekit-ram"])),
        "the card's front matter has no tag merge: add it under tags (mergekit writes mergekit, merge; "
        "mergekit-ram adds mergekit-ram)",
    ),
    "a local path in the card": (
        lambda f: edit_card(f, lambda m: m["base_model"].append("/data/models/agent")),
        f"README.md names local paths (/data/models/agent): {FIX}",
    ),
    "a local path in the recipe": (
        _replace("mergekit_config.yml", "org/tool-agent", "./models/tool-agent"),
        f"mergekit_config.yml names local paths (./models/tool-agent): {FIX}",
    ),
    "a local path in the statistics": (
        _replace("ram_statistics.json", '"org/tool-agent"', '"~/models/tool-agent"'),
        f"ram_statistics.json names local paths (~/models/tool-agent): {FIX}",
    ),
    "a statistics warning": (
        _statistics(lambda data: data.update(warnings=["every model changed at least 90% of its parameters"])),
        "statistics warning: every model changed at least 90% of its parameters (--accept-warnings once it is "
        "understood)",
    ),
    "statistics that are not JSON": (
        lambda f: (f / "ram_statistics.json").write_text('{"schema": 2,', encoding="utf-8"),
        "ram_statistics.json is not the JSON object a merge writes: merge again",
    ),
    "statistics through a link": (
        lambda f: _link(f, "ram_statistics.json"),
        "ram_statistics.json cannot be read (it is a symbolic link): replace it with the merge's own",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_problem_alone_is_one_line(clean: Path, tmp_path, case: str) -> None:
    introduce, expected = CASES[case]
    folder = tmp_path / "out"
    shutil.copytree(clean, folder, symlinks=True)
    introduce(folder)
    status, lines = check(folder)
    assert status == 1 and len(lines) == 2 and lines[1] == "1 problem(s): do not upload yet", lines
    if expected.endswith("..."):
        assert lines[0].startswith(f"problem: {expected[:-3]}"), lines
    else:
        assert lines[0] == f"problem: {expected}"


def test_json_report_and_accepted_warnings(clean: Path, tmp_path) -> None:
    folder = tmp_path / "out"
    shutil.copytree(clean, folder)
    warning = "a warning read and understood"
    _statistics(lambda data: data.update(warnings=[warning]))(folder)
    completed = run_script("mergekit-ram", "check", str(folder), "--json", check=False)
    assert completed.returncode == 1
    assert json.loads(completed.stdout) == {
        "folder": str(folder),
        "ready": False,
        "problems": [
            {
                "check": "statistics",
                "message": f"statistics warning: {warning} (--accept-warnings once it is understood)",
            }
        ],
        "notes": [],
    }
    assert check(folder, "--accept-warnings") == (0, [f"note: statistics warning: {warning}", "ready to upload"])
    completed = run_script("mergekit-ram", "check", str(clean), "--json", check=False)
    assert completed.returncode == 0
    assert json.loads(completed.stdout) == {"folder": str(clean), "ready": True, "problems": [], "notes": []}


def test_usage_errors_exit_with_status_2(clean: Path, tmp_path) -> None:
    """No folder, a file for a folder, a licence id the Hub does not write: click's usage error, status 2,
    and nothing changed."""
    card = (clean / "README.md").read_bytes()
    for arguments, error in (
        (
            [str(tmp_path / "missing")],
            f"Error: Invalid value for 'OUT': Directory '{tmp_path / 'missing'}' does not exist.",
        ),
        (
            [str(clean / "config.json")],
            f"Error: Invalid value for 'OUT': Directory '{clean / 'config.json'}' is a file.",
        ),
        (
            [str(clean), "--set-license", "Apache 2.0"],
            "Error: Invalid value for '--set-license': 'Apache 2.0' is not a licence id of the Hub (lower case, such "
            "as apache-2.0 or mit)",
        ),
    ):
        completed = run_script("mergekit-ram", "check", *arguments, check=False)
        assert (completed.returncode, completed.stderr.splitlines()[-1]) == (2, error)
    assert (clean / "README.md").read_bytes() == card


def test_set_license_without_a_card_is_one_line(clean: Path, tmp_path) -> None:
    folder = tmp_path / "out"
    shutil.copytree(clean, folder)
    (folder / "README.md").unlink()
    completed = run_script("mergekit-ram", "check", str(folder), "--set-license", "mit", check=False)
    assert (completed.returncode, completed.stderr.splitlines()) == (
        1,
        [
            f"Error: cannot set the licence of {folder}: there is no README.md (merge with mergekit-yaml, which "
            "writes the card)"
        ],
    )
    assert not (folder / "README.md").exists()
