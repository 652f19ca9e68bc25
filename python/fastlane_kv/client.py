"""A Python client of ``fastlane kv serve``, with the device memory shared zero copy.

At ``HELLO`` the server gives each connection its own slab of the device pool as a sealed
memfd (over ``SCM_RIGHTS``). :class:`KvClient` maps it ``MAP_SHARED``: the bytes a caller
writes through :meth:`KvClient.block` are the very pages the server's swap workers read,
and a swap-in lands where :meth:`KvClient.block` reads. No KV byte crosses the socket.

One connection is one request/response stream; the client serialises calls with a lock, so
one :class:`KvClient` may be shared by threads (each call waits for the one in flight).
Every socket wait is bounded (``io_timeout``; a ``COMPLETE`` wait also by its own timeout).
"""

from __future__ import annotations

import array
import mmap
import os
import socket
import stat
import threading
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from . import proto
from .proto import ErrorCode, Location, Op, Phase, ProtocolError, Tier

_HELLO_RECV = proto.HEADER_LEN + 256
"""Bytes read with the fd: a whole successful ``HELLO`` reply (at most 176 bytes)."""
_FDS_MAX = 4
"""Room for this many fds in the control buffer: more than one is refused, not truncated."""
COMPLETE_WAIT_MAX_S: float = 60.0
"""The longest ``COMPLETE`` wait the server grants (``fastlane_kvswap::server::COMPLETE_WAIT_MAX``)."""


class KvError(Exception):
    """The server answered a request with an error status.

    ``code`` is the :class:`ErrorCode` (``OTHER`` for a status this client does not know),
    ``status`` the raw number, ``message`` the server's text, ``op`` the request's op.
    """

    def __init__(self, op: int, status: int, message: str) -> None:
        self.op = op
        self.status = status
        self.code = ErrorCode.from_wire(status)
        self.message = message
        super().__init__(f"{_op_name(op)}: {self.code.name} ({status}): {message}")


@dataclass(frozen=True)
class Lookup:
    """Where a sequence is (``LOOKUP``)."""

    phase: Phase
    """Resident, swapping out, out, spilling or swapping in."""
    tier: Optional[Tier]
    """The tier holding the swapped-out copy; ``None`` while none does."""
    blocks_out: int
    """Blocks in the swapped-out copy."""
    device_blocks: int
    """Device blocks the sequence holds."""


@dataclass(frozen=True)
class TierStats:
    """Bytes of one tier (server-wide)."""

    capacity_bytes: int
    used_bytes: int


@dataclass(frozen=True)
class Stats:
    """``STATS``: server-wide tier and device pool accounting (counts, no contents)."""

    host: TierStats
    nvme: TierStats
    remote: TierStats
    device_free: int
    """Device pool blocks no sequence holds (pool-wide)."""
    device_pinned: int
    """Device pool blocks pinned by a transfer in flight."""


Blocks = Sequence[int]
Keys = Sequence[bytes]
KeyBlocks = Sequence["tuple[bytes, int]"]


