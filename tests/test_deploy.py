"""The deployment files in ``deploy/`` agree with the code: ports, probe paths, settings, app.

Nothing here builds an image or starts a container (see docs/deploy.md for what was run): the
Dockerfile, the compose file and the Kubernetes manifests are read as text and YAML, and what
they set is checked against the code. Every ``P2PSHARD_*`` variable they give a node is loaded
through ``NodeConfig.load`` with the ``node.toml`` they mount, so a misspelt key or a value the
configuration refuses fails here; every port they expose, publish or probe is the one that
configuration listens on; every probe path is a route of the management endpoint; the grace
periods exceed the node's ``shutdown_timeout``; the ``--app`` target imports.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest
import yaml

from p2pshard import NodeConfig
from p2pshard._management import ROUTES, Route, route
from p2pshard.cli._app import load_app

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
NODE_TOML = DEPLOY / "node.toml"
CONFIG_PATH = "/etc/p2pshard/node.toml"
"""Where the image's ENTRYPOINT reads the configuration, and the files mount it."""
TOKEN = "deploy-test-token-0123456789"


def load(environ: Mapping[str, str], toml: Path = NODE_TOML) -> NodeConfig:
    """The node's configuration as the container gets it: the mounted file and its variables."""
    unknown = [n for n in environ if not n.startswith("P2PSHARD_")]
    assert not unknown, f"not configuration variables: {unknown}"
    return NodeConfig.load(toml, environ=environ)


def discovery(environ: Mapping[str, str], config: NodeConfig) -> dict[str, str]:
    """The discovery settings the node ends with, as text by key."""
    return {k: str(v) for k, v in attrs.asdict(config.discovery).items()}


def check_route(path: str) -> None:
    matched = route("GET", path)
    assert isinstance(matched, Route), f"GET {path} is not a management route: {ROUTES}"
    assert matched.name in ("alive", "ready"), f"a probe must call /alive or /ready, not {path}"


# --- the Dockerfile ------------------------------------------------------------------------------


def instructions(text: str) -> Iterator[tuple[str, str]]:
    """The Dockerfile's instructions, continuation lines joined: (INSTRUCTION, arguments)."""
    joined = re.sub(r"\\\n", " ", text)
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            yield word.upper(), rest.strip()


def dockerfile() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for word, rest in instructions((DEPLOY / "Dockerfile").read_text()):
        found.setdefault(word, []).append(rest)
    return found


def exec_form(text: str) -> list[str]:
    assert text.startswith("["), f"use the exec form (a JSON array): {text}"
    value = yaml.safe_load(text)
    assert isinstance(value, list)
    return [str(v) for v in value]


def test_the_dockerfile_runs_the_node_on_the_configured_ports_as_non_root() -> None:
    docker = dockerfile()
    config = load({"P2PSHARD_NODE_NAME": "n1", "P2PSHARD_CANONICAL_HOST": "10.0.0.1"})
    assert docker["FROM"] == ["python:3.11-slim"]
    assert docker["USER"][-1] not in ("root", "0")
    exposed = {int(p.partition("/")[0]) for line in docker["EXPOSE"] for p in line.split()}
    assert exposed == {config.bind_port, config.management.port}
    assert docker["STOPSIGNAL"] == ["SIGTERM"]

    [healthcheck] = docker["HEALTHCHECK"]
    _, _, command = healthcheck.partition("CMD ")
    probe = " ".join(exec_form(command))
    [url] = re.findall(r"http://[^'\" ]+", probe)
    assert url == f"http://127.0.0.1:{config.management.port}/alive"
    check_route("/alive")

    entrypoint = exec_form(docker["ENTRYPOINT"][-1])
    assert entrypoint[:2] == ["p2pshard", "node"]
    assert entrypoint[entrypoint.index("--config") + 1] == CONFIG_PATH
    arguments = exec_form(docker["CMD"][-1])
    assert arguments[0] == "--app"


def test_every_file_the_dockerfile_copies_exists() -> None:
    for line in dockerfile()["COPY"]:
        *sources, _ = shlex.split(line)
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"


def test_the_app_the_image_runs_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    docker = dockerfile()
    command = exec_form(docker["CMD"][-1])
    spec = command[command.index("--app") + 1]
    # The image copies the app's module into its WORKDIR, where the import looks first.
    copied = [shlex.split(line) for line in docker["COPY"]]
    module = spec.partition(":")[0]
    assert [f"deploy/{module}.py", f"/app/{module}.py"] in copied
    assert docker["WORKDIR"][-1] == "/app"
    monkeypatch.syspath_prepend(str(DEPLOY))
    monkeypatch.delitem(sys.modules, module, raising=False)
    app = load_app(spec, "the Dockerfile's --app")
    assert app.spec == spec


# --- compose -------------------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    document = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert isinstance(document, dict)
    return document


def interpolated(value: str) -> str:
    """Compose's ``${VAR:?message}`` with the test's token for the management token."""
    return re.sub(r"\$\{P2PSHARD_MANAGEMENT__TOKEN:\?[^}]*\}", TOKEN, value)


def node_services(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: service
        for name, service in document["services"].items()
        if "P2PSHARD_NODE_NAME" in (service.get("environment") or {})
    }


