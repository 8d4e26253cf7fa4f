"""The ``p2pshard`` command, run as real processes where it matters."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import stat
import subprocess
import time
import tomllib
from pathlib import Path

import pytest
from cryptography import x509

from p2pshard.cli import EXIT_DOWNED, main
from p2pshard.cli._localcluster import LocalCluster
from p2pshard.testing import free_port_block
from tests._support.node_processes import (
    PYTHON,
    node_processes,
    read_until,
    time_wait_port,
    wait_for_lines,
)


def test_certs_init_and_node_write_keys_with_mode_0600(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["certs", "init", "--cluster", "shop", "--out", str(tmp_path / "ca")]) == 0
    assert (
        main(["certs", "node", "n1", "--ca", str(tmp_path / "ca"), "--out", str(tmp_path / "n1")])
        == 0
    )
    assert "node 'n1' of cluster 'shop'" in capsys.readouterr().out
    for key in (tmp_path / "ca" / "ca-key.pem", tmp_path / "n1" / "node-key.pem"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate((tmp_path / "n1" / "node.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["p2pshard://shop/n1"]


@pytest.mark.parametrize("kind", ["client", "admin"])
def test_certs_client_and_admin_make_certificates_of_their_kind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    assert main(["certs", "init", "--cluster", "shop", "--out", str(tmp_path / "ca")]) == 0
    out_dir = tmp_path / "ops"
    assert main(["certs", kind, "ops", "--ca", str(tmp_path / "ca"), "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert f"{kind} 'ops' of cluster 'shop'" in out
    assert stat.S_IMODE((out_dir / f"{kind}-key.pem").stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate((out_dir / f"{kind}.pem").read_bytes())
    assert f"serial {cert.serial_number:x})" in out
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
        f"p2pshard://shop/{kind}/ops"
    ]


def test_certs_request_here_and_sign_where_the_ca_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ca, here = tmp_path / "ca", tmp_path / "alice"
    assert main(["certs", "init", "--cluster", "shop", "--out", str(ca)]) == 0
    request = ["certs", "request", "alice", "--kind", "admin", "--cluster", "shop"]
    assert main([*request, "--out", str(here)]) == 0
    out = capsys.readouterr().out
    assert f"key {here / 'admin-key.pem'} (mode 0600, keep it here)" in out
    assert "p2pshard certs sign admin.csr --ca CA_DIR --out admin.pem" in out
    assert stat.S_IMODE((here / "admin-key.pem").stat().st_mode) == 0o600
    sign = ["certs", "sign", str(here / "admin.csr"), "--ca", str(ca)]
    assert main([*sign, "--out", str(here / "admin.pem"), "--days", "30"]) == 0
    out = capsys.readouterr().out
    cert = x509.load_pem_x509_certificate((here / "admin.pem").read_bytes())
    assert "signed admin 'alice' of cluster 'shop'" in out
    assert "  identity     p2pshard://shop/admin/alice\n" in out
    assert "  key          ECDSA P-256\n" in out
    assert f"  serial       {cert.serial_number:x}  (deny it with serial:" in out
    assert f"send back {here / 'admin.pem'} and the CA certificate {ca / 'ca.pem'}" in out
    # The same request again would overwrite the certificate: refused without --force.
    assert main([*sign, "--out", str(here / "admin.pem")]) == 2
    assert "admin.pem already exists" in capsys.readouterr().err
    # A request for another cluster is refused with the reason, and nothing is written.
    assert main(["certs", "init", "--cluster", "other", "--out", str(tmp_path / "other")]) == 0
    capsys.readouterr()
    other = ["certs", "sign", str(here / "admin.csr"), "--ca", str(tmp_path / "other")]
    assert main([*other, "--out", str(tmp_path / "x.pem")]) == 2
    err = capsys.readouterr().err
    assert "p2pshard certs: error: refusing to sign" in err
    assert "it is for cluster 'shop' (p2pshard://shop/admin/alice), but this CA signs for" in err
    assert not (tmp_path / "x.pem").exists()


def test_certs_request_needs_a_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["certs", "request", "x", "--kind", "root", "--cluster", "c", "--out", str(tmp_path)])
    assert info.value.code == 2
    assert "argument --kind: invalid choice: 'root'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def _pyproject_version() -> str:
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    return str(tomllib.loads(pyproject.read_text())["project"]["version"])


def test_version_is_the_one_pyproject_sets(capsys: pytest.CaptureFixture[str]) -> None:
    """What ``--version`` prints comes from the installed metadata: a release that set one number
    in pyproject.toml and ran with a stale install would show the old one here."""
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"p2pshard {_pyproject_version()}\n"


def test_cli_errors_name_the_problem_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["certs", "init", "--cluster", "bad name", "--out", str(tmp_path)]) == 2
    assert "cluster name 'bad name' is invalid" in capsys.readouterr().err
    assert (
        main(["certs", "node", "n1", "--ca", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
    )
    assert "cannot read the cluster CA" in capsys.readouterr().err
    (tmp_path / "node.toml").write_text(
        'cluster_name = "c"\nnode_name = "n"\nbind_port = 70000\n'
        '[tls]\nca_file = "a"\ncert_file = "b"\nkey_file = "c"\n'
    )
    assert main(["node", "--config", str(tmp_path / "node.toml")]) == 2
    err = capsys.readouterr().err
    assert "bind_port = 70000 is invalid" in err
    assert main(["local-cluster", "--nodes", "0", "--dir", str(tmp_path / "lc")]) == 2
    assert "--nodes 0 is invalid" in capsys.readouterr().err


def test_local_cluster_refuses_a_port_in_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = free_port_block(2)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", base + 1))
        busy.listen()
        code = main(
            ["local-cluster", "--nodes", "2", "--base-port", str(base), "--dir", str(tmp_path)]
        )
    assert code == 2
    assert f"cannot use 127.0.0.1:{base + 1}" in capsys.readouterr().err


def test_node_with_missing_certificate_files_says_which(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "node.toml").write_text(
        'cluster_name = "c"\nnode_name = "n"\nbind_port = 0\nself_join = true\n'
        '[tls]\nca_file = "ca.pem"\ncert_file = "node.pem"\nkey_file = "node-key.pem"\n'
    )
    assert main(["node", "--config", str(tmp_path / "node.toml")]) == 2
    assert f"TLS CA file '{tmp_path / 'ca.pem'}' does not exist" in capsys.readouterr().err


def test_local_cluster_links_every_node_and_stops_cleanly(tmp_path: Path) -> None:
    """The README's main job, end to end: three processes form a cluster over TLS, then leave."""
    base = free_port_block(3)
    started = time.monotonic()
    result = subprocess.run(
        [
            *PYTHON,
            "local-cluster",
            "--nodes",
            "3",
            "--base-port",
            str(base),
            "--dir",
            str(tmp_path),
            "--duration",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    for i in (1, 2, 3):
        assert f"node-{i}: members: node-1 UP, node-2 UP, node-3 UP" in output, output
        assert f"node-{i}: stopped (removed from the cluster)" in output, output
    assert time.monotonic() - started < 60
    assert "Traceback" not in output


def test_node_process_stops_on_sigterm(tmp_path: Path) -> None:
    assert main(["certs", "init", "--cluster", "c", "--out", str(tmp_path / "ca")]) == 0
    assert (
        main(["certs", "node", "n", "--ca", str(tmp_path / "ca"), "--out", str(tmp_path / "n")])
        == 0
    )
    (tmp_path / "node.toml").write_text(
        'cluster_name = "c"\nnode_name = "n"\nbind_port = 0\nself_join = true\n'
        'app_version = "2.4.1"\n'
        '[tls]\nca_file = "n/ca.pem"\ncert_file = "n/node.pem"\nkey_file = "n/node-key.pem"\n'
    )
    with subprocess.Popen(
        [*PYTHON, "node", "--config", str(tmp_path / "node.toml")],
        stderr=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            assert child.stderr is not None
            deadline = time.monotonic() + 30
            for line in child.stderr:
                if "running as" in line:
                    break
                assert time.monotonic() < deadline
            # The log says which release and app_version started (a rolling upgrade's record).
            assert f"(p2pshard {_pyproject_version()}, app_version 2.4.1)" in line
            child.send_signal(signal.SIGTERM)
            assert child.wait(timeout=30) == 0
            assert "SIGTERM received, leaving the cluster" in child.stderr.read()
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()


def test_three_processes_remove_a_node_killed_with_sigkill(tmp_path: Path) -> None:
    """Real processes over TLS: kill -9 one node; the other two detect, down and remove it."""
    base = free_port_block(3)
    plan = LocalCluster(nodes=3, data_dir=tmp_path, base_port=base)
    configs = plan.prepare()
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "P2PSHARD_SPLIT_BRAIN_RESOLVER__STABLE_AFTER": "3",
    }
    logs = [tmp_path / f"node-{i}.log" for i in (1, 2, 3)]
    with node_processes(configs, logs, env) as children:
        everyone = "members: node-1 UP, node-2 UP, node-3 UP"
        wait_for_lines(logs, everyone, limit=60)
        children[2].send_signal(signal.SIGKILL)
        children[2].wait(timeout=10)
        wait_for_lines(logs[:2], "members: node-1 UP, node-2 UP", after=everyone, limit=60)
        for log in logs[:2]:
            text = log.read_text()
            assert "node-3@" in text.split(everyone, 1)[1]
            assert "is unreachable" in text
            assert "node-3 DOWN" in text  # downed by the split brain resolver, then removed


def test_a_node_downed_by_the_cluster_exits_with_exit_downed_and_a_leaving_one_with_0(
    tmp_path: Path,
) -> None:
    """SIGSTOP one of three node processes until the others down it; woken, it learns that it
    was downed and exits with EXIT_DOWNED (for a supervisor to restart it); the others leave on
    SIGTERM and exit with 0."""
    base = free_port_block(3)
    configs = LocalCluster(nodes=3, data_dir=tmp_path, base_port=base).prepare()
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "P2PSHARD_SPLIT_BRAIN_RESOLVER__STABLE_AFTER": "3",
    }
    logs = [tmp_path / f"node-{i}.log" for i in (1, 2, 3)]
    with node_processes(configs, logs, env) as children:
        everyone = "members: node-1 UP, node-2 UP, node-3 UP"
        wait_for_lines(logs, everyone, limit=60)
        children[2].send_signal(signal.SIGSTOP)
        wait_for_lines(logs[:2], "node-3 DOWN", after=everyone, limit=60)
        children[2].send_signal(signal.SIGCONT)
        assert children[2].wait(timeout=60) == EXIT_DOWNED, logs[2].read_text()
        assert "exiting with status 3 so that a supervisor starts this node again" in (
            logs[2].read_text()
        )
        for child in children[:2]:
            child.send_signal(signal.SIGTERM)
        assert [child.wait(timeout=60) for child in children[:2]] == [0, 0]


# -- misconfiguration fails at start, with the reason ---------------------------------------------


def node_files(tmp_path: Path, cluster: str, node: str) -> Path:
    """A CA for ``cluster`` and a certificate for ``node`` under ``tmp_path``; the node's dir."""
    ca = tmp_path / f"ca-{cluster}"
    if not (ca / "ca.pem").exists():
        assert main(["certs", "init", "--cluster", cluster, "--out", str(ca)]) == 0
    out = tmp_path / f"{cluster}-{node}"
    assert main(["certs", "node", node, "--ca", str(ca), "--out", str(out)]) == 0
    return out


def node_toml(path: Path, files: Path, *, name: str = "node-1", extra: str = "") -> Path:
    path.write_text(
        f'cluster_name = "shop"\nnode_name = "{name}"\nbind_port = 0\n{extra}'
        f'[tls]\nca_file = "{files}/ca.pem"\ncert_file = "{files}/node.pem"\n'
        f'key_file = "{files}/node-key.pem"\n'
    )
    return path


def run_node(config: Path) -> subprocess.CompletedProcess[str]:
    """``p2pshard node --config``, expected to end by itself (a node that runs times out)."""
    return subprocess.run(
        [*PYTHON, "node", "--config", str(config)], capture_output=True, text=True, timeout=30
    )


def test_node_with_a_certificate_of_another_node_or_cluster_refuses_to_start(
    tmp_path: Path,
) -> None:
    seed = 'seed_nodes = ["127.0.0.1:1"]\n'
    other_node = node_files(tmp_path, "shop", "node-2")
    result = run_node(node_toml(tmp_path / "a.toml", other_node, extra=seed))
    assert result.returncode == 2, result.stderr
    assert "is for node 'node-2' of cluster 'shop' (p2pshard://shop/node-2)" in result.stderr
    assert "cluster_name = 'shop' and node_name = 'node-1'" in result.stderr
    other_cluster = node_files(tmp_path, "other", "node-1")
    result = run_node(node_toml(tmp_path / "b.toml", other_cluster, extra=seed))
    assert result.returncode == 2, result.stderr
    assert "is for node 'node-1' of cluster 'other'" in result.stderr
    assert "needs a certificate for p2pshard://shop/node-1" in result.stderr
    assert "Traceback" not in result.stderr


def test_node_with_a_bind_address_in_use_names_it(tmp_path: Path) -> None:
    files = node_files(tmp_path, "shop", "node-1")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = node_toml(tmp_path / "node.toml", files, extra='seed_nodes = ["127.0.0.1:1"]\n')
        config.write_text(config.read_text().replace("bind_port = 0", f"bind_port = {port}"))
        result = run_node(config)
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "give this node another bind_port" in result.stderr


def test_node_with_nowhere_to_join_refuses_to_start(tmp_path: Path) -> None:
    files = node_files(tmp_path, "shop", "node-1")
    result = run_node(node_toml(tmp_path / "node.toml", files))
    assert result.returncode == 2, result.stderr
    assert "seed_nodes is empty and self_join is false" in result.stderr
    assert "set self_join = true" in result.stderr


# -- Ctrl-C --------------------------------------------------------------------------------------


def test_a_second_ctrl_c_while_the_node_leaves_prints_no_traceback(tmp_path: Path) -> None:
    files = node_files(tmp_path, "shop", "node-1")
    port = free_port_block(1)
    config = node_toml(tmp_path / "node.toml", files, extra=f'seed_nodes = ["127.0.0.1:{port}"]\n')
    config.write_text(config.read_text().replace("bind_port = 0", f"bind_port = {port}"))
    seen: list[str] = []
    with subprocess.Popen(
        [*PYTHON, "node", "--config", str(config)],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "P2PSHARD_CLUSTER__SEED_NODE_TIMEOUT": "0.5"},  # no one else to ask
    ) as child:
        try:
            assert child.stderr is not None
            read_until(child.stderr, "members: node-1 UP", seen)
            child.send_signal(signal.SIGINT)
            read_until(child.stderr, "SIGINT received, leaving the cluster", seen)
            child.send_signal(signal.SIGINT)  # while it leaves: it takes a few gossip rounds
            seen.append(child.stderr.read())
            assert child.wait(timeout=30) == 0, "".join(seen)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    output = "".join(seen)
    assert "SIGINT received; already leaving" in output, output
    assert "Traceback" not in output, output
    assert "node-1: stopped (removed from the cluster)" in output, output


