"""p2pshard: Akka Cluster Sharding's guarantees for Python, on Trio, as a peer-to-peer cluster.

This package re-exports the public names; each lives in a private module of its own. The lower
layers are the packages ``membership`` (transport, wire format, errors) and ``crdt``.

``PostgresJournal`` needs psycopg 3 (the ``postgresql`` extra), so it is imported on first use.
"""

from typing import TYPE_CHECKING

from membership import Address as Address
from membership import ClusterError as ClusterError
from membership import ConfigurationError as ConfigurationError
from membership import MessageRegistrationError as MessageRegistrationError
from membership import MessageTooLarge as MessageTooLarge
from membership import SendQueueFull as SendQueueFull
from membership import SerializationError as SerializationError
from membership import TransportClosed as TransportClosed
from membership import TransportError as TransportError
from membership import TransportSettings as TransportSettings
from membership import UniqueAddress as UniqueAddress
from membership import message as message

from ._config import ClientConfig as ClientConfig
from ._config import DiscoverySettings as DiscoverySettings
from ._config import ManagementSettings as ManagementSettings
from ._config import NodeConfig as NodeConfig
from ._config import TlsFiles as TlsFiles
from ._errors import AskTimeout as AskTimeout
from ._errors import BufferOverflow as BufferOverflow
from ._errors import EventTooLarge as EventTooLarge
from ._errors import JournalConflict as JournalConflict
from ._errors import JournalError as JournalError
from ._errors import JournalFenced as JournalFenced
from ._errors import LeaseUnavailable as LeaseUnavailable
from ._errors import NodeLeaseGone as NodeLeaseGone
from ._errors import RegionStopped as RegionStopped
from ._errors import RemoteEntityError as RemoteEntityError
from ._errors import ShardingError as ShardingError
from ._failover import FAILOVER_PROFILES as FAILOVER_PROFILES
from ._failover import FAST_LAN as FAST_LAN
from ._failover import FailoverProfile as FailoverProfile
from ._node import Node as Node
from ._node import open_node as open_node
from .leases import AttachedLease as AttachedLease
from .leases import Lease as Lease
from .leases import LeaseBackend as LeaseBackend
from .leases import LeaseClock as LeaseClock
from .leases import LeaseGrant as LeaseGrant
from .leases import Leases as Leases
from .leases import LeaseSettings as LeaseSettings
from .leases import LeaseStatistics as LeaseStatistics
from .leases import MemoryLeaseBackend as MemoryLeaseBackend
from .leases import NodeLeaseBackend as NodeLeaseBackend
from .leases import SqliteLeaseBackend as SqliteLeaseBackend
from .persistence import AcceptedCall as AcceptedCall
from .persistence import BatchJournal as BatchJournal
from .persistence import EventSourcedEntity as EventSourcedEntity
from .persistence import GroupCommitStatistics as GroupCommitStatistics
from .persistence import Journal as Journal
from .persistence import JournalSettings as JournalSettings
from .persistence import JournalStatistics as JournalStatistics
from .persistence import MemoryJournal as MemoryJournal
from .persistence import MemoryJournalStatistics as MemoryJournalStatistics
from .persistence import Recovery as Recovery
from .persistence import SnapshotWrite as SnapshotWrite
from .persistence import SqliteJournal as SqliteJournal
from .persistence import journal_statistics as journal_statistics
from .persistence import open_journal as open_journal
from .sharding import ClusterShardingStats as ClusterShardingStats
from .sharding import ClusterView as ClusterView
from .sharding import CoordinatorStatistics as CoordinatorStatistics
from .sharding import EntityContext as EntityContext
from .sharding import EntityId as EntityId
from .sharding import EntityRef as EntityRef
from .sharding import HashExtractor as HashExtractor
from .sharding import IncarnationObserver as IncarnationObserver
from .sharding import LeastShardAllocationStrategy as LeastShardAllocationStrategy
from .sharding import MessageExtractor as MessageExtractor
from .sharding import RegionStatistics as RegionStatistics
from .sharding import ShardAllocationStrategy as ShardAllocationStrategy
from .sharding import ShardId as ShardId
from .sharding import Sharding as Sharding
from .sharding import ShardingEnvelope as ShardingEnvelope
from .sharding import ShardingSettings as ShardingSettings
from .sharding import ShardRegion as ShardRegion
from .sharding import ShardRegionState as ShardRegionState
from .sharding import ShardState as ShardState

if TYPE_CHECKING:
    from .persistence._postgres import PostgresJournal as PostgresJournal


def __getattr__(name: str) -> object:
    if name == "PostgresJournal":
        from .persistence._postgres import PostgresJournal

        return PostgresJournal
    raise AttributeError(f"module 'p2pshard' has no attribute {name!r}")
