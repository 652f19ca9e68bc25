//! In-guest test driver for fastlane-rdma: each scenario is a pair of roles run as two
//! processes on 127.0.0.1 over a real RDMA device (soft-RoCE `rxe0` in the QEMU guest of
//! `tests/vm/guest-rdma.sh`). Prints `CHECK <name> ok|FAIL <detail>` lines and exits non-zero
//! on the first failure. The device is `$RDMA_DEV` (default `rxe0`).
//!
//! Roles: `basic-server ADDR`, `basic-client ADDR`, `gone-server ADDR`,
//! `gone-client ADDR write|recv`, `pool-server ADDR [BYTES]`, `pool-client ADDR`,
//! `replica ADDR BYTES`, `primary ADDR BYTES`.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use fastlane_rdma::{
    ConnectOptions, Connection, Device, Durability, Listener, Mirror, MirrorReplica, PollMode,
    PoolServer, Range, RdmaError, RemotePool, RemoteRegion,
};

use fastlane_guest_tests::driver::{check, R};
use fastlane_util::pattern;

const MIB: usize = 1 << 20;

fn fnv(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn e(err: RdmaError) -> String {
    err.to_string()
}

fn device() -> R<Device> {
    let name = std::env::var("RDMA_DEV").unwrap_or_else(|_| "rxe0".into());
    Device::open(&name).map_err(e)
}

fn addr(s: Option<&String>) -> R<SocketAddr> {
    s.ok_or("missing ADDR")?.parse().map_err(|x| format!("bad ADDR: {x}"))
}

fn num(s: Option<&String>) -> R<usize> {
    s.ok_or("missing BYTES")?.parse().map_err(|x| format!("bad BYTES: {x}"))
}

fn basic_server(a: SocketAddr) -> R<()> {
    let dev = device()?;
    let l = Listener::bind(a).map_err(e)?;
    println!("READY");
    let opts = ConnectOptions {
        poll: PollMode::Event,
        buffer_len: 2 * MIB,
        expose_buffer: true,
        op_timeout: Duration::from_secs(20),
        ..Default::default()
    };
    let mut c = l.accept(&dev, opts).map_err(e)?;
    c.post_recv(0, 0).map_err(e)?;
    // The client's WRITE with immediate comes after its 1 MiB WRITE: by then [0, 1 MiB) of
    // our buffer holds its pattern.
    let done = c.wait_recv(Duration::from_secs(20)).map_err(e)?;
    check("server-imm", done.imm == Some(0xC0FF_EE01), format!("imm {:x?}", done.imm))?;
    let mut got = vec![0u8; MIB];
    c.buffer().read_at(0, &mut got).map_err(e)?;
    let sum = fnv(&got);
    println!("server checksum {sum:016x}");
    c.buffer().write_at(MIB + MIB / 2, &sum.to_le_bytes()).map_err(e)?;
    c.send(MIB + MIB / 2, 8, Some(0xACED)).map_err(e)?;
    // Stay until the client is done (its socket closes): PeerGone is the normal end.
    c.post_recv(0, 0).map_err(e)?;
    match c.wait_recv(Duration::from_secs(30)) {
        Err(RdmaError::PeerGone { .. }) | Ok(_) => Ok(()),
        Err(x) => Err(e(x)),
    }
}

fn basic_client(a: SocketAddr) -> R<()> {
    let dev = device()?;
    println!("device {dev:?}");
    let t0 = Instant::now();
    let opts = ConnectOptions { buffer_len: 4 * MIB, ..Default::default() };
    let mut c = Connection::connect(&dev, a, opts).map_err(e)?;
    check(
        "connect",
        c.remote().len == 2 * MIB as u64,
        format!("{:?} in {:?}", c.remote(), t0.elapsed()),
    )?;

    let data = pattern::bytes(42, MIB);
    let sum = fnv(&data);
    c.buffer().write_at(0, &data).map_err(e)?;
    let t = Instant::now();
    c.write(0, 0, MIB).map_err(e)?;
    let wt = t.elapsed();
    let t = Instant::now();
    c.read(MIB, 0, MIB).map_err(e)?;
    let rt = t.elapsed();
    let mut back = vec![0u8; MIB];
    c.buffer().read_at(MIB, &mut back).map_err(e)?;
    let back_sum = fnv(&back);
    check(
        "write-read-1MiB",
        back_sum == sum && back == data,
        format!("fnv {sum:016x} vs {back_sum:016x}; write {wt:?} read {rt:?}"),
    )?;

    // Immediate data: the server answers with its own checksum of what landed in its memory.
    c.post_recv(3 * MIB, 64).map_err(e)?;
    c.write_imm(0, MIB as u64, 16, 0xC0FF_EE01).map_err(e)?;
    let reply = c.wait_recv(Duration::from_secs(20)).map_err(e)?;
    let mut s = [0u8; 8];
    c.buffer().read_at(3 * MIB, &mut s).map_err(e)?;
    let server_sum = u64::from_le_bytes(s);
    check("imm-and-send", reply.imm == Some(0xACED) && reply.byte_len == 8, format!("{reply:?}"))?;
    check("server-checksum", server_sum == sum, format!("server saw {server_sum:016x}"))?;

    // Out of range, caught locally: the connection stays usable.
    let r = c.write(0, 2 * MIB as u64 - 10, 100);
    check(
        "out-of-range-local",
        matches!(r, Err(RdmaError::RemoteAccess { remote: false, granted, .. }) if granted == 2 * MIB as u64),
        format!("{r:?}"),
    )?;
    let r = c.write(0, 0, 64);
    check("usable-after-local-refusal", r.is_ok(), format!("{r:?}"))?;

    // Out of range, refused by the peer's device (the local check bypassed).
    let remote = c.remote();
    let t = Instant::now();
    let r = c.write_unchecked(remote.addr + remote.len, remote.rkey, 0, 100);
    check(
        "out-of-range-remote",
        matches!(r, Err(RdmaError::RemoteAccess { remote: true, .. })),
        format!("{r:?} after {:?}", t.elapsed()),
    )?;
    check("broken-after-remote-refusal", matches!(c.write(0, 0, 8), Err(RdmaError::Broken)), "")?;
    Ok(())
}

fn gone_server(a: SocketAddr) -> R<()> {
    let dev = device()?;
    let l = Listener::bind(a).map_err(e)?;
    println!("READY");
    let opts = ConnectOptions {
        expose_buffer: true,
        op_timeout: Duration::from_secs(20),
        ..Default::default()
    };
    let _c = l.accept(&dev, opts).map_err(e)?;
    println!("ACCEPTED");
    // Wait to be killed (bounded).
    std::thread::sleep(Duration::from_secs(60));
    Ok(())
}

fn gone_client(a: SocketAddr, mode: &str) -> R<()> {
    let dev = device()?;
    let timeout = Duration::from_secs(5);
    let opts = ConnectOptions { op_timeout: timeout, ..Default::default() };
    let mut c = Connection::connect(&dev, a, opts).map_err(e)?;
    println!("CONNECTED");
    let start = Instant::now();
    let mut last_ok = Instant::now();
    let mut n = 0u64;
    let err = loop {
        if start.elapsed() > Duration::from_secs(40) {
            return check(&format!("peer-gone-{mode}"), false, "no error within 40 s");
        }
        let r = if mode == "recv" {
            c.post_recv(0, 0).and_then(|_| c.wait_recv(Duration::from_secs(30))).map(|_| ())
        } else {
            c.write(0, 0, 64 * 1024)
        };
        match r {
            Ok(()) => {
                n += 1;
                last_ok = Instant::now();
            }
            Err(x) => break x,
        }
    };
    let after = last_ok.elapsed();
    check(
        &format!("peer-gone-{mode}"),
        matches!(err, RdmaError::PeerGone { .. }) && after <= timeout + Duration::from_secs(1),
        format!("{err} ({n} ops ok before; error {after:?} after the last success)"),
    )
}

fn pool_server(a: SocketAddr, size: usize) -> R<()> {
    let dev = device()?;
    let p = PoolServer::bind(&dev, a, size as u64).map_err(e)?;
    println!("READY size={}", p.size());
    let stop = AtomicBool::new(false);
    p.serve(&stop).map_err(e)
}

fn pool_client(a: SocketAddr) -> R<()> {
    let dev = device()?;
    let opts = ConnectOptions { buffer_len: 256 * 1024, ..Default::default() };
    let mut p = RemotePool::connect_with(&dev, a, opts).map_err(e)?;
    let ra = p.grant(MIB as u64).map_err(e)?;
    let rb = p.grant(100_000).map_err(e)?;
    check("pool-grant", ra.len() == MIB as u64 && rb.len() >= 100_000, format!("{ra:?} {rb:?}"))?;
    let da = pattern::bytes(7, MIB);
    let db = pattern::bytes(8, 100_000);
    p.write(&ra, 0, &da).map_err(e)?;
    p.write(&rb, 0, &db).map_err(e)?;
    let mut ba = vec![0u8; MIB];
    let mut bb = vec![0u8; 100_000];
    p.read(&ra, 0, &mut ba).map_err(e)?;
    p.read(&rb, 0, &mut bb).map_err(e)?;
    check(
        "pool-write-read",
        ba == da && bb == db,
        format!("fnv {:016x}/{:016x} vs {:016x}/{:016x}", fnv(&da), fnv(&db), fnv(&ba), fnv(&bb)),
    )?;
    let r = p.write(&rb, rb.len() - 10, &[1u8; 100]);
    check(
        "pool-out-of-range-local",
        matches!(r, Err(RdmaError::RemoteAccess { remote: false, .. })),
        format!("{r:?}"),
    )?;
    let r = p.grant(1 << 40);
    check("pool-full", matches!(r, Err(RdmaError::PoolFull { .. })), format!("{r:?}"))?;

    // A second client sees its own grants; a released range's key is dead.
    let mut q = RemotePool::connect_with(&dev, a, opts).map_err(e)?;
    let rc = q.grant(4096).map_err(e)?;
    q.write(&rc, 0, b"second client").map_err(e)?;
    let stale = rb;
    p.release(rb).map_err(e)?;
    let r = q.write(&stale, 0, b"stale");
    check(
        "pool-released-range-refused",
        matches!(r, Err(RdmaError::RemoteAccess { remote: true, .. })),
        format!("{r:?}"),
    )?;

    // A forged, widened range is refused by the server's device.
    let forged =
        Range { id: ra.id, region: RemoteRegion { len: ra.len() + MIB as u64, ..ra.region } };
    let r = p.write(&forged, ra.len(), b"beyond the grant");
    check(
        "pool-forged-range-refused",
        matches!(r, Err(RdmaError::RemoteAccess { remote: true, .. })),
        format!("{r:?}"),
    )?;
    Ok(())
}

fn replica(a: SocketAddr, size: usize) -> R<()> {
    let dev = device()?;
    let m = MirrorReplica::bind(&dev, a, size).map_err(e)?;
    println!("READY");
    let mut s = m.accept(Duration::from_secs(20)).map_err(e)?;
    let stop = AtomicBool::new(false);
    let mut syncs = 0u64;
    let acks = s.serve(&stop, &mut |_| {
        syncs += 1;
        Ok(())
    });
    let acks = acks.map_err(e)?;
    let mut got = vec![0u8; size];
    s.memory().read_at(0, &mut got).map_err(e)?;
    println!("REPLICA acks={acks} syncs={syncs} fnv={:016x}", fnv(&got));
    Ok(())
}

fn primary(a: SocketAddr, size: usize) -> R<()> {
    let dev = device()?;
    let opts = ConnectOptions { buffer_len: 64 * 1024, ..Default::default() };
    let mut m = Mirror::connect(&dev, a, opts).map_err(e)?;
    check("mirror-connect", m.capacity() == size as u64, format!("capacity {}", m.capacity()))?;
    let mut image = vec![0u8; size];
    let mut off = 0usize;
    let mut seq = 0u64;
    let mut acks = 0;
    let t = Instant::now();
    let mut worst = Duration::ZERO;
    while off < size {
        let len = (64 + (seq as usize * 997) % 8000).min(size - off);
        let rec = pattern::bytes(1000 + seq, len);
        let w = Instant::now();
        m.write(off as u64, &rec).map_err(e)?;
        worst = worst.max(w.elapsed());
        image[off..off + len].copy_from_slice(&rec);
        off += len;
        seq += 1;
        if seq.is_multiple_of(64) {
            m.sync(Durability::ReplicaAck).map_err(e)?;
            acks += 1;
        }
    }
    m.sync(Durability::ReplicaAck).map_err(e)?;
    acks += 1;
    m.sync(Durability::ReadAfterWrite).map_err(e)?;
    let el = t.elapsed();
    let mut back = vec![0u8; size];
    m.read_back(0, &mut back).map_err(e)?;
    check(
        "mirror-ordered-writes",
        back == image,
        format!("{seq} writes, {acks} acks in {el:?}, slowest write {worst:?}"),
    )?;
    let r = m.write(size as u64 - 4, &[0u8; 8]);
    check(
        "mirror-out-of-range",
        matches!(r, Err(RdmaError::RemoteAccess { remote: false, .. })),
        format!("{r:?}"),
    )?;
    println!("PRIMARY fnv={:016x}", fnv(&image));
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let role = args.get(1).map(String::as_str).unwrap_or("");
    let r = (|| -> R<()> {
        match role {
            "basic-server" => basic_server(addr(args.get(2))?),
            "basic-client" => basic_client(addr(args.get(2))?),
            "gone-server" => gone_server(addr(args.get(2))?),
            "gone-client" => {
                gone_client(addr(args.get(2))?, args.get(3).map(String::as_str).unwrap_or("write"))
            }
            "pool-server" => {
                let size = if args.len() > 3 { num(args.get(3))? } else { 64 * MIB };
                pool_server(addr(args.get(2))?, size)
            }
            "pool-client" => pool_client(addr(args.get(2))?),
            "replica" => replica(addr(args.get(2))?, num(args.get(3))?),
            "primary" => primary(addr(args.get(2))?, num(args.get(3))?),
            "devices" => {
                println!("{:?}", fastlane_rdma::device_names());
                Ok(())
            }
            _ => Err(format!("unknown role {role:?}; see the file's doc comment")),
        }
    })();
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(m) => {
            println!("ERROR {role}: {m}");
            ExitCode::FAILURE
        }
    }
}
