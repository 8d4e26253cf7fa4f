"""Rewrite the golden wire fixtures of the current protocol version.

Run from the repository root::

    .venv/bin/python -m tests.wire_fixtures.regenerate

It writes ``tests/wire_fixtures/v<current>/`` (frames and schema) from the samples in
``_samples.py``, and refuses:

- to write any other version's set: an older version's set records what released nodes send and
  is never rewritten (``--version`` names the set, for that check);
- when the current classes cannot read, or be read by, any committed set (the same check as
  ``tests/test_wire_golden.py``): regenerating must not hide an incompatible change;
- when an internal message type has no sample.

It runs itself again with ``PYTHONHASHSEED=0``: sets and frozensets are encoded in iteration
order, so a fixed seed keeps the frames the same from one run to the next.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from membership.internal import wire

from . import _golden
from ._golden import GoldenSet, Json
from ._samples import TO_UID, plain_samples, samples


class RegenerateError(Exception):
    """The set cannot be written; the message says why and what to do."""


def build_set(version: int) -> GoldenSet:
    """The set of ``version`` as the current code and samples make it.

    Raises:
        RegenerateError: an internal type has no sample, or a sample does not round-trip.
    """
    internal = _golden.internal_wire_names()
    frames: dict[str, list[dict[str, Json]]] = {}
    try:
        values = samples()
    except ValueError as exc:
        raise RegenerateError(str(exc)) from exc
    for value in values:
        name = wire.wire_name(type(value))
        if name is None:
            raise RegenerateError(f"sample {value!r} is of a class that is not registered")
        frames.setdefault(name, []).append(frame_of(value))
    frames[_golden.PLAIN] = [frame_of(value) for value in plain_samples()]
    missing = sorted(set(internal) - set(frames))
    if missing:
        raise RegenerateError(
            f"no sample of {', '.join(missing)}: add a representative instance of each to "
            "samples() in tests/wire_fixtures/_samples.py"
        )
    names = sorted(name for name in frames if name != _golden.PLAIN)
    return GoldenSet(version=version, frames=frames, schema=_golden.live_schema(names))


def frame_of(value: object) -> dict[str, Json]:
    """The recorded frame of ``value``: its payload and what the current code decodes it to.

    Raises:
        RegenerateError: ``value`` does not come back equal from the wire.
    """
    payload = wire.encode(value, to_uid=TO_UID)
    to_uid, decoded = wire.decode_parts(payload)
    if decoded != value or to_uid != TO_UID:
        raise RegenerateError(f"sample {value!r} decodes as {decoded!r}: pick another value")
    kind = payload[1]
    return {
        "kind": _golden.KIND_NAMES[kind],
        "to_uid": to_uid,
        "hex": payload.hex(),
        "repr": repr(decoded),
        "value": _golden.describe(decoded),
    }


def regenerate(version: int | None = None, root: Path = _golden.FIXTURES) -> Path:
    """Write the current version's set under ``root``; returns its directory.

    Raises:
        RegenerateError: ``version`` is not the current one, a committed set is newer than this
            code, the current classes are incompatible with a committed schema, or a sample is
            missing.
    """
    current = _golden.current_version()
    if version is None:
        version = current
    label = _golden.set_label(version)
    if version < current:
        raise RegenerateError(
            f"{label} is the set of an older protocol version (this code speaks {current}): "
            "a released version's set is never rewritten, since it records what its nodes send"
        )
    if version > current:
        raise RegenerateError(f"this code speaks protocol version {current}, not {version}")
    newer = [v for v in _golden.committed_versions(root) if v > current]
    if newer:
        raise RegenerateError(
            f"sets of newer protocol versions are committed ({', '.join(map(str, newer))}); "
            f"this code speaks {current}: regenerate from code that speaks the newest"
        )
    golden = build_set(version)
    problems = []
    for committed in _golden.committed_versions(root):
        old = _golden.load_set(committed, root)
        problems += [
            f"{old.label}: {p}" for p in _golden.compare_schemas(old.schema, golden.schema)
        ]
    if problems:
        raise RegenerateError(
            "refusing to regenerate: the current classes cannot exchange messages with nodes "
            "of a committed set, and rewriting the set would hide it:\n  "
            + "\n  ".join(problems)
            + "\nChange the class instead: add a field last with a default, or add a new type."
        )
    return _golden.write_set(golden, root)


def main(argv: list[str] | None = None) -> int:
    """The command line: ``python -m tests.wire_fixtures.regenerate [--version N]``."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.wire_fixtures.regenerate",
        description="Rewrite the golden wire fixtures of the current protocol version.",
    )
    parser.add_argument(
        "--version",
        type=int,
        default=None,
        help="the protocol version of the set to write (default and only choice: the current)",
    )
    args = parser.parse_args(argv)
    if os.environ.get("PYTHONHASHSEED") != "0":
        rerun = [sys.executable, "-m", "tests.wire_fixtures.regenerate", *(argv or sys.argv[1:])]
        return subprocess.run(rerun, env={**os.environ, "PYTHONHASHSEED": "0"}).returncode
    try:
        directory = regenerate(args.version)
    except RegenerateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    golden = _golden.load_set(int(directory.name[1:]), directory.parent)
    count = sum(len(frames) for frames in golden.frames.values())
    shown = directory.relative_to(Path.cwd()) if directory.is_relative_to(Path.cwd()) else directory
    print(f"wrote {count} frames of {len(golden.schema)} message types to {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
