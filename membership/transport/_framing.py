"""Length-prefixed framing, sans-IO.

Theory of operation: every frame on a link is a 4-byte big-endian length followed by that many
bytes. :class:`FrameDecoder` is fed whatever the socket returned and hands back the complete
frames; it reports :class:`FrameTooLarge` as soon as a header announces more than the limit (before
buffering the body, so a hostile peer cannot make us allocate), after the whole frames that came
before it, and raises :class:`TruncatedFrame` when the stream ends inside a frame. The caller
closes that one link on either. Akka's Artery TCP framing is the same shape (with its own magic
header, which the TLS handshake makes unnecessary here).
"""

from __future__ import annotations

import struct

from ._errors import FrameTooLarge, TruncatedFrame

HEADER = struct.Struct(">I")
HEADER_SIZE = HEADER.size


def encode_frame(payload: bytes) -> bytes:
    """Prefix ``payload`` with its length."""
    return HEADER.pack(len(payload)) + payload


class FrameDecoder:
    """Turns a byte stream into frames; one decoder per link and direction."""

    __slots__ = ("_buffer", "_max_frame_size", "frames_decoded")

    def __init__(self, max_frame_size: int) -> None:
        self._buffer = bytearray()
        self._max_frame_size = max_frame_size
        self.frames_decoded = 0

    @property
    def buffered(self) -> int:
        """Bytes received that do not yet make a whole frame."""
        return len(self._buffer)

    def feed(
        self, data: bytes | bytearray | memoryview
    ) -> tuple[list[bytes], FrameTooLarge | None]:
        """Add received bytes; return every frame now complete, in order, and any error.

        The error is a :class:`FrameTooLarge` for a header announcing a frame above the limit;
        frames that arrived whole before it are still returned, so nothing already received is
        lost. After an error the decoder is unusable: deliver the frames, then close the link.
        """
        buffer = self._buffer
        buffer += data
        frames: list[bytes] = []
        error: FrameTooLarge | None = None
        offset = 0
        end = len(buffer)
        limit = self._max_frame_size
        whole = b""
        while end - offset >= HEADER_SIZE:
            (size,) = HEADER.unpack_from(buffer, offset)
            if size > limit:
                error = FrameTooLarge(
                    f"peer announced a frame of {size} bytes; max_frame_size is {limit}"
                )
                break
            stop = offset + HEADER_SIZE + size
            if stop > end:
                break
            if not whole:
                # One copy of the buffer as bytes, once a frame is complete (not before: a big
                # frame arrives in many pieces), so that each frame is then a single slice.
                # Slicing the bytearray and converting each slice costs a copy more per frame.
                whole = bytes(buffer)
            frames.append(whole[offset + HEADER_SIZE : stop])
            offset = stop
        if offset:
            del buffer[:offset]
        self.frames_decoded += len(frames)
        return frames, error

    def eof(self) -> None:
        """The stream ended: raise :class:`TruncatedFrame` if it ended inside a frame."""
        if self._buffer:
            raise TruncatedFrame(
                f"stream ended with {len(self._buffer)} bytes of an incomplete frame"
            )