class KvClient:
    """One connection to ``fastlane kv serve`` and the mapping of its own device slab.

    Use :meth:`connect`; close with :meth:`close` or a ``with`` block. Block ids are
    pool-wide, as on the wire; :attr:`slab` is the range this connection's mapping holds.
    """

    def __init__(
        self, sock: socket.socket, hello: proto.HelloReply, memory: mmap.mmap, io_timeout: float
    ) -> None:
        """Internal: use :meth:`connect`."""
        self._sock: Optional[socket.socket] = sock
        self._hello = hello
        self._memory = memory
        self._view: Optional[memoryview] = memoryview(memory)
        self._io_timeout = io_timeout
        self._next_id = 1
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- connection

    @classmethod
    def connect(
        cls,
        path: Union[str, os.PathLike[str]],
        slab_blocks: int = 0,
        namespace: Optional[str] = None,
        io_timeout: float = 30.0,
    ) -> "KvClient":
        """Connects to the server's socket at ``path``, sends ``HELLO`` and maps the slab.

        ``slab_blocks``: device blocks wanted in this connection's slab (0: the server's
        ``--conn-blocks-default``). ``namespace``: ``None`` or ``""`` for the server's
        default (``uid:<uid>``). ``io_timeout``: bound in seconds on each socket wait.

        A refusal (credentials, namespace, slab size) raises :class:`KvError` with the
        server's code and message; a reply that does not parse, :class:`ProtocolError`;
        socket failures, ``OSError``.
        """
        payload = proto.hello(slab_blocks, namespace or "")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fds: list[int] = []
        try:
            sock.settimeout(io_timeout)
            sock.connect(os.fspath(path))
            # A refused peer may find the socket closed under its HELLO: read the answer
            # anyway, and report the send error only when there is none.
            send_error: Optional[OSError] = None
            try:
                sock.sendall(proto.frame(Op.HELLO, 0, payload))
            except OSError as e:
                send_error = e
            data, fds = _recv_with_fds(sock, _HELLO_RECV)
            if not data:
                if send_error is not None:
                    raise send_error
                raise ProtocolError(
                    "server closed the connection during HELLO (a server of protocol "
                    "version 1 closes a version 2 HELLO)"
                )
            if len(data) < proto.HEADER_LEN:
                data += _recv_exact(sock, proto.HEADER_LEN - len(data), "HELLO")
            h = proto.Header.decode(data[: proto.HEADER_LEN])
            if h.op != Op.HELLO | proto.REPLY or h.req_id != 0:
                raise ProtocolError(f"reply op {h.op:#x} id {h.req_id} does not match HELLO")
            end = proto.HEADER_LEN + h.length
            if len(data) > end:
                raise ProtocolError("bytes after the HELLO reply")
            data += _recv_exact(sock, end - len(data), "HELLO")
            status, body = proto.split_status(data[proto.HEADER_LEN : end])
            if status != ErrorCode.OK:
                raise KvError(Op.HELLO, status, body.decode("utf-8", errors="replace"))
            if len(fds) != 1:
                raise ProtocolError(f"HELLO reply with {len(fds)} file descriptors, expected 1")
            hello = proto.HelloReply.decode(body)
            memory = _map_slab(fds[0], hello.map_len)
        except BaseException:
            sock.close()
            raise
        finally:
            # The mapping keeps the slab alive; mmap holds its own duplicate of the fd.
            for fd in fds:
                os.close(fd)
        return cls(sock, hello, memory, io_timeout)

    def close(self) -> None:
        """Closes the connection (the server then drops this connection's sequences) and
        unmaps the slab.

        A :meth:`block` view still held keeps the mapping alive until it is released
        (``with client.block(i) as v: ...`` releases it); the socket is closed regardless.
        """
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if self._view is not None:
                self._view.release()
                self._view = None
            try:
                self._memory.close()
            except BufferError:
                pass  # views still exported: the pages go when the last one is released

    def __enter__(self) -> "KvClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.close()

    # ----------------------------------------------------------------- the mapping

    @property
    def block_bytes(self) -> int:
        """Bytes per device block."""
        return self._hello.block_bytes

    @property
    def blocks(self) -> int:
        """Blocks in this connection's slab."""
        return self._hello.blocks

    @property
    def slab(self) -> range:
        """The pool-wide block ids of this connection's slab: every block ``ALLOC`` gives
        it is in here, and the mapping holds these blocks and no others."""
        first = self._hello.first_block
        return range(first, first + self._hello.blocks)

    @property
    def namespace(self) -> str:
        """The namespace the server put this connection in."""
        return self._hello.namespace

    @property
    def memory(self) -> mmap.mmap:
        """The whole slab: a ``MAP_SHARED`` mapping of the memfd the server sent."""
        return self._memory

    def block(self, block: int) -> memoryview:
        """A writable view of device block ``block`` (pool-wide id, in :attr:`slab`):
        zero copy, straight into the shared mapping.

        Only meaningful for blocks this client owns; do not write a block while a store of
        it is in flight. ``IndexError`` for a block outside this connection's slab (it is
        not in this process's memory at all).
        """
        view = self._view
        if view is None:
            raise ValueError("client is closed")
        if block not in self.slab:
            raise IndexError(f"block {block} is not in this connection's slab {self.slab}")
        off = (block - self._hello.first_block) * self._hello.block_bytes
        return view[off : off + self._hello.block_bytes]

    def write_block(self, block: int, data: bytes) -> None:
        """Copies ``data`` (at most one block) to the start of device block ``block``."""
        if len(data) > self.block_bytes:
            raise ValueError(f"{len(data)} bytes do not fit a block of {self.block_bytes}")
        with self.block(block) as v:
            v[: len(data)] = data

    def read_block(self, block: int) -> bytes:
        """A copy of device block ``block``."""
        with self.block(block) as v:
            return v.tobytes()

    # ----------------------------------------------------------------- requests

    def call(self, op: int, payload: bytes = b"", timeout: Optional[float] = None) -> bytes:
        """Sends one request and returns the reply body after an OK status.

        The generic entry point: every op method goes through it, and an op the server
        gains later needs only an encoder and a decoder in :mod:`fastlane_kv.proto` and a
        method here. Raises
        :class:`KvError` on an error status. On a socket timeout or a reply that does not
        parse the connection is closed (the stream may be out of step) and the error
        (``TimeoutError``/``OSError`` or :class:`ProtocolError`) raised.
        """
        with self._lock:
            sock = self._sock
            if sock is None:
                raise ValueError("client is closed")
            req_id = self._next_id
            self._next_id = (self._next_id + 1) & proto.U32_MAX
            try:
                sock.settimeout(self._io_timeout if timeout is None else timeout)
                sock.sendall(proto.frame(op, req_id, payload))
                h = proto.Header.decode(_recv_exact(sock, proto.HEADER_LEN, _op_name(op)))
                if h.op != op | proto.REPLY or h.req_id != req_id:
                    raise ProtocolError(
                        f"reply op {h.op:#x} id {h.req_id} to op {op} id {req_id}"
                    )
                status, body = proto.split_status(_recv_exact(sock, h.length, _op_name(op)))
            except (OSError, ProtocolError):
                sock.close()
                self._sock = None
                raise
        if status != ErrorCode.OK:
            raise KvError(op, status, body.decode("utf-8", errors="replace"))
        return body

    def alloc(self, seq: int, n: int) -> list[int]:
        """Takes ``n`` device blocks (of this connection's slab) for sequence ``seq``."""
        blocks = proto.decode_blocks(self.call(Op.ALLOC, proto.seq_n(seq, n)))
        if len(blocks) != n or any(b not in self.slab for b in blocks):
            raise ProtocolError(f"ALLOC of {n} gave {blocks}, not {n} blocks of {self.slab}")
        return blocks

    def free(self, seq: int, blocks: Blocks) -> None:
        """Gives ``blocks`` of ``seq`` back (refused while a transfer pins them)."""
        self.call(Op.FREE, proto.seq_blocks(seq, list(blocks)))

    def lookup(self, seq: int) -> Lookup:
        """Where ``seq`` is (vLLM: ``lookup``)."""
        phase, tier, blocks_out, device_blocks = proto.decode_lookup(
            self.call(Op.LOOKUP, proto.seq_only(seq))
        )
        try:
            p = Phase(phase)
            t = None if tier == 255 else Tier(tier)
        except ValueError as e:
            raise ProtocolError(f"LOOKUP reply: phase {phase} tier {tier}") from e
        return Lookup(p, t, blocks_out, device_blocks)

    def prepare_store(self, seq: int, blocks: Blocks) -> int:
        """Starts swapping ``blocks`` of ``seq`` out (vLLM: ``prepare_store``); returns the
        ticket. The blocks stay the sequence's and are pinned until the ticket finishes."""
        return proto.decode_ticket(self.call(Op.PREPARE_STORE, proto.seq_blocks(seq, list(blocks))))

    def prepare_load(self, seq: int, blocks: Blocks) -> int:
        """Starts swapping ``seq`` back into ``blocks`` (its own, same count and order;
        vLLM: ``prepare_load``); returns the ticket."""
        return proto.decode_ticket(self.call(Op.PREPARE_LOAD, proto.seq_blocks(seq, list(blocks))))

    def complete(self, ticket: int, timeout: float = 10.0) -> None:
        """Waits at most ``timeout`` seconds (the server caps it at 60 s) for ``ticket``
        (vLLM: ``complete_store``/``complete_load``).

        Returns when the transfer succeeded; raises :class:`KvError` with the transfer's
        error, or with ``TIMEOUT`` when it is still running (it goes on; wait again).
        """
        timeout = min(max(timeout, 0.0), COMPLETE_WAIT_MAX_S)
        self.call(
            Op.COMPLETE,
            proto.complete(ticket, int(timeout * 1000)),
            timeout=timeout + self._io_timeout,
        )

    wait = complete

    def poll(self, ticket: int) -> bool:
        """Whether ``ticket`` has finished: ``True`` once it succeeded (its result is then
        consumed), ``False`` while it runs; a failed transfer raises :class:`KvError`.

        The server looks for about a millisecond; call it again, bounded, to wait.
        """
        try:
            self.call(Op.COMPLETE, proto.complete(ticket, 0))
        except KvError as e:
            if e.code == ErrorCode.TIMEOUT:
                return False
            raise
        return True

    def swap_out(self, seq: int, blocks: Blocks, timeout: float = 10.0) -> None:
        """``prepare_store`` then ``complete``: ``seq``'s ``blocks`` are in a tier on return."""
        self.complete(self.prepare_store(seq, blocks), timeout)

    def swap_in(self, seq: int, blocks: Blocks, timeout: float = 10.0) -> None:
        """``prepare_load`` then ``complete``: ``blocks`` hold ``seq``'s data on return."""
        self.complete(self.prepare_load(seq, blocks), timeout)

    def touch(self, seq: int) -> None:
        """Marks ``seq`` recently used (spilling picks the least recently used; vLLM:
        ``touch``)."""
        self.call(Op.TOUCH, proto.seq_only(seq))

    def drop_seq(self, seq: int) -> None:
        """Forgets ``seq``: cancels its transfers, releases its tier copy and device
        blocks."""
        self.call(Op.DROP, proto.seq_only(seq))

    def cancel(self, ticket: int) -> None:
        """Cancels ``ticket``; :meth:`complete` then reports ``CANCELLED`` (unless it had
        finished); the data stays where it was."""
        self.call(Op.CANCEL, proto.ticket_only(ticket))

    # ------------------------------------------------------- content-addressed blocks

    def put(self, items: KeyBlocks) -> list[bool]:
        """Stores each ``(key, block)``'s device block in the server's content-addressed
        store under ``key`` (32 bytes), shared with the connections of this namespace.

        The bytes go from the shared mapping (write them with :meth:`block` first) straight
        into the store: none cross the socket. Each block must be held by one of this
        connection's sequences (:meth:`alloc`) with no transfer in flight, else
        :class:`KvError` (``BLOCK_NOT_OWNED``, ``BLOCK_PINNED``) and nothing is stored.
        Per key: ``True`` stored, ``False`` refused.
        """
        items = list(items)
        return proto.decode_flags(self.call(Op.PUT, proto.key_blocks(items)), len(items), "PUT")

    def get(self, items: KeyBlocks) -> list[bool]:
        """For each ``(key, block)``: on a hit (``True``) the server copied the stored bytes
        into ``block`` of the shared mapping (read them with :meth:`block`); on a miss
        (``False``) the block is untouched. Blocks as for :meth:`put`, each named once
        (``DUPLICATE_BLOCK`` otherwise)."""
        items = list(items)
        return proto.decode_flags(self.call(Op.GET, proto.key_blocks(items)), len(items), "GET")

    def exists(self, keys: Keys) -> list[Location]:
        """Where each key's block is in this namespace: :class:`Location` ``ABSENT``,
        ``HOST``, ``NVME`` or ``CLUSTER``."""
        keys = list(keys)
        return proto.decode_locations(self.call(Op.EXISTS, proto.keys(keys)), len(keys))

    def pin(self, keys: Keys) -> list[bool]:
        """Pins each key's block in the server's host memory for this connection: never
        evicted until as many :meth:`unpin` calls or until this connection closes. ``False``
        for a key on no tier or one there is no room to hold."""
        keys = list(keys)
        return proto.decode_flags(self.call(Op.PIN, proto.keys(keys)), len(keys), "PIN")

    def unpin(self, keys: Keys) -> list[bool]:
        """Releases one of this connection's pins of each key; ``False`` where it holds
        none (another connection's pins are not its to release)."""
        keys = list(keys)
        return proto.decode_flags(self.call(Op.UNPIN, proto.keys(keys)), len(keys), "UNPIN")

    def evict(self, keys: Keys) -> list[bool]:
        """Removes each key's block from the server's own tiers; ``False`` where it is
        absent or pinned by any connection. Copies in a shared cluster stay."""
        keys = list(keys)
        return proto.decode_flags(self.call(Op.EVICT, proto.keys(keys)), len(keys), "EVICT")

    def stats(self) -> Stats:
        """Server-wide tier bytes and device pool blocks."""
        t, free, pinned = proto.decode_stats(self.call(Op.STATS))
        return Stats(
            TierStats(t[0], t[1]), TierStats(t[2], t[3]), TierStats(t[4], t[5]), free, pinned
        )


