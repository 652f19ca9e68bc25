"""fastlane_kv: a pure-Python client of ``fastlane kv serve`` (protocol version 2).

The device memory is shared, not copied: the server sends each connection a memfd of its
own slab of the device pool, which :class:`KvClient` maps; :meth:`KvClient.block` gives a
zero-copy ``memoryview`` of one block. The swap ops (alloc, free, prepare_store,
prepare_load, complete/poll, touch, drop, cancel, lookup, stats) and the content-addressed
ones (put, get, exists, pin, unpin, evict: blocks by a 32-byte key, shared within a
namespace) are methods of :class:`KvClient`; an error status raises :class:`KvError` with the server's code and
message. Standard library only. See ``docs/kvswap.md``, section "Python client".
"""

from .client import (
    COMPLETE_WAIT_MAX_S,
    KvClient,
    KvError,
    Lookup,
    Stats,
    TierStats,
)
from .proto import VERSION as PROTOCOL_VERSION
from .proto import ErrorCode, Location, Op, Phase, ProtocolError, Tier

__all__ = [
    "COMPLETE_WAIT_MAX_S",
    "ErrorCode",
    "KvClient",
    "KvError",
    "Location",
    "Lookup",
    "Op",
    "PROTOCOL_VERSION",
    "Phase",
    "ProtocolError",
    "Stats",
    "Tier",
    "TierStats",
]

__version__ = "0.1.0"
