"""Support code for the tests: simulated clusters, worker programs and process helpers.

Nothing here is a test; tests import from here, never from each other.
"""
