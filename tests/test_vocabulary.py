"""One owner per word: event kinds, roles, states, engine kinds and failover kinds are enum members in the product,
never string literals outside their enum's definition.

The check reads every product module's syntax tree and looks where such a word decides something: a comparison
(``kind == "failover"``, ``x in ("fence", "promote")``), an event's kind (``events.record("fence", ...)``), a
``match`` case, and a value given to a field of that name (``kind=``, ``role=``, ``state=``, ``engine=``,
``mode=``: as a keyword, a dict entry, a ``.get`` default, a parameter's, a class field's or a flag's default). A
literal there that spells one of the enums' values fails, naming the file, the line and the member to use.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path

import pytest

from hotweights.contract import Role, State
from hotweights.engines import Engine
from hotweights.eventkinds import EventKind, FailoverKind

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("hotweights", "cache", "standby", "controller", "gateway", "chaos")
ENUMS: tuple[type[StrEnum], ...] = (EventKind, FailoverKind, Role, State, Engine)
FIELDS = frozenset({"kind", "mode", "role", "state", "engine"})  # names whose values are words of ENUMS


def owners(value: str) -> list[str]:
    """The members that spell ``value`` (``EventKind.FAILOVER``), none when it is no enum's word."""
    return [f"{enum.__name__}.{enum(value).name}" for enum in ENUMS if value in enum._value2member_map_]


def strings(node: ast.AST | None) -> Iterator[ast.Constant]:
    """The string constants ``node`` is, or holds as a tuple, list or set, or as an ``a if c else b``'s branch."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node
    elif isinstance(node, ast.Tuple | ast.List | ast.Set):
        for element in node.elts:
            yield from strings(element)
    elif isinstance(node, ast.IfExp):
        yield from strings(node.body)
        yield from strings(node.orelse)


def is_field(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value in FIELDS


def deciding_strings(tree: ast.AST) -> Iterator[ast.Constant]:
    """Every string constant ``tree`` uses where a word of ENUMS decides something (module docstring)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                yield from strings(operand)
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else None
            if name == "record" and node.args:
                yield from strings(node.args[0])
            if name == "get" and len(node.args) == 2 and is_field(node.args[0]):
                yield from strings(node.args[1])
            flag = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
            for keyword in node.keywords:  # kind=..., and a command line's --role flag's default=...
                if keyword.arg in FIELDS or (keyword.arg == "default" and str(flag).removeprefix("--") in FIELDS):
                    yield from strings(keyword.value)
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if is_field(key):
                    yield from strings(value)
        elif isinstance(node, ast.MatchValue) or (
            isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in FIELDS
        ):
            yield from strings(node.value)
        elif isinstance(node, ast.arguments):
            positional = [*node.posonlyargs, *node.args]
            pairs = [*zip(positional[len(positional) - len(node.defaults) :], node.defaults, strict=True)]
            pairs += [(arg, default) for arg, default in zip(node.kwonlyargs, node.kw_defaults, strict=True)]
            for arg, default in pairs:
                if arg.arg in FIELDS:
                    yield from strings(default)


def enum_bodies(tree: ast.AST) -> set[int]:
    """The ids of the constants that define an enum's members (a class deriving from an Enum)."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any("Enum" in ast.unparse(base) for base in node.bases):
            inside |= {id(c) for c in ast.walk(node) if isinstance(c, ast.Constant)}
    return inside


def literal_words(source: str) -> list[tuple[int, str, list[str]]]:
    """(line, literal, the members to use instead) for each enum word ``source`` writes as a literal."""
    tree = ast.parse(source)
    defining = enum_bodies(tree)
    found = {(c.lineno, c.value, tuple(owners(c.value))) for c in deciding_strings(tree) if id(c) not in defining}
    return sorted((line, value, list(members)) for line, value, members in found if members)


def test_no_product_module_writes_an_enum_word_as_a_string() -> None:
    modules = sorted(path for package in PRODUCT for path in (REPO / package).rglob("*.py"))
    assert len(modules) > 100
    found = [
        f"{path.relative_to(REPO)}:{line}: {value!r} (use {' or '.join(members)})"
        for path in modules
        for line, value, members in literal_words(path.read_text())
    ]
    assert not found, "enum words written as strings:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ('events.record("fence", "fenced")', [(1, "fence", ["EventKind.FENCE"])]),
        (
            'if event["kind"] in ("failover", "switchover"): pass',
            [
                (1, "failover", ["EventKind.FAILOVER"]),
                (1, "switchover", ["EventKind.SWITCHOVER", "FailoverKind.SWITCHOVER"]),
            ],
        ),
        ('ok = member.state == "ready"', [(1, "ready", ["State.READY"])]),
        ('run(kind="forced")', [(1, "forced", ["FailoverKind.FORCED"])]),
        ('row = {"role": "standby"}', [(1, "standby", ["Role.STANDBY"])]),
        ('def f(engine: str = "vllm"): pass', [(1, "vllm", ["Engine.VLLM"])]),
        ('role = row.get("role", "primary")', [(1, "primary", ["Role.PRIMARY"])]),
        ('p.add_argument("--role", default="standby")', [(1, "standby", ["Role.STANDBY"])]),
        ("class Mode(StrEnum):\n    FENCE = 'fence'", []),  # an enum's own definition
        ('print("fence"); parser.add_parser("switchover")', []),  # words that decide nothing
        ('if name == "hotweights": pass', []),  # a string no enum spells
    ],
)
def test_the_check_finds_enum_words_where_they_decide(source: str, found: list) -> None:
    """Each position the check reads, and what it leaves alone."""
    assert literal_words(source) == found
