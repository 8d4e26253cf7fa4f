"""Cluster membership: the lowest layer of p2pshard.

Transport (TCP with mutual TLS, and a simulated network), the wire format, and the error hierarchy
of the whole project. Gossip membership, failure detection, downing and singletons build on these.
"""

from ._app_version import AppVersion as AppVersion
from ._app_version import newest_app_version as newest_app_version
from ._cluster import Cluster as Cluster
from ._cluster import ClusterStatistics as ClusterStatistics
from ._cluster import DowningLease as DowningLease
from ._cluster import Subscription as Subscription
from ._cluster_settings import ClusterSettings as ClusterSettings
from ._events import ClusterEvent as ClusterEvent
from ._events import LeaderChanged as LeaderChanged
from ._events import MemberDowned as MemberDowned
from ._events import MemberEvent as MemberEvent
from ._events import MemberExited as MemberExited
from ._events import MemberJoined as MemberJoined
from ._events import MemberLeft as MemberLeft
from ._events import MemberRemoved as MemberRemoved
from ._events import MemberUp as MemberUp
from ._events import MemberWeaklyUp as MemberWeaklyUp
from ._events import ReachableMember as ReachableMember
from ._events import UnreachableMember as UnreachableMember
from ._failure_detector import FailureDetectorSettings as FailureDetectorSettings
from ._lease import FencedGrant as FencedGrant
from ._lease import HeldLease as HeldLease
from ._member import Member as Member
from ._member import MemberStatus as MemberStatus
from .sbr import SplitBrainResolverSettings as SplitBrainResolverSettings
from .singleton import SingletonContext as SingletonContext
from .singleton import SingletonProxy as SingletonProxy
from .singleton import SingletonRequest as SingletonRequest
from .singleton import Singletons as Singletons
from .singleton import SingletonUnavailable as SingletonUnavailable
from .transport import Address as Address
from .transport import ClusterError as ClusterError
from .transport import ConfigurationError as ConfigurationError
from .transport import Envelope as Envelope
from .transport import FrameDecodeError as FrameDecodeError
from .transport import FrameTooLarge as FrameTooLarge
from .transport import HandshakeError as HandshakeError
from .transport import IdentityKind as IdentityKind
from .transport import IllegalTransition as IllegalTransition
from .transport import LinkConditions as LinkConditions
from .transport import MessageDecodeError as MessageDecodeError
from .transport import MessageRegistrationError as MessageRegistrationError
from .transport import MessageTooLarge as MessageTooLarge
from .transport import PeerIdentity as PeerIdentity
from .transport import PeerStatistics as PeerStatistics
from .transport import ProtocolError as ProtocolError
from .transport import SendQueueFull as SendQueueFull
from .transport import SerializationError as SerializationError
from .transport import SimNetwork as SimNetwork
from .transport import SimNetworkStatistics as SimNetworkStatistics
from .transport import SimTransport as SimTransport
from .transport import TooManyRefused as TooManyRefused
from .transport import TraceEvent as TraceEvent
from .transport import Transport as Transport
from .transport import TransportClosed as TransportClosed
from .transport import TransportError as TransportError
from .transport import TransportSettings as TransportSettings
from .transport import TransportStatistics as TransportStatistics
from .transport import TruncatedFrame as TruncatedFrame
from .transport import UniqueAddress as UniqueAddress
from .transport import deterministic_scheduling as deterministic_scheduling
from .transport import message as message