def test_ctrl_c_while_the_local_cluster_starts_prints_no_traceback(tmp_path: Path) -> None:
    """Ctrl-C reaches the launcher's whole process group, as a terminal sends it."""
    status, output = interrupt_local_cluster(tmp_path)
    assert status == 0, output
    assert "stopping the cluster" in output, output
    assert "Traceback" not in output, output
    assert "KeyboardInterrupt" not in output, output


def test_ctrl_c_stops_a_local_cluster_started_with_sigint_ignored(tmp_path: Path) -> None:
    """A launcher started from a script's background job inherits SIGINT ignored, and Python
    then raises no KeyboardInterrupt: the old launcher ran on after Ctrl-C (a full test run
    started that way hung on it for 8 minutes). The launcher takes SIGINT itself now."""
    status, output = interrupt_local_cluster(tmp_path, sigint_ignored=True)
    assert status == 0, output
    assert "stopping the cluster" in output, output


def interrupt_local_cluster(tmp_path: Path, *, sigint_ignored: bool = False) -> tuple[int, str]:
    """Start a two-node local cluster, Ctrl-C its process group once it runs; its exit status
    and output. Whatever is still running at the end (the launcher, its nodes) is killed."""
    base = free_port_block(2)
    command = ["local-cluster", "--nodes", "2", "--base-port", str(base), "--dir", str(tmp_path)]
    seen: list[str] = []
    nodes: list[int] = []
    with subprocess.Popen(
        [*PYTHON, *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=ignore_sigint if sigint_ignored else None,
    ) as launcher:
        try:
            assert launcher.stdout is not None
            read_until(launcher.stdout, "Ctrl-C stops it", seen)
            nodes = [int(pid) for pid in re.findall(r"\(pid (\d+)\)", seen[-1])]
            if not sigint_ignored:
                wait_until_python_takes_sigint(nodes)  # the nodes are importing their modules
            os.killpg(launcher.pid, signal.SIGINT)
            rest, _ = launcher.communicate(timeout=60)
            seen.append(rest)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
                for pid in nodes:  # in sessions of their own: the launcher's group missed them
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
    return launcher.returncode, "".join(seen)


def ignore_sigint() -> None:
    """In the child before it runs: SIGINT ignored, as a background job of a script has it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def wait_until_python_takes_sigint(pids: list[int]) -> None:
    """Until each process has a SIGINT handler: Python installs its own as it starts.

    Before that a SIGINT ends the process without a word; after it, in the old launcher, it
    raised KeyboardInterrupt in the middle of the node's imports.
    """
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        masks = []
        for pid in pids:
            status = Path(f"/proc/{pid}/status").read_text()
            caught = re.search(r"^SigCgt:\s*([0-9a-f]+)$", status, re.MULTILINE)
            assert caught is not None, status
            masks.append(int(caught[1], 16))
        if all(mask & (1 << (signal.SIGINT - 1)) for mask in masks):
            return
        time.sleep(0.005)
    raise AssertionError(f"processes {pids} never took SIGINT")


def test_local_cluster_port_check_ignores_connections_in_time_wait(tmp_path: Path) -> None:
    """A cluster stopped a moment ago leaves TIME-WAIT connections on its ports: not taken."""
    plan = LocalCluster(nodes=1, data_dir=tmp_path, base_port=time_wait_port())
    plan.check_ports()


def test_sighup_reloads_the_deny_list_and_keeps_the_old_one_when_the_new_is_bad(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real node process: a client is served, then denied after SIGHUP; a bad file is not
    taken."""
    assert main(["certs", "init", "--cluster", "c", "--out", str(tmp_path / "ca")]) == 0
    for kind, name in (("node", "n"), ("client", "ops"), ("client", "other")):
        args = ["certs", kind, name, "--ca", str(tmp_path / "ca"), "--out", str(tmp_path / name)]
        assert main(args) == 0
    port = free_port_block(1)
    config = tmp_path / "node.toml"
    node_toml = (
        f'cluster_name = "c"\nnode_name = "n"\nbind_port = {port}\nself_join = true\n'
        '[tls]\nca_file = "n/ca.pem"\ncert_file = "n/node.pem"\nkey_file = "n/node-key.pem"\n'
    )
    config.write_text(node_toml)
    for name in ("ops", "other"):
        (tmp_path / f"{name}.toml").write_text(
            f'cluster_name = "c"\n[tls]\nca_file = "{name}/ca.pem"\n'
            f'cert_file = "{name}/client.pem"\nkey_file = "{name}/client-key.pem"\n'
        )
    log = tmp_path / "node.log"

    def status(client: str) -> int:
        capsys.readouterr()
        config = str(tmp_path / f"{client}.toml")
        return main(["status", "--node", f"127.0.0.1:{port}", "--config", config, "--json"])

    with log.open("w") as out:
        child = subprocess.Popen([*PYTHON, "node", "--config", str(config)], stderr=out)
    try:
        wait_for_lines([log], "SIGHUP reloads [tls]", limit=30)
        assert status("ops") == 0
        assert '"name": "n"' in capsys.readouterr().out

        config.write_text(node_toml + 'deny = ["client ops"]\n')
        child.send_signal(signal.SIGHUP)
        wait_for_lines([log], "is refused: tls.deny = ('client ops',) is invalid", limit=30)
        assert status("ops") == 0  # the old settings stay

        config.write_text(
            node_toml.replace("node_name", "shutdown_timeout = 3\nnode_name")
            + 'deny = ["client:ops"]\n'
        )
        child.send_signal(signal.SIGHUP)
        wait_for_lines([log], "SIGHUP: applied [tls]", limit=30)
        text = log.read_text()
        assert "changes more than [tls]; the rest applies at the next start" in text
        assert status("ops") == 1
        assert "cannot link to it" in capsys.readouterr().err
        assert status("other") == 0  # only the denied client is refused
        assert "client:ops (certificate serial" in log.read_text()
        assert child.poll() is None
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
