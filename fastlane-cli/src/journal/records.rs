//! `fastlane journal append|verify|dump`: writing records, checking a journal file or
//! segment directory, and printing (or exporting) its records.

use std::io::{BufRead as _, Write};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use fastlane_journal::format::FrameHeader;
use fastlane_journal::scan::read_superblock;
use fastlane_journal::verify::hex;
use fastlane_journal::{
    read_from, scan, verify, verify_dir, Anchor, Journal, JournalError, JournalProducer, ReadEnd,
};

use super::{open_config, AppendArgs, DumpArgs, VerifyArgs};

pub(super) fn append(a: &AppendArgs) -> Result<()> {
    if let Some(dir) = &a.service {
        // With --service there is no FILE: clap hands the first record to that positional.
        let records: Vec<String> = a
            .common
            .file
            .iter()
            .map(|f| f.to_string_lossy().into_owned())
            .chain(a.records.iter().cloned())
            .collect();
        return super::serve::append_service(
            dir,
            &records,
            a.generate,
            a.record_bytes,
            a.ack_every,
        );
    }
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
    let mut last = 0;
    let run = generate_into(&mut tx, n, record_bytes, ack_every, &mut last);
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

/// Appends `n` generated records through `tx` (a journal's producer or a service's), printing
/// "ACK SEQ" for every `ack_every`-th once durable; `last` ends as the last seq appended.
pub(super) fn generate_into(
    tx: &mut JournalProducer,
    n: u64,
    record_bytes: usize,
    ack_every: Option<u64>,
    last: &mut u64,
) -> Result<(), JournalError> {
    let mut payload = vec![b'.'; record_bytes.max(1)];
    let out = std::io::stdout();
    for i in 1..=n {
        let seq = tx.next_seq();
        let text = format!("record {seq}");
        let k = text.len().min(payload.len());
        payload.fill(b'.');
        payload[..k].copy_from_slice(&text.as_bytes()[..k]);
        *last = tx.append_blocking(&payload, Duration::from_secs(10))?;
        if ack_every.is_some_and(|e| i % e.max(1) == 0 || i == n) {
            tx.wait_durable(*last, Duration::from_secs(30))?;
            let mut o = out.lock();
            let _ = writeln!(o, "ACK {last}");
            let _ = o.flush();
        }
    }
    if *last > 0 {
        tx.wait_durable(*last, Duration::from_secs(30))?;
    }
    Ok(())
}

pub(super) fn verify_cmd(a: &VerifyArgs) -> Result<()> {
    let head = match &a.expect_head {
        Some(h) => Some(parse_head(h)?),
        None => None,
    };
    let anchor = Anchor { last_seq: a.expect_last_seq, head };
    if a.file.is_dir() {
        return verify_dir_cmd(a, anchor);
    }
    let mut f =
        std::fs::File::open(&a.file).with_context(|| format!("open {}", a.file.display()))?;
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

/// `verify DIR`: the same summary line as for a file (`end` in the last segment), then the
/// segments it covers.
fn verify_dir_cmd(a: &VerifyArgs, anchor: Anchor) -> Result<()> {
    let r = verify_dir(&a.file, anchor)
        .with_context(|| format!("verify segment directory {}", a.file.display()))?;
    println!(
        "records {}  last seq {}  head {}  end {}",
        r.records,
        r.last_seq,
        hex(&r.head),
        r.end
    );
    let older = if r.first_segment > 0 { " (older segments removed)" } else { "" };
    println!(
        "segments {}  from seq {}, segments {}..{}{older}",
        r.segments, r.first_seq, r.first_segment, r.last_segment
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

/// Prints (or, with `--raw`, writes in binary) the records `dump` walks.
struct Printer<W: Write> {
    out: W,
    raw: bool,
    /// Show the producer id column (format version 2).
    producer: bool,
    from: u64,
    limit: u64,
    printed: u64,
    err: Option<std::io::Error>,
}

impl<W: Write> Printer<W> {
    /// One record; `false` to stop (the limit, or stdout failed).
    fn record(&mut self, h: &FrameHeader, offset: Option<u64>, payload: &[u8]) -> bool {
        if h.seq < self.from {
            return true;
        }
        if self.printed >= self.limit {
            return false;
        }
        self.printed += 1;
        let r = if self.raw {
            // Export form: seq u64 LE, producer id u32 LE, length u32 LE, payload.
            let mut head = [0u8; 16];
            head[0..8].copy_from_slice(&h.seq.to_le_bytes());
            head[8..12].copy_from_slice(&h.flags.to_le_bytes());
            head[12..16].copy_from_slice(&h.len.to_le_bytes());
            self.out.write_all(&head).and_then(|()| self.out.write_all(payload))
        } else {
            let text: String = payload
                .iter()
                .take(64)
                .map(|&b| if b.is_ascii_graphic() || b == b' ' { b as char } else { '.' })
                .collect();
            let at = offset.map(|o| format!(" @{o:<10}")).unwrap_or_default();
            let producer =
                if self.producer { format!(" producer {:<5}", h.flags) } else { String::new() };
            writeln!(
                self.out,
                "{:>10}{at}{producer} len {:<5} ts {} chain {} {:?}",
                h.seq,
                h.len,
                h.timestamp_ns,
                hex(&h.chain),
                text
            )
        };
        match r {
            Ok(()) => true,
            Err(e) => {
                self.err = Some(e);
                false
            }
        }
    }

    /// Flushes; a reader that went away (`| head`) is not an error.
    fn finish(mut self) -> Result<()> {
        let r = self.out.flush();
        match self.err.take().map_or(r, Err) {
            Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
            _ => Ok(()),
        }
    }
}

pub(super) fn dump(a: &DumpArgs) -> Result<()> {
    let stdout = std::io::stdout();
    let mut p = Printer {
        out: std::io::BufWriter::new(stdout.lock()),
        raw: a.raw,
        producer: true,
        from: a.from,
        limit: a.limit,
        printed: 0,
        err: None,
    };
    if a.file.is_dir() {
        let stop = read_from(&a.file, a.from, &mut |h, payload| p.record(h, None, payload))
            .with_context(|| format!("read segment directory {}", a.file.display()))?;
        p.finish()?;
        eprintln!(
            "{} records, last seq {}, from seq {}",
            stop.visited, stop.last_seq, stop.first_seq
        );
        return match stop.end {
            ReadEnd::End | ReadEnd::Visitor => Ok(()),
            ReadEnd::Problem(problem) => bail!("{problem}"),
        };
    }
    let mut f =
        std::fs::File::open(&a.file).with_context(|| format!("open {}", a.file.display()))?;
    p.producer = read_superblock(&mut f)
        .with_context(|| format!("{}: not a journal", a.file.display()))?
        .frames_have_flags();
    let s = scan(&mut f, &mut |v| p.record(v.header, Some(v.offset), v.payload))?;
    p.finish()?;
    eprintln!("{} records, last seq {}, stopped: {:?}", s.records, s.last_seq, s.stop);
    Ok(())
}
