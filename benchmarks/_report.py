"""What the benchmark scripts share to report: median and percentiles, JSON without NaN, table
cells, progress, and running a whole benchmark to a printed report.

Every script is a module of the ``benchmarks`` package, run from the project root as
``python -m benchmarks.NAME``; none edits ``sys.path``.

A figure that could not be had is NaN in the report, ``-`` in a table and null in JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import sys
import traceback
from collections.abc import Callable
from typing import Any


def benchmark_parser(doc: str | None, *, quick: str) -> argparse.ArgumentParser:
    """The arguments every benchmark takes: ``--quick`` (its help says what it cuts) and ``--json``.

    The description is the first line of the script's docstring ``doc``.
    """
    parser = argparse.ArgumentParser(description=doc.split("\n", 1)[0] if doc else None)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def progress_line(enabled: bool, text: str) -> None:
    """One progress line on stderr."""
    if enabled:
        print(text, file=sys.stderr, flush=True)


def median(samples: list[float]) -> float:
    """The median, NaN for no samples."""
    return statistics.median(samples) if samples else math.nan


def p99(samples: list[float]) -> float:
    """The 99th percentile (the inclusive method, interpolated), NaN for no samples."""
    if not samples:
        return math.nan
    if len(samples) == 1:
        return samples[0]
    return statistics.quantiles(samples, n=100, method="inclusive")[98]


def quantiles_ms(samples: list[float]) -> dict[str, float]:
    """p50 and p99 of ``samples`` (seconds) in milliseconds; NaN for no samples."""
    return {"p50_ms": median(samples) * 1e3, "p99_ms": p99(samples) * 1e3}


def quantiles_us(samples: list[float]) -> dict[str, float]:
    """p50 and p99 of ``samples`` (seconds) in microseconds; NaN for no samples."""
    return {"p50_us": median(samples) * 1e6, "p99_us": p99(samples) * 1e6}


def json_safe(value: Any) -> Any:
    """``value`` with NaN (a figure that could not be had) as None: strict JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def cell(value: float | None, spec: str = ".2f") -> str:
    """A table cell: ``value`` formatted, or ``-`` when there is none."""
    return "-" if value is None or math.isnan(value) else format(value, spec)


def run_and_print(
    run: Callable[[], dict[str, Any]],
    table: Callable[[dict[str, Any]], str],
    *,
    as_json: bool,
    stopped: str,
) -> int:
    """Run a benchmark and print its report (a table, or JSON); the exit status.

    A plain kill unwinds through the clean-up as Ctrl-C does; ``stopped`` says what that
    clean-up stopped. A measurement that fails is printed with its traceback.
    """
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        report = run()
    except KeyboardInterrupt:
        print(f"interrupted; {stopped}", file=sys.stderr)
        return 130
    except Exception as exc:  # a measurement failed: say which, with its traceback
        while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]  # type: ignore[assignment]
        traceback.print_exception(exc, file=sys.stderr)
        print(f"benchmark failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(json_safe(report), indent=2) if as_json else table(report))
    return 0
