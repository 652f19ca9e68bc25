"""The `fastlane kv serve` wire protocol, version 2, in Python.

Mirrors ``fastlane-kvswap/src/proto.rs`` (spec: ``docs/kvswap.md``). Every message is a 16-byte
header then ``len`` payload bytes, all little endian::

    magic u32 = "KVSW"  version u16 = 2  op u16  req_id u32  len u32

Replies carry ``op | 0x8000`` and the request's ``req_id``; their payload starts with a
``status u32`` (0 = OK, else an :class:`ErrorCode`) and, on an error, a UTF-8 message.

Ops 12-17 (``PUT``, ``GET``, ``EXISTS``, ``PIN``, ``UNPIN``, ``EVICT``) are the
content-addressed ones, added within version 2 (every earlier op is unchanged). Their keys
are 32 opaque bytes, qualified by the connection's namespace on the server; their replies are
the status and one byte per key.

This module only encodes and decodes bytes; it does no I/O. Everything read from the
server is checked (magic, version, op, lengths) before it is used.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Sequence

MAGIC: int = struct.unpack("<I", b"KVSW")[0]
"""``"KVSW"`` read as a little-endian u32."""
VERSION: int = 2
"""Protocol version this module speaks."""
HEADER_LEN: int = 16
"""Header bytes."""
PAYLOAD_MAX: int = 64 * 1024
"""Largest payload either side accepts."""
BLOCKS_MAX: int = (PAYLOAD_MAX - 12) // 4
"""Most block ids in one request (16 381)."""
NAMESPACE_MAX: int = 128
"""Longest namespace name in a ``HELLO``."""
REPLY: int = 0x8000
"""Reply bit of ``op``."""
U32_MAX: int = 0xFFFF_FFFF
"""Largest sequence id, block id, count or timeout on the wire."""
KEY_BYTES: int = 32
"""Bytes of a content key."""
KEYS_MAX: int = (PAYLOAD_MAX - 4) // KEY_BYTES
"""Most keys in one ``EXISTS``/``PIN``/``UNPIN``/``EVICT`` (2 047)."""
KEY_BLOCKS_MAX: int = (PAYLOAD_MAX - 4) // (KEY_BYTES + 4)
"""Most ``(key, block)`` pairs in one ``PUT``/``GET`` (1 820)."""

_HEADER = struct.Struct("<IHHII")
_HELLO_REPLY = struct.Struct("<QIIQI")  # block_bytes, first_block, blocks, map_len, ns_len
_LOOKUP_REPLY = struct.Struct("<BBHII")  # phase, tier, pad, blocks_out, device_blocks
_STATS_REPLY = struct.Struct("<6QII")  # 3 x (capacity, used), device_free, device_pinned
_NAMESPACE_BYTES = frozenset(
    b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-"
)


class Op(enum.IntEnum):
    """Operation codes (``fastlane_kvswap::proto::op``); the vLLM name is in brackets."""

    HELLO = 1
    """Handshake; the reply carries the memfd of the client's own slab."""
    ALLOC = 2
    """Take device blocks for a sequence."""
    FREE = 3
    """Give device blocks back."""
    LOOKUP = 4
    """Where a sequence is (``lookup``)."""
    PREPARE_STORE = 5
    """Start a swap-out (``prepare_store``)."""
    COMPLETE = 6
    """Wait for a ticket (``complete_store`` / ``complete_load``)."""
    PREPARE_LOAD = 7
    """Start a swap-in (``prepare_load``)."""
    TOUCH = 8
    """Mark a sequence used (``touch``)."""
    DROP = 9
    """Forget a sequence."""
    CANCEL = 10
    """Cancel a ticket."""
    STATS = 11
    """Tier accounting."""
    PUT = 12
    """Copy blocks of the slab into the content-addressed store under keys."""
    GET = 13
    """Copy stored blocks, by key, into blocks of the slab."""
    EXISTS = 14
    """Where each key's block is."""
    PIN = 15
    """Keep keys' blocks in the server's host memory for this connection."""
    UNPIN = 16
    """Release this connection's pins."""
    EVICT = 17
    """Remove unpinned blocks from the server's own tiers."""


