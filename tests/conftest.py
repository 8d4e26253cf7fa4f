"""Suite-wide options: ``--slow`` runs the soak and many-seed tests marked ``slow``, and the
costly property tests with their full example counts (``tests/_support/examples.py``)."""

from __future__ import annotations

import pytest

from tests._support import examples


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        help="also run tests marked slow (soak and many-seed runs; minutes, not seconds)",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Before the test modules are imported: their hypothesis settings read it.
    examples.FULL = bool(config.getoption("--slow"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
