"""Leases with fencing tokens.

The lease, the node lease its shard leases are attached to, a node's leases, and the in-memory,
SQLite and etcd backends.
"""

from ._lease import Lease as Lease
from ._lease import LeaseBackend as LeaseBackend
from ._lease import LeaseClock as LeaseClock
from ._lease import LeaseGrant as LeaseGrant
from ._lease import LeaseSettings as LeaseSettings
from ._lease import LeaseStatistics as LeaseStatistics
from ._leases import Leases as Leases
from ._memory import MemoryLeaseBackend as MemoryLeaseBackend
from ._node_lease import AttachedLease as AttachedLease
from ._node_lease import NodeLeaseBackend as NodeLeaseBackend
from ._sqlite import SqliteLeaseBackend as SqliteLeaseBackend
