//! `fastlane journal append|verify|dump`: writing records, checking a journal file, and
//! printing its frames.

use std::io::{BufRead as _, Write as _};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use fastlane_journal::verify::hex;
use fastlane_journal::{scan, verify, Anchor, Journal, JournalError};

use super::{open_config, AppendArgs, DumpArgs, VerifyArgs};

pub(super) fn append(a: &AppendArgs) -> Result<()> {
    let j = Journal::open_or_create(open_config(&a.common)?)?;
    if let Some(r) = j.recovery().replica {
        eprintln!("replica resync: {:?}, {} bytes sent", r.action, r.bytes_sent);
    }
    if let Some(n) = a.generate {
        return append_generated(j, n, a.record_bytes, a.ack_every);
    }
    let mut tx = j.producer()?;
    let mut last = 0;
    let mut push = |rec: &[u8]| -> Result<()> {
        last = tx.append_blocking(rec, Duration::from_secs(10))?;
        println!("{last}");
        Ok(())
    };
    if a.records.is_empty() {
        for line in std::io::stdin().lock().lines() {
            push(line?.as_bytes())?;
        }
    } else {
        for r in &a.records {
            push(r.as_bytes())?;
        }
    }
    if last > 0 {
        tx.wait_durable(last, Duration::from_secs(30))?;
    }
    drop(tx);
    j.close()?;
    Ok(())
}

/// `append --generate N`: payload "record SEQ" padded with '.' to `record_bytes`; with
/// `ack_every`, waits for every N-th seq (and the last) to be durable and prints "ACK SEQ".
/// A writer failure (a dead replica) ends it with the writer's error, after the last ACK.
pub(super) fn append_generated(
    j: Journal,
    n: u64,
    record_bytes: usize,
    ack_every: Option<u64>,
) -> Result<()> {
    let mut tx = j.producer()?;
    let mut payload = vec![b'.'; record_bytes.max(1)];
    let out = std::io::stdout();
    let mut last = 0;
    let run = (|| -> Result<(), JournalError> {
        for i in 1..=n {
            let seq = tx.next_seq();
            let text = format!("record {seq}");
            let k = text.len().min(payload.len());
            payload.fill(b'.');
            payload[..k].copy_from_slice(&text.as_bytes()[..k]);
            last = tx.append_blocking(&payload, Duration::from_secs(10))?;
            if ack_every.is_some_and(|e| i % e.max(1) == 0 || i == n) {
                tx.wait_durable(last, Duration::from_secs(30))?;
                let mut o = out.lock();
                let _ = writeln!(o, "ACK {last}");
                let _ = o.flush();
            }
        }
        if last > 0 {
            tx.wait_durable(last, Duration::from_secs(30))?;
        }
        Ok(())
    })();
    drop(tx);
    let closed = j.close();
    match (run, closed) {
        (Ok(()), Ok(_)) => {
            println!("DONE {last}");
            Ok(())
        }
        (_, Err(e)) => Err(anyhow::Error::new(e).context("journal writer failed")),
        (Err(e), Ok(_)) => Err(e.into()),
    }
}

pub(super) fn verify_cmd(a: &VerifyArgs) -> Result<()> {
    let mut f =
        std::fs::File::open(&a.file).with_context(|| format!("open {}", a.file.display()))?;
    let head = match &a.expect_head {
        Some(h) => Some(parse_head(h)?),
        None => None,
    };
    let anchor = Anchor { last_seq: a.expect_last_seq, head };
    let r = verify(&mut f, anchor)?;
    println!(
        "records {}  last seq {}  head {}  end {}",
        r.records,
        r.last_seq,
        hex(&r.head),
        r.end
    );
    match r.problem {
        None => {
            println!("OK");
            Ok(())
        }
        Some(p) => bail!("{p}"),
    }
}

pub(super) fn parse_head(h: &str) -> Result<[u8; 16]> {
    let h = h.trim();
    if h.len() != 32 || !h.is_ascii() {
        bail!("--expect-head wants 32 hex digits");
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&h[2 * i..2 * i + 2], 16).context("--expect-head: not hex")?;
    }
    Ok(out)
}

pub(super) fn dump(a: &DumpArgs) -> Result<()> {
    let mut f =
        std::fs::File::open(&a.file).with_context(|| format!("open {}", a.file.display()))?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut printed = 0u64;
    let mut err = None;
    let s = scan(&mut f, &mut |v| {
        if v.header.seq < a.from {
            return true;
        }
        if printed >= a.limit {
            return false;
        }
        printed += 1;
        let text: String = v
            .payload
            .iter()
            .take(64)
            .map(|&b| if b.is_ascii_graphic() || b == b' ' { b as char } else { '.' })
            .collect();
        let r = writeln!(
            out,
            "{:>10} @{:<10} len {:<5} ts {} chain {} {:?}",
            v.header.seq,
            v.offset,
            v.header.len,
            v.header.timestamp_ns,
            hex(&v.header.chain),
            text
        );
        if let Err(e) = r {
            err = Some(e);
            return false;
        }
        true
    })?;
    if let Some(e) = err {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            return Err(e.into());
        }
    }
    eprintln!("{} records, last seq {}, stopped: {:?}", s.records, s.last_seq, s.stop);
    Ok(())
}
