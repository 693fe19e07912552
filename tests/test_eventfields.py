"""Every event carries only the fields its kind declares (``hotweights.eventkinds``).

The check reads every product module's syntax tree for ``record(EventKind.X, message, field=...)`` calls and
looks at each field given by name, or in a dict literal spread into the call (``**({"fill_ms": ...} if fill
else {})``): one that its kind (each kind, for ``EventKind.A if c else EventKind.B``) does not declare fails,
naming the file and the line. A kind known only at run time (``change.kind``) must still be given fields some
kind declares; fields spread from a variable (``**timings``) are checked by ``EventLog.record`` itself, which
refuses an undeclared field whatever the writer.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args, get_origin

import pytest

from hotweights.controller.events import EventLog
from hotweights.controller.redundancy import Redundancy, Tracker
from hotweights.eventkinds import EventField, EventKind, FailoverKind, undeclared

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("hotweights", "cache", "standby", "controller", "gateway", "chaos")
EVERY_FIELD = frozenset().union(*(kind.fields for kind in EventKind))


def kinds(node: ast.expr) -> list[EventKind] | None:
    """The kinds ``node`` names (``EventKind.X``, a string, either branch of an ``a if c else b``); None when it
    is known only at run time."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == EventKind.__name__:
        return [EventKind[node.attr]]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [EventKind(node.value)]
    if isinstance(node, ast.IfExp):
        body, orelse = kinds(node.body), kinds(node.orelse)
        return None if body is None or orelse is None else body + orelse
    return None


def spread_names(node: ast.expr) -> Iterator[str]:
    """The keys of the dict literals ``node`` is (either branch of an ``a if c else b``); none for a variable."""
    if isinstance(node, ast.Dict):
        yield from (key.value for key in node.keys if isinstance(key, ast.Constant))
    elif isinstance(node, ast.IfExp):
        yield from spread_names(node.body)
        yield from spread_names(node.orelse)


def recorded(tree: ast.AST) -> Iterator[tuple[int, list[EventKind] | None, list[str]]]:
    """(line, its kinds or None, the field names it gives) for each ``.record(kind, ...)`` call of ``tree`` whose
    kind may be an event's: ``EventKind``'s, or any given fields (``stream.record()`` and the like are not)."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "record"):
            continue
        names = [name for kw in node.keywords for name in ([kw.arg] if kw.arg else spread_names(kw.value))]
        found = kinds(node.args[0]) if node.args else None
        if found is not None or names:
            yield node.lineno, found, names


def undeclared_fields(source: str) -> list[tuple[int, str | None, str]]:
    """(line, kind or None when known only at run time, field) for each field a record call gives that its kind
    does not declare (with no kind known: that no kind declares)."""
    found = []
    for line, named, names in recorded(ast.parse(source)):
        if named is None:
            found += [(line, None, name) for name in names if name not in EVERY_FIELD]
        else:
            found += [(line, str(kind), name) for kind in named for name in undeclared(kind, names)]
    return found


def conforms(value: object, value_type: Any) -> bool:
    """Whether ``value`` is of a field's ``value_type`` (a class, a union of classes, or a ``list`` of one)."""
    if get_origin(value_type) is list:
        return isinstance(value, list) and all(conforms(item, get_args(value_type)[0]) for item in value)
    return isinstance(value, value_type)


def product_modules() -> list[Path]:
    return sorted(path for package in PRODUCT for path in (REPO / package).rglob("*.py"))


