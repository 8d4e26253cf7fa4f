"""Replicated state for p2pshard: pycrdt documents with majority reads and writes (ddata mode).

Each key of a :class:`Replicator` holds a pycrdt ``Doc`` that every replica edits and merges;
reads and writes take a consistency level; anti-entropy gossip and delta pushes spread the rest;
durable keys live in SQLite. This package sits between ``membership`` (which it may import) and
``p2pshard`` (which it must not).
"""

from ._consistency import ReadAll as ReadAll
from ._consistency import ReadConsistency as ReadConsistency
from ._consistency import ReadFrom as ReadFrom
from ._consistency import ReadLocal as ReadLocal
from ._consistency import ReadMajority as ReadMajority
from ._consistency import ReadMajorityPlus as ReadMajorityPlus
from ._consistency import WriteAll as WriteAll
from ._consistency import WriteConsistency as WriteConsistency
from ._consistency import WriteLocal as WriteLocal
from ._consistency import WriteMajority as WriteMajority
from ._consistency import WriteMajorityPlus as WriteMajorityPlus
from ._consistency import WriteTo as WriteTo
from ._consistency import quorum as quorum
from ._errors import DataDeleted as DataDeleted
from ._errors import GetFailure as GetFailure
from ._errors import ReplicationError as ReplicationError
from ._errors import StoreFailure as StoreFailure
from ._errors import UpdateTimeout as UpdateTimeout
from ._replicator import Changed as Changed
from ._replicator import Deleted as Deleted
from ._replicator import OperationStatistics as OperationStatistics
from ._replicator import PendingUpdate as PendingUpdate
from ._replicator import Replicator as Replicator
from ._replicator import ReplicatorStatistics as ReplicatorStatistics
from ._replicator import Subscription as Subscription
from ._replicator import open_replicator as open_replicator
from ._settings import ReplicatorSettings as ReplicatorSettings
