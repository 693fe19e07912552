"""The gateway's suspect rules (``controller.suspects``) as pure decisions, and the file its workers share them
through (``gateway.suspectjournal``), on real files."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import pytest

from hotweights.controller.suspects import (
    MEMORY,
    Kind,
    Outcome,
    Record,
    Rule,
    SuspectLimits,
    SuspectTable,
    client_wait,
    is_started,
    refusal,
    stall_outcome,
)
from hotweights.gateway.discovery import Upstream
from hotweights.gateway.metrics import GatewayMetrics
from hotweights.gateway.suspectguard import Stall, SuspectGuard, Tracked
from hotweights.gateway.suspectjournal import SuspectJournal, encode

LIMITS = SuspectLimits(suspect_after=2, suspect_ttl_s=3600.0, client_failures=2, client_window_s=60.0)
NO_CLIENT_BOUND = SuspectLimits(suspect_after=2, suspect_ttl_s=3600.0, client_failures=0, client_window_s=60.0)


def unanswered(digest: str, *failures: str, client: str = "c", at: float = 0.0) -> Record:
    return Record(Kind.UNANSWERED, at, digest=digest, client=client, failures=failures)


def answered(digest: str, at: float = 0.0) -> Record:
    return Record(Kind.ANSWERED, at, digest=digest)


def table(*records: Record, limits: SuspectLimits = LIMITS) -> SuspectTable:
    suspects = SuspectTable(limits)
    for record in records:
        suspects.apply(record)
    return suspects


@pytest.mark.unit
@pytest.mark.parametrize(
    ("own", "body", "client", "limits", "rule"),
    [
        # A first failure alone never refuses: the only request in flight at a crash (one client at low load), or
        # the newest, sent just before it, is re-sent like any other; so is one whose client lost one engine.
        (1, 1, 1, LIMITS, None),
        (2, 2, 2, LIMITS, Rule.FAILURES),  # in flight at two failures: no third engine
        (0, 2, 0, LIMITS, Rule.BODY),  # on arrival, a body two engines failed with: refused at once
        (1, 2, 1, LIMITS, Rule.BODY),  # the same body failed an engine before, in another request
        (0, 1, 0, LIMITS, None),  # one failure with that body: sent
        (0, 0, 2, LIMITS, Rule.CLIENT),  # a client whose requests two engines failed with, unanswered
        (1, 1, 2, LIMITS, Rule.CLIENT),  # a re-send that would bring its client to the bound
        (0, 0, 9, NO_CLIENT_BOUND, None),  # client_failures = 0: no client bound
        (2, 0, 0, NO_CLIENT_BOUND, Rule.FAILURES),
    ],
)
def test_which_rule_refuses_a_request(own: int, body: int, client: int, limits: SuspectLimits, rule: Rule) -> None:
    assert refusal(own, body, client, limits) is rule


@pytest.mark.unit
@pytest.mark.parametrize(
    ("times", "now", "wait"),
    [
        ([], 10.0, 0.0),
        ([5.0], 10.0, 0.0),  # below the bound
        ([5.0, 8.0], 10.0, 55.0),  # at it: until the older leaves the 60 s window
        ([1.0, 5.0, 8.0], 10.0, 55.0),  # beyond it: until two have left
        ([8.0, 5.0, 1.0], 10.0, 55.0),  # in any order
    ],
)
def test_how_long_a_client_at_its_bound_waits(times: list[float], now: float, wait: float) -> None:
    assert client_wait(times, now, LIMITS) == pytest.approx(wait)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("answer_began", "streamed", "started"),
    [
        (False, True, False),  # a stream cut before its headers only waited for its slots: the failure is not its
        (True, True, True),  # its headers came: the engine had started it
        (True, False, True),  # a whole reply's headers come with its end
        (False, False, True),  # a whole reply without headers may have started all the same
    ],
)
def test_whether_a_failure_counts_against_the_request_in_flight(
    answer_began: bool, streamed: bool, started: bool
) -> None:
    assert is_started(answer_began, streamed) is started


@pytest.mark.unit
@pytest.mark.parametrize(
    ("answered_at", "pid_now", "gone_at", "outcome"),
    [
        (0.0, 7, 0.0, Outcome.UNRESOLVED),  # no probe answered nor refused since the stall
        (5.0, 7, 0.0, Outcome.UNRESOLVED),  # answered before it only
        (11.0, 7, 0.0, Outcome.CLEARED),  # the same process answered again: it was slow (a probe timed out on a load)
        (11.0, 8, 0.0, Outcome.FAILED),  # another process answers there: the stalled one was fenced and replaced
        (0.0, 7, 11.0, Outcome.FAILED),  # nothing listens any more: fenced
        (12.0, 7, 11.0, Outcome.FAILED),  # gone, whatever answered after
    ],
)
def test_what_a_stall_turns_out_to_be(answered_at: float, pid_now: int, gone_at: float, outcome: Outcome) -> None:
    assert stall_outcome(7, 10.0, answered_at, pid_now, gone_at) is outcome


@pytest.mark.unit
def test_a_stall_counts_once_resolved_or_expired() -> None:
    """Stalls stay aside until their engine is gone (a failure) or answers again as the same process (forgotten);
    at the deadline those still unresolved count."""
    gone, slow, hung = (Upstream(f"http://{name}", pid=7) for name in ("gone", "slow", "hung"))
    tracked = Tracked("d", 1, "c")
    for upstream in (gone, slow, hung):
        tracked.stalls[f"{upstream.url} pid 7"] = Stall(upstream, 7, 10.0, f"{upstream.url} stopped answering")
    gone.gone_at, slow.answered_at = 11.0, 11.0
    tracked.resolve(expired=False)
    assert list(tracked.failures) == ["http://gone pid 7"] and list(tracked.stalls) == ["http://hung pid 7"]
    tracked.resolve(expired=True)
    assert list(tracked.failures) == ["http://gone pid 7", "http://hung pid 7"] and not tracked.stalls


@pytest.mark.unit
@pytest.mark.parametrize(
    ("known", "failure", "refused"),
    [
        ([], "cut", False),  # a first failure: sent again
        ([unanswered("d", "a", client="other")], "cut", True),  # with one its body had already: not
        ([unanswered("d", "a", "b", client="other")], "slow", True),  # its body became suspect meanwhile
        ([unanswered("e", "a", "b")], "slow", True),  # its client reached its bound meanwhile
        ([unanswered("d", "a", client="other")], "gone", True),  # a stall that would decide: the engine is gone
        ([unanswered("d", "a", client="other")], "slow", False),  # ... the same process answers again: only slow
    ],
)
def test_whether_a_request_is_sent_again_after_a_failure(known: list[Record], failure: str, refused: bool) -> None:
    """A cut counts at once; a stall (the engine stopped answering its probes) once resolved, when it decides."""

    async def decide() -> str | None:
        guard = SuspectGuard(LIMITS, SuspectJournal(None), GatewayMetrics())
        for record in known:
            guard.table.apply(replace(record, at=time.time()))  # the guard decides on the wall clock
        tracked, deadline = Tracked("d", 1, "c"), time.monotonic() + 5
        if failure == "cut":
            return await guard.on_failure(tracked, "http://e pid 7", "cut", deadline)
        upstream = Upstream("http://e", pid=7)
        resolved_at = time.monotonic() + 1  # by the time it is looked at
        upstream.gone_at, upstream.answered_at = (resolved_at, 0.0) if failure == "gone" else (0.0, resolved_at)
        return await guard.on_failure(tracked, "http://e pid 7", "stopped answering", deadline, upstream)

    message = asyncio.run(decide())
    assert (message is not None) is refused, message
    assert message is None or message.startswith("not re-sent: ")


@pytest.mark.unit
def test_a_request_of_death_sent_twice_costs_two_engines() -> None:
    """The first is re-sent once, then refused; the second, same body, is refused on arrival, whoever sends it."""
    suspects = table()
    assert suspects.on_arrival("d", "c1", 0.0) is None
    assert suspects.on_failure(["a pid 1"], "d", "c1", 1.0) is None  # re-sent
    assert suspects.on_failure(["a pid 1", "b pid 2"], "d", "c1", 2.0) is Rule.FAILURES
    suspects.apply(unanswered("d", "a pid 1", "b pid 2", client="c1", at=2.0))
    assert suspects.on_arrival("d", "c2", 3.0) is Rule.BODY
    assert suspects.on_arrival("d", "c2", 3602.5) is None  # both failures older than suspect_ttl_s
    assert suspects.on_arrival("other", "c2", 3.0) is None


@pytest.mark.unit
@pytest.mark.parametrize(
    ("records", "rule"),
    [
        ([unanswered("d", "a"), unanswered("d", "b", client="c2")], Rule.BODY),  # two requests, one failure each
        ([unanswered("d", "a"), unanswered("d", "a", client="c2")], None),  # one failure, two requests there
        ([unanswered("d", "a", "b"), unanswered("d", "a", "b")], Rule.BODY),  # a record applied twice
        ([answered("d"), unanswered("d", "a", "b")], None),  # an engine answered it: not what killed them
        ([unanswered("d", "a", "b"), answered("d")], None),
        ([answered("d", at=-3600.0), unanswered("d", "a", "b")], Rule.BODY),  # answered too long ago
        ([unanswered("d", "a", at=-3600.0), unanswered("d", "b", client="c2")], None),  # a failure too long ago
    ],
)
def test_when_a_body_is_suspect(records: list[Record], rule: Rule | None) -> None:
    assert table(*records).on_arrival("d", "c3", 0.5) is rule


@pytest.mark.unit
@pytest.mark.parametrize(
    ("records", "digest", "now", "rule"),
    [
        ([unanswered("d", "a", "b")], "new body", 1.0, Rule.CLIENT),  # whatever it sends next
        ([unanswered("d1", "a"), unanswered("d2", "b")], "new body", 1.0, None),  # two requests, one each: an outage
        ([unanswered("d1", "a", "b"), unanswered("d2", "c")], "new body", 1.0, Rule.CLIENT),  # one was in flight at two
        ([unanswered("d1", "a"), unanswered("d2", "a")], "new body", 1.0, None),  # one failure twice
        ([unanswered("d", "a", "b")], "new body", 60.5, None),  # the window has passed
        ([unanswered("d", "a", "b"), answered("known")], "known", 1.0, None),  # a body an engine answered passes
        ([unanswered("d", "a", "b", client="other")], "new body", 1.0, None),  # another client's
        ([answered("d1"), unanswered("d1", "a", "b")], "new body", 1.0, None),  # an answered body counts for no one
    ],
)
def test_when_a_client_is_refused(records: list[Record], digest: str, now: float, rule: Rule | None) -> None:
    assert table(*records).on_arrival(digest, "c", now) is rule


@pytest.mark.unit
def test_a_re_send_counts_its_own_failures_with_those_of_its_body_and_client() -> None:
    """One failure of its own, one of its body's from an earlier request: not re-sent; the same for a client one of
    whose requests was in flight at two (not one left unanswered by an outage); a body an engine answered is refused
    by its own failures only (rule 1), a drill's load in a storm."""
    assert table(unanswered("d", "a", client="x")).on_failure(["b"], "d", "c", 1.0) is Rule.BODY
    assert table(unanswered("e", "a", "b")).on_failure(["c"], "d", "c", 1.0) is Rule.CLIENT
    assert table(unanswered("e", "a")).on_failure(["b"], "d", "c", 1.0) is None  # an outage's unanswered request
    assert table(unanswered("d", "a")).on_failure(["a"], "d", "c", 1.0) is None  # the same failure
    popular = table(answered("d"), unanswered("d", "a", "b"))
    assert popular.on_failure(["c"], "d", "c", 1.0) is None
    assert popular.on_failure(["b", "c"], "d", "c", 1.0) is Rule.FAILURES


