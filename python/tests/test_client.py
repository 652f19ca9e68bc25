"""fastlane_kv against a real ``fastlane kv serve`` process over its real Unix socket.

The binary is ``$FASTLANE_BIN`` (default ``target/debug/fastlane``, from the repository
root or the current directory). Each test starts its own server in a fresh temporary
directory and stops it with SIGTERM, checking that it exits cleanly. Every wait is bounded
in time and count.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path
from typing import Callable, Optional, TypeVar

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))

from fastlane_kv import (  # noqa: E402  (after the path set-up above)
    ErrorCode,
    KvClient,
    KvError,
    Location,
    Phase,
    ProtocolError,
    Tier,
)

BLOCK_BYTES = 128 * 1024
"""One token of Llama-3.1-8B fp16 (``--tokens-per-block 1``)."""
POOL_BLOCKS = 16
START_WAIT_S = 30.0
STOP_WAIT_S = 20.0
T = TypeVar("T")


def fastlane_bin() -> Path:
    """The ``fastlane`` binary to test; fails the test run with a hint when absent."""
    env = os.environ.get("FASTLANE_BIN")
    default = [Path("target/debug/fastlane"), REPO / "target/debug/fastlane"]
    candidates = [Path(env)] if env else default
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c.resolve()
    raise RuntimeError(
        f"no fastlane binary at {', '.join(map(str, candidates))}: build it with "
        "`cargo build -p fastlane-cli` or set FASTLANE_BIN"
    )


def pattern(seed: int, n: int = BLOCK_BYTES) -> bytes:
    """``n`` reproducible pseudo-random bytes, different for every seed."""
    return random.Random(seed).randbytes(n)


def until(what: str, f: Callable[[], Optional[T]], timeout_s: float = 10.0, tries: int = 1000) -> T:
    """Calls ``f`` until it returns something other than ``None``, at most ``tries`` times
    and ``timeout_s`` seconds, 10 ms apart; fails with ``what`` otherwise."""
    deadline = time.monotonic() + timeout_s
    for _ in range(tries):
        r = f()
        if r is not None:
            return r
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


class KvServer:
    """A ``fastlane kv serve`` child on a socket in its own temporary directory."""

    def __init__(self, *extra: str) -> None:
        self.dir = tempfile.TemporaryDirectory(prefix="fastlane-kv-py-")
        self.sock = Path(self.dir.name) / "kv.sock"
        self.log_path = Path(self.dir.name) / "serve.log"
        self._log = open(self.log_path, "wb")
        args = [
            str(fastlane_bin()), "kv", "serve", "--socket", str(self.sock),
            "--device-blocks", str(POOL_BLOCKS), "--host-bytes", "16M",
            "--tokens-per-block", "1", *extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            until("kv serve to listen", self._listening, timeout_s=START_WAIT_S, tries=3000)
        except BaseException:
            self.stop()
            raise

    def _listening(self) -> Optional[bool]:
        """True once the server says it listens (after its signal handlers are set)."""
        if self.proc.poll() is not None:
            raise AssertionError(f"kv serve exited with {self.proc.returncode}:\n{self.log()}")
        return True if "listening on" in self.log() and self.sock.exists() else None

    def log(self) -> str:
        """What the server printed so far."""
        return self.log_path.read_text(errors="replace")

    def connect(self, slab_blocks: int = 0, namespace: Optional[str] = None) -> KvClient:
        """A client, retrying (bounded) while the server is starting."""
        deadline = time.monotonic() + START_WAIT_S
        for _ in range(int(START_WAIT_S / 0.05) + 1):
            if self.proc.poll() is not None:
                raise AssertionError(f"kv serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                return KvClient.connect(self.sock, slab_blocks, namespace, io_timeout=10.0)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        raise AssertionError(f"kv serve did not come up in {START_WAIT_S} s:\n{self.log()}")

    def stop(self) -> int:
        """SIGTERM, bounded wait (SIGKILL after it); returns the exit status."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(STOP_WAIT_S)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(STOP_WAIT_S)
            return self.proc.returncode
        finally:
            self._log.close()


