"""Cluster singletons.

The sans-IO core that decides where the instance runs, and the trio manager and proxy that run
it and route messages to it.
"""

from ._manager import SingletonContext as SingletonContext
from ._manager import SingletonProxy as SingletonProxy
from ._manager import SingletonRequest as SingletonRequest
from ._manager import Singletons as Singletons
from ._manager import SingletonUnavailable as SingletonUnavailable
