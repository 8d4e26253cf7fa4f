"""The transport layer of membership.

Addresses, the wire format and framing, TLS links and the TCP transport, the simulated network,
certificates and identities, and the error hierarchy of the project. It imports nothing else from
``membership``; gossip, downing and singletons build on it.
"""

from ._address import Address as Address
from ._address import UniqueAddress as UniqueAddress
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
from ._identity import IdentityKind as IdentityKind
from ._identity import PeerIdentity as PeerIdentity
from ._settings import TransportSettings as TransportSettings
from ._simnet import LinkConditions as LinkConditions
from ._simnet import SimNetwork as SimNetwork
from ._simnet import SimNetworkStatistics as SimNetworkStatistics
from ._simnet import SimTransport as SimTransport
from ._simnet import TraceEvent as TraceEvent
from ._simnet import deterministic_scheduling as deterministic_scheduling
from ._transport import Envelope as Envelope
from ._transport import PeerStatistics as PeerStatistics
from ._transport import Transport as Transport
from ._transport import TransportStatistics as TransportStatistics
from ._wire import message as message
