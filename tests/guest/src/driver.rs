//! What the guest driver binaries share: the `CHECK name ok|FAIL detail` lines the host test
//! reads, the remote pool server the swap tiers connect to, and the `main` that turns a
//! driver's result into `ERROR …` and an exit status.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;

/// A driver step's result: the message of the first failure.
pub type R<T> = Result<T, String>;

/// Prints `CHECK name ok detail` or `CHECK name FAIL detail` (and fails).
pub fn check(name: &str, ok: bool, detail: impl std::fmt::Display) -> R<()> {
    if ok {
        println!("CHECK {name} ok {detail}");
        Ok(())
    } else {
        println!("CHECK {name} FAIL {detail}");
        Err(format!("{name} failed: {detail}"))
    }
}

/// Serves a `fastlane_rdma` memory pool of `bytes` on `addr` (device `$RDMA_DEV`, default
/// `rxe0`), printing `READY size=N` once it listens; runs until killed.
pub fn pool_server(addr: SocketAddr, bytes: u64) -> R<()> {
    let dev =
        fastlane_rdma::Device::open(&std::env::var("RDMA_DEV").unwrap_or_else(|_| "rxe0".into()))
            .map_err(|x| x.to_string())?;
    let p = fastlane_rdma::PoolServer::bind(&dev, addr, bytes).map_err(|x| x.to_string())?;
    println!("READY size={}", p.size());
    p.serve(&AtomicBool::new(false)).map_err(|x| x.to_string())
}

/// The `main` of a remote-tier driver: `NAME pool-server ADDR BYTES` or `NAME client ADDR`
/// (running `client`); a failure prints `ERROR message` and exits 1.
pub fn remote_main(name: &str, client: fn(SocketAddr) -> R<()>) -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let addr = || -> R<SocketAddr> {
        args.get(2).ok_or("missing ADDR")?.parse().map_err(|x| format!("bad ADDR: {x}"))
    };
    let r = match args.get(1).map(String::as_str) {
        Some("pool-server") => args
            .get(3)
            .ok_or_else(|| "missing BYTES".to_string())
            .and_then(|b| b.parse::<u64>().map_err(|_| "bad BYTES".to_string()))
            .and_then(|bytes| pool_server(addr()?, bytes)),
        Some("client") => addr().and_then(client),
        _ => Err(format!("usage: {name} pool-server ADDR BYTES | client ADDR")),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(m) => {
            println!("ERROR {m}");
            ExitCode::FAILURE
        }
    }
}
