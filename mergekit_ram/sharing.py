"""``mergekit-ram check OUT``: what stops a merged model folder from being shared on the Hub, one line
each with its fix; notes do not stop sharing. The folder is a stranger's (``mergekit_ram.files``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Any, Iterator, NamedTuple, Optional

import yaml
from safetensors import safe_open

from mergekit_ram.errors import MergedFolderError, one_line
from mergekit_ram.files import (
    JSON_LIMIT,
    UnreadableFile,
    descriptor_path,
    open_regular,
    read_regular,
    write_atomically,
)
from mergekit_ram.published import CARD_TAG, front_matter, with_front_matter
from mergekit_ram.staging import MANIFEST_FILE, MARKER_FILE, PRIVATE_PREFIX
from mergekit_ram.stats.schema import STATISTICS_FILE

CARD, RECIPE, CONFIG, INDEX = "README.md", "mergekit_config.yml", "config.json", "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # what transformers loads, with its config
NAMING_FILES = (CARD, RECIPE, STATISTICS_FILE)  # the files that name the merged models, in report order
LICENSE_ID = re.compile(r"[a-z0-9][a-z0-9.+-]*")  # a Hub licence id: apache-2.0, llama3.1, cc-by-nc-4.0, other
MERGE_TAG = "merge"


class Finding(NamedTuple):
    """A line of the report; ``check`` names the check for scripts; a note does not stop sharing."""

    check: str
    message: str
    note: bool = False


class Report(NamedTuple):
    folder: str
    findings: list[Finding]

    def of(self, note: bool) -> list[Finding]:
        return [finding for finding in self.findings if finding.note == note]

    @property
    def ready(self) -> bool:
        return not self.of(note=False)

    def to_json(self) -> dict[str, Any]:
        problems, notes = ([{"check": f.check, "message": f.message} for f in self.of(note)] for note in (False, True))
        return {"folder": self.folder, "ready": self.ready, "problems": problems, "notes": notes}

    def lines(self) -> list[str]:
        problems = len(self.of(note=False))
        verdict = f"{problems} problem(s): do not upload yet" if problems else "ready to upload"
        return [f"{'note' if f.note else 'problem'}: {f.message}" for f in self.of(True) + self.of(False)] + [verdict]


class FolderFile(NamedTuple):
    name: str
    text: Optional[str]  # None where absent or unreadable (``problem``)
    problem: Optional[Finding] = None


def _reason(error: Exception) -> str:
    return error.strerror if isinstance(error, OSError) and error.strerror else one_line(error)


@contextlib.contextmanager
def opened_folder(out: str) -> Iterator[int]:
    """The user's own path: a link to a folder is followed."""
    try:
        folder = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as error:
        raise MergedFolderError(f"cannot open the folder {out} ({error.strerror or error})") from None
    try:
        yield folder
    finally:
        os.close(folder)


def read_file(folder: int, name: str, check: str) -> FolderFile:
    """A regular file of the folder (not a link), bounded, UTF-8."""
    try:
        return FolderFile(name, read_regular(name, JSON_LIMIT, dir_fd=folder, follow_symlinks=False).decode("utf-8"))
    except FileNotFoundError:
        return FolderFile(name, None)
    except (OSError, UnreadableFile, UnicodeDecodeError) as error:
        message = f"{name} cannot be read ({_reason(error)}): replace it with the merge's own"
        return FolderFile(name, None, Finding(check, message))


def parsed_json(file: FolderFile) -> Any:
    with contextlib.suppress(ValueError, RecursionError):
        return json.loads(file.text) if file.text is not None else None
    return None


def card_front_matter(card: str) -> tuple[Optional[dict[str, Any]], str]:
    """``front_matter``, with (None, ``card``) for front matter that is not YAML."""
    with contextlib.suppress(yaml.YAMLError, RecursionError):
        return front_matter(card)
    return None, card


def check_folder(out: str, accept_warnings: bool = False) -> Report:
    """``accept_warnings`` makes statistics warnings notes."""
    with opened_folder(out) as folder:
        names = set(os.listdir(folder))
        files = card, recipe, statistics = [
            read_file(folder, name, check) for name, check in zip(NAMING_FILES, ("card", "recipe", "statistics"))
        ]
        findings = [*incomplete(names), *weights(folder, names), *config(folder), *tokenizer(folder)]
    findings += [file.problem for file in files if file.problem is not None]
    data = parsed_json(statistics)
    metadata = card_front_matter(card.text)[0] if card.text is not None else None
    findings += statistics_findings(statistics, data, accept_warnings) + card_findings(card, metadata, data)
    return Report(out, findings + local_paths(files, models_named(recipe, data, metadata)))


