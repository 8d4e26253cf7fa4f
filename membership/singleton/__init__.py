"""Cluster singletons.

The sans-IO cores that decide where the instance runs (``_core``) and where a proxy sends
(``_proxy_core``), and the trio manager and proxy that run it and route messages to it.
"""

from ._manager import SingletonContext as SingletonContext
from ._manager import SingletonRequest as SingletonRequest
from ._manager import Singletons as Singletons
from ._proxy import SingletonProxy as SingletonProxy
from ._proxy_core import SingletonUnavailable as SingletonUnavailable
