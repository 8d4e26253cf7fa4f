"""What the packages built on membership (``crdt``, ``p2pshard``) use of its inner workings.

Not a public API: these names may change in any release. They are gathered here so that the
higher packages never import a private module of this one, and so that what they depend on is
one list a reader can see. User code uses the names of ``membership`` itself.
"""

from ._authorization import member_traffic_refusal as member_traffic_refusal
from ._cluster_messages import Down as Down
from ._cluster_messages import GossipEnvelope as GossipEnvelope
from ._cluster_messages import GossipStatus as GossipStatus
from ._cluster_messages import Join as Join
from ._cluster_messages import Leave as Leave
from ._failure_detector import phi as phi
from ._heartbeat import Heartbeat as Heartbeat
from ._islands import Sighting as Sighting
from ._islands import Verdict as Verdict
from ._lease import acquire_until_granted as acquire_until_granted
from ._member import NOT_UP as NOT_UP
from ._timer import NEVER as NEVER
from ._timer import CoreTimer as CoreTimer
from ._timer import TimedCore as TimedCore
from .transport import _wire
from .transport._address import NAME_PATTERN as NAME_PATTERN
from .transport._address import check_name as check_name
from .transport._address import node_order as node_order
from .transport._certs import CA_CERT as CA_CERT
from .transport._certs import create_certificate as create_certificate
from .transport._certs import create_cluster_ca as create_cluster_ca
from .transport._certs import create_node_certificate as create_node_certificate
from .transport._certs import create_signing_request as create_signing_request
from .transport._certs import load_cluster_ca as load_cluster_ca
from .transport._certs import node_uri as node_uri
from .transport._certs import sign_request as sign_request
from .transport._framing import HEADER_SIZE as HEADER_SIZE
from .transport._settings import in_range as in_range
from .transport._tcp import TcpTransport as TcpTransport
from .transport._tcp import open_tcp_transport as open_tcp_transport
from .transport._tls import DenyList as DenyList
from .transport._tls import TlsIdentity as TlsIdentity
from .transport._tls import certificate_identity as certificate_identity
from .transport._tls import identity_text as identity_text
from .transport._tls import peer_identity as peer_identity
from .transport._trioutil import single_error as single_error
from .transport._versions import CURRENT_PROTOCOL as CURRENT_PROTOCOL
from .transport._versions import ProtocolRange as ProtocolRange
from .transport._wire import decode_value as decode_value
from .transport._wire import encode_value as encode_value

wire = _wire
"""The wire module: ``message`` registration, frames and the codec's fast paths."""
