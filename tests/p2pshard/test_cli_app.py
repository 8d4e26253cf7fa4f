"""``p2pshard node --app MODULE:FUNCTION``: an application's setup run on the node.

The bad inputs run in this process (the app is loaded before the node starts, so they need no
certificates); the app itself runs in real node processes, its module written here and found
through the working directory, as ``python -m`` finds modules.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from p2pshard.cli import EXIT_APP_FAILED, main
from p2pshard.cli._app import load_app
from p2pshard.testing import free_port_block
from tests._support.node_processes import wait_for_lines

ROOT = Path(__file__).resolve().parents[2]

NODE_TOML = (
    'cluster_name = "c"\nnode_name = "n"\nbind_port = {port}\nself_join = true\n{extra}'
    '[tls]\nca_file = "n/ca.pem"\ncert_file = "n/node.pem"\nkey_file = "n/node-key.pem"\n'
)

BAD_APP = """\
VALUE = 3


async def setup(node):
    pass


def sync_setup(node):
    pass


async def two_args(node, other):
    pass


async def no_args():
    pass


class Setup:
    async def __call__(self, node):
        pass


instance = Setup()
"""


@pytest.fixture
def app_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The working directory, holding app modules ``appmod_*``; they are forgotten after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the loader may add the directory
    (tmp_path / "appmod_bad.py").write_text(BAD_APP)
    (tmp_path / "appmod_dep.py").write_text("import appmod_not_installed\n")
    (tmp_path / "appmod_boom.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "appmod_pkg").mkdir()
    (tmp_path / "appmod_pkg" / "__init__.py").write_text("")
    (tmp_path / "node.toml").write_text(NODE_TOML.format(port=0, extra=""))
    importlib.invalidate_caches()
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("appmod_")]:
        del sys.modules[name]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (
            "appmod_bad",
            "--app 'appmod_bad' is invalid: the ':' is missing: expected MODULE:FUNCTION, "
            "e.g. 'shop.app:setup'",
        ),
        ("appmod_bad:", "'' is not a function name"),
        ("appmods/bad:setup", "'appmods/bad' is not a module name"),
        ("appmod_bad.py:setup", "'appmod_bad.py' is a file name: give the module's name"),
        (
            "appmod_missing:setup",
            "--app 'appmod_missing:setup': no module named 'appmod_missing' on the module search "
            "path: run p2pshard node in the directory that holds it (now {cwd}), or add that "
            "directory to PYTHONPATH (searched: ",
        ),
        ("appmod_pkg.nothing:setup", "no module named 'appmod_pkg.nothing' on the module"),
        (
            "appmod_dep:setup",
            "importing module 'appmod_dep' failed: No module named 'appmod_not_installed' (a "
            "module it imports; is it installed?)",
        ),
        (
            "appmod_boom:setup",
            "importing module 'appmod_boom' raised RuntimeError: boom at import (the traceback "
            "is above)",
        ),
        (
            "appmod_bad:stup",
            "module 'appmod_bad' ({cwd}/appmod_bad.py) has no attribute 'stup'; did you mean "
            "'setup'?",
        ),
        ("appmod_bad:instance.run", "'instance' of module 'appmod_bad'"),
        ("appmod_bad:VALUE", "'VALUE' is not callable but int 3: expected async def setup(node)"),
        ("appmod_bad:Setup", "'Setup' is a class, not a function"),
        (
            "appmod_bad:sync_setup",
            "'sync_setup' is not an async function: write it as async def sync_setup(node)",
        ),
        (
            "appmod_bad:two_args",
            "two_args(node, other) cannot be called with one argument, the running node",
        ),
        ("appmod_bad:no_args", "no_args() cannot be called with one argument"),
    ],
)
def test_a_bad_app_is_refused_before_the_node_starts_with_exit_2(
    app_dir: Path, capsys: pytest.CaptureFixture[str], spec: str, expected: str
) -> None:
    assert main(["node", "--config", str(app_dir / "node.toml"), "--app", spec]) == 2
    err = capsys.readouterr().err
    assert f"p2pshard node: error: --app {spec!r}" in err
    assert expected.format(cwd=os.getcwd()) in err
    # The traceback of an error inside the app's module, where it helps find the line.
    assert ("Traceback" in err) == (spec in ("appmod_boom:setup", "appmod_dep:setup")), err
    assert "running as" not in err


def test_the_app_of_the_config_file_or_environment_is_loaded_and_checked(
    app_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = app_dir / "node.toml"
    config.write_text(NODE_TOML.format(port=0, extra='app = "appmod_bad:stup"\n'))
    assert main(["node", "--config", str(config)]) == 2
    assert f"error: app of {config} 'appmod_bad:stup': module 'appmod_bad'" in (
        capsys.readouterr().err
    )
    monkeypatch.setenv("P2PSHARD_APP", "appmod_bad:sync_setup")
    assert main(["node", "--config", str(config)]) == 2
    assert "error: P2PSHARD_APP 'appmod_bad:sync_setup': 'sync_setup' is not an async" in (
        capsys.readouterr().err
    )
    # --app wins over both.
    assert main(["node", "--config", str(config), "--app", "appmod_bad:no_args"]) == 2
    assert "error: --app 'appmod_bad:no_args': no_args()" in capsys.readouterr().err
    config.write_text(NODE_TOML.format(port=0, extra='app = "appmod_bad"\n'))
    monkeypatch.delenv("P2PSHARD_APP")
    assert main(["node", "--config", str(config)]) == 2
    assert "app = 'appmod_bad' is invalid: the ':' is missing" in capsys.readouterr().err


def test_an_async_function_or_callable_object_is_a_setup(app_dir: Path) -> None:
    setup = load_app("appmod_bad:setup", "--app").setup
    module = sys.modules["appmod_bad"]
    assert setup is module.setup
    assert load_app("appmod_bad:instance", "--app").setup is module.instance


# -- the app in real node processes ---------------------------------------------------------------

COUNTER_APP = """\
import logging

