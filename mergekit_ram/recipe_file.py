"""Recipe files read as mergekit's scripts read them (one document, or ``mergekit-multi``'s stages), with a
one-line ``RecipeError`` naming the file, the place and the fix instead of a yaml, recursion or pydantic traceback.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import yaml
from pydantic import BaseModel, ValidationError

from mergekit_ram.errors import RecipeError


@dataclass(frozen=True)
class Stage:
    """One document of a recipe file; ``depends_on``: the earlier stages whose output it merges."""

    name: Optional[str]
    config: Any  # mergekit.config.MergeConfiguration, model paths of earlier stages resolved
    depends_on: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return self.name if self.name is not None else "(unnamed final stage)"


#: The deepest nesting a recipe may have (it needs about ten): far deeper YAML exhausts Python's recursion in
#: yaml's composer and in validation, so it is refused first, from the parser's events.
MAX_NESTING = 64


class _Scan(NamedTuple):
    methods: list[str]  # each document's ``merge_method`` scalar as spelt (no merge keys, no aliases)
    too_deep: Optional[yaml.Mark]  # where the nesting goes beyond MAX_NESTING (the scan stops there)
    complete: bool  # every event parsed: no syntax error, not too deep


def _scan(text: str) -> _Scan:
    """The parser's events while the text is valid YAML, stopped past MAX_NESTING (a token costs time per level)."""
    methods: list[str] = []
    open_nodes: list[Optional[int]] = []  # per open collection: nodes read so far in a mapping, None in a list
    key: Optional[str] = None
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.CollectionEndEvent):
                open_nodes.pop()
            elif isinstance(event, yaml.NodeEvent):
                read = open_nodes[-1] if open_nodes else None
                if read is not None:
                    open_nodes[-1] = read + 1
                    scalar = event.value if isinstance(event, yaml.ScalarEvent) else None
                    if len(open_nodes) == 1 and read % 2 == 0:
                        key = scalar
                    elif len(open_nodes) == 1 and key == "merge_method" and scalar is not None:
                        methods.append(scalar)
                if isinstance(event, yaml.CollectionStartEvent):
                    open_nodes.append(0 if isinstance(event, yaml.MappingStartEvent) else None)
                    if len(open_nodes) > MAX_NESTING:
                        return _Scan(methods, event.start_mark, complete=False)
    except yaml.YAMLError:
        return _Scan(methods, None, complete=False)
    return _Scan(methods, None, complete=True)


def declared_methods(text: str) -> list[str]:
    """Each document's ``merge_method`` as ``yaml.safe_load`` reads it; else as spelt while the text is valid."""
    scan = _scan(text)
    if scan.complete:
        try:
            documents = list(yaml.safe_load_all(text))
        except (yaml.YAMLError, ValueError):  # what the events do not show: an undefined alias, a bad value
            return scan.methods
        return [
            document["merge_method"]
            for document in documents
            if isinstance(document, dict) and isinstance(document.get("merge_method"), str)
        ]
    return scan.methods


def read_text(path: str) -> Optional[str]:
    """The file's text, or None where it cannot be read (mergekit reports that itself)."""
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError):
        return None


def read_documents(path: str, text: str) -> list[Any]:
    """The non-empty YAML documents of a recipe file; one nested beyond ``MAX_NESTING`` is refused first."""
    too_deep = _scan(text).too_deep
    if too_deep is not None:
        raise RecipeError(
            f"{path}: lists or mappings nested more than {MAX_NESTING} levels deep at line {too_deep.line + 1}, "
            f"column {too_deep.column + 1}; a recipe needs about ten: check the brackets or the indentation there"
        )
    try:
        documents = list(yaml.safe_load_all(text))
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        parts = (getattr(error, "context", None), getattr(error, "problem", None))
        detail = ", ".join(part for part in parts if part) or str(error)
        raise RecipeError(f"{path}: invalid YAML{where}: {detail}") from error
    except ValueError as error:  # a value yaml cannot convert (a date 2020-13-45, ``!!int abc``)
        raise RecipeError(f"{path}: invalid YAML: a value cannot be read ({error})") from error
    return [document for document in documents if document is not None]


def validate(path: str, document: Any, schema: type[BaseModel], where: str = "") -> Any:
    """``schema.model_validate(document)``, its first errors on one line on refusal."""
    try:
        return schema.model_validate(document)
    except ValidationError as error:
        problems = error.errors(include_url=False)
        shown = [
            f"{'.'.join(str(part) for part in problem['loc']) or 'the document'}: {problem['msg']}"
            for problem in problems[:3]
        ]
        more = len(problems) - len(shown)
        suffix = f" (and {more} more)" if more > 0 else ""
        raise RecipeError(f"{path}{where}: not a valid mergekit recipe: {'; '.join(shown)}{suffix}") from None


def stage_output(intermediate_dir: str, name: str) -> Optional[str]:
    """The finished output of an earlier stage under ``intermediate_dir``, if it is there."""
    path = os.path.join(intermediate_dir, name)
    return path if intermediate_dir and os.path.exists(os.path.join(path, "config.json")) else None
