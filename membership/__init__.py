"""Cluster membership: the lowest layer of p2pshard.

Transport (TCP with mutual TLS, and a simulated network), the wire format, and the error hierarchy
of the whole project. Gossip membership, failure detection, downing and singletons build on these.
"""

from ._address import Address as Address
from ._address import UniqueAddress as UniqueAddress
from ._cluster import Cluster as Cluster
from ._cluster import ClusterStatistics as ClusterStatistics
from ._cluster import DowningLease as DowningLease
from ._cluster import Subscription as Subscription
from ._cluster_core import ClusterSettings as ClusterSettings
from ._errors import ClusterError as ClusterError
from ._errors import ConfigurationError as ConfigurationError
from ._errors import FrameDecodeError as FrameDecodeError
from ._errors import FrameTooLarge as FrameTooLarge
from ._errors import HandshakeError as HandshakeError
from ._errors import IllegalTransition as IllegalTransition
from ._errors import MessageDecodeError as MessageDecodeError
from ._errors import MessageRegistrationError as MessageRegistrationError
from ._errors import MessageTooLarge as MessageTooLarge
from ._errors import ProtocolError as ProtocolError
from ._errors import SendQueueFull as SendQueueFull
from ._errors import SerializationError as SerializationError
from ._errors import TooManyRefused as TooManyRefused
from ._errors import TransportClosed as TransportClosed
from ._errors import TransportError as TransportError
from ._errors import TruncatedFrame as TruncatedFrame
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
from ._identity import IdentityKind as IdentityKind
from ._identity import PeerIdentity as PeerIdentity
from ._lease import FencedGrant as FencedGrant
from ._lease import HeldLease as HeldLease
from ._member import Member as Member
from ._member import MemberStatus as MemberStatus
from ._sbr import SplitBrainResolverSettings as SplitBrainResolverSettings
from ._settings import TransportSettings as TransportSettings
from ._simnet import LinkConditions as LinkConditions
from ._simnet import SimNetwork as SimNetwork
from ._simnet import SimNetworkStatistics as SimNetworkStatistics
from ._simnet import SimTransport as SimTransport
from ._simnet import TraceEvent as TraceEvent
from ._simnet import deterministic_scheduling as deterministic_scheduling
from ._singleton import SingletonContext as SingletonContext
from ._singleton import SingletonProxy as SingletonProxy
from ._singleton import SingletonRequest as SingletonRequest
from ._singleton import Singletons as Singletons
from ._singleton import SingletonUnavailable as SingletonUnavailable
from ._transport import Envelope as Envelope
from ._transport import PeerStatistics as PeerStatistics
from ._transport import Transport as Transport
from ._transport import TransportStatistics as TransportStatistics
from ._wire import message as message