import attrs
import trio

from p2pshard import EntityContext, HashExtractor, Node, message

logger = logging.getLogger("counter_app")


@message
@attrs.frozen
class Increment:
    delta: int


@message
@attrs.frozen
class Get: ...


class Counter:
    def __init__(self, ctx: EntityContext) -> None:
        self.value = 0

    async def receive(self, msg: object, ctx: EntityContext) -> object:
        match msg:
            case Increment(delta=delta):
                self.value += delta
            case Get():
                return self.value
        return None


async def start_counters(node: Node) -> None:
    counters = await node.sharding.start("Counter", Counter, extractor=HashExtractor(10))
    await counters.entity_ref("c-1").tell(Increment(2))
    logger.info("counter c-1 = %d", await counters.entity_ref("c-1").ask(Get(), timeout=10))


async def setup(node: Node) -> None:
    await start_counters(node)


async def serve(node: Node) -> None:
    await start_counters(node)
    try:
        await trio.sleep_forever()  # an app's own server, say
    finally:
        logger.info("serve: cancelled")


async def fail(node: Node) -> None:
    await start_counters(node)
    raise RuntimeError("cannot reach the database at db.internal")
"""


def prepare_node(tmp_path: Path) -> tuple[Path, int]:
    """Certificates, ``node.toml`` (self_join, a free port), ``ops.toml`` (a client) and
    ``counter_app.py`` in ``tmp_path``; the node's config file and port."""
    assert main(["certs", "init", "--cluster", "c", "--out", str(tmp_path / "ca")]) == 0
    for kind, name in (("node", "n"), ("client", "ops")):
        args = ["certs", kind, name, "--ca", str(tmp_path / "ca"), "--out", str(tmp_path / name)]
        assert main(args) == 0
    port = free_port_block(1)
    config = tmp_path / "node.toml"
    config.write_text(NODE_TOML.format(port=port, extra='log_level = "INFO"\n'))
    (tmp_path / "ops.toml").write_text(
        'cluster_name = "c"\n[tls]\nca_file = "ops/ca.pem"\n'
        'cert_file = "ops/client.pem"\nkey_file = "ops/client-key.pem"\n'
    )
    (tmp_path / "counter_app.py").write_text(COUNTER_APP)
    return config, port


