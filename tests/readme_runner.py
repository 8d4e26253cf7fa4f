"""Runs one documentation fragment against a real node: ``python -m tests.readme_runner PARTS``.

``PARTS`` is a JSON file: a list of ``[source, filename, first_line]``, the fragment and then the
code of its example comment (see ``tests/test_readme.py``). The node is opened from
``node.toml`` in the working directory and is Up before the first part runs; each part runs in
one namespace holding ``node`` and ``trio``, compiled with top-level ``await`` allowed and with
the line numbers of the file it came from, so a traceback points at the document's line.
"""

from __future__ import annotations

import ast
import inspect
import json
import sys
from pathlib import Path

import trio

from p2pshard import NodeConfig, open_node


async def run(parts: list[tuple[str, str, int]]) -> None:
    async with open_node(NodeConfig.load("node.toml")) as node:
        await node.cluster.wait_up()
        namespace: dict[str, object] = {"__name__": "__readme__", "node": node, "trio": trio}
        for source, filename, first_line in parts:
            code = compile(
                "\n" * (first_line - 1) + source,
                filename,
                "exec",
                flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
                dont_inherit=True,
            )
            result = eval(code, namespace)  # the repository's own documentation
            if inspect.iscoroutine(result):
                await result


def main() -> None:
    parts = [(str(s), str(f), int(n)) for s, f, n in json.loads(Path(sys.argv[1]).read_text())]
    trio.run(run, parts)


if __name__ == "__main__":
    main()
