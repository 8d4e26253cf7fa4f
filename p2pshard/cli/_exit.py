"""The exit statuses of ``p2pshard node``.

A module of their own: the CLI and the test harnesses that run node processes both read them,
and neither imports the other.
"""

EXIT_DOWNED = 3
"""``p2pshard node``'s exit status when the cluster downed or removed the node without being
asked: a supervisor that restarts on failure (systemd ``Restart=on-failure``, a Kubernetes pod)
starts it again, and it rejoins as a new incarnation. A graceful leave (SIGTERM, Ctrl-C) exits
with 0, a configuration error with 2, a failure to run (the address is taken) with 1."""

EXIT_APP_FAILED = 4
"""``p2pshard node --app``'s exit status when the application's setup function raised: the node
left the cluster gracefully (its shards handed off) and the log holds the traceback. An app that
cannot be loaded at all (no such module or function) is a configuration error, 2, found before
the node starts."""
