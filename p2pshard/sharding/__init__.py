"""Cluster sharding.

Entity ids and allocation, the coordinator (state, core and shell), shard regions, shards,
entities and their worker pool, remember entities, and the wire protocol between them.
"""

from ._allocation import ClusterView as ClusterView
from ._allocation import EntityId as EntityId
from ._allocation import LeastShardAllocationStrategy as LeastShardAllocationStrategy
from ._allocation import ShardAllocationStrategy as ShardAllocationStrategy
from ._allocation import ShardId as ShardId
from ._coordinator_core import CoordinatorStatistics as CoordinatorStatistics
from ._entity import EntityContext as EntityContext
from ._entity import EntityRef as EntityRef
from ._extractor import HashExtractor as HashExtractor
from ._extractor import MessageExtractor as MessageExtractor
from ._extractor import ShardingEnvelope as ShardingEnvelope
from ._region import RegionStatistics as RegionStatistics
from ._region import ShardRegion as ShardRegion
from ._region import ShardRegionState as ShardRegionState
from ._region import ShardState as ShardState
from ._services import IncarnationObserver as IncarnationObserver
from ._settings import ShardingSettings as ShardingSettings
from ._sharding import ClusterShardingStats as ClusterShardingStats
from ._sharding import Sharding as Sharding