def start_node(
    tmp_path: Path, log: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``p2pshard node`` in ``tmp_path`` with ``-P``: the working directory is not on the path
    unless the command puts it there, as for the installed ``p2pshard`` script."""
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-P", "-m", "p2pshard", "node", "--config", "node.toml", *args],
            cwd=tmp_path,
            stderr=out,
            env={
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": str(ROOT),  # p2pshard itself, wherever it is installed
                **(env or {}),
            },
        )


def stop(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is None:
        child.kill()
        child.wait()


def test_the_app_serves_its_entity_type_and_sigterm_still_leaves_with_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, port = prepare_node(tmp_path)
    log = tmp_path / "node.log"
    child = start_node(tmp_path, log, "--app", "counter_app:setup")
    try:
        wait_for_lines([log], "app counter_app:setup is set up; the node runs on", limit=30)
        assert "counter_app: counter c-1 = 2" in log.read_text()
        capsys.readouterr()
        status = ["status", "--node", f"127.0.0.1:{port}", "--config", str(tmp_path / "ops.toml")]
        assert main([*status, "--json"]) == 0
        reply = json.loads(capsys.readouterr().out)
        [counter] = [t for t in reply["entity_types"] if t["type_name"] == "Counter"]
        [region] = counter["regions"]
        assert (region["name"], region["entity_count"]) == ("n", 1), counter
        assert child.poll() is None
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == 0, log.read_text()
    finally:
        stop(child)
    text = log.read_text()
    assert "SIGTERM received, leaving the cluster" in text
    assert "n: handing off shards" in text  # the app's Counter shards
    assert "Traceback" not in text


def test_sigterm_cancels_a_setup_that_still_runs_and_exits_0(tmp_path: Path) -> None:
    prepare_node(tmp_path)
    log = tmp_path / "node.log"
    child = start_node(tmp_path, log, "--app", "counter_app:serve")
    try:
        wait_for_lines([log], "counter_app: counter c-1 = 2", limit=30)
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == 0, log.read_text()
    finally:
        stop(child)
    text = log.read_text()
    assert "serve: cancelled" in text.split("SIGTERM received, leaving the cluster", 1)[1]
    assert "n: handing off shards" in text
    assert "is set up" not in text
    assert "Traceback" not in text


def test_a_setup_that_raises_leaves_the_cluster_and_exits_with_exit_app_failed(
    tmp_path: Path,
) -> None:
    """Given by P2PSHARD_APP this time: the environment overrides the file's app key."""
    config, _ = prepare_node(tmp_path)
    config.write_text(config.read_text().replace("self_join", 'app = "nothing:here"\nself_join'))
    log = tmp_path / "node.log"
    child = start_node(tmp_path, log, env={"P2PSHARD_APP": "counter_app:fail"})
    try:
        assert child.wait(timeout=30) == EXIT_APP_FAILED, log.read_text()
    finally:
        stop(child)
    text = log.read_text()
    raised = "n: the setup of app counter_app:fail raised; leaving the cluster"
    assert raised in text, text
    after = text.split(raised, 1)[1]
    assert "RuntimeError: cannot reach the database at db.internal" in after
    assert "n: handing off shards" in after
    assert "n: leaving the cluster" in after
    assert (
        "n: exiting with status 4: the setup of app counter_app:fail failed (the traceback is "
        "above)"
    ) in after
    assert EXIT_APP_FAILED == 4


def test_the_help_names_the_app_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["node", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--app MODULE:FUNCTION" in text
    assert "async def setup(node)" in text