def config(folder: int) -> list[Finding]:
    file = read_file(folder, CONFIG, "config")
    missing = (
        f"no {CONFIG}: transformers cannot load the folder (mergekit-pytorch writes weights only): merge with "
        "mergekit-yaml"
    )
    return [file.problem or Finding("config", missing)] if file.text is None else []


def incomplete(names: set[str]) -> list[Finding]:
    """The plugin's transaction marks a folder it has not finished publishing into."""
    killed = (
        f"{MARKER_FILE} is present: a merge into this folder was killed while publishing; merge into it again (it "
        "writes its own complete result)"
    )
    private = sorted(name for name in names if name.startswith(PRIVATE_PREFIX) and name != MANIFEST_FILE)
    return [Finding("incomplete", killed)] * (MARKER_FILE in names) + [
        Finding(
            "incomplete",
            f"{name} is present: a merge is writing into this folder, or one was killed; wait for it to finish, or "
            "check that hidden folder and remove it",
        )
        for name in private
    ]


def weights(folder: int, names: set[str]) -> list[Finding]:
    files = sorted(name for name in names if name.endswith(".safetensors"))
    if not files:
        return [Finding("weights", "no weights (*.safetensors): merge again with mergekit-yaml")]
    found = index_findings(folder, names) if INDEX in names else []
    return found + [finding for name in files for finding in tensor_findings(folder, name)]


def index_findings(folder: int, names: set[str]) -> list[Finding]:
    index = read_file(folder, INDEX, "weights")
    if index.problem is not None:
        return [index.problem]
    data = parsed_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        return [Finding("weights", f"{INDEX} has no weight_map of tensor names to files: merge again")]
    return [
        Finding("weights", f"{INDEX} names {shard!r}, which is not a file of this folder: merge again")
        for shard in sorted({str(shard) for shard in weight_map.values()})
        if shard not in names  # the folder's own entries: plain names
    ]


def tensor_findings(folder: int, name: str) -> list[Finding]:
    """Every tensor loads with safetensors, one at a time, and a floating one holds no NaN or Inf."""
    try:
        with open_regular(name, dir_fd=folder, follow_symlinks=False) as (handle, _):
            path = descriptor_path(handle)  # the descriptor's own file, whatever becomes of the name (/proc)
            if path is None:
                return [Finding("weights", f"{name} cannot be read: /proc is not mounted here (mount it)")]
            with safe_open(path, framework="pt") as tensors:
                bad = [key for key in tensors.keys() if not is_finite(tensors.get_tensor(key))]
    except (OSError, UnreadableFile) as error:
        return [Finding("weights", f"{name} cannot be read ({_reason(error)}): merge again")]
    except Exception as error:  # safetensors' own refusal of a damaged file, whatever its type
        return [Finding("weights", f"{name} does not load with safetensors ({one_line(error)}): merge again")]
    shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    message = (
        f"{name}: {len(bad)} tensor(s) hold NaN or Inf ({shown}): do not share it; check the inputs and merge again "
        "(a wider out_dtype where values overflow it)"
    )
    return [Finding("finite", message)] if bad else []


def is_finite(tensor: Any) -> bool:
    return not tensor.is_floating_point() or bool(tensor.isfinite().all())


def tokenizer(folder: int) -> list[Finding]:
    """A tokenizer file as a regular file of the folder (a link is not uploaded as the file everywhere)."""
    problems = []
    for name in TOKENIZER_FILES:
        try:
            with open_regular(name, dir_fd=folder, follow_symlinks=False):
                return []
        except FileNotFoundError:
            pass
        except (OSError, UnreadableFile) as error:
            problems.append(f"{name} cannot be read ({_reason(error)}): copy the file itself into the folder")
    problems.append(
        f"no tokenizer ({', '.join(TOKENIZER_FILES[:-1])} or {TOKENIZER_FILES[-1]}): copy the base model's "
        "tokenizer files (tokenizer_config.json and the others) into the folder"
    )
    return [Finding("tokenizer", problems[0])]


def statistics_findings(statistics: FolderFile, data: Any, accept_warnings: bool) -> list[Finding]:
    if statistics.problem is not None:
        return []  # reported with the files
    if statistics.text is None:
        return [Finding("statistics", f"no {STATISTICS_FILE}: not a merge with mergekit-ram's methods", note=True)]
    if not isinstance(data, dict):
        return [Finding("statistics", f"{STATISTICS_FILE} is not the JSON object a merge writes: merge again")]
    warnings = data.get("warnings")
    hint = "" if accept_warnings else " (--accept-warnings once it is understood)"
    return [
        Finding("statistics", f"statistics warning: {warning}{hint}", note=accept_warnings)
        for warning in map(str, warnings if isinstance(warnings, list) else [])
    ]


