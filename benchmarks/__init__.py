"""Benchmarks: scripts run by hand, not by the test suite (see each module's docstring)."""