class ErrorCode(enum.IntEnum):
    """Reply status codes (``fastlane_kvswap::proto::ErrorCode``)."""

    OK = 0
    UNKNOWN_SEQUENCE = 1
    DOUBLE_SWAP_OUT = 2
    NOT_SWAPPED_OUT = 3
    BUSY = 4
    TIER_FULL = 5
    QUOTA_EXCEEDED = 6
    REMOTE_PEER_GONE = 7
    BLOCK_PINNED = 8
    BLOCK_NOT_OWNED = 9
    DUPLICATE_BLOCK = 10
    DEVICE_FULL = 11
    BLOCK_COUNT_MISMATCH = 12
    CHECKSUM_MISMATCH = 13
    TIER_IO = 14
    CANCELLED = 15
    UNKNOWN_TICKET = 16
    TIMEOUT = 17
    PEER_REFUSED = 18
    HELLO_REQUIRED = 19
    NAMESPACE_REFUSED = 20
    VERSION_UNSUPPORTED = 21
    STORE_DISABLED = 22
    OTHER = 99

    @classmethod
    def from_wire(cls, status: int) -> "ErrorCode":
        """The code for a status read from the wire; an unknown one is ``OTHER``."""
        try:
            return cls(status)
        except ValueError:
            return cls.OTHER


class Phase(enum.IntEnum):
    """Where a sequence is, as ``LOOKUP`` reports it."""

    RESIDENT = 0
    SWAPPING_OUT = 1
    OUT = 2
    SPILLING = 3
    SWAPPING_IN = 4


class Tier(enum.IntEnum):
    """Which tier holds a swapped-out copy."""

    HOST = 0
    NVME = 1
    REMOTE = 2


class Location(enum.IntEnum):
    """Where ``EXISTS`` found a key's block, nearest tier first."""

    ABSENT = 0
    HOST = 1
    """The server's host memory."""
    NVME = 2
    """The server's NVMe tier."""
    CLUSTER = 3
    """The shared cluster (a hint: a later ``GET`` may still miss)."""


class ProtocolError(Exception):
    """The server sent bytes that do not parse as a reply of protocol version 2.

    The connection is unusable afterwards (the stream may be out of step).
    """


