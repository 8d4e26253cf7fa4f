"""Length-prefixed framing: reassembly from any chunking, the size limit, and end of stream.

Hypothesis tests print a ``@reproduce_failure`` blob when they fail; paste it above the test to
re-run that exact case.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from membership import FrameTooLarge, TruncatedFrame
from membership.transport._framing import HEADER, FrameDecoder, encode_frame
from tests._support.examples import examples

LIMIT = 1024


def feed_all(decoder: FrameDecoder, chunks: list[bytes]) -> list[bytes]:
    frames: list[bytes] = []
    for chunk in chunks:
        got, error = decoder.feed(chunk)
        assert error is None
        frames += got
    return frames


def test_encode_frame_prefixes_the_big_endian_length() -> None:
    assert encode_frame(b"abc") == b"\x00\x00\x00\x03abc"


def test_frames_fed_one_byte_at_a_time_reassemble() -> None:
    payloads = [b"first", b"", b"x" * 300, b"last"]
    stream = b"".join(map(encode_frame, payloads))
    decoder = FrameDecoder(LIMIT)
    assert feed_all(decoder, [stream[i : i + 1] for i in range(len(stream))]) == payloads
    assert decoder.frames_decoded == len(payloads)
    assert decoder.buffered == 0


@settings(max_examples=examples(200), deadline=None, print_blob=True)
@given(payloads=st.lists(st.binary(max_size=40), max_size=8), data=st.data())
def test_frames_split_anywhere_reassemble_identically(
    payloads: list[bytes], data: st.DataObject
) -> None:
    stream = b"".join(map(encode_frame, payloads))
    cuts = sorted(data.draw(st.sets(st.integers(min_value=0, max_value=len(stream)))))
    bounds = [0, *cuts, len(stream)]
    chunks = [stream[a:b] for a, b in itertools.pairwise(bounds)]
    decoder = FrameDecoder(LIMIT)
    assert feed_all(decoder, chunks) == payloads
    decoder.eof()


def test_zero_length_frames_work() -> None:
    frames, error = FrameDecoder(LIMIT).feed(encode_frame(b"") * 3)
    assert (frames, error) == ([b"", b"", b""], None)


def test_a_frame_of_exactly_the_limit_is_accepted() -> None:
    frames, error = FrameDecoder(LIMIT).feed(encode_frame(b"x" * LIMIT))
    assert (frames, error) == ([b"x" * LIMIT], None)


def test_a_frame_one_over_the_limit_is_refused_from_its_header_alone() -> None:
    frames, error = FrameDecoder(LIMIT).feed(HEADER.pack(LIMIT + 1))
    assert frames == []
    assert isinstance(error, FrameTooLarge)
    assert f"frame of {LIMIT + 1} bytes; max_frame_size is {LIMIT}" in str(error)


def test_an_oversize_header_comes_after_the_whole_frames_before_it() -> None:
    decoder = FrameDecoder(LIMIT)
    frames, error = decoder.feed(encode_frame(b"a") + encode_frame(b"bc") + HEADER.pack(2**32 - 1))
    assert frames == [b"a", b"bc"]
    assert isinstance(error, FrameTooLarge)
    assert decoder.frames_decoded == 2


def test_an_oversize_header_split_across_feeds_is_reported_when_complete() -> None:
    decoder = FrameDecoder(LIMIT)
    header = HEADER.pack(LIMIT + 1)
    assert decoder.feed(encode_frame(b"a") + header[:2]) == ([b"a"], None)
    frames, error = decoder.feed(header[2:])
    assert frames == []
    assert isinstance(error, FrameTooLarge)


@pytest.mark.parametrize(
    "tail",
    [b"\x00", HEADER.pack(5), HEADER.pack(5) + b"abcd"],
    ids=["partial-header", "header-only", "partial-body"],
)
def test_eof_inside_a_frame_raises_truncated_frame(tail: bytes) -> None:
    decoder = FrameDecoder(LIMIT)
    assert decoder.feed(encode_frame(b"whole") + tail) == ([b"whole"], None)
    with pytest.raises(TruncatedFrame, match=f"{len(tail)} bytes of an incomplete frame"):
        decoder.eof()


def test_eof_with_nothing_buffered_is_fine() -> None:
    FrameDecoder(LIMIT).eof()
    decoder = FrameDecoder(LIMIT)
    decoder.feed(encode_frame(b"a"))
    decoder.eof()
