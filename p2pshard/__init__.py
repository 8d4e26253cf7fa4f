"""p2pshard: Akka Cluster Sharding's guarantees for Python, on Trio, as a peer-to-peer cluster.

This package re-exports the public names; each lives in a private module of its own.
"""

from ._config import NodeConfig as NodeConfig
from ._config import TlsFiles as TlsFiles
