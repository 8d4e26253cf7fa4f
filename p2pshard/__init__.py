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

from ._allocation import ClusterView as ClusterView
from ._allocation import EntityId as EntityId
from ._allocation import LeastShardAllocationStrategy as LeastShardAllocationStrategy
from ._allocation import ShardAllocationStrategy as ShardAllocationStrategy
from ._allocation import ShardId as ShardId
from ._config import ClientConfig as ClientConfig
from ._config import NodeConfig as NodeConfig
from ._config import TlsFiles as TlsFiles
from ._entity import EntityContext as EntityContext
from ._entity import EntityRef as EntityRef
from ._errors import AskTimeout as AskTimeout
from ._errors import BufferOverflow as BufferOverflow
from ._errors import EventTooLarge as EventTooLarge
from ._errors import JournalConflict as JournalConflict
from ._errors import JournalError as JournalError
from ._errors import JournalFenced as JournalFenced
from ._errors import LeaseUnavailable as LeaseUnavailable
from ._errors import RegionStopped as RegionStopped
from ._errors import RemoteEntityError as RemoteEntityError
from ._errors import ShardingError as ShardingError
from ._extractor import HashExtractor as HashExtractor
from ._extractor import MessageExtractor as MessageExtractor
from ._extractor import ShardingEnvelope as ShardingEnvelope
from ._failover import FAILOVER_PROFILES as FAILOVER_PROFILES
from ._failover import FAST_LAN as FAST_LAN
from ._failover import FailoverProfile as FailoverProfile
from ._journal import Journal as Journal
from ._journal import JournalSettings as JournalSettings
from ._journal import Recovery as Recovery
from ._journal import open_journal as open_journal
from ._journal_memory import MemoryJournal as MemoryJournal
from ._journal_memory import MemoryJournalStatistics as MemoryJournalStatistics
from ._journal_sqlite import SqliteJournal as SqliteJournal
from ._lease import Lease as Lease
from ._lease import LeaseBackend as LeaseBackend
from ._lease import LeaseClock as LeaseClock
from ._lease import LeaseGrant as LeaseGrant
from ._lease import Leases as Leases
from ._lease import LeaseSettings as LeaseSettings
from ._lease_memory import MemoryLeaseBackend as MemoryLeaseBackend
from ._lease_sqlite import SqliteLeaseBackend as SqliteLeaseBackend
from ._node import Node as Node
from ._node import open_node as open_node
from ._persistence import EventSourcedEntity as EventSourcedEntity
from ._region import RegionStatistics as RegionStatistics
from ._region import ShardRegion as ShardRegion
from ._region import ShardRegionState as ShardRegionState
from ._region import ShardState as ShardState
from ._settings import ShardingSettings as ShardingSettings
from ._sharding import ClusterShardingStats as ClusterShardingStats
from ._sharding import IncarnationObserver as IncarnationObserver
from ._sharding import Sharding as Sharding

if TYPE_CHECKING:
    from ._journal_postgres import PostgresJournal as PostgresJournal


def __getattr__(name: str) -> object:
    if name == "PostgresJournal":
        from ._journal_postgres import PostgresJournal

        return PostgresJournal
    raise AttributeError(f"module 'p2pshard' has no attribute {name!r}")