def test_compose_runs_three_nodes_whose_settings_load() -> None:
    document = compose()
    nodes = node_services(document)
    assert len(nodes) == 3
    for name, service in nodes.items():
        environ = {k: interpolated(str(v)) for k, v in service["environment"].items()}
        config = load(environ)
        assert config.node_name == name
        # Discovery finds the addresses the alias resolves to; a node must advertise its own.
        network = service["networks"]["default"]
        assert config.canonical_host == network["ipv4_address"]
        subnet = document["networks"]["default"]["ipam"]["config"][0]["subnet"]
        assert config.canonical_host is not None
        assert ipaddress.ip_address(config.canonical_host) in ipaddress.ip_network(subnet)
        assert config.management.token == TOKEN
        assert config.lease.backend == "etcd"
        assert config.lease.endpoints == ("http://etcd:2379",)
        assert "etcd" in document["services"]

        mounts = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
        assert (DEPLOY / mounts[CONFIG_PATH]).resolve() == NODE_TOML
        certs = next(target for target, source in mounts.items() if source == "certs")
        for path in (config.tls.ca_file, config.tls.cert_file, config.tls.key_file):
            assert str(path).startswith(certs + "/"), f"{path} is not in the certs volume"
        # The certs job writes node-N/node.pem and node-N-key.pem, and ca.pem at the top.
        job = " ".join(document["services"]["certs"]["command"])
        assert "for n in " + " ".join(nodes) in job
        assert config.tls.cert_file == Path(certs, name, "node.pem")
        assert config.tls.key_file == Path(certs, name, "node-key.pem")
        assert config.tls.ca_file == Path(certs, "ca.pem")
        assert "cp ca/ca.pem ca.pem" in job

        found = discovery(environ, config)
        assert found["method"] == "dns"
        assert found["service_name"] in network["aliases"]
        assert int(found["contact_port"]) == config.bind_port
        assert int(found["required_contact_points"]) <= len(nodes)

        grace = service["stop_grace_period"]
        assert grace.endswith("s")
        assert float(grace[:-1]) > config.shutdown_timeout
        for published in service.get("ports", ()):
            assert int(published.rsplit(":", 1)[1]) == config.management.port
            assert published.startswith("127.0.0.1:"), "management over plain HTTP: loopback"


def test_compose_builds_the_dockerfile() -> None:
    for name, service in compose()["services"].items():
        build = service.get("build")
        if build is None:
            continue
        assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == (
            DEPLOY / "Dockerfile"
        ), name


# --- Kubernetes ----------------------------------------------------------------------------------

POD = {"metadata.name": "p2pshard-0", "status.podIP": "10.244.1.7"}
"""What the downward API gives a pod in these checks."""


def manifests() -> dict[str, dict[str, Any]]:
    path = DEPLOY / "kubernetes" / "p2pshard.yaml"
    found = {doc["kind"]: doc for doc in yaml.safe_load_all(path.read_text()) if doc}
    assert set(found) == {"Service", "ConfigMap", "StatefulSet"}
    return found


def pod_environ(container: dict[str, Any]) -> dict[str, str]:
    """The container's variables as the kubelet sets them: downward API, secret, ``$(VAR)``."""
    environ: dict[str, str] = {}
    for entry in container["env"]:
        if "value" in entry:
            value = re.sub(r"\$\((\w+)\)", lambda m: environ[m.group(1)], str(entry["value"]))
        elif "fieldRef" in entry["valueFrom"]:
            value = POD[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            assert entry["valueFrom"]["secretKeyRef"] == {
                "name": "p2pshard-management",
                "key": "token",
            }
            value = TOKEN
        environ[entry["name"]] = value
    return environ


def test_the_kubernetes_manifests_match_the_code(tmp_path: Path) -> None:
    found = manifests()
    service, config_map, stateful_set = (
        found["Service"],
        found["ConfigMap"],
        found["StatefulSet"],
    )
    # The ConfigMap carries deploy/node.toml itself.
    assert config_map["data"]["node.toml"] == NODE_TOML.read_text()
    spec = stateful_set["spec"]
    pod = spec["template"]["spec"]
    [container] = pod["containers"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts[CONFIG_PATH]["subPath"] == "node.toml"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert (
        volumes[mounts[CONFIG_PATH]["name"]]["configMap"]["name"] == config_map["metadata"]["name"]
    )

    environ = pod_environ(container)
    toml = tmp_path / "node.toml"
    toml.write_text(config_map["data"]["node.toml"])
    config = load(environ, toml)
    assert config.node_name == POD["metadata.name"]
    assert config.canonical_host == POD["status.podIP"]
    assert config.management.token == TOKEN
    assert config.lease.backend == "etcd"
    assert config.lease.endpoints

    # Ports: the container's are the configuration's; the Service and probes use their names.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"cluster": config.bind_port, "management": config.management.port}
    for port in service["spec"]["ports"]:
        assert ports[port["targetPort"]] == port["port"]
    for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/alive")):
        get = container[probe]["httpGet"]
        assert get["path"] == path
        check_route(get["path"])
        assert get["port"] == "management"

    # Discovery: the headless Service, found before its pods are ready, all started at once.
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert spec["serviceName"] == service["metadata"]["name"]
    assert spec["podManagementPolicy"] == "Parallel"
    found_discovery = discovery(environ, config)
    assert found_discovery["method"] == "dns"
    assert found_discovery["service_name"].startswith(service["metadata"]["name"] + ".")
    assert int(found_discovery["contact_port"]) == config.bind_port
    assert int(found_discovery["required_contact_points"]) <= spec["replicas"] == 3

    # Certificates from the Secret, the pod's own by name.
    certs = next(m for m in container["volumeMounts"] if volumes[m["name"]].get("secret"))
    for file in (config.tls.ca_file, config.tls.cert_file, config.tls.key_file):
        assert str(file).startswith(certs["mountPath"] + "/")
    assert config.tls.cert_file.name == f"{POD['metadata.name']}.pem"

    # SIGTERM's graceful leave ends before the kubelet kills the process; not root.
    assert pod["terminationGracePeriodSeconds"] > config.shutdown_timeout
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["args"] == exec_form(dockerfile()["CMD"][-1])
