"""Leases with fencing tokens.

The lease and the shard-lease factory, and the in-memory, SQLite and etcd backends.
"""

from ._lease import Lease as Lease
from ._lease import LeaseBackend as LeaseBackend
from ._lease import LeaseClock as LeaseClock
from ._lease import LeaseGrant as LeaseGrant
from ._lease import Leases as Leases
from ._lease import LeaseSettings as LeaseSettings
from ._lease import LeaseStatistics as LeaseStatistics
from ._memory import MemoryLeaseBackend as MemoryLeaseBackend
from ._sqlite import SqliteLeaseBackend as SqliteLeaseBackend