# --------------------------------------------------------------------- helpers


def _op_name(op: int) -> str:
    """``PREPARE_STORE`` for a known op, the number for one this client does not know."""
    try:
        return Op(op).name
    except ValueError:
        return f"op {op}"


def _recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
    """Exactly ``n`` bytes; each ``recv`` is bounded by the socket's timeout and returns at
    least one byte, so this loops at most ``n`` times."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ProtocolError(
                f"server closed the connection in the middle of a {what} reply "
                f"({len(buf)} of {n} bytes)"
            )
        buf += chunk
    return bytes(buf)


def _recv_with_fds(sock: socket.socket, n: int) -> "tuple[bytes, list[int]]":
    """Up to ``n`` bytes and the fds riding on them (``SCM_RIGHTS``, close-on-exec).

    Every fd received is returned (the caller closes them); a truncated control message
    (more fds than room) is an error, after closing what did arrive.
    """
    fds = array.array("i")
    data, ancdata, flags, _addr = sock.recvmsg(
        n, socket.CMSG_SPACE(_FDS_MAX * fds.itemsize), socket.MSG_CMSG_CLOEXEC
    )
    for level, kind, cdata in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(cdata[: len(cdata) - len(cdata) % fds.itemsize])
    if flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise ProtocolError("HELLO reply with more file descriptors than expected")
    return data, list(fds)


def _map_slab(fd: int, map_len: int) -> mmap.mmap:
    """Maps ``map_len`` bytes of the slab memfd ``fd`` shared, read-write.

    Checks first that the file is a regular file (a memfd) at least that long: touching a
    mapped page past the end of a file is SIGBUS, not an exception. The server seals the
    memfd against shrinking, so the check stays true.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ProtocolError("HELLO reply fd is not a memfd (not a regular file)")
    if st.st_size < map_len:
        raise ProtocolError(f"slab memfd of {st.st_size} bytes, HELLO says {map_len}")
    return mmap.mmap(fd, map_len, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
