"""The ``p2pshard`` command.

``node`` (with ``--app``, an application's setup function), ``status``, ``leave``/``down``,
``certs``, ``chaos`` and the local cluster, and the exit statuses of ``p2pshard node``.
"""

from ._exit import EXIT_APP_FAILED as EXIT_APP_FAILED
from ._exit import EXIT_DOWNED as EXIT_DOWNED
from ._main import main as main
