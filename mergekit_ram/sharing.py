"""``mergekit-ram check OUT``: what stops a merged model folder from being shared on the Hub, every problem in
one run, one line each with its fix; notes do not stop sharing. The naming files are read as mergekit and
huggingface_hub read them, through ``hub_ids`` (``ModelCard``, ``yaml.safe_load``, the statistics' models).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shlex
import stat
from typing import Any, NamedTuple, Optional, Union

import yaml
from huggingface_hub import ModelCard
from safetensors import safe_open

import mergekit_ram.hub_ids as hub
from mergekit_ram.errors import MergedFolderError, one_line
from mergekit_ram.files import UnreadableFile, open_regular
from mergekit_ram.published import listed
from mergekit_ram.staging import MANIFEST_FILE, MARKER_FILE, PRIVATE_PREFIX
from mergekit_ram.stats.render import terminal_text
from mergekit_ram.stats.schema import StatisticsFile, read_statistics

CARD, RECIPE, STATISTICS, INDEX = *hub.NAMING_FILES, "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # what transformers loads, with its config
LICENSE_ID = re.compile(r"[a-z0-9][a-z0-9.+-]*")  # a Hub licence id: apache-2.0, llama3.1, cc-by-nc-4.0, other
#: What a model repository holds for transformers and the Hub: the card and its licence texts, the configuration,
#: the weights and their index, the tokenizer's files (those ``save_pretrained`` writes for the tokenizers of
#: causal language models), the generation configuration, the chat template, a processor's configuration; and
#: the merge's recipe and statistics.
MODEL_FILES = frozenset(
    {
        CARD, ".gitattributes", "LICENSE", "LICENSE.md", "LICENSE.txt", "NOTICE", "USE_POLICY.md",
        "config.json", "generation_config.json", RECIPE, STATISTICS, INDEX, "pytorch_model.bin.index.json",
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
        "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "sentencepiece.bpe.model",
        "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json",
    }
)  # fmt: skip
#: ... and files by pattern: weights (shards included), a model's own code (``trust_remote_code``), tiktoken files.
MODEL_PATTERN = re.compile(
    r"[^/]+\.safetensors|pytorch_model(-\d+-of-\d+)?\.bin|(configuration|modeling|tokenization)_\w+\.py|[^/]+\.tiktoken"
)
NOT_UPLOADED = frozenset({".git", ".cache"})  # what ``hf upload`` leaves out by itself (huggingface_hub's)
NAMING_CHECKS = ("card", "recipe", "statistics")  # the check that reports each naming file
LISTED, SHOWN = 20, 120  # entries named one by one at most; characters of a front matter value quoted at most


class Finding(NamedTuple):
    """A line of the report; ``check`` names the check for scripts; a note does not stop sharing."""

    check: str
    message: str
    note: bool = False


class Report(NamedTuple):
    folder: str
    findings: list[Finding]
    changed: list[str] = []  # the files ``--hub-id`` or ``--set-license`` rewrote first

    def of(self, note: bool) -> list[Finding]:
        return [finding for finding in self.findings if finding.note == note]

    @property
    def ready(self) -> bool:
        return not self.of(note=False)

    def to_json(self) -> dict[str, Any]:
        problems, notes = ([{"check": f.check, "message": f.message} for f in self.of(note)] for note in (False, True))
        return dict(folder=self.folder, ready=self.ready, problems=problems, notes=notes, changed=self.changed)

    def lines(self) -> list[str]:
        """One line per finding, notes first (unprintable characters of a stranger's names escaped), the verdict."""
        lines = [f"{'note' if f.note else 'problem'}: {f.message}" for f in self.of(True) + self.of(False)]
        verdict = "ready to upload" if self.ready else f"{len(self.of(False))} problem(s): do not upload yet"
        return [terminal_text(line) for line in lines] + [verdict]


def read_file(folder: int, name: str, check: str) -> Union[str, Finding, None]:
    """``hub_ids.read_text`` (None: absent), or the finding that the file cannot be read."""
    try:
        return hub.read_text(name, folder)
    except (OSError, ValueError) as error:
        return Finding(check, f"{name} cannot be read ({hub.reason(error)}): replace it with the merge's own")


def check_folder(out: str, accept_warnings: bool = False, changed: Optional[list[str]] = None) -> Report:
    """``accept_warnings`` makes statistics warnings notes; ``changed``: what was rewritten first (reported)."""
    try:
        folder = os.open(out, os.O_RDONLY | os.O_DIRECTORY)  # the user's own path: a link to a folder is followed
    except OSError as error:
        raise MergedFolderError(f"cannot open the folder {out} ({error.strerror or error})") from None
    try:
        names = set(os.listdir(folder))
        found = incomplete(names) + weights(folder, names, out) + config(folder) + tokenizer(folder)
        found += uploaded(folder, names)
        read = {name: read_file(folder, name, check) for name, check in zip(hub.NAMING_FILES, NAMING_CHECKS)}
    finally:
        os.close(folder)
    found += [text for text in read.values() if isinstance(text, Finding)]
    texts = {name: text if isinstance(text, str) else None for name, text in read.items()}
    card, recipe, statistics = None, None, None
    with _reported(found, "card", "write it as plain YAML, as mergekit does, or merge again"):
        card = hub.read_card(texts[CARD])
    with _reported(found, "recipe", "merge again (mergekit writes the recipe it ran)"):
        recipe = hub.read_recipe(texts[RECIPE])
    with _reported(found, "statistics", "merge again"):
        statistics = read_statistics(text) if (text := texts[STATISTICS]) is not None else None
    naming = hub.Naming(texts, card, recipe, statistics)
    local = naming.local_paths()
    if not isinstance(read[STATISTICS], Finding):
        found += statistics_findings(texts[STATISTICS], statistics, accept_warnings)
    if not any(finding.check == "card" for finding in found) and not isinstance(read[CARD], Finding):
        found += card_findings(texts[CARD], card, statistics, local)
    return Report(out, found + local_paths(naming, local), list(changed or []))


@contextlib.contextmanager
def _reported(found: list[Finding], check: str, fix: str) -> Any:
    """A naming file that does not parse, as the one finding of its check."""
    try:
        yield
    except ValueError as error:  # the readers' one-line errors, and the parameter table's
        found.append(Finding(check, f"{one_line(error)}: {fix}"))


def _json(text: Optional[str]) -> Any:
    """The JSON, None where it is not."""
    with contextlib.suppress(ValueError, RecursionError):
        return json.loads(text or "")
    return None


def incomplete(names: set[str]) -> list[Finding]:
    """The plugin's transaction marks a folder it has not finished publishing into."""
    killed = (
        f"{MARKER_FILE} is present: a merge into this folder was killed while publishing; merge into it again (it "
        "writes its own complete result)"
    )
    running = [
        f"{name} is present: a merge is writing into this folder, or one was killed; wait for it to finish, or check "
        "that hidden folder and remove it"
        for name in _private(names)
    ]
    return [Finding("incomplete", message) for message in [killed] * (MARKER_FILE in names) + running]


def _private(names: set[str]) -> list[str]:
    return sorted(name for name in names if name.startswith(PRIVATE_PREFIX) and name != MANIFEST_FILE)


def weights(folder: int, names: set[str], out: str) -> list[Finding]:
    """The index names files of the folder; every weights file loads (``tensor_findings``)."""
    files = sorted(name for name in names if name.endswith(".safetensors"))
    if not files:
        return [Finding("weights", "no weights (*.safetensors): merge again with mergekit-yaml")]
    index = read_file(folder, INDEX, "weights") if INDEX in names else '{"weight_map": {}}'
    data = _json(index) if not isinstance(index, Finding) else None  # JSON as strangers write it
    shards = data.get("weight_map") if isinstance(data, dict) else None
    if isinstance(shards, dict) and all(isinstance(shard, str) for shard in shards.values()):
        missing = sorted(set(shards.values()) - names)  # the folder's own entries: plain names
        found = [
            Finding("weights", f"{INDEX} names {shard}, which is not a file of this folder: merge again")
            for shard in missing
        ]
    else:
        found = [
            index
            if isinstance(index, Finding)
            else Finding("weights", f"{INDEX} has no weight_map of tensor names to files: merge again")
        ]
    return found + [finding for name in files for finding in tensor_findings(folder, name, out)]


def tensor_findings(folder: int, name: str, out: str) -> list[Finding]:
    """Every tensor loads with safetensors, one at a time, and a floating one holds no NaN or Inf."""
    try:
        with open_regular(name, dir_fd=folder, follow_symlinks=False):
            with safe_open(os.path.join(out, name), framework="pt") as tensors:
                bad = [key for key in tensors.keys() if not _finite(tensors.get_tensor(key))]
    except (OSError, UnreadableFile) as error:
        return [Finding("weights", f"{name} cannot be read ({hub.reason(error)}): merge again")]
    except Exception as error:  # safetensors' own refusal of a damaged file, whatever its type
        return [Finding("weights", f"{name} does not load with safetensors ({one_line(error)}): merge again")]
    shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    message = (
        f"{name}: {len(bad)} tensor(s) hold NaN or Inf ({shown}): do not share it; check the inputs and merge again "
        "(a wider out_dtype where values overflow it)"
    )
    return [Finding("finite", message)] if bad else []


def _finite(tensor: Any) -> bool:
    return not tensor.is_floating_point() or bool(tensor.isfinite().all())


def config(folder: int) -> list[Finding]:
    text = read_file(folder, "config.json", "config")
    missing = (
        "no config.json: transformers cannot load the folder (mergekit-pytorch writes weights only): merge with "
        "mergekit-yaml"
    )
    return [text if isinstance(text, Finding) else Finding("config", missing)] if not isinstance(text, str) else []


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
            problems.append(f"{name} cannot be read ({hub.reason(error)}): copy the file itself into the folder")
    missing = (
        f"no tokenizer ({', '.join(TOKENIZER_FILES[:-1])} or {TOKENIZER_FILES[-1]}): copy the base model's "
        "tokenizer files (tokenizer_config.json and the others) into the folder"
    )
    return [Finding("tokenizer", (problems + [missing])[0])]


def uploaded(folder: int, names: set[str]) -> list[Finding]:
    """One note naming the entries ``hf upload`` would upload that are not part of the model (the user decides),
    with the ``--exclude`` patterns that leave them out (a ``*`` there also matches across folders)."""
    extra = names - MODEL_FILES - NOT_UPLOADED - {MARKER_FILE} - set(_private(names))  # a killed merge's: problems
    stray = sorted(name for name in extra if not MODEL_PATTERN.fullmatch(name))
    if not stray:
        return []
    shown = [name + "/" * _is_folder(folder, name) for name in stray[:LISTED]]
    patterns = [f"'{PRIVATE_PREFIX}*'" if name == MANIFEST_FILE else shlex.quote(glob.escape(name)) for name in shown]
    named = [
        f"{name} (mergekit-ram's record of the files its merge wrote here: keep it for the next merge)"
        if name == MANIFEST_FILE
        else name
        for name in shown
    ]
    more = f" and {len(stray) - LISTED} more" if len(stray) > LISTED else ""
    one = len(stray) == 1
    message = (
        f"hf upload would upload {', '.join(named)}{more}, which {'is' if one else 'are'} not part of the model: "
        f"leave {'it' if one else 'them'} out, hf upload ... {' '.join(f'--exclude {p}' for p in patterns)}"
        + (", or move the rest out of the folder" if more else "")
    )
    return [Finding("upload", message, note=True)]


def _is_folder(folder: int, name: str) -> bool:
    """A folder of ``folder`` itself (a link is not followed)."""
    with contextlib.suppress(OSError):
        return stat.S_ISDIR(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)
    return False


def statistics_findings(text: Optional[str], statistics: Optional[StatisticsFile], accept: bool) -> list[Finding]:
    """The statistics' warnings (a file that does not read is reported by ``check_folder``)."""
    if text is None:
        return [Finding("statistics", "no ram_statistics.json: not a merge with mergekit-ram's methods", note=True)]
    hint = "" if accept else " (--accept-warnings once it is understood)"
    warnings = statistics.warnings if statistics is not None else []
    return [Finding("statistics", f"statistics warning: {w}{hint}", note=accept) for w in warnings]


def shown(value: Any) -> str:
    """A front matter value as YAML writes it (``merge``, ``[a, b]``, ``null``), never as Python does; cut short."""
    with contextlib.suppress(yaml.YAMLError):
        text = yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip().removesuffix("...").strip()
        return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."
    return "a value that is not YAML"


def card_findings(
    text: Optional[str], card: Optional[ModelCard], statistics: Optional[StatisticsFile], local: list[str]
) -> list[Finding]:
    """The card's front matter as the Hub reads it (``ModelCard``): a licence, ``base_model`` and
    ``base_model_relation: merge``, the merge tag; every one checked, whatever the others found."""
    if text is None:
        return [Finding("card", "no README.md model card: merge with mergekit-yaml (without --no-write-model-card)")]
    if card is None:
        missing = "README.md has no YAML front matter (between --- lines at its top): merge again with mergekit-yaml"
        return [Finding("card", missing)]
    get, found = card.data.get, []
    base_model, relation, tags = get("base_model"), get("base_model_relation"), get("tags")
    if not get("license"):
        message = (
            "the card's front matter has no license: mergekit-ram check OUT --set-license ID, with an id the input "
            "models' licences allow (apache-2.0, mit, ...)"
        )
        found.append(Finding("license", message))
    if get("license") == "other" and not (get("license_name") and get("license_link")):
        message = "the card says license: other without license_name and license_link: add both to its front matter"
        found.append(Finding("license", message))
    if not listed(base_model):
        fix = "list the merged models' Hub ids under base_model (mergekit lists those of its recipe)"
        fix = "--hub-id writes it (below)" if local else fix
        message = f"the card's front matter has no base_model (mergekit lists only Hub ids there): {fix}"
        found.append(Finding("base_model", message))
    if any(not isinstance(name, str) or not name for name in listed(base_model)):
        message = (
            f"the card's base_model is {shown(base_model)}, not a list of Hub ids: list the merged models' Hub ids"
        )
        found.append(Finding("base_model", message))
    if relation != "merge":
        has = (
            "the card's front matter has no base_model_relation"
            if relation is None
            else f"the card's front matter has base_model_relation: {shown(relation)}"
        )
        message = f"{has}: set base_model_relation: merge (the Hub's relation for a merge of the base_model models" + (
            "; --hub-id writes it)" if local else ")"
        )
        found.append(Finding("base_model_relation", message))
    if not (isinstance(tags, list) and "merge" in tags):
        message = (
            "the card's front matter has no tag merge: add it under tags (mergekit writes mergekit, merge; "
            "mergekit-ram adds mergekit-ram)"
        )
        found.append(Finding("tags", message))
    missing_section = statistics is not None and "## RAM statistics" not in card.text
    return found + [Finding("card", "README.md has no RAM statistics section", note=True)] * missing_section


def local_paths(files: hub.Naming, local: list[str]) -> list[Finding]:
    """The naming files that name local folders (readers of the card cannot find those models), with the step
    that names them by their Hub ids."""
    card, statistics = files.card, files.statistics
    named = {
        CARD: listed(card.data.get("base_model")) + hub.recipe_paths(files.recipe) if card else [],  # mergekit's
        RECIPE: hub.recipe_paths(files.recipe),
        STATISTICS: [path for row in statistics.models for path in hub.reference_paths(row.model)]
        if statistics
        else [],
    }
    naming = [name for name in hub.NAMING_FILES if any(path in local for path in named[name])]
    if not naming:
        return []
    paths = sorted({path for name in naming for path in named[name] if path in local})
    named_by = naming[0] + " names" if len(naming) == 1 else f"{', '.join(naming[:-1])} and {naming[-1]} name"
    return [
        Finding(
            "local_paths",
            f"{named_by} local folders ({', '.join(paths)}): mergekit-ram check OUT --hub-id {paths[0]}=ORG/NAME for "
            "each local model (or --hub-id-file FILE) names them by their Hub ids in README.md, mergekit_config.yml "
            "and ram_statistics.json alike",
        )
    ]