def test_every_product_record_call_gives_only_fields_its_kind_declares() -> None:
    calls = [call for path in product_modules() for call in recorded(ast.parse(path.read_text()))]
    assert sum(named is not None for _, named, _ in calls) > 40  # the walk sees the writers
    found = [
        f"{path.relative_to(REPO)}:{line}: {kind or 'a kind known at run time'} declares no field {name!r}"
        for path in product_modules()
        for line, kind, name in undeclared_fields(path.read_text())
    ]
    assert not found, "event fields not in hotweights.eventkinds:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ('events.record(EventKind.FENCE, "fenced", member="g0-e0", group=0)', []),
        ('events.record(EventKind.FENCE, "fenced", service="g0-cache")', [(1, "fence", "service")]),
        ('events.record("hung", "hung", service="g0-cache", seq=3)', [(1, "hung", "seq")]),
        (
            'events.record(EventKind.START if again else EventKind.HUNG, "up", duration_ms=1.0)',
            [(1, "hung", "duration_ms")],
        ),
        (
            'events.record(EventKind.HUNG, "up", **({"fill_ms": 1.0} if fill else {}))',
            [(1, "hung", "fill_ms")],
        ),
        ('events.record(EventKind.FENCE, "fenced", member="g0-e0", **timings)', []),  # EventLog.record's to check
        ("events.record(change.kind, change.message, group=0, degraded_s=1.0)", [(1, None, "degraded_s")]),
        ("event.record(stream)", []),
        ("done.record()", []),
    ],
)
def test_undeclared_fields_reads_record_calls(source: str, found: list[tuple[int, str | None, str]]) -> None:
    assert undeclared_fields(source) == found


@pytest.mark.parametrize(
    ("kind", "fields", "refused"),
    [
        (EventKind.DETECT, {"member": "g0-e0", "group": 0, "detect_ms": 1.5, "fence_ms": 0.0}, None),
        (EventKind.CONTROLLER_STOP, {}, None),
        (EventKind.CONTROLLER_START, {"adopted": ["g0-e0", "g0-cache"]}, None),
        (EventKind.FAILOVER, {"group": 0, "mode": FailoverKind.FORCED, "old": None, "new": "g0-e1"}, None),
        (EventKind.MIGRATION, {EventField.REQUEST: "cmpl-1", EventField.TO: "http://127.0.0.1:1"}, None),
        ("detect", {"member": "g0-e0"}, None),  # a kind given as its string
        (EventKind.FENCE, {"member": "g0-e0", "service": "g0-cache"}, "event fence declares no field service"),
        (EventKind.CONTROLLER_STOP, {"seq": 7, "adopted": []}, "event controller_stop declares no field adopted, seq"),
    ],
)
def test_event_log_refuses_a_field_its_kind_does_not_declare(
    kind: EventKind | str, fields: dict[str, Any], refused: str | None
) -> None:
    events = EventLog(None)
    if refused is None:
        assert events.record(kind, "it happened", **fields) == events.events[-1]
        assert events.events[-1].keys() == {"seq", "time", "kind", "message", *fields}
        assert all(conforms(value, EventField(name).value_type) for name, value in fields.items())
    else:
        with pytest.raises(TypeError, match=refused):
            events.record(kind, "it happened", **fields)
        assert not events.events and events.seq == 0


def test_redundancy_changes_give_the_fields_of_their_kind() -> None:
    """The controller records a redundancy change as its kind with ``group``, ``degraded_ms`` and its details."""
    tracker = Tracker(alert_after_s=1.0)
    full, short = Redundancy(0, 2, 2, 0, 0, True), Redundancy(0, 2, 1, 0, 0, True, ("g0-e2 exited",))
    timeline = [(0.0, full), (1.0, short), (3.0, short), (4.0, full)]
    changes = [change for now, state in timeline for change in tracker.observe(now, [state])]
    assert [c.kind for c in changes] == [
        EventKind.REDUNDANCY_LOST, EventKind.REDUNDANCY_ALERT, EventKind.REDUNDANCY_RESTORED
    ]  # fmt: skip
    assert [undeclared(c.kind, {EventField.GROUP, EventField.DEGRADED_MS, *c.details}) for c in changes] == [[]] * 3


def test_every_field_is_carried_by_some_kind_and_its_type_can_be_checked() -> None:
    assert set(EventField) == EVERY_FIELD
    for field in EventField:
        conforms(None, field.value_type)  # a class, a union of classes or a list of one: no TypeError
