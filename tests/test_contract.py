"""``hotweights.contract``: the one open-listener rule, held by every server as a real process.

A server asked to listen on a non-loopback address without a bearer token refuses to start: one
line on stderr naming the setting, exit 2, nothing bound, nothing loaded."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hotweights.contract import is_loopback, refuse_open_listener
from hotweights.errors import ConfigError
from hotweights.spawn import hotweights_command
from tests.cachehelpers import ENV
from tests.enginehelpers import free_port
from tests.gatewayhelpers import write_cluster


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.1.2.3", False),
        ("example.com", False),
        ("localhost.example.com", False),
    ],
)
def test_loopback_is_decided_by_address(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
    if loopback:
        refuse_open_listener(host, False, "--host", "fix")
    else:
        with pytest.raises(ConfigError, match="is not loopback and no bearer token is set: fix"):
            refuse_open_listener(host, False, "--host", "fix")
    refuse_open_listener(host, True, "--host", "fix")  # a token makes any address acceptable


def refused(*args: str, timeout: float = 60.0) -> str:
    """Run ``hotweights *args``; it must exit 2 with one line on stderr, which is returned."""
    result = subprocess.run(hotweights_command(*args), env=ENV, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_engine_refuses_an_open_host_without_a_token(tiny_model: Path) -> None:
    port = str(free_port())
    line = refused("engine", "--model", str(tiny_model), "--host", "0.0.0.0", "--port", port)
    assert "--host '0.0.0.0' is not loopback" in line and "--token-file" in line


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("--max-batch", "-1"), "--max-batch must be >= 0 (0: what the KV pool holds), found -1"),
        (("--kv-pool-tokens", "-16"), "--kv-pool-tokens must be >= 0 (0: sized automatically), found -16"),
        (("--kv-pool-share", "0"), "--kv-pool-share must be in (0, 1], found 0.0"),
        (
            ("--kv-pool-tokens", "1024", "--kv-cache-tokens", "4096"),
            "--kv-pool-tokens 1024: a KV pool of 1024 positions cannot hold one sequence of 4096 positions "
            "(--kv-cache-tokens); raise it or lower --kv-cache-tokens",
        ),
    ],
)
def test_engine_refuses_a_kv_pool_it_cannot_size_or_serve_from(
    tiny_model: Path, flags: tuple[str, ...], expected: str
) -> None:
    line = refused("engine", "--model", str(tiny_model), "--port", str(free_port()), *flags)
    assert line == f"hotweights engine: error: {expected}"


def test_gateway_refuses_an_open_host_without_a_token(tmp_path: Path) -> None:
    config = write_cluster(tmp_path / "open.toml", [free_port()], host="0.0.0.0")
    line = refused("gateway", "--config", str(config))
    assert f"{config}: gateway.host '0.0.0.0' is not loopback" in line and "cluster.token_file" in line
    config = write_cluster(tmp_path / "loopback.toml", [free_port()])
    line = refused("gateway", "--config", str(config), "--host", "0.0.0.0", "--port", str(free_port()))
    assert "--host '0.0.0.0' is not loopback" in line and "cluster.token_file" in line
    line = refused("gateway", "--upstream", "http://127.0.0.1:1", "--host", "::", "--port", str(free_port()))
    assert "--host '::' is not loopback" in line


def test_controller_refuses_an_open_host_without_a_token(tmp_path: Path) -> None:
    config = tmp_path / "cluster.toml"
    config.write_text(f'[cluster]\nhost = "0.0.0.0"\nport = {free_port()}\n[gateway]\nport = {free_port()}\n')
    line = refused("controller", "--config", str(config))
    assert f"{config}: cluster.host '0.0.0.0' is not loopback" in line and "cluster.token_file" in line