@dataclass(frozen=True)
class Header:
    """A message header."""

    op: int
    req_id: int
    length: int
    version: int = VERSION

    def encode(self) -> bytes:
        """The 16 header bytes."""
        return _HEADER.pack(MAGIC, self.version, self.op, self.req_id, self.length)

    @classmethod
    def decode(cls, b: bytes) -> "Header":
        """Decodes and checks magic, version and length."""
        if len(b) != HEADER_LEN:
            raise ProtocolError(f"header of {len(b)} bytes, expected {HEADER_LEN}")
        magic, version, op, req_id, length = _HEADER.unpack(b)
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {magic:#x}")
        if version != VERSION:
            raise ProtocolError(
                f"reply in protocol version {version}; this client speaks {VERSION}"
            )
        if length > PAYLOAD_MAX:
            raise ProtocolError(f"payload of {length} bytes is too long")
        return cls(op=op, req_id=req_id, length=length, version=version)


def frame(op: int, req_id: int, payload: bytes) -> bytes:
    """A whole request frame: header and payload."""
    if len(payload) > PAYLOAD_MAX:
        raise ValueError(f"payload of {len(payload)} bytes is over {PAYLOAD_MAX}")
    return Header(op=op, req_id=req_id, length=len(payload)).encode() + payload


def _u32(name: str, v: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= U32_MAX:
        raise ValueError(f"{name} {v!r} is not a u32")
    return v


def check_namespace(namespace: str) -> bytes:
    """The namespace as wire bytes, or ``ValueError`` if the server would refuse it."""
    b = namespace.encode("ascii", errors="replace")
    if len(b) > NAMESPACE_MAX or not all(c in _NAMESPACE_BYTES for c in b):
        raise ValueError(
            f"namespace {namespace!r}: at most {NAMESPACE_MAX} bytes of [A-Za-z0-9._:-]"
        )
    return b


def hello(blocks: int, namespace: str) -> bytes:
    """``HELLO`` payload: ``blocks u32, ns_len u32, ns_len bytes``."""
    ns = check_namespace(namespace)
    return struct.pack("<II", _u32("slab_blocks", blocks), len(ns)) + ns


def seq_n(seq: int, n: int) -> bytes:
    """``ALLOC`` payload: ``seq u32, n u32``."""
    if _u32("n", n) > BLOCKS_MAX:
        raise ValueError(f"{n} blocks is over the {BLOCKS_MAX} of one request")
    return struct.pack("<II", _u32("seq", seq), n)


def seq_blocks(seq: int, blocks: "list[int] | tuple[int, ...]") -> bytes:
    """``FREE``/``PREPARE_STORE``/``PREPARE_LOAD`` payload: ``seq, count, count x block``."""
    if len(blocks) > BLOCKS_MAX:
        raise ValueError(f"{len(blocks)} blocks is over the {BLOCKS_MAX} of one request")
    for b in blocks:
        _u32("block", b)
    return struct.pack(f"<II{len(blocks)}I", _u32("seq", seq), len(blocks), *blocks)


def seq_only(seq: int) -> bytes:
    """``LOOKUP``/``TOUCH``/``DROP`` payload: ``seq u32``."""
    return struct.pack("<I", _u32("seq", seq))


def complete(ticket: int, timeout_ms: int) -> bytes:
    """``COMPLETE`` payload: ``ticket u64, timeout_ms u32``."""
    return struct.pack("<QI", ticket, min(max(timeout_ms, 0), U32_MAX))


def ticket_only(ticket: int) -> bytes:
    """``CANCEL`` payload: ``ticket u64``."""
    return struct.pack("<Q", ticket)


def _key(k: object) -> bytes:
    if not isinstance(k, (bytes, bytearray, memoryview)) or len(k) != KEY_BYTES:
        raise ValueError(f"key {k!r:.80} is not {KEY_BYTES} bytes")
    return bytes(k)


def key_blocks(items: "Sequence[tuple[bytes, int]]") -> bytes:
    """``PUT``/``GET`` payload: ``count u32, count x (key [32 bytes], block u32)``."""
    if len(items) > KEY_BLOCKS_MAX:
        raise ValueError(f"{len(items)} keys is over the {KEY_BLOCKS_MAX} of one PUT/GET")
    out = [struct.pack("<I", len(items))]
    for k, b in items:
        out.append(_key(k))
        out.append(struct.pack("<I", _u32("block", b)))
    return b"".join(out)


def keys(ks: "Sequence[bytes]") -> bytes:
    """``EXISTS``/``PIN``/``UNPIN``/``EVICT`` payload: ``count u32, count x key``."""
    if len(ks) > KEYS_MAX:
        raise ValueError(f"{len(ks)} keys is over the {KEYS_MAX} of one request")
    return struct.pack("<I", len(ks)) + b"".join(_key(k) for k in ks)


def decode_flags(body: bytes, n: int, what: str) -> "list[bool]":
    """A ``PUT``/``GET``/``PIN``/``UNPIN``/``EVICT`` reply body: one 0/1 byte per key."""
    if len(body) != n:
        raise ProtocolError(f"{what} reply of {len(body)} bytes for {n} keys")
    if any(b > 1 for b in body):
        raise ProtocolError(f"{what} reply: a per-key result other than 0 or 1")
    return [b == 1 for b in body]


def decode_locations(body: bytes, n: int) -> "list[Location]":
    """An ``EXISTS`` reply body: one :class:`Location` byte per key."""
    if len(body) != n:
        raise ProtocolError(f"EXISTS reply of {len(body)} bytes for {n} keys")
    try:
        return [Location(b) for b in body]
    except ValueError as e:
        raise ProtocolError(f"EXISTS reply: {e}") from e


def split_status(payload: bytes) -> "tuple[int, bytes]":
    """A reply payload's status and the rest (the body, or the error message)."""
    if len(payload) < 4:
        raise ProtocolError(f"reply of {len(payload)} bytes has no status")
    return struct.unpack_from("<I", payload)[0], payload[4:]


@dataclass(frozen=True)
class HelloReply:
    """A successful ``HELLO`` reply: this connection's own slab of the device pool."""

    block_bytes: int
    """Bytes per device block."""
    first_block: int
    """Block id of the slab's first block (block ids on the wire are pool-wide)."""
    blocks: int
    """Blocks in the slab."""
    map_len: int
    """Bytes to map from the memfd (``block_bytes * blocks``)."""
    namespace: str
    """The namespace the server put the connection in."""

    @classmethod
    def decode(cls, body: bytes) -> "HelloReply":
        """Decodes and checks lengths and that ``map_len`` is the slab's size."""
        if len(body) < _HELLO_REPLY.size:
            raise ProtocolError(f"HELLO reply of {len(body)} bytes, expected at least 28")
        block_bytes, first, blocks, map_len, ns_len = _HELLO_REPLY.unpack_from(body)
        ns = body[_HELLO_REPLY.size :]
        if ns_len > NAMESPACE_MAX or len(ns) != ns_len:
            raise ProtocolError("HELLO reply: namespace length")
        if not all(c in _NAMESPACE_BYTES for c in ns):
            raise ProtocolError("HELLO reply: namespace characters")
        if blocks == 0 or block_bytes == 0 or block_bytes * blocks != map_len:
            raise ProtocolError("HELLO reply: slab size")
        if first + blocks > U32_MAX:
            raise ProtocolError("HELLO reply: slab past the last block id")
        return cls(block_bytes, first, blocks, map_len, ns.decode("ascii"))


def decode_blocks(body: bytes) -> "list[int]":
    """An ``ALLOC`` reply body: ``count u32, count x block u32``."""
    if len(body) < 4:
        raise ProtocolError("ALLOC reply without a count")
    (n,) = struct.unpack_from("<I", body)
    if len(body) != 4 + 4 * n:
        raise ProtocolError(f"ALLOC reply of {len(body)} bytes for {n} blocks")
    return list(struct.unpack_from(f"<{n}I", body, 4))


def decode_ticket(body: bytes) -> int:
    """A ``PREPARE_STORE``/``PREPARE_LOAD`` reply body: ``ticket u64``."""
    if len(body) != 8:
        raise ProtocolError(f"ticket reply of {len(body)} bytes, expected 8")
    return struct.unpack("<Q", body)[0]


def decode_lookup(body: bytes) -> "tuple[int, int, int, int]":
    """A ``LOOKUP`` reply body: ``(phase, tier, blocks_out, device_blocks)``."""
    if len(body) != _LOOKUP_REPLY.size:
        raise ProtocolError(f"LOOKUP reply of {len(body)} bytes, expected 12")
    phase, tier, _pad, blocks_out, device_blocks = _LOOKUP_REPLY.unpack(body)
    return phase, tier, blocks_out, device_blocks


def decode_stats(body: bytes) -> "tuple[tuple[int, ...], int, int]":
    """A ``STATS`` reply body: the six tier counters, device free, device pinned."""
    if len(body) != _STATS_REPLY.size:
        raise ProtocolError(f"STATS reply of {len(body)} bytes, expected 56")
    v = _STATS_REPLY.unpack(body)
    return v[:6], v[6], v[7]