def card_findings(card: FolderFile, metadata: Optional[dict[str, Any]], statistics: Any) -> list[Finding]:
    """The card's front matter as the Hub reads it: a licence, ``base_model`` (a merge of them), the merge tag."""
    if card.problem is not None:
        return []
    if card.text is None:
        return [Finding("card", f"no {CARD} model card: merge with mergekit-yaml (without --no-write-model-card)")]
    if metadata is None:
        return [
            Finding(
                "card",
                f"{CARD} has no YAML front matter (between --- lines at its top): merge again with mergekit-yaml",
            )
        ]
    license_id, base_model, relation, tags = (
        metadata.get(key) for key in ("license", "base_model", "base_model_relation", "tags")
    )
    checks = [
        (
            "license",
            not license_id,
            "the card's front matter has no license: mergekit-ram check OUT --set-license ID, with an id the "
            "input models' licences allow (apache-2.0, mit, ...)",
        ),
        (
            "license",
            license_id == "other" and not (metadata.get("license_name") and metadata.get("license_link")),
            "the card says license: other without license_name and license_link: add both to its front matter",
        ),
        (
            "base_model",
            not base_model,
            "the card's front matter has no base_model (mergekit lists only Hub ids there): merge again with the "
            "models' Hub ids in the recipe, or list them under base_model",
        ),
        (
            "base_model_relation",
            bool(base_model) and relation != "merge",
            f"the card's front matter has base_model_relation {relation!r}: set base_model_relation: merge (the "
            "Hub's relation for a merge of the base_model models)",
        ),
        (
            "tags",
            not (isinstance(tags, list) and MERGE_TAG in tags),
            f"the card's front matter has no tag {MERGE_TAG}: add it under tags (mergekit writes mergekit, "
            f"{MERGE_TAG}; mergekit-ram adds {CARD_TAG})",
        ),
    ]
    found = [Finding(check, message) for check, failed, message in checks if failed]
    if isinstance(statistics, dict) and "## RAM statistics" not in card.text:
        found.append(Finding("card", f"{CARD} has no RAM statistics section", note=True))
    return found


def models_named(recipe: FolderFile, statistics: Any, card: Optional[dict[str, Any]]) -> list[str]:
    """Every model the statistics, the recipe and the card's ``base_model`` name."""
    listed_models = statistics.get("models") if isinstance(statistics, dict) else None
    names = [str(m["model"]) for m in listed_models or () if isinstance(m, dict) and "model" in m]
    with contextlib.suppress(yaml.YAMLError, RecursionError):
        names += recipe_models(yaml.safe_load(recipe.text) if recipe.text else None)
    listed = (card or {}).get("base_model") or []
    return names + [str(name) for name in (listed if isinstance(listed, list) else [listed])]


def recipe_models(document: Any) -> list[str]:
    """Every ``model`` and ``base_model`` a recipe names, at any depth; each node once (YAML aliases)."""
    found, seen, stack = [], set(), [document]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("model", "base_model") and isinstance(value, str):
                    found.append(value)
                else:
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
    return found


def local_paths(files: list[FolderFile], models: list[str]) -> list[Finding]:
    """Not Hub ids (``name``, ``org/name``): readers of the card cannot find those models."""
    paths = sorted({part.split("@")[0] for name in models for part in name.split("+")} - {""})
    local = [path for path in paths if path[0] in "/~." or path.count("/") > 1 or os.path.isdir(path)]
    return [
        Finding(
            "local_paths",
            f"{file.name} names local paths ({', '.join(named)}): merge again with the models' Hub ids in "
            f"the recipe, or replace the paths with them in {', '.join(NAMING_FILES)} alike",
        )
        for file in files
        if (named := [path for path in local if file.text is not None and path in file.text])
    ]


def set_license(out: str, license_id: str) -> None:
    """Write ``license: license_id`` into the card's front matter (made if it has none)."""
    with opened_folder(out) as folder:
        card = read_file(folder, CARD, "card")
        if card.text is None:
            reason = card.problem.message if card.problem is not None else f"there is no {CARD}"
            raise MergedFolderError(
                f"cannot set the licence of {out}: {reason} (merge with mergekit-yaml, which writes the card)"
            )
        metadata, body = card_front_matter(card.text)
        if metadata is None and card.text.startswith("---\n"):
            raise MergedFolderError(
                f"cannot set the licence: the front matter of {out}/{CARD} is not a YAML mapping; fix it by hand"
            )
        write_atomically(CARD, with_front_matter({**(metadata or {}), "license": license_id}, body), dir_fd=folder)
