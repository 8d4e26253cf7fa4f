#!/usr/bin/env bash
# The whole test suite: lint, types, tests. `scripts/test.sh --slow` adds soak and many-seed runs;
# any other arguments go to pytest.
source "$(dirname "$0")/_venv.sh"
ruff check .
ruff format --check .
mypy
python -m pytest "$@"
