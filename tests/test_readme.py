"""Every Python example of the documentation runs, as written, against a real node.

The documents are README.md and every Markdown file under docs/ and examples/. A fenced block is
an example when the line right before it closes an HTML comment that opens with ``example:``::

    <!-- example: MODE; prints: TEXT
    code run after the block, with its names (optional)
    -->

Modes: ``program`` (a ```python block that is a whole program: run as a script in the example
directory), ``fragment`` (a ```python block run with ``node`` bound to a running node that is Up,
top-level ``await`` allowed; see ``tests/readme_runner.py``), ``shell`` (a ```sh block run with
bash in the example directory before any Python example), ``node.toml`` (a ```toml block that is
the directory's ``node.toml``) and ``node.toml, added`` (a ```toml block of tables added to it).
``prints: TEXT`` asks for a line of standard output equal to TEXT. A ```python block without such
a comment fails the test: no example goes untested. A block may appear in more than one document
(the README's first steps are also on the docs site): the ``node.toml`` blocks must then be
identical, and each distinct shell block runs once.

The example directory gets the certificates the shell examples make and the node.toml the toml
examples make; each program or fragment runs in its own process, with ``P2PSHARD_BIND_PORT`` and
``P2PSHARD_SEED_NODES`` moved to a free port (the documents use 25520), and the management
endpoint to any free port (``P2PSHARD_MANAGEMENT__PORT=0``; the documents use 8558).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from p2pshard import NodeConfig
from p2pshard.testing import free_port

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = sorted({ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("examples/**/*.md")})
PYTHON_MODES = ("program", "fragment")
TIMEOUT = 90.0


@attrs.frozen
class Example:
    document: Path
    line: int
    """The line of the block's opening fence (1-based)."""
    language: str
    code: str
    mode: str | None
    options: dict[str, str] = attrs.field(factory=dict)
    then: str = ""
    then_line: int = 0

    @property
    def where(self) -> str:
        return f"{self.document.relative_to(ROOT)}:{self.line}"


_FENCE = re.compile(r"^```(\w*)\s*$")


def examples(document: Path) -> list[Example]:
    """Every fenced block of ``document`` at the top level, with its example comment if any."""
    lines = document.read_text().splitlines()
    found: list[Example] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{document}:{i + 1}: the fence is never closed"
        code = "\n".join(lines[i + 1 : end]) + "\n"
        found.append(_with_comment(document, lines, i, match.group(1), code))
        i = end + 1
    return found


def _with_comment(
    document: Path, lines: list[str], fence: int, language: str, code: str
) -> Example:
    plain = Example(document, fence + 1, language, code, None)
    if fence == 0 or not lines[fence - 1].rstrip().endswith("-->"):
        return plain
    start = fence - 1
    while start >= 0 and not lines[start].startswith("<!--"):
        start -= 1
    if start < 0:
        return plain
    head = lines[start].removeprefix("<!--").strip()
    body = lines[start + 1 : fence]
    if head.endswith("-->"):
        head, body = head.removesuffix("-->").strip(), []
    else:
        body = [*body[:-1], body[-1].rstrip().removesuffix("-->")]
    if not head.startswith("example:"):
        return plain
    mode, *rest = (part.strip() for part in head.removeprefix("example:").split(";"))
    options = {}
    for option in rest:
        key, sep, value = option.partition(":")
        assert sep, f"{document}:{start + 1}: option {option!r} is not KEY: VALUE"
        options[key.strip()] = value.strip()
    then = "\n".join(body).strip("\n")
    return attrs.evolve(
        plain, mode=mode, options=options, then=then + "\n" if then else "", then_line=start + 2
    )


ALL = [example for document in DOCUMENTS for example in examples(document)]
PYTHON = [e for e in ALL if e.language == "python"]


def test_every_python_example_is_marked_and_compiles() -> None:
    assert PYTHON, "no Python examples found"
    for example in ALL:
        kinds = {
            "python": PYTHON_MODES,
            "sh": ("shell",),
            "toml": ("node.toml", "node.toml, added"),
        }
        if example.mode is not None:
            assert example.mode in kinds.get(example.language, ()), (
                f"{example.where}: example: {example.mode} does not go with a ```"
                f"{example.language} block"
            )
            assert set(example.options) <= {"prints"}, f"{example.where}: {example.options}"
    unmarked = [e.where for e in PYTHON if e.mode is None]
    assert not unmarked, f"Python blocks without an <!-- example: ... --> comment: {unmarked}"
    for example in PYTHON:
        flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT  # fragments may await at the top level
        compile(example.code, example.where, "exec", flags=flags, dont_inherit=True)
        if example.then:
            compile(example.then, example.where, "exec", flags=flags, dont_inherit=True)


@pytest.fixture(scope="module")
def example_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory made by the shell and toml examples: certificates and node.toml."""
    directory = tmp_path_factory.mktemp("readme")
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    # A block may be shown twice (README.md and a docs page): each distinct one runs once.
    shells = {e.code: e for e in ALL if e.mode == "shell"}
    for example in shells.values():
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", example.code],
            cwd=directory,
            env={**os.environ, "PATH": path},
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert result.returncode == 0, f"{example.where}: {result.stdout}{result.stderr}"
    bases = {e.code for e in ALL if e.mode == "node.toml"}
    where = [e.where for e in ALL if e.mode == "node.toml"]
    assert len(bases) == 1, f"the node.toml examples differ: {where}"
    [base] = bases
    (directory / "base.toml").write_text(base)
    added = [e.code for e in ALL if e.mode == "node.toml, added"]
    (directory / "node.toml").write_text("\n".join([base, *added]))
    return directory


def test_the_node_toml_example_is_complete(example_dir: Path) -> None:
    """The file as README shows it loads, and names the certificates the shell example made."""
    config = NodeConfig.load(example_dir / "base.toml", environ={})
    for path in (config.tls.ca_file, config.tls.cert_file, config.tls.key_file):
        assert path.is_file(), path
    assert config.seed_nodes == (config.canonical_address,)


@pytest.mark.parametrize("example", PYTHON, ids=[e.where for e in PYTHON])
def test_the_example_runs(example: Example, example_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
        "P2PSHARD_BIND_PORT": str(port),
        "P2PSHARD_SEED_NODES": f"127.0.0.1:{port}",
        "P2PSHARD_MANAGEMENT__PORT": "0",
    }
    if example.mode == "program":
        script = tmp_path / "example.py"
        script.write_text("\n" * (example.line) + example.code)
        command = [sys.executable, str(script)]
    else:
        parts = [(example.code, str(example.document), example.line + 1)]
        if example.then:
            parts.append((example.then, str(example.document), example.then_line))
        (tmp_path / "parts.json").write_text(json.dumps(parts))
        command = [sys.executable, "-m", "tests.readme_runner", str(tmp_path / "parts.json")]
    result = subprocess.run(
        command, cwd=example_dir, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    output = f"{example.where}:\n{result.stdout}\n{result.stderr}"
    assert result.returncode == 0, output
    assert "Traceback" not in result.stderr, output
    if "prints" in example.options:
        assert example.options["prints"] in result.stdout.splitlines(), output
