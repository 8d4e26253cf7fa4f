"""What the benchmark scripts share to report: quantiles, JSON without NaN, table cells, progress.

A figure that could not be had is NaN in the report, ``-`` in a table and null in JSON.
"""

from __future__ import annotations

import math
import statistics
import sys
from typing import Any


def progress_line(enabled: bool, text: str) -> None:
    """One progress line on stderr."""
    if enabled:
        print(text, file=sys.stderr, flush=True)


def quantiles_ms(samples: list[float]) -> dict[str, float]:
    """p50 and p99 of ``samples`` (seconds) in milliseconds; NaN for no samples."""
    if not samples:
        return {"p50_ms": math.nan, "p99_ms": math.nan}
    if len(samples) == 1:
        return {"p50_ms": samples[0] * 1e3, "p99_ms": samples[0] * 1e3}
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return {"p50_ms": statistics.median(samples) * 1e3, "p99_ms": cuts[98] * 1e3}


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
