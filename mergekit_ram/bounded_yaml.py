"""YAML from strangers' folders (a card's front matter, a recipe beside merged weights), read within bounds.

``yaml.safe_load`` runs away on such text: nine levels of ten aliases are 10**9 values to whatever walks the result
(a 2.5 KB card took 67 s and 1.8 GB to a ``MemoryError``), nesting exhausts the recursive composer, and a date that
is not one (``2024-13-01``) raises a ``ValueError``. Here size, nesting and values (each alias counted as the node
it names) are bounded while composing, before anything is constructed; dates stay text; a refusal is one line.
"""

from __future__ import annotations

from typing import Any

import yaml

from mergekit_ram.errors import RamError, one_line

MAX_CHARACTERS = 1 << 20  # the longest text read: a card's front matter or a recipe is a few KB
MAX_NESTING = 64  # lists or mappings inside each other (a recipe needs about ten, a front matter three)
MAX_NODES = 100_000  # values of a document once each alias is counted as the node it names


class UnreadableYaml(RamError, ValueError):
    """Text that is not YAML, or that exceeds a bound; the message says which and where."""


class TextDatesLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that reads an unquoted date as text and bounds nesting and values while composing."""

    yaml_implicit_resolvers = {
        first: [(tag, pattern) for tag, pattern in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.opened: list[yaml.Event] = []  # the start events of the collections being composed
        self.sizes: dict[int, int] = {}  # id(node) -> its values, aliases expanded

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        named = [opened for opened in self.opened if opened.anchor == event.anchor]
        if isinstance(event, yaml.AliasEvent) and named:
            raise UnreadableYaml(f"has an alias inside the node it names, near line {named[0].start_mark.line + 1}")
        nested = isinstance(event, yaml.CollectionStartEvent)
        if nested and len(self.opened) == MAX_NESTING:
            mark = event.start_mark
            raise UnreadableYaml(
                f"nests lists or mappings more than {MAX_NESTING} levels deep at line {mark.line + 1}, column "
                f"{mark.column + 1}"
            )
        self.opened += [event] * nested
        node = super().compose_node(parent, index)
        del self.opened[len(self.opened) - nested :]
        if id(node) not in self.sizes:  # else an alias
            pairs = node.value if isinstance(node, yaml.MappingNode) else []
            children = (
                node.value if isinstance(node, yaml.SequenceNode) else [child for pair in pairs for child in pair]
            )
            self.sizes[id(node)] = 1 + sum(self.sizes[id(child)] for child in children)
            if self.sizes[id(node)] > MAX_NODES:
                raise UnreadableYaml(
                    f"expands to more than {MAX_NODES:,} values through its aliases (*name) near line "
                    f"{node.start_mark.line + 1}"
                )
        return node


def compose(text: str, what: str) -> list[yaml.Node]:
    """The documents' node graphs (an alias is the node it names), within the bounds."""
    if len(text) > MAX_CHARACTERS:
        raise UnreadableYaml(f"{what} is {len(text):,} characters, more than the {MAX_CHARACTERS:,} read at most")
    try:
        return list(yaml.compose_all(text, Loader=TextDatesLoader))
    except yaml.YAMLError as error:
        raise UnreadableYaml(f"{what} is not valid YAML ({_place(error)})") from None
    except UnreadableYaml as error:
        raise UnreadableYaml(f"{what} {error}") from None


def load(text: str, what: str) -> list[Any]:
    """The documents' values (``yaml.safe_load_all``'s, dates as text), within the bounds."""
    documents, loader = compose(text, what), TextDatesLoader("")
    try:
        return [loader.construct_document(node) for node in documents]
    except (yaml.YAMLError, ValueError, TypeError, OverflowError) as error:  # ``!!int x``, ``!!timestamp 2024-13-01``
        raise UnreadableYaml(f"{what} has a value that cannot be read ({_place(error)})") from None
    finally:
        loader.dispose()


def load_one(text: str, what: str) -> Any:
    """The single document's value (None for empty text); more than one document is refused."""
    documents = load(text, what)
    if len(documents) > 1:
        raise UnreadableYaml(f"{what} holds {len(documents)} YAML documents; one is expected")
    return documents[0] if documents else None


def _place(error: BaseException) -> str:
    """The parser's problem and line, on one line."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or one_line(error)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem
