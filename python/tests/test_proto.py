"""fastlane_kv.proto without a server: frames byte for byte as ``fastlane_kvswap::proto`` writes
them, and hostile ``HELLO`` replies refused."""

from __future__ import annotations

import struct
import sys
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from fastlane_kv import proto  # noqa: E402
from fastlane_kv.proto import ErrorCode, Op, ProtocolError  # noqa: E402


def hello_reply(block_bytes: int, first: int, blocks: int, map_len: int, ns: bytes) -> bytes:
    return struct.pack("<QIIQI", block_bytes, first, blocks, map_len, len(ns)) + ns


class FrameTest(unittest.TestCase):
    def test_frames_match_the_rust_encoding(self) -> None:
        # fastlane_kvswap::proto::Request::Stats.encode(7) and PrepareStore { seq: 3, [5, 6] }.
        self.assertEqual(
            proto.frame(Op.STATS, 7, b""),
            b"KVSW" + bytes([2, 0, 11, 0, 7, 0, 0, 0, 0, 0, 0, 0]),
        )
        f = proto.frame(Op.PREPARE_STORE, 1, proto.seq_blocks(3, [5, 6]))
        self.assertEqual(f[16:], struct.pack("<IIII", 3, 2, 5, 6))
        self.assertEqual(proto.Header.decode(f[:16]), proto.Header(Op.PREPARE_STORE, 1, 16))
        self.assertEqual(proto.hello(4, "ns"), struct.pack("<II", 4, 2) + b"ns")
        self.assertEqual(proto.complete(9, 1500), struct.pack("<QI", 9, 1500))

    def test_bad_arguments_are_refused_before_sending(self) -> None:
        for bad in (lambda: proto.seq_only(-1), lambda: proto.seq_only(1 << 32),
                    lambda: proto.seq_blocks(1, [0] * (proto.BLOCKS_MAX + 1)),
                    lambda: proto.seq_n(1, proto.BLOCKS_MAX + 1),
                    lambda: proto.hello(0, "a/b"), lambda: proto.hello(0, "x" * 129)):  # fmt: skip
            with self.assertRaises(ValueError):
                bad()

    def test_content_addressed_frames_match_the_rust_encoding(self) -> None:
        k1, k2 = b"\x01" * 32, b"\x02" * 32
        # fastlane_kvswap::proto::Request::Put { items: [(k1, 4), (k2, 5)] } and Exists { [k1, k2] }.
        self.assertEqual(
            proto.key_blocks([(k1, 4), (k2, 5)]),
            struct.pack("<I", 2) + k1 + struct.pack("<I", 4) + k2 + struct.pack("<I", 5),
        )
        self.assertEqual(proto.keys([k1, k2]), struct.pack("<I", 2) + k1 + k2)
        self.assertEqual(proto.frame(Op.EVICT, 3, proto.keys([]))[6:8], b"\x11\x00")
        self.assertEqual((Op.PUT, Op.GET, Op.EXISTS, Op.PIN, Op.UNPIN, Op.EVICT),
                         (12, 13, 14, 15, 16, 17))  # fmt: skip
        self.assertEqual((proto.KEYS_MAX, proto.KEY_BLOCKS_MAX), (2047, 1820))
        self.assertEqual(ErrorCode.from_wire(22), ErrorCode.STORE_DISABLED)
        for bad in (lambda: proto.keys([b"\x01" * 31]), lambda: proto.keys(["x" * 32]),
                    lambda: proto.keys([k1] * (proto.KEYS_MAX + 1)),
                    lambda: proto.key_blocks([(k1, -1)]),
                    lambda: proto.key_blocks([(k1, 0)] * (proto.KEY_BLOCKS_MAX + 1))):  # fmt: skip
            with self.assertRaises(ValueError):
                bad()

    def test_per_key_replies(self) -> None:
        self.assertEqual(proto.decode_flags(b"\x01\x00", 2, "PUT"), [True, False])
        self.assertEqual(
            proto.decode_locations(b"\x00\x01\x02\x03", 4),
            [proto.Location.ABSENT, proto.Location.HOST, proto.Location.NVME,
             proto.Location.CLUSTER],
        )  # fmt: skip
        for bad in (lambda: proto.decode_flags(b"\x01", 2, "GET"),
                    lambda: proto.decode_flags(b"\x02", 1, "PIN"),
                    lambda: proto.decode_locations(b"\x04", 1),
                    lambda: proto.decode_locations(b"", 1)):  # fmt: skip
            with self.assertRaises(ProtocolError):
                bad()

    def test_hostile_headers(self) -> None:
        good = proto.Header(Op.STATS | proto.REPLY, 1, 4).encode()
        for i, v in ((0, 0), (4, 1), (14, 0xFF)):  # magic, version 1, length over the max
            b = bytearray(good)
            b[i] = v
            with self.assertRaises(ProtocolError):
                proto.Header.decode(bytes(b))
        with self.assertRaises(ProtocolError):
            proto.Header.decode(good[:15])

    def test_hello_reply_checks(self) -> None:
        ok = hello_reply(4096, 8, 4, 4 * 4096, b"uid:1000")
        r = proto.HelloReply.decode(ok)
        self.assertEqual((r.block_bytes, r.first_block, r.blocks, r.map_len, r.namespace),
                         (4096, 8, 4, 16384, "uid:1000"))  # fmt: skip
        for cut in range(len(ok)):
            with self.assertRaises(ProtocolError):
                proto.HelloReply.decode(ok[:cut])
        for bad in (
            hello_reply(4096, 8, 4, 4096, b""),  # map_len is not the slab's size
            hello_reply(4096, 8, 0, 0, b""),  # empty slab
            hello_reply(4096, 0xFFFF_FFFF, 4, 4 * 4096, b""),  # past the last block id
            hello_reply(4096, 0, 1, 4096, b"a/b"),  # namespace characters
        ):
            with self.assertRaises(ProtocolError):
                proto.HelloReply.decode(bad)

    def test_replies(self) -> None:
        self.assertEqual(proto.split_status(b"\x09\x00\x00\x00no"), (9, b"no"))
        with self.assertRaises(ProtocolError):
            proto.split_status(b"\x00")
        self.assertEqual(proto.decode_blocks(struct.pack("<III", 2, 4, 5)), [4, 5])
        with self.assertRaises(ProtocolError):
            proto.decode_blocks(struct.pack("<II", 2, 4))
        with self.assertRaises(ProtocolError):
            proto.decode_ticket(b"\x00" * 7)
        self.assertEqual(ErrorCode.from_wire(12345), ErrorCode.OTHER)
        self.assertEqual(ErrorCode.from_wire(9), ErrorCode.BLOCK_NOT_OWNED)


if __name__ == "__main__":
    unittest.main()
