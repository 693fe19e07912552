"""Completions in flight survive a failover: the gateway continues them on the next primary.

Unit tests drive ``gateway.migration``'s ledger through cut segments; the process tests run three
engines and the gateway, SIGKILL then SIGSTOP the primary while greedy streams are under way, promote a
standby as a controller would, and compare every text with the uninterrupted reference.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from hotweights.contract import REPLAY_HEADER, Endpoint
from hotweights.gateway.migration import MIGRATED_IDS, Ledger, Migratable, Refusal, StopStrings, plan
from hotweights.httpguard import NO_JSON
from hotweights.requestschema import MAX_STOP_CHARS, MAX_STOP_STRINGS, Invalid
from tests.cachehelpers import wait_until
from tests.conftest import make_checkpoint
from tests.enginehelpers import EngineProcess
from tests.gatewayhelpers import GatewayProcess, metric, write_cluster

MAX_TOKENS = 400
COMPLETION_STREAMS = 24  # greedy; with the chats, the sampled, the stopped and the non-streamed: 32 requests
CHAT_STREAMS = 5
FLAGS = ("--kv-cache-tokens", "512", "--max-batch", "32")
INVARIANT = ("--batch-invariant",)


def body(**fields: object) -> dict:
    return {"prompt": "hi", "max_tokens": 8} | fields


def chat(**fields: object) -> dict:
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8} | fields
    return {k: v for k, v in request.items() if v is not None}


@dataclass(frozen=True)
class Bad:
    """``plan`` refuses the request as an engine would (``Invalid``), naming ``param``."""

    param: str


@pytest.mark.unit
@pytest.mark.parametrize(
    ("method", "path", "value", "expected"),
    [
        ("GET", "/v1/models", NO_JSON, None),
        ("POST", "/v1/embeddings", body(), None),
        ("POST", "/v1/completions", NO_JSON, Refusal.NOT_JSON),  # another content type
        ("POST", "/v1/completions", [1, 2], Refusal.NOT_JSON),  # the engine says what it expects
        ("POST", "/v1/completions", body(n=2), Refusal.SEVERAL_CHOICES),
        ("POST", "/v1/completions", body(best_of=3), Refusal.SEVERAL_CHOICES),
        ("POST", "/v1/completions", body(prompt=["a", "b"]), Refusal.SEVERAL_CHOICES),
        ("POST", "/v1/completions", body(logprobs=2), Refusal.LOGPROBS),
        ("POST", "/v1/completions", body(echo=True), Refusal.ECHO),
        ("POST", "/v1/completions", body(max_tokens="8"), Bad("max_tokens")),
        ("POST", "/v1/completions", body(max_tokens=0), Bad("max_tokens")),
        ("POST", "/v1/completions", body(max_tokens=8.0), Bad("max_tokens")),
        ("POST", "/v1/completions", body(stop=[1]), Bad("stop")),
        ("POST", "/v1/completions", body(stop=[""]), Bad("stop")),
        ("POST", "/v1/completions", body(stop=["a"] * (MAX_STOP_STRINGS + 1)), Bad("stop")),
        ("POST", "/v1/completions", body(stop="a" * (MAX_STOP_CHARS + 1)), Bad("stop")),
        ("POST", "/v1/completions", body(stream="yes"), Bad("stream")),
        ("POST", "/v1/completions", body(stream_options={"include_usage": 1}), Bad("stream_options")),
        ("POST", "/v1/completions", body(return_token_ids=1), Bad("return_token_ids")),
        ("POST", "/v1/completions", body(prompt=[[]]), Bad("prompt")),
        ("POST", "/v1/completions", body(prompt=[[1], []], stop=[1]), Refusal.SEVERAL_CHOICES),  # the engine judges
        ("POST", "/v1/completions", body(prompt=[1, True]), Bad("prompt")),
        ("POST", "/v1/completions", body(prompt=[1] * (MIGRATED_IDS + 1)), Refusal.LONG_PROMPT),
        ("POST", "/v1/completions", body(prompt=[[1] * (MIGRATED_IDS + 1)]), Refusal.LONG_PROMPT),
        ("POST", "/v1/completions", body(stop=[]), Migratable),
        ("POST", "/v1/completions", body(prompt=[1, 2, 3]), Migratable),
        ("POST", "/v1/completions", body(prompt=["one"]), Migratable),
        ("POST", "/v1/completions", body(stream=True, logprobs=None), Migratable),
        ("POST", "/v1/chat/completions", chat(), Migratable),
        ("POST", "/v1/chat/completions", chat(max_tokens=None, max_completion_tokens=9), Migratable),
        ("POST", "/v1/chat/completions", chat(max_tokens=None), Refusal.NO_BUDGET),
        ("POST", "/v1/chat/completions", chat(max_tokens=None, max_completion_tokens="9"), Refusal.MAX_TOKENS),
        ("POST", "/v1/chat/completions", chat(max_tokens="9"), Bad("max_tokens")),
        ("POST", "/v1/chat/completions", chat(stop=["a"] * (MAX_STOP_STRINGS + 1)), Bad("stop")),
        ("POST", "/v1/chat/completions", chat(tools=[]), Refusal.CHAT_FIELDS),
        ("POST", "/v1/chat/completions", chat(n=2), Refusal.SEVERAL_CHOICES),
        ("POST", "/v1/chat/completions", chat(logprobs=True), Refusal.LOGPROBS),
    ],
)
def test_which_requests_migrate(method: str, path: str, value: object, expected: object) -> None:
    decided = plan(method, path, value)
    if isinstance(expected, Bad):
        assert isinstance(decided, Invalid) and decided.param == expected.param, decided
    else:
        assert isinstance(decided, Migratable) if expected is Migratable else decided == expected


def chunk(text: str, ids: list[int], finish: str | None = None, **choice: object) -> dict:
    fields = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "token_ids": ids} | choice
    return {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m", "choices": [fields]}


@pytest.mark.unit
def test_a_cut_continues_from_the_released_tokens_and_drops_text_already_sent() -> None:
    """Segment one sends "ab" (tokens 1, 2 released) then "c" whose token is held back (a possible stop
    string); the continuation regenerates that token, whose "c" the client already has."""
    ledger = Ledger(plan("POST", "/v1/completions", body(max_tokens=6, stream=True)))
    shown = [
        ledger.take(chunk("a", [1], prompt_token_ids=[9, 9])),
        ledger.take(chunk("b", [2])),
        ledger.take(chunk("c", [])),
    ]
    assert [c["choices"][0]["text"] for c in shown] == ["a", "b", "c"]
    assert all("token_ids" not in c["choices"][0] and "prompt_token_ids" not in c["choices"][0] for c in shown)
    continuation = ledger.cut()
    assert continuation["prompt"] == [9, 9, 1, 2] and continuation["max_tokens"] == 4
    assert continuation["return_token_ids"] and continuation["stream"]
    second = {**chunk("cd", [3, 4]), "id": "cmpl-2", "created": 8}
    shown = ledger.take(second)
    assert shown["choices"][0]["text"] == "d" and (shown["id"], shown["created"]) == ("cmpl-1", 7)
    assert ledger.take(chunk("", [], "length"))["choices"][0]["finish_reason"] == "length"
    ledger.take({"id": "cmpl-2", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}})
    assert (ledger.text, ledger.released, ledger.finish_reason) == ("abcd", [1, 2, 3, 4], "length")
    assert ledger.usage() == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}


@pytest.mark.unit
def test_tokens_whose_text_has_not_come_back_are_generated_again_not_replayed() -> None:
    """Tokens 3 and 4 are a character's first bytes (no text yet): the continuation starts after token 2,
    as an uncut run would have, so an engine never decodes a prompt that ends inside a character; the
    usage counts the tokens as the uncut run does."""
    ledger = Ledger(plan("POST", "/v1/completions", body(max_tokens=8, stream=True)))
    for piece in (chunk("a", [1], prompt_token_ids=[9]), chunk("b", [2]), chunk("", [3]), chunk("", [4])):
        ledger.take(piece)
    continuation = ledger.cut()
    assert continuation["prompt"] == [9, 1, 2] and continuation["max_tokens"] == 6
    assert ledger.take({**chunk("é", [3, 4], "length"), "id": "cmpl-2"})["choices"][0]["text"] == "é"
    assert (ledger.text, ledger.released) == ("abé", [1, 2, 3, 4])
    assert ledger.usage()["completion_tokens"] == 4


@pytest.mark.unit
@pytest.mark.parametrize(
    ("released", "expected"),
    [
        (0, {"prompt": "hi", "max_tokens": 3}),  # nothing came back: the request as it was
        (2, {"prompt": [5, 1, 2], "max_tokens": 1}),
        (3, None),  # the budget is spent: the request ends with length
    ],
)
def test_the_continuation_asks_for_the_budget_left(released: int, expected: dict | None) -> None:
    ledger = Ledger(plan("POST", "/v1/completions", body(max_tokens=3)))
    if released:
        ledger.take(chunk("x" * released, list(range(1, released + 1)), prompt_token_ids=[5]))
    continuation = ledger.cut()
    if expected is None:
        assert continuation is None and ledger.finish_reason == "length"
    else:
        assert {k: continuation[k] for k in expected} == expected


@pytest.mark.unit
def test_a_client_that_asked_for_token_ids_gets_them_once_per_request() -> None:
    ledger = Ledger(plan("POST", "/v1/completions", body(return_token_ids=True)))
    first = ledger.take(chunk("a", [1], prompt_token_ids=[5]))["choices"][0]
    assert first["token_ids"] == [1] and first["prompt_token_ids"] == [5]
    ledger.cut()
    again = ledger.take(chunk("b", [2], prompt_token_ids=[5, 1]))["choices"][0]
    assert again["token_ids"] == [2] and "prompt_token_ids" not in again
    assert ledger.whole()["choices"][0] | {"text": ""} == {
        "index": 0,
        "text": "",
        "logprobs": None,
        "finish_reason": None,
        "token_ids": [1, 2],
        "prompt_token_ids": [5],
    }


@pytest.mark.unit
def test_a_chat_continues_as_a_completion_of_its_prompt_ids_and_keeps_its_shape() -> None:
    ledger = Ledger(plan("POST", "/v1/chat/completions", chat(max_completion_tokens=5, stream=True)))
    first = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m", "prompt_token_ids": [5]}
    role = ledger.take(
        first | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": []}]}
    )
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""} and "prompt_token_ids" not in role
    ledger.take(first | {"choices": [{"index": 0, "delta": {"content": "ab"}, "token_ids": [1, 2]}]})
    continuation = ledger.cut()
    assert continuation["prompt"] == [5, 1, 2] and continuation["max_tokens"] == 3
    assert "messages" not in continuation and "max_completion_tokens" not in continuation
    shown = ledger.take(chunk("c", [3], "stop"))
    assert shown["object"] == "chat.completion.chunk" and shown["id"] == "chatcmpl-1"
    assert shown["choices"] == [{"index": 0, "delta": {"content": "c"}, "logprobs": None, "finish_reason": "stop"}]
    whole = ledger.whole()
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"] == {
        "role": "assistant",
        "content": "abc",
    }


@pytest.mark.unit
@pytest.mark.parametrize(
    ("stop", "pieces", "sent", "hit"),
    [
        ((), ["ab", "c"], ["ab", "c"], False),
        (("cd",), ["abc", "de"], ["ab", ""], True),  # "c" held back, then the stop string completes
        (("cd",), ["abc", "x"], ["ab", "cx"], False),  # held back, then let go
        (("xyz", "b"), ["axy", "zb"], ["a", ""], True),  # the first one met ends the text
        (("cd",), ["a", "bcd!"], ["a", "b"], True),
    ],
)
def test_stop_strings_hold_back_what_may_start_one(
    stop: tuple[str, ...], pieces: list[str], sent: list[str], hit: bool
) -> None:
    stops = StopStrings(stop)
    assert [stops.push(piece) for piece in pieces] == sent and stops.hit is hit


@pytest.mark.unit
def test_the_engine_is_asked_without_stop_strings_and_the_gateway_ends_at_one_across_a_cut() -> None:
    ledger = Ledger(plan("POST", "/v1/completions", body(stop=["STOP"], max_tokens=9, stream=True)))
    assert "stop" not in ledger.request.upstream_body()
    assert ledger.take(chunk("aS", [1, 2], prompt_token_ids=[5]))["choices"][0]["text"] == "a"
    continuation = ledger.cut()
    assert "stop" not in continuation and continuation["prompt"] == [5, 1, 2]
    shown = ledger.take(chunk("TOPb", [3]))["choices"][0]
    assert (shown["text"], shown["finish_reason"], ledger.stopped, ledger.text) == ("", "stop", True, "a")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("first", "next_", "continues"),
    [("w1", "w1", True), ("w1", "w2", False), (None, "w2", True), ("w1", None, True)],
)
def test_a_request_continues_only_on_the_weights_that_began_it(
    first: str | None, next_: str | None, continues: bool
) -> None:
    """Other weights refuse a continuation (an engine that names none is not checked); a restart forgets what was
    generated, not how often the request migrated."""
    ledger = Ledger(plan("POST", "/v1/completions", body(max_tokens=6)), weights=first)
    ledger.take(chunk("a", [1], prompt_token_ids=[9]))
    assert ledger.cut() is not None and ledger.continues_on(next_) is continues
    ledger.restart()
    assert (ledger.released, ledger.text, ledger.prompt_ids, ledger.weights) == ([], "", None, None)
    assert ledger.migrations == 1 and ledger.client_saw_nothing


# Process tests: three engines, the gateway, requests cut by SIGKILL and by SIGSTOP.


@dataclass
class Case:
    """One request through the gateway, read on a thread, and the text the engine gives it uncut."""

    path: str
    request: dict
    expected: dict = field(default_factory=dict)  # {"text", "finish_reason", "usage"} of the uncut run
    got: dict = field(default_factory=lambda: {"text": "", "finish_reason": None, "usage": None})
    ids: set[str] = field(default_factory=set)
    chunks: int = 0
    outcome: str = ""  # "done", or what went wrong
    thread: threading.Thread | None = None

    @property
    def under_way(self) -> bool:
        return bool(self.chunks or self.outcome or not self.request.get("stream"))

    def run(self, url: str) -> None:
        try:
            with httpx.Client(base_url=url, timeout=120.0) as client:
                if self.request.get("stream"):
                    with client.stream("POST", self.path, json=self.request) as response:
                        self.read(response)
                else:
                    self.read_whole(client.post(self.path, json=self.request))
        except httpx.HTTPError as exc:
            self.outcome = repr(exc)

    def read_whole(self, response: httpx.Response) -> None:
        if response.status_code != 200:
            self.outcome = f"{response.status_code}: {response.text}"
            return
        self.ids.add(response.json()["id"])
        self.got = uncut(response.json())
        self.outcome = "done"

    def read(self, response: httpx.Response) -> None:
        if response.status_code != 200:
            self.outcome = f"{response.status_code}: {response.read()!r}"
            return
        for line in response.iter_lines():
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                self.outcome = "done"
                return
            event = json.loads(payload) if payload else {}
            if "error" in event:
                self.outcome = f"error event: {event['error']['message']}"
                return
            for choice in event.get("choices", ()):
                self.got["text"] += choice["text"] if "text" in choice else choice["delta"]["content"]
                self.got["finish_reason"] = choice["finish_reason"] or self.got["finish_reason"]
                self.chunks += 1
            self.ids.update([event["id"]] if event else [])
            self.got["usage"] = event.get("usage") or self.got["usage"]
        self.outcome = "ended without [DONE]"


def uncut(reply: dict) -> dict:
    """Text, finish reason and usage of a whole (non-streamed) reply, completion or chat."""
    choice = reply["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    return {"text": text, "finish_reason": choice["finish_reason"], "usage": reply["usage"]}


def cases(engine: EngineProcess) -> list[Case]:
    """Greedy completion and chat streams, one with a stop string met after the cut, one sampled with a
    seed, and a non-streamed completion; each with its uncut reply, from ``engine`` directly."""
    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    made = [Case(Endpoint.COMPLETIONS, greedy | {"prompt": f"Stream {i} begins"}) for i in range(COMPLETION_STREAMS)]
    made += [
        Case(Endpoint.CHAT_COMPLETIONS, greedy | {"messages": [{"role": "user", "content": f"Hi {i}"}]})
        for i in range(CHAT_STREAMS)
    ]
    made += [Case(Endpoint.COMPLETIONS, greedy | {"prompt": "Sampled", "temperature": 0.9, "top_p": 0.95, "seed": 7})]
    for case in made:
        case.request |= streamed
    made += [Case(Endpoint.COMPLETIONS, greedy | {"prompt": "Not streamed"})]
    uncut_reply(engine, made[0])
    far = made[0].expected["text"]
    stop = far[len(far) * 3 // 4 :][:6]  # met three quarters in: after the cut
    made.append(Case(Endpoint.COMPLETIONS, made[0].request | {"stop": [stop]}))
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda case: uncut_reply(engine, case), made[1:]))
    assert made[-1].expected["finish_reason"] == "stop"
    return made


def uncut_reply(engine: EngineProcess, case: Case) -> None:
    case.expected = uncut(engine.client.post(case.path, json=case.request | {"stream": False}).json())


@contextlib.contextmanager
def running(url: str, made: list[Case]) -> Iterator[list[Case]]:
    """Every case on its own thread; joined when the block ends."""
    for case in made:
        case.thread = threading.Thread(target=case.run, args=(url,))
        case.thread.start()
    try:
        yield made
    finally:
        for case in made:
            case.thread.join(timeout=120)


@pytest.fixture(scope="module")
def engines(tiny_model: Path) -> Iterator[list[EngineProcess]]:
    """Engines "a" (primary), "b" and "c" (standbys); c batch-invariant, so the continuations that land on it (after
    the hang) replay the tokens generated before the cut through decode steps (the gateway says how many)."""
    with contextlib.ExitStack() as stack:
        started = []
        for engine_id, role, mode in (("a", "primary", ()), ("b", "standby", ()), ("c", "standby", INVARIANT)):
            flags = (*FLAGS, *mode, "--engine-id", engine_id, "--role", role)
            started.append(stack.enter_context(EngineProcess(tiny_model, *flags)))
        yield started


@pytest.fixture(scope="module")
def gateway(engines: list[EngineProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    # Every request at once is admitted: as many as one engine batches (FLAGS), whichever group it serves. A
    # hold of 30 s: on two cores shared with another test's servers, a new primary busy with every continuation
    # can miss its probes for longer than the default 10 s (the fail_over test's promote waits on it).
    ports = [e.port for e in engines]
    path = tmp_path_factory.mktemp("migration") / "cluster.toml"
    config = write_cluster(path, ports, max_in_flight=32, hold_timeout_s=30.0)
    with GatewayProcess(config) as gateway:
        gateway.wait_health(lambda h: len(h["primaries"]) == 1, what="the primary")
        yield gateway


def fail_over(
    gateway: GatewayProcess, made: list[Case], fault: signal.Signals, old: EngineProcess, new: EngineProcess
) -> int:
    """Once every stream has text, send ``fault`` to the primary, then promote ``new`` as a controller
    would once it has fenced the old one; the requests in flight at the fault."""
    wait_until(lambda: all(case.under_way for case in made), timeout=60, what="every stream under way")
    old.process.send_signal(fault)
    in_flight = sum(not case.outcome for case in made)
    gateway.wait_health(lambda h: old.url not in h["primaries"], what="the gateway to drop the old primary")
    assert new.post(Endpoint.PROMOTE).status_code == 200
    return in_flight


def test_the_engine_takes_token_ids_and_continues_from_the_tokens_it_released(engines: list[EngineProcess]) -> None:
    """A token-id prompt is the text prompt's equal; a stream's released tokens, appended to its prompt's
    ids, continue it with exactly the rest of the text (sampled with a seed too); ids outside the
    vocabulary are one 400 naming the prompt."""
    a = engines[0]
    sampled = {"max_tokens": 40, "temperature": 0.9, "seed": 3}
    whole = a.complete(prompt="Token ids", return_token_ids=True, **sampled).json()["choices"][0]
    by_ids = a.complete(prompt=whole["prompt_token_ids"], **sampled).json()["choices"][0]
    assert by_ids["text"] == whole["text"]
    chunks = a.stream(prompt="Token ids", return_token_ids=True, **sampled)
    released = [i for c in chunks[:10] for i in c["choices"][0]["token_ids"]]
    sent = "".join(c["choices"][0]["text"] for c in chunks[:10])
    rest = a.complete(prompt=whole["prompt_token_ids"] + released, **sampled | {"max_tokens": 40 - len(released)})
    assert sent + rest.json()["choices"][0]["text"] == whole["text"]
    bad = a.complete(prompt=[1, 10**9])
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "prompt")


@pytest.mark.timeout(240)
def test_requests_survive_a_killed_and_then_a_hung_primary(
    engines: list[EngineProcess], gateway: GatewayProcess
) -> None:
    """Completions and chats of MAX_TOKENS tokens: the primary SIGKILLed mid-stream, then the next one
    SIGSTOPped: no request breaks, every reply equals the uncut one (text, finish reason, usage for the
    whole request), one id per reply."""
    a, b, c = engines
    figures = {}
    reference = cases(a)
    for fault, old, new in ((signal.SIGKILL, a, b), (signal.SIGSTOP, b, c)):
        made = [Case(case.path, case.request, case.expected) for case in reference]
        migrated = metric(gateway, "hotweights_gateway_migrations_total")
        with running(gateway.url, made):
            in_flight = fail_over(gateway, made, fault, old, new)
        assert [case.outcome for case in made] == ["done"] * len(made)
        assert [case.got for case in made] == [case.expected for case in made]
        assert all(len(case.ids) == 1 for case in made)
        figures[fault.name] = (in_flight, metric(gateway, "hotweights_gateway_migrations_total") - migrated)
        assert figures[fault.name][1] >= 1, "no request was cut: the fault came too late"
    print(f"requests in flight and migrated at each fault: {figures}")
    events = gateway.client.get(Endpoint.GATEWAY_EVENTS, params={"limit": 1000}).json()["events"]
    migrations = [e for e in events if e["kind"] == "migration"]
    assert len(migrations) == sum(migrated for _, migrated in figures.values())
    # A primary whose probe timed out under load is cut too, and its requests may go back to it: any engine.
    assert all(e["to"] in (a.url, b.url, c.url) and e["tokens_replayed"] >= 0 for e in migrations)
    # c, batch-invariant, now serves: a replay count needs one token-id prompt longer than it.
    for prompt, count, status in (([5, 6, 7], "2", 200), ([5, 6, 7], "3", 400), (["text"], "1", 400)):
        body = {"prompt": prompt[0] if isinstance(prompt[0], str) else prompt, "max_tokens": 2}
        answer = c.client.post(Endpoint.COMPLETIONS, json=body, headers={REPLAY_HEADER: count})
        assert answer.status_code == status, answer.text
        assert status == 200 or answer.json()["error"]["param"] == REPLAY_HEADER


def test_a_completion_cut_by_a_model_update_runs_again_on_the_new_weights_or_ends_saying_why(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A model update's next primary computes with other weights (the engines name theirs on every answer): a
    non-streamed completion cut on the old weights runs again from its prompt on the new ones (its reply is
    theirs alone, never half of each), and a stream whose client already has text ends with an error event that
    says why; neither is continued. A draining primary whose weights no other engine serves is not cut: its
    streams finish there, whole."""
    other = make_checkpoint(tmp_path / "other", seed=1)
    with contextlib.ExitStack() as stack:
        old = stack.enter_context(EngineProcess(tiny_model, *FLAGS, "--engine-id", "old", "--role", "primary"))
        new = stack.enter_context(EngineProcess(other, *FLAGS, "--engine-id", "new", "--role", "standby"))
        config = write_cluster(tmp_path / "cluster.toml", [old.port, new.port])
        gateway = stack.enter_context(GatewayProcess(config))
        gateway.wait_health(lambda h: h["primaries"] == [old.url], what="the old weights' primary")
        greedy = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
        whole, chat, streamed = (
            Case(Endpoint.COMPLETIONS, greedy | {"prompt": "Not streamed"}),
            Case(Endpoint.CHAT_COMPLETIONS, greedy | {"messages": [{"role": "user", "content": "Not streamed"}]}),
            Case(Endpoint.COMPLETIONS, greedy | {"prompt": "Streamed", "stream": True}),
        )
        with running(gateway.url, [whole, chat, streamed]):
            # the non-streamed ones say nothing until done: the old primary counts them in flight
            wait_until(lambda: metric(old, "hotweights_engine_in_flight_requests") == 3, what="all three on the old")
            fail_over(gateway, [whole, chat, streamed], signal.SIGKILL, old, new)
        for case in (whole, chat):
            assert (case.outcome, case.got) == ("done", uncut(new.client.post(case.path, json=case.request).json()))
        assert streamed.chunks and "serves other weights" in streamed.outcome, streamed.outcome
        kinds = [e["kind"] for e in gateway.client.get(Endpoint.GATEWAY_EVENTS, params={"limit": 100}).json()["events"]]
        assert [kinds.count(k) for k in ("migration_restarted", "migration", "migration_failed")] == [2, 2, 1], kinds
        # The new weights' primary drains (the old weights' engine, dead, was the only other): nothing is cut.
        made = [Case(Endpoint.COMPLETIONS, greedy | {"prompt": f"Drained {i}", "stream": True}) for i in range(3)]
        for case in made:
            uncut_reply(new, case)
        with running(gateway.url, made), ThreadPoolExecutor(1) as pool:
            wait_until(lambda: all(case.chunks for case in made), timeout=60, what="every stream under way")
            drained = pool.submit(new.post, Endpoint.DRAIN, json={"timeout_s": 60})
            gateway.wait_health(lambda h: not h["primaries"], what="the gateway to see the drain")
        assert drained.result().status_code == 200
        assert [(case.outcome, case.got["text"]) for case in made] == [("done", c.expected["text"]) for c in made]
        assert len(gateway.client.get(Endpoint.GATEWAY_EVENTS, params={"limit": 100}).json()["events"]) == len(kinds)