@pytest.mark.unit
def test_the_memory_is_bounded_and_forgets_the_oldest_first() -> None:
    suspects = table(*(unanswered(f"d{i}", "a", "b", client=f"c{i}") for i in range(MEMORY + 1)))
    assert len(suspects.bodies) == len(suspects.clients) == MEMORY
    assert suspects.on_arrival("d0", "c0", 1.0) is None
    assert suspects.on_arrival(f"d{MEMORY}", "new client", 1.0) is Rule.BODY


def test_workers_share_records_through_the_journal(tmp_path: Path) -> None:
    """What one worker appends, another reads (each line once); a worker that starts later reads it all, the
    rotated file included; a line cut short is skipped."""
    path = tmp_path / "state" / "gateway-suspects.jsonl"
    one, two = SuspectJournal(path, max_bytes=300), SuspectJournal(path, max_bytes=300)
    assert two.read_new() == []
    records = [unanswered(f"d{i}", "http://127.0.0.1:1 pid 7", at=float(i)) for i in range(4)]
    for record in records[:2]:
        one.append(record)
    assert two.read_new() == records[:2]
    assert two.read_new() == []
    for record in records[2:]:
        one.append(record)  # the file passed 300 bytes: it rotated to .1
    assert path.with_name(path.name + ".1").exists()
    assert two.read_new() == records[2:]
    with open(path, "ab") as out:
        out.write(b'{"kind": "failed", "at"\n')
    assert SuspectJournal(path).read_new() == records


def test_records_a_failed_write_kept_are_written_with_the_next(tmp_path: Path) -> None:
    """A journal that cannot be written (a directory in its place here, as EIO or a full disk would) loses nothing
    that fits in memory: the next append writes it first."""
    path = tmp_path / "gateway-suspects.jsonl"
    journal = SuspectJournal(path)
    path.mkdir()
    journal.append(unanswered("d", "a"))
    assert journal.failing
    path.rmdir()
    journal.append(unanswered("d", "b"))
    assert journal.failing == ""
    assert path.read_bytes() == encode(unanswered("d", "a")) + encode(unanswered("d", "b"))
