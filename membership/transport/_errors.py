"""The error hierarchy of the whole project.

It is rooted here, in the lowest package, so that every layer raises and catches the same classes.
Two branches matter to a caller: *local misuse* (bad configuration, a message type nobody
registered, using a closed transport), which is raised at the call that did it, and *remote
misbehaviour* (a peer that sends garbage or presents the wrong certificate), which never reaches
application code: the transport counts it in ``statistics()``, logs it and closes that one link.
"""

from __future__ import annotations


class ClusterError(Exception):
    """Base class of every error this project raises on purpose."""


class ConfigurationError(ClusterError, ValueError):
    """A setting or configuration value is invalid.

    Raised when a settings object is built or a configuration file is loaded, never later: the
    message names the field, the value given and what is allowed.
    """


class SerializationError(ClusterError, TypeError):
    """A message cannot be put on the wire.

    Raised by the call that sends it (``send``, ``send_nowait``, later ``tell``/``ask``) when the
    message, or a value inside it, is of a type that is neither a plain msgpack type nor registered
    with :func:`message`. The message names the offending type. Nothing is sent.
    """


class MessageTooLarge(SerializationError):
    """An encoded message is bigger than the transport's ``max_frame_size``.

    Raised by the sending call; nothing is sent. Raise the setting on every node, or split the
    message.
    """


class MessageRegistrationError(ClusterError, ValueError):
    """:func:`message` was applied to something it cannot register.

    For example a class that is not an attrs class, or a wire name already taken by another class.
    """


class TransportError(ClusterError):
    """A problem with node-to-node links that the caller has to know about."""


class TransportClosed(TransportError):
    """The transport was closed (or its node crashed) before or during the call."""


class SendQueueFull(TransportError):
    """``send_nowait`` found the bounded send queue of that peer full.

    The message was not queued. The queue fills when the peer reads slower than we write or while
    the link is down and reconnecting. ``send`` waits for room instead of raising this.
    """


class HandshakeError(TransportError):
    """A link could not be established: the peer's identity or certificate is not acceptable.

    Raised inside the transport and logged; callers see it only through ``statistics()``.
    """


class ProtocolError(ClusterError):
    """A peer sent bytes that break the wire protocol (remote misbehaviour).

    Never raised to application code: the transport closes that one link, counts the error in
    ``statistics()`` and logs it.
    """


class FrameTooLarge(ProtocolError):
    """A frame header announced more bytes than ``max_frame_size``."""


class TruncatedFrame(ProtocolError):
    """The stream ended in the middle of a frame."""


class FrameDecodeError(ProtocolError):
    """A frame's envelope could not be decoded (bad version byte, bad header, not msgpack)."""


class TooManyRefused(ProtocolError):
    """A peer's messages were refused faster than the transport allows: its link is closed.

    Refused means not allowed to the identity of its link; the rate is
    ``TransportSettings.refused_messages_per_second`` after ``refused_messages_burst``.
    """


class MessageDecodeError(ProtocolError):
    """A well-framed message could not be turned back into an object.

    Its type is unknown on this node (not registered, e.g. a newer peer) or its fields are
    rejected by the class. The transport drops that one message, counts and logs it, and keeps
    the link: the frames around it are intact.
    """


class IllegalTransition(ClusterError, ValueError):
    """A member status change that Akka's life cycle does not allow (e.g. Down to Up).

    Raised by the sans-IO membership core; the state it was asked to change is left as it was.
    """
