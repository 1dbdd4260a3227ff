"""``mergekit-ram check OUT --hub-id LOCAL=ID``: a merge of local folders names them in its card, recipe and
statistics; given each one's Hub id once, the three are rewritten alike, each by its structure, into what a merge of
the ids writes (so a second run changes nothing). ``sharing`` reads the three through ``parse`` too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Any, Iterable, NamedTuple, Optional

import yaml

import mergekit_ram.bounded_yaml as bounded_yaml
from mergekit_ram.errors import MergedFolderError, one_line
from mergekit_ram.files import JSON_LIMIT, UnreadableFile, read_regular
from mergekit_ram.published import MODEL_LIST, Card, listed, merge_metadata, read_card, with_sorted_model_list
from mergekit_ram.staging import folder_writer, replace_files
from mergekit_ram.stats.schema import STATISTICS_FILE, statistics_from_dict

CARD, RECIPE = "README.md", "mergekit_config.yml"
NAMING_FILES = (CARD, RECIPE, STATISTICS_FILE)  # the files that name the merged models, in report order
UNREADABLE = (OSError, UnreadableFile, UnicodeDecodeError)  # what reading a stranger's file may raise
#: A Hub model id as ``huggingface_hub.utils.validate_repo_id`` takes it (``name`` or ``org/name``, each at most 96;
#: no ``--``, ``..`` or final ``.git``); a git revision after ``@``, as mergekit reads ``org/name@revision``.
_NAME = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
HUB_ID, REVISION = re.compile(rf"(?:{_NAME}/)?{_NAME}"), re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./-]{0,254}")
#: Recipe keys, at any depth, whose text is a model reference (``path@revision+lora@revision``), or one path.
REFERENCE_KEYS, PATH_KEYS = (
    frozenset({"model", "base_model", "tokenizer_source", "source"}),
    frozenset({"lora", "path"}),
)
LOCAL_LINE = (
    "When this model was merged, {ids} were local folders: this card, mergekit_config.yml and ram_statistics.json "
    "name them by their Hub ids."
)
#: mergekit's card: its line ``This model was merged using the <method> merge method using <model> as a base.``,
#: and where it quotes the recipe (group 1: its text and a line end).
_BASE_LINE = ("This model was merged using the ", " merge method using ", " as a base.")
RECIPE_BLOCK = re.compile(
    r"^The following YAML configuration was used to produce this model:\n\n```yaml\n(.*?)^```$", re.M | re.S
)
_BEFORE, _AFTER = r"(?<![^\s(\[|`'\"])", r"(?=[\s)\]|`'\",:;]|$)"  # around a path mentioned in text (not "base.")


def parse_hub_id(text: str) -> tuple[str, str]:
    """``LOCAL=ID`` as (LOCAL, ID), split at the last ``=`` (a folder's name may hold one, an id cannot)."""
    local, equals, hub_id = text.rpartition("=")
    name, at, revision = hub_id.partition("@")
    if not equals or not local or not hub_id:
        raise ValueError(
            f"{text!r} is not LOCAL=ID (a local model's folder, '=', its Hub id: ./models/coder=org/coder)"
        )
    if not HUB_ID.fullmatch(name) or "--" in name or ".." in name or name.endswith(".git"):
        raise ValueError(f"{text!r}: {name!r} is not a Hub model id (org/name: letters, digits, '_', '.', '-')")
    if at and not REVISION.fullmatch(revision):
        raise ValueError(f"{text!r}: {revision!r} is not a revision (a branch, tag or commit after @)")
    return local, hub_id


def read_hub_id_file(path: str) -> list[tuple[str, str]]:
    """A YAML or JSON mapping of local folders to Hub ids (``{./models/coder: org/coder}``), bounded."""
    try:
        mapping = bounded_yaml.load_one(read_regular(path, bounded_yaml.MAX_CHARACTERS).decode("utf-8"), path)
    except (*UNREADABLE, bounded_yaml.UnreadableYaml) as error:
        raise ValueError(f"cannot read {path} ({reason(error)})") from None
    if not isinstance(mapping, dict):
        raise ValueError(f"{path} is not a mapping of local model folders to Hub ids ({{./models/coder: org/coder}})")
    if not all(isinstance(text, str) for pair in mapping.items() for text in pair):
        raise ValueError(f"{path}: every key must be a folder and every value a Hub id, as text")
    return [parse_hub_id(f"{local}={hub_id}") for local, hub_id in mapping.items()]


def reason(error: Exception) -> str:
    return error.strerror if isinstance(error, OSError) and error.strerror else one_line(error)


def resolved(path: str) -> str:
    """A path as typed or as a recipe wrote it, from here, links resolved (``A1/`` is ``./A1``)."""
    return os.path.realpath(os.path.expanduser(path))


def is_local(path: str) -> bool:
    """What mergekit reads from the disk: not a Hub id, or a folder here (where the merge ran)."""
    return bool(path) and (not HUB_ID.fullmatch(path) or os.path.isdir(path))


def hub_path(hub_id: str) -> str:
    """An id without its revision: what the card's ``base_model`` lists and links."""
    return hub_id.partition("@")[0]


def reference_paths(reference: str, whole: bool = True) -> list[str]:
    """The paths of ``path@revision+lora@revision`` as mergekit splits it (``whole``), else of ``path@revision``."""
    return [part.partition("@")[0] for part in (reference.split("+") if whole else [reference])]


def renamed_reference(reference: str, renames: dict[str, str], whole: bool = True) -> str:
    """Each renamed path replaced by its Hub id (the local path's revision dropped)."""
    return "+".join(renames.get(hub_path(part), part) for part in (reference.split("+") if whole else [reference]))


def names_models(key: Any, value: Any) -> bool:
    """Whether a recipe's ``key: value`` is a model reference or path (a tokenizer's ``base``, ``union`` are not)."""
    words = key in ("source", "tokenizer_source") and value in ("base", "union")
    return key in REFERENCE_KEYS | PATH_KEYS and isinstance(value, str) and not words


def references(text: str) -> list[tuple[str, yaml.ScalarNode]]:
    """(key, scalar node) of every model reference of a recipe, at any depth, in the text's order (an alias once)."""
    found: dict[int, tuple[str, yaml.ScalarNode]] = {}
    stack = bounded_yaml.compose(text, RECIPE)  # bounded: a walk of every value, aliases expanded, is short
    while stack:
        node = stack.pop()
        stack += node.value if isinstance(node, yaml.SequenceNode) else []
        for key, value in node.value if isinstance(node, yaml.MappingNode) else []:
            if _is_text(key) and _is_text(value) and names_models(key.value, value.value):
                found.setdefault(id(value), (key.value, value))
            else:
                stack.append(value)
    return sorted(found.values(), key=lambda reference: reference[1].start_mark.index)


def _is_text(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:str"


def recipe_paths(text: str) -> list[str]:
    return [path for key, node in references(text) for path in reference_paths(node.value, key in REFERENCE_KEYS)]


def renamed_recipe(text: str, renames: dict[str, str]) -> str:
    """The recipe's text with its references renamed where the parser found them, in their quoting; where that does
    not read back as the renamed recipe (an alias shared with another key), the renamed recipe dumped."""
    pieces, done = [], 0
    for key, node in references(text):
        new = renamed_reference(node.value, renames, key in REFERENCE_KEYS)
        if new == node.value:
            continue
        if key == "path" and "@" in new:
            raise MergedFolderError(
                f"{RECIPE} names {node.value} as a path beside its revision: give its Hub id without @revision, and "
                "write the revision into the recipe's revision field"
            )
        start, end = node.start_mark.index, node.end_mark.index
        properties = re.findall(r"^(?:[&!]\S*\s+)*", text[start:end])[0]  # an anchor or a tag stays
        pieces += [text[done:start], properties, _scalar(new, node.style)]
        done = end
    if not pieces:
        return text
    expected = [_renamed_value(document, renames) for document in bounded_yaml.load(text, RECIPE)]
    with contextlib.suppress(bounded_yaml.UnreadableYaml):
        if bounded_yaml.load("".join(pieces) + text[done:], RECIPE) == expected:
            return "".join(pieces) + text[done:]
    return yaml.safe_dump_all(expected, sort_keys=False, allow_unicode=True)


def _scalar(value: str, style: Optional[str]) -> str:
    """``value`` in the original's quoting where that reads back as the same text, else double-quoted (JSON's)."""
    if style == "'":
        return "'" + value.replace("'", "''") + "'"
    with contextlib.suppress(bounded_yaml.UnreadableYaml):
        if style is None and bounded_yaml.load(value, "a model id") == [value]:
            return value
    return json.dumps(value)


def _renamed_value(value: Any, renames: dict[str, str], key: Any = None) -> Any:
    """A constructed recipe with its references renamed (what the spliced text must read back as)."""
    if isinstance(value, dict):
        return {k: _renamed_value(v, renames, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_renamed_value(v, renames) for v in value]
    return renamed_reference(value, renames, key in REFERENCE_KEYS) if names_models(key, value) else value


def statistics_models(data: Any) -> list[str]:
    """The model names of statistics its reader takes (each model's row, each tensor's list), where text."""
    read = statistics_from_dict(data) if data is not None else None
    names = [model.model for model in read.models] + [n for t in read.tensors for n in t.models] if read else []
    return list(dict.fromkeys(name for name in names if isinstance(name, str)))


def renamed_statistics(data: Any, renames: dict[str, str], key: Any = None) -> Any:
    """Every text that is a model name renamed (keys too); in ``warnings``, each path mentioned."""
    if isinstance(data, dict):
        return {renamed_statistics(k, renames): renamed_statistics(v, renames, k) for k, v in data.items()}
    if isinstance(data, list):
        return [renamed_statistics(value, renames, "warnings" if key == "warnings" else None) for value in data]
    if isinstance(data, str):
        return renamed_mentions(data, renames) if key == "warnings" else renamed_reference(data, renames)
    return data


def mentions(text: str, paths: Iterable[str]) -> list[str]:
    """The ``paths`` that ``text`` mentions as whole words (not inside a longer path or a word)."""
    return [path for path in paths if re.search(_BEFORE + re.escape(path) + _AFTER, text)]


def renamed_mentions(text: str, renames: dict[str, str]) -> str:
    """Each whole-word mention of a renamed path replaced by its Hub id (longest paths first)."""
    paths = "|".join(re.escape(path) for path in sorted(renames, key=len, reverse=True))
    return re.sub(f"{_BEFORE}(?:{paths}){_AFTER}", lambda found: renames[found[0]], text) if renames else text


def renamed_body(body: str, renames: dict[str, str], ids: list[str]) -> str:
    """The card's text renamed: the recipe it quotes as the recipe file is (word by word where it does not parse);
    mergekit's base line and model list (sorted again) linking the ids as it links Hub models; other mentions the
    ids; ``LOCAL_LINE`` after the model list (else before the plugin's section, or last)."""
    block = RECIPE_BLOCK.search(body)
    start, end = block.span(1) if block is not None else (len(body), len(body))
    try:
        quoted = renamed_recipe(body[start:end], renames)
    except bounded_yaml.UnreadableYaml:
        quoted = renamed_mentions(body[start:end], renames)
    body = with_sorted_model_list(_renamed_text(body[:start], renames) + quoted + _renamed_text(body[end:], renames))
    line = LOCAL_LINE.format(ids=", ".join(ids))
    models, section = MODEL_LIST.search(body), body.find("\n## Reproducing this merge\n")
    if models is not None:
        return body[: models.end()] + "\n" + line + "\n" + body[models.end() :]
    if section >= 0:
        return body[: section + 1] + line + "\n" + body[section:]
    return body + ("" if body.endswith("\n") or not body else "\n") + "\n" + line + "\n"


def _renamed_text(text: str, renames: dict[str, str]) -> str:
    def linked(models: str) -> str:  # mergekit's ``path`` or ``path + lora``, a Hub id linked as it links one
        ids = [hub_path(renames[part]) if part in renames else None for part in models.split(" + ")]
        return " + ".join(f"[{i}](https://huggingface.co/{i})" if i else p for i, p in zip(ids, models.split(" + ")))

    first, middle, last = _BASE_LINE
    lines = text.splitlines(True)
    for number, line in enumerate(lines):  # the base line by plain string search: linear in the line
        body = line.rstrip("\r\n")
        cut = body.find(middle) + len(middle)
        if body.startswith(first) and body.endswith(last) and cut >= len(middle):
            lines[number] = body[:cut] + linked(body[cut : len(body) - len(last)]) + last + line[len(body) :]
    text = MODEL_LIST.sub(
        lambda found: found[1] + "".join(f"* {linked(item[2:])}\n" for item in found[2].split("\n")[:-1]),
        "".join(lines),
    )
    return renamed_mentions(text, renames)


def read_text(folder: int, name: str) -> Optional[str]:
    """A regular file of the folder (never through a link), bounded, UTF-8; None where absent; else ``UNREADABLE``."""
    with contextlib.suppress(FileNotFoundError):
        return read_regular(name, JSON_LIMIT, dir_fd=folder, follow_symlinks=False).decode("utf-8")
    return None


def strict_json(text: Optional[str]) -> Any:
    """The JSON, None where it is not (nor NaN or Infinity, which the merge never writes: ``int`` refuses them)."""
    with contextlib.suppress(ValueError, RecursionError):
        return json.loads(text or "", parse_constant=int)
    return None


def readable_statistics(data: Any) -> Any:
    """``data`` where the statistics file's reader (``statistics_from_dict``) takes it, else None."""
    with contextlib.suppress(Exception):  # whatever a stranger's file makes the reader raise: it does not take it
        statistics_from_dict(data)
        return data
    return None


class Parsed(NamedTuple):
    """The naming files as far as they parse (None: absent, or in ``errors``, why a card or recipe does not)."""

    card: Optional[Card]
    recipe: Optional[list[str]]  # its model paths
    statistics: Any  # the object the statistics reader takes
    quoted: list[str]  # the model paths of the recipe the card quotes
    errors: dict[str, str]


def parse(texts: dict[str, Optional[str]]) -> Parsed:
    """The naming files (None: absent) parsed as a stranger's, bounded."""
    (card_text, recipe_text, statistics_text), card, recipe, quoted = (texts[n] for n in NAMING_FILES), None, None, []
    errors: dict[str, str] = {}
    try:
        card = read_card(card_text) if card_text is not None else None
    except bounded_yaml.UnreadableYaml as error:
        errors[CARD] = str(error)
    try:
        recipe = recipe_paths(recipe_text) if recipe_text is not None else None
    except bounded_yaml.UnreadableYaml as error:
        errors[RECIPE] = str(error)
    data = strict_json(statistics_text)
    block = RECIPE_BLOCK.search(card.body) if card is not None else None
    with contextlib.suppress(bounded_yaml.UnreadableYaml):
        quoted = recipe_paths(block[1]) if block is not None else []
    return Parsed(card, recipe, readable_statistics(data), quoted, errors)


def folder_paths(files: Parsed) -> list[list[str]]:
    """The model paths each place names: the recipe, the recipe the card quotes, the statistics, ``base_model``."""
    base_model = listed((files.card.metadata or {}).get("base_model")) if files.card is not None else []
    statistics = [path for name in statistics_models(files.statistics) for path in reference_paths(name)]
    return [files.recipe or [], files.quoted, statistics, [name for name in base_model if isinstance(name, str)]]


def all_paths(places: list[list[str]]) -> list[str]:
    return list(dict.fromkeys(path for paths in places for path in paths if path))


def renames_for(places: list[list[str]], hub_ids: dict[str, str], out: str) -> dict[str, str]:
    """{path as the folder names it: Hub id} for each local path; refused where a local model has no id, an id names
    no model of the folder, or one place (the recipe, say) would name two models by one id."""
    paths = all_paths(places)
    renames = {path: hub_ids[resolved(path)] for path in paths if resolved(path) in hub_ids}
    if missing := [path for path in paths if is_local(path) and path not in renames]:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""  # five named at most
        raise MergedFolderError(
            f"{out} names local models without a Hub id: {', '.join(missing[:5])}{more}; give each one: --hub-id "
            f"{missing[0]}=ORG/NAME (or a --hub-id-file of them all); nothing was changed"
        )
    named, local = {hub_path(renames.get(path, path)) for path in paths}, [path for path in paths if is_local(path)]
    for path, hub_id in hub_ids.items():
        if hub_id not in renames.values() and hub_path(hub_id) not in named:  # else applied by an earlier run
            raise MergedFolderError(
                f"--hub-id {path}={hub_id}: {out} names no model at {path} (its local models: "
                f"{', '.join(local) or 'none'}); nothing was changed"
            )
    for place in places:
        owners: dict[str, str] = {}
        for path in place:
            if resolved(other := owners.setdefault(renames.get(path, path), path)) != resolved(path):
                raise MergedFolderError(
                    f"{other} and {path} would both be named {renames.get(path, path)}: give each model its own Hub "
                    "id; nothing was changed"
                )
    return renames


def prepared_texts(
    texts: dict[str, Any], out: str, hub_ids: dict[str, str], license_id: Optional[str]
) -> dict[str, str]:
    """The naming files that the Hub ids and the licence change, as they make them."""
    files = parse(texts)
    if files.errors:
        raise MergedFolderError(
            f"cannot change {out}: {next(iter(files.errors.values()))}; fix it by hand or merge again"
        )
    if texts[STATISTICS_FILE] is not None and files.statistics is None:
        raise MergedFolderError(
            f"cannot change {out}: {STATISTICS_FILE} is not the statistics a merge writes: merge again"
        )
    renames = renames_for(folder_paths(files), hub_ids, out) if hub_ids else {}
    new = {**texts, RECIPE: renamed_recipe(texts[RECIPE], renames) if texts[RECIPE] is not None else None}
    renamed = renamed_statistics(files.statistics, renames)
    if readable_statistics(renamed) is None and files.statistics is not None:
        raise MergedFolderError(f"renaming the models of {out}/{STATISTICS_FILE} breaks it: report it as a bug")
    if renamed != files.statistics:
        new[STATISTICS_FILE] = json.dumps(renamed, indent=2, allow_nan=False) + "\n"  # as the merge writes it
    card = files.card
    if card is not None and renames:
        ids = sorted({hub_path(hub_id) for hub_id in renames.values()})
        listed_ids = [
            n for n in listed((card.metadata or {}).get("base_model")) if isinstance(n, str) and not is_local(n)
        ]
        metadata = merge_metadata(
            {**(card.metadata or {}), "base_model": [n for n in listed_ids if n not in renames] + ids}
        )
        card = Card(metadata, renamed_body(card.body, renames, ids), card.line_break)
    if license_id is not None and card is None:
        raise MergedFolderError(
            f"cannot set the licence of {out}: there is no {CARD} (merge with mergekit-yaml, which writes the card)"
        )
    if license_id is not None and card is not None:
        card = card._replace(metadata={**(card.metadata or {}), "license": license_id})
    new[CARD] = card.text() if card is not files.card and card is not None else texts[CARD]
    return {name: text for name, text in new.items() if text is not None and text != texts[name]}


def prepare_for_hub(out: str, pairs: list[tuple[str, str]], license_id: Optional[str]) -> list[str]:
    """The Hub ids and the licence written, all or nothing, under the merge's own lock (``staging.replace_files``,
    refused if the files changed since they were read under it); the files changed. Everything is checked first."""
    hub_ids: dict[str, str] = {}
    for local, hub_id in pairs:
        if (given := hub_ids.setdefault(resolved(local), hub_id)) != hub_id:
            raise MergedFolderError(f"{local} is given two Hub ids, {given} and {hub_id}: give it one")
    with folder_writer(out) as folder:
        texts = {}
        for name in NAMING_FILES:
            try:
                texts[name] = read_text(folder, name)
            except UNREADABLE as error:
                message = f"cannot read {out}/{name} ({reason(error)}): replace it with the merge's own"
                raise MergedFolderError(message) from None
        new = prepared_texts(texts, out, hub_ids, license_id)
    changed = [name for name in (STATISTICS_FILE, RECIPE, CARD) if name in new]
    if changed:
        replace_files(out, {name: new[name] for name in changed}, expected=texts)
    return changed