class ServerTest(unittest.TestCase):
    """Starts one server per test and checks it stops cleanly."""

    server_args: tuple[str, ...] = ()

    def setUp(self) -> None:
        self.server = KvServer(*self.server_args)
        self.clients: list[KvClient] = []

    def tearDown(self) -> None:
        for c in self.clients:
            c.close()
        rc = self.server.stop()
        log = self.server.log()
        self.server.dir.cleanup()
        self.assertEqual(rc, 0, f"kv serve exit status {rc}:\n{log}")
        self.assertFalse(self.server.sock.exists(), "socket left behind")

    def client(self, slab_blocks: int = 0, namespace: Optional[str] = None) -> KvClient:
        c = self.server.connect(slab_blocks, namespace)
        self.clients.append(c)
        return c

    def assertKvError(self, code: ErrorCode, f: Callable[[], object]) -> KvError:
        with self.assertRaises(KvError) as cm:
            f()
        e = cm.exception
        self.assertEqual(e.code, code, str(e))
        self.assertEqual(e.status, int(code))
        self.assertTrue(e.message, "the server's message is empty")
        return e


class HelloTest(ServerTest):
    def test_hello_maps_the_slab_of_a_memfd(self) -> None:
        c = self.client(slab_blocks=5)
        self.assertEqual(c.block_bytes, BLOCK_BYTES)
        self.assertEqual(c.blocks, 5)
        self.assertEqual(len(c.memory), 5 * BLOCK_BYTES)
        self.assertEqual(len(c.slab), 5)
        self.assertTrue(0 <= c.slab.start and c.slab.stop <= POOL_BLOCKS, c.slab)
        self.assertEqual(c.namespace, f"uid:{os.geteuid()}")
        self.assertEqual(c.memory[:], bytes(5 * BLOCK_BYTES), "a fresh slab is zeroed")
        # The mapping is a MAP_SHARED mapping of the memfd, not a private copy.
        anchor = ctypes.c_char.from_buffer(c.memory)
        start = ctypes.addressof(anchor)
        del anchor
        maps = Path("/proc/self/maps").read_text().splitlines()
        line = next((m for m in maps if int(m.split("-")[0], 16) == start), None)
        self.assertIsNotNone(line, f"no mapping at {start:#x}")
        assert line is not None
        perms, name = line.split()[1], line.split()[-1]
        self.assertEqual(perms[:2] + perms[3], "rws", line)
        self.assertIn("memfd:", line, name)
        # Default size: a quarter of the pool; a second connection gets a disjoint slab.
        d = self.client()
        self.assertEqual(d.blocks, POOL_BLOCKS // 4)
        self.assertFalse(set(c.slab) & set(d.slab), (c.slab, d.slab))

    def test_block_views_are_zero_copy(self) -> None:
        c = self.client(slab_blocks=2)
        b = c.alloc(1, 2)
        self.assertTrue(all(x in c.slab for x in b), b)
        v = c.block(b[1])
        self.assertIs(v.obj, c.memory)
        self.assertEqual((len(v), v.readonly), (BLOCK_BYTES, False))
        v[:4] = b"\x01\x02\x03\x04"
        off = (b[1] - c.slab.start) * BLOCK_BYTES
        self.assertEqual(c.memory[off : off + 4], b"\x01\x02\x03\x04")
        c.write_block(b[0], b"xyz")
        self.assertEqual(c.read_block(b[0])[:3], b"xyz")
        with self.assertRaises(IndexError):
            c.block(c.slab.stop)
        v.release()

    def test_hello_refusals(self) -> None:
        e = self.assertKvError(
            ErrorCode.QUOTA_EXCEEDED, lambda: KvClient.connect(self.server.sock, POOL_BLOCKS + 1)
        )
        self.assertIn("at most", e.message)
        self.assertKvError(
            ErrorCode.NAMESPACE_REFUSED, lambda: KvClient.connect(self.server.sock, 1, "team-x")
        )
        other = f"uid:{os.geteuid() + 1}"
        self.assertKvError(
            ErrorCode.NAMESPACE_REFUSED, lambda: KvClient.connect(self.server.sock, 1, other)
        )
        with self.assertRaises(ValueError):
            KvClient.connect(self.server.sock, 1, "a/b")
        # Still serving.
        self.assertEqual(self.client(1).blocks, 1)


class NamespaceTest(ServerTest):
    server_args = ("--namespace", f"team-py={os.geteuid()}")

    def test_configured_namespace(self) -> None:
        self.assertEqual(self.client(1, "team-py").namespace, "team-py")


class SwapTest(ServerTest):
    def test_swap_out_zero_swap_in_restores_the_pattern(self) -> None:
        c = self.client(slab_blocks=4)
        blocks = c.alloc(7, 3)
        want = [pattern(100 + i) for i in range(3)]
        for b, p in zip(blocks, want):
            c.block(b)[:] = p
        c.swap_out(7, blocks, timeout=10.0)
        got = c.lookup(7)
        self.assertEqual((got.phase, got.tier, got.blocks_out), (Phase.OUT, Tier.HOST, 3), got)
        for b in blocks:
            c.block(b)[:] = bytes(BLOCK_BYTES)
        self.assertEqual(c.read_block(blocks[0]), bytes(BLOCK_BYTES))
        t = c.prepare_load(7, blocks)
        c.complete(t, timeout=10.0)
        for b, p in zip(blocks, want):
            self.assertTrue(c.block(b) == p, f"block {b} differs after swap-in")
        self.assertEqual(c.lookup(7).phase, Phase.RESIDENT)

    def test_swap_in_into_other_blocks_after_free(self) -> None:
        c = self.client(slab_blocks=4)
        blocks = c.alloc(1, 2)
        want = [pattern(7), pattern(8)]
        for b, p in zip(blocks, want):
            c.write_block(b, p)
        t = c.prepare_store(1, blocks)
        done = until("swap-out", lambda: True if c.poll(t) else None)
        self.assertTrue(done)
        c.free(1, blocks)
        # Another sequence takes two blocks first, so seq 1 comes back in a different set.
        filler = c.alloc(2, 2)
        back = c.alloc(1, 2)
        self.assertEqual(len(set(back) | set(filler)), 4)
        c.swap_in(1, back)
        self.assertEqual([c.read_block(b) for b in back], want)

    def test_poll_and_cancel(self) -> None:
        c = self.client(slab_blocks=2)
        blocks = c.alloc(3, 2)
        t = c.prepare_store(3, blocks)
        c.cancel(t)
        # Either cancelled before it ran, or it had already finished.
        try:
            until("cancelled swap-out", lambda: True if c.poll(t) else None)
            self.assertEqual(c.lookup(3).phase, Phase.OUT)
        except KvError as e:
            self.assertEqual(e.code, ErrorCode.CANCELLED, str(e))
            self.assertEqual(c.lookup(3).phase, Phase.RESIDENT)
        # A finished ticket's result is delivered once.
        self.assertKvError(ErrorCode.UNKNOWN_TICKET, lambda: c.poll(t))
        c.touch(3)
        c.drop_seq(3)
        self.assertKvError(ErrorCode.UNKNOWN_SEQUENCE, lambda: c.lookup(3))


class ErrorTest(ServerTest):
    def test_errors_carry_the_servers_code_and_message(self) -> None:
        c = self.client(slab_blocks=4)
        blocks = c.alloc(1, 2)
        other = c.alloc(2, 1)
        self.assertKvError(ErrorCode.UNKNOWN_SEQUENCE, lambda: c.lookup(99))
        self.assertKvError(ErrorCode.UNKNOWN_SEQUENCE, lambda: c.touch(99))
        # A block of another sequence, and one outside this connection's slab.
        self.assertKvError(ErrorCode.BLOCK_NOT_OWNED, lambda: c.free(1, other))
        outside = (c.slab.stop) % POOL_BLOCKS
        self.assertKvError(ErrorCode.BLOCK_NOT_OWNED, lambda: c.prepare_store(1, [outside]))
        self.assertKvError(ErrorCode.NOT_SWAPPED_OUT, lambda: c.prepare_load(1, blocks))
        self.assertKvError(ErrorCode.UNKNOWN_TICKET, lambda: c.complete(12345, timeout=0.1))
        self.assertKvError(ErrorCode.UNKNOWN_TICKET, lambda: c.cancel(12345))
        self.assertKvError(ErrorCode.DEVICE_FULL, lambda: c.alloc(3, 2))
        c.swap_out(1, blocks)
        self.assertKvError(ErrorCode.DOUBLE_SWAP_OUT, lambda: c.prepare_store(1, blocks))
        with self.assertRaises(ValueError):
            c.alloc(-1, 1)
        # The connection is still good after all of that.
        self.assertEqual(c.lookup(1).phase, Phase.OUT)
        # An op this server does not know closes that connection only.
        d = self.client(slab_blocks=1)
        with self.assertRaises(ProtocolError) as cm:
            d.call(200)
        self.assertIn("closed the connection", str(cm.exception))
        with self.assertRaises(ValueError):
            d.stats()
        self.assertEqual(c.lookup(1).phase, Phase.OUT)


class StatsTest(ServerTest):
    def test_stats_move_with_alloc_swap_and_drop(self) -> None:
        c = self.client(slab_blocks=4)
        s0 = c.stats()
        self.assertEqual(s0.host.capacity_bytes, 16 << 20)
        self.assertEqual((s0.host.used_bytes, s0.device_pinned), (0, 0))
        blocks = c.alloc(5, 3)
        s1 = c.stats()
        self.assertEqual(s1.device_free, s0.device_free - 3)
        c.swap_out(5, blocks)
        s2 = c.stats()
        self.assertEqual(s2.host.used_bytes, 3 * BLOCK_BYTES)
        self.assertEqual(s2.device_pinned, 0)
        c.drop_seq(5)
        s3 = c.stats()
        self.assertEqual((s3.host.used_bytes, s3.device_free), (0, s0.device_free))


class IsolationTest(ServerTest):
    def test_a_second_client_cannot_see_the_first_ones_data(self) -> None:
        a = self.client(slab_blocks=4)
        ablocks = a.alloc(1, 4)
        want = {b: pattern(1000 + b) for b in ablocks}
        for b, p in want.items():
            a.block(b)[:] = p
        b = self.client(slab_blocks=4)
        self.assertFalse(set(a.slab) & set(b.slab))
        self.assertEqual(b.memory[:], bytes(len(b.memory)), "B's mapping is not all zeroes")
        for x in ablocks:
            with self.assertRaises(IndexError):
                b.block(x)
        self.assertKvError(ErrorCode.BLOCK_NOT_OWNED, lambda: b.free(1, ablocks[:1]))
        self.assertKvError(ErrorCode.UNKNOWN_SEQUENCE, lambda: b.lookup(1))
        # B writes all of its own memory and swaps its sequence 1: A's bytes do not move.
        b.memory[:] = b"\xff" * len(b.memory)
        bblocks = b.alloc(1, 4)
        self.assertKvError(ErrorCode.BLOCK_NOT_OWNED, lambda: b.prepare_store(1, ablocks[:1]))
        b.swap_out(1, bblocks)
        b.swap_in(1, bblocks)
        for x, p in want.items():
            self.assertTrue(a.block(x) == p, f"A's block {x} changed")
        # A goes; a later connection given A's old range sees zeroes.
        aslab = a.slab
        self.clients.remove(a)
        a.close()

        def reuse() -> Optional[KvClient]:
            c = KvClient.connect(self.server.sock, 4, io_timeout=10.0)
            if c.slab == aslab:
                return c
            c.close()
            return None

        c = until("A's slab to be given out again", reuse, timeout_s=10.0, tries=200)
        self.clients.append(c)
        self.assertEqual(c.memory[:], bytes(len(c.memory)), "the next client sees A's data")


def key(n: int) -> bytes:
    """A 32-byte content key for ``n``."""
    return n.to_bytes(8, "little") + b"\x5a" * 24


class CasNvmeTest(ServerTest):
    """The store with 2 blocks of host memory and an NVMe tier file (--cas-nvme)."""

    def setUp(self) -> None:
        self.tier_dir = tempfile.TemporaryDirectory(prefix="fastlane-kv-py-nvme-")
        self.server_args = (
            "--cas-bytes", str(2 * BLOCK_BYTES),
            "--cas-nvme", str(Path(self.tier_dir.name) / "cas.tier"),
            "--cas-nvme-bytes", str(8 * BLOCK_BYTES),
        )  # fmt: skip
        super().setUp()

    def tearDown(self) -> None:
        super().tearDown()
        self.tier_dir.cleanup()

    def test_blocks_evicted_from_host_come_back_from_nvme(self) -> None:
        c = self.client(slab_blocks=4)
        b = c.alloc(1, 4)
        for i in range(3):
            c.block(b[i])[:] = pattern(80 + i)
        self.assertEqual(c.put([(key(80 + i), b[i]) for i in range(3)]), [True] * 3)
        # The spill of the oldest block is written in the background: wait for it (bounded).
        until("the oldest block to reach the NVMe tier",
              lambda: c.exists([key(80)]) == [Location.NVME] or None)  # fmt: skip
        self.assertEqual(c.exists([key(81), key(82)]), [Location.HOST, Location.HOST])
        c.block(b[3])[:] = bytes(BLOCK_BYTES)
        self.assertEqual(c.get([(key(80), b[3])]), [True])
        self.assertEqual(c.read_block(b[3]), pattern(80))
        # EVICT removes it from host and NVMe alike.
        until("no spill in flight for key 80", lambda: c.evict([key(80)])[0] or None)
        self.assertEqual(c.exists([key(80)]), [Location.ABSENT])


class CasTest(ServerTest):
    server_args = ("--namespace", f"team-py={os.geteuid()}", "--cas-bytes", "4M")

    def test_put_get_exists_pin_unpin_evict(self) -> None:
        c = self.client(slab_blocks=4)
        b = c.alloc(1, 4)
        c.block(b[0])[:] = pattern(1)
        c.block(b[1])[:] = pattern(2)
        self.assertEqual(c.put([(key(1), b[0]), (key(2), b[1])]), [True, True])
        self.assertEqual(
            c.exists([key(1), key(2), key(3)]), [Location.HOST, Location.HOST, Location.ABSENT]
        )
        # A hit lands in the shared mapping: a view taken before the GET sees it (zero copy).
        view = c.block(b[2])
        view[:] = bytes(BLOCK_BYTES)
        c.block(b[3])[:] = b"\x77" * BLOCK_BYTES
        self.assertEqual(c.get([(key(2), b[2]), (key(3), b[3])]), [True, False])
        self.assertTrue(view == pattern(2), "GET did not bring back the PUT bytes")
        self.assertTrue(c.block(b[3]) == b"\x77" * BLOCK_BYTES, "a miss wrote its block")
        view.release()
        # The store keeps its own copy.
        c.block(b[0])[:] = bytes(BLOCK_BYTES)
        self.assertEqual(c.get([(key(1), b[3])]), [True])
        self.assertEqual(c.read_block(b[3]), pattern(1))
        # Pinned blocks are not evicted; UNPIN releases only what this connection pinned.
        self.assertEqual(c.pin([key(1), key(3)]), [True, False])
        self.assertEqual(c.evict([key(1), key(2), key(3)]), [False, True, False])
        self.assertEqual(c.exists([key(1), key(2)]), [Location.HOST, Location.ABSENT])
        self.assertEqual(c.unpin([key(1), key(1)]), [True, False])
        self.assertEqual(c.evict([key(1)]), [True])
        self.assertEqual(c.exists([key(1)]), [Location.ABSENT])
        self.assertEqual(c.put([]), [])

    def test_namespaces_share_inside_and_isolate_across(self) -> None:
        a = self.client(slab_blocks=2, namespace="team-py")
        b = self.client(slab_blocks=2, namespace="team-py")
        u = self.client(slab_blocks=2)  # uid:<uid>, another namespace
        ab, bb, ub = a.alloc(1, 2), b.alloc(1, 2), u.alloc(1, 2)
        a.block(ab[0])[:] = pattern(50)
        self.assertEqual(a.put([(key(50), ab[0])]), [True])
        # Same namespace: found, and the bytes are A's.
        self.assertEqual(b.exists([key(50)]), [Location.HOST])
        self.assertEqual(b.get([(key(50), bb[0])]), [True])
        self.assertEqual(b.read_block(bb[0]), pattern(50))
        # Another namespace: cannot read, test for, pin nor evict it.
        u.block(ub[0])[:] = b"\x33" * BLOCK_BYTES
        self.assertEqual(u.get([(key(50), ub[0])]), [False])
        self.assertTrue(u.block(ub[0]) == b"\x33" * BLOCK_BYTES)
        self.assertEqual(u.exists([key(50)]), [Location.ABSENT])
        self.assertEqual(u.pin([key(50)]), [False])
        self.assertEqual(u.evict([key(50)]), [False])
        self.assertEqual(b.exists([key(50)]), [Location.HOST])
        # The same client key in U's namespace is another block.
        u.block(ub[1])[:] = pattern(51)
        self.assertEqual(u.put([(key(50), ub[1])]), [True])
        self.assertEqual(b.get([(key(50), bb[1])]), [True])
        self.assertEqual(b.read_block(bb[1]), pattern(50))

    def test_pins_are_released_when_their_connection_closes(self) -> None:
        a = self.client(slab_blocks=1, namespace="team-py")
        b = self.client(slab_blocks=1, namespace="team-py")
        ab = a.alloc(1, 1)
        a.write_block(ab[0], pattern(60))
        self.assertEqual(a.put([(key(60), ab[0])]), [True])
        self.assertEqual(b.pin([key(60), key(60)]), [True, True])
        self.assertEqual(a.evict([key(60)]), [False], "a pinned block was evicted")
        self.assertEqual(a.unpin([key(60)]), [False], "A released B's pin")
        self.clients.remove(b)
        b.close()
        # B's connection thread releases its pins when it sees the close (bounded wait).
        until("B's pins to go with its connection", lambda: a.evict([key(60)])[0] or None)
        self.assertEqual(a.exists([key(60)]), [Location.ABSENT])

    def test_blocks_must_be_the_connections_own(self) -> None:
        a = self.client(slab_blocks=2)
        b = self.client(slab_blocks=2)
        ab, bb = a.alloc(1, 1), b.alloc(1, 1)
        a.write_block(ab[0], pattern(70))
        self.assertEqual(a.put([(key(70), ab[0])]), [True])
        unallocated = next(x for x in b.slab if x not in bb)
        for bad in (ab[0], unallocated, 0xFFFF_FFFF):
            self.assertKvError(ErrorCode.BLOCK_NOT_OWNED, lambda: b.put([(key(71), bad)]))
            self.assertKvError(
                ErrorCode.BLOCK_NOT_OWNED, lambda: b.get([(key(70), bb[0]), (key(70), bad)])
            )
        self.assertEqual(b.read_block(bb[0]), bytes(BLOCK_BYTES), "a refused GET wrote")
        self.assertEqual(b.exists([key(71)]), [Location.ABSENT])
        self.assertKvError(
            ErrorCode.DUPLICATE_BLOCK, lambda: b.get([(key(70), bb[0]), (key(70), bb[0])])
        )
        self.assertEqual(a.read_block(ab[0]), pattern(70))
        with self.assertRaises(ValueError):
            b.put([(b"short", bb[0])])
        with self.assertRaises(ValueError):
            b.exists([key(1)] * 2048)
        # Still serving.
        self.assertEqual(b.get([(key(70), bb[0])]), [True])
        self.assertEqual(b.read_block(bb[0]), pattern(70))


class CasDisabledTest(ServerTest):
    server_args = ("--cas-bytes", "0")

    def test_ops_are_refused_and_the_connection_goes_on(self) -> None:
        c = self.client(slab_blocks=1)
        b = c.alloc(1, 1)
        e = self.assertKvError(ErrorCode.STORE_DISABLED, lambda: c.put([(key(1), b[0])]))
        self.assertIn("--cas-bytes 0", e.message)
        self.assertKvError(ErrorCode.STORE_DISABLED, lambda: c.get([(key(1), b[0])]))
        for op in (c.exists, c.pin, c.unpin, c.evict):
            self.assertKvError(ErrorCode.STORE_DISABLED, lambda: op([key(1)]))
        self.assertEqual(c.lookup(1).device_blocks, 1)


if __name__ == "__main__":
    unittest.main()
