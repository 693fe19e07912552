"""The OpenAPI documents say what the servers answer: each declares the bearer scheme, every status
code of every endpoint and ``/metrics`` as text; schemathesis fuzzes a real engine and a real
controller, each a stack of its own, and fails on any server error or undeclared status code.

503 is the one 5xx the contract has (not ready, not primary, not serving, an action that failed), so
the fuzzer accepts it where the document declares it; any other 5xx fails the run."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hotweights.contract import Endpoint
from tests.controllerhelpers import TOKEN as CONTROLLER_TOKEN
from tests.controllerhelpers import ControllerStack
from tests.enginehelpers import EngineProcess

ENGINE_TOKEN = "fuzz-token-5678"
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance"
SCHEMATHESIS_TOML = '[checks.not_a_server_error]\nexpected-statuses = ["2xx", "3xx", "4xx", "503"]\n'
FUZZ_TIMEOUT_S = 150  # per run; each takes seconds on the tiny model


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[EngineProcess]:
    """A primary of its own: the fuzzer demotes, drains and promotes it at will."""
    with EngineProcess(tiny_model, "--kv-cache-tokens", "256", "--max-batch", "2", token=ENGINE_TOKEN) as engine:
        yield engine


@pytest.fixture(scope="module")
def controller(tiny_model: Path) -> Iterator[ControllerStack]:
    """A cluster of its own (one daemon, two engines): the fuzzer switches over, drains and restarts."""
    stack = ControllerStack(tiny_model, engines=2)
    try:
        stack.start_controller()
        stack.wait_steady()
        yield stack
    finally:
        stack.close()


def fuzz(url: str, workdir: Path, token: str | None, *extra: str) -> None:
    """Run schemathesis against the live document at ``url``; fail with its report."""
    config = workdir / "schemathesis.toml"
    config.write_text(SCHEMATHESIS_TOML)
    command = [
        *(sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run", f"{url}/openapi.json"),
        *("--checks", CHECKS, "--phases", "examples,coverage,fuzzing", "--max-examples", "25"),
        *("--workers", "1", "--generation-database", "none", "--request-timeout", "60", "--no-color", *extra),
    ]
    if token is not None:
        command += ["--header", f"Authorization: Bearer {token}"]
    else:  # the mutations, each of which must answer 401; the reads were fuzzed with the token already
        command += ["--include-method", "POST", "--include-method", "DELETE"]
    result = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=FUZZ_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]


def document(url: str) -> dict:
    response = httpx.get(f"{url}/openapi.json", timeout=10)
    response.raise_for_status()
    return response.json()


def declared(doc: dict, path: str, method: str) -> set[str]:
    return set(doc["paths"][path][method]["responses"])


def assert_bearer_and_text_metrics(doc: dict, mutation: tuple[str, str]) -> None:
    assert doc["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": doc["components"]["securitySchemes"]["bearer"]["description"],
    }
    path, method = mutation
    assert doc["paths"][path][method]["security"] == [{"bearer": []}]
    assert all(p["name"].lower() != "authorization" for p in doc["paths"][path][method].get("parameters", []))
    assert set(doc["paths"][Endpoint.METRICS]["get"]["responses"]["200"]["content"]) == {"text/plain"}


def test_engine_document_declares_what_the_engine_answers(engine: EngineProcess) -> None:
    doc = document(engine.url)
    assert_bearer_and_text_metrics(doc, (Endpoint.PROMOTE, "post"))
    assert declared(doc, Endpoint.PROMOTE, "post") == {"200", "400", "401", "409"}
    assert declared(doc, Endpoint.LEASE, "post") == {"200", "400", "401", "409"}
    assert declared(doc, Endpoint.DEMOTE, "post") == {"200", "400", "401", "409"}
    assert declared(doc, Endpoint.COMPLETIONS, "post") == {"200", "400", "404", "408", "413", "429", "500", "503"}
    for path in (Endpoint.LIVE, Endpoint.READY, Endpoint.PRIMARY, Endpoint.STANDBY):
        for method in ("get", "head", "options"):
            assert declared(doc, path, method) == {"200", "503"}, (path, method)


def test_controller_document_declares_what_the_controller_answers(controller: ControllerStack) -> None:
    doc = document(controller.url)
    assert_bearer_and_text_metrics(doc, ("/switchover", "post"))
    assert declared(doc, "/switchover", "post") == {"200", "400", "401", "404", "409", "412", "422", "503"}
    assert declared(doc, "/engines", "post") == {"201", "400", "401", "404", "409", "422", "503"}
    assert declared(doc, "/cache/{group}/restart", "post") == {"202", "401", "404", "422", "503"}
    assert declared(doc, Endpoint.ROLLOUT, "post") == {"200", "400", "401", "404", "409", "412", "422", "503"}


def test_fuzzing_the_engine_finds_no_server_error_or_undeclared_status(engine: EngineProcess, tmp_path: Path) -> None:
    fuzz(engine.url, tmp_path, ENGINE_TOKEN)
    fuzz(engine.url, tmp_path, None)  # every role change answers 401 without the token
    assert engine.client.get(Endpoint.READY).status_code == 200


def test_fuzzing_the_controller_finds_no_server_error_or_undeclared_status(
    controller: ControllerStack, tmp_path: Path
) -> None:
    # Authorized, but not POST /engines nor POST /rollout: every example would start one more engine process,
    # or restart them all.
    excluded = ("--exclude-path", "/engines", "--exclude-path", Endpoint.ROLLOUT)
    fuzz(controller.url, tmp_path, CONTROLLER_TOKEN, *excluded)
    fuzz(controller.url, tmp_path, None)  # every mutation answers 401 without the token
    controller.wait_steady()
