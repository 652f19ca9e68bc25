//! Bringing a replica up to date when the journal opens (or is created), before the writer
//! acknowledges anything new.
//!
//! The replica reports where it stands ([`Replica::position`]: what a scan of its own image
//! finds). That answer is a claim, checked against the primary's own hash chain before any
//! byte is sent:
//!
//! | replica | condition | action |
//! |---|---|---|
//! | blank (zero superblock) | — | send the superblock and `[data, end)` (a blank image is taken to be zero throughout, as `create` takes a new device) |
//! | journal, same id, behind or level | the primary's chain at the replica's end offset has the replica's seq and head | send `[replica end, end)`, zero the torn window after `end` |
//! | journal, same id, ahead by at most one torn window | the replica's frame ending at the primary's end has the primary's seq and head | zero the replica past `end` (those records never reached the primary's disk, so were never acknowledged) |
//! | anything else | | [`ReplicaError::Diverged`], nothing written |
//!
//! "Anything else": another journal id, bytes that are no journal, a chain that differs (the
//! hash chain makes a matching head at the same seq and offset a matching prefix), data past
//! the replica's torn window, or a replica ahead by more than a torn window (then the primary
//! lost records it had flushed, and deciding which copy wins is the operator's). With
//! `rebuild` the replica is rewritten from the primary instead: superblock, every frame, and
//! zeroes over the whole rest of the image.
//!
//! A replica that lies consistently (claims the primary's head without holding the bytes) is
//! not detected here — only a full read of it could; `fastlane journal verify` on the replica
//! with `--expect-head` is the check for that.

use super::format::{Chain, Superblock, DATA_OFFSET};
use super::io::ReadAt;
use super::replica::{Replica, ReplicaError, ReplicaJournal, ReplicaPosition};
use super::{JournalError, Seq};

/// Bytes per replica write while resynchronising.
const CHUNK: usize = 1 << 20;
const ALIGN: u64 = 4096;

/// What the primary knows after its own recovery.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Local {
    pub(crate) sb: Superblock,
    /// Offset after the last valid frame (the device reads as zero after it).
    pub(crate) end: u64,
    pub(crate) last_seq: Seq,
    pub(crate) head: Chain,
    /// Device bytes (a multiple of 4096).
    pub(crate) size: u64,
}

/// What resynchronisation did to the replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResyncAction {
    /// A blank replica got the whole journal.
    Initialised,
    /// The replica was rewritten from the primary (asked for).
    Rebuilt,
    /// The replica had every record; only the superblock and the torn window were rewritten.
    UpToDate,
    /// The replica was behind: the records after `from_seq` were sent.
    CaughtUp {
        /// The replica's last seq before.
        from_seq: Seq,
    },
    /// The replica was ahead by records the primary never wrote durably; they were zeroed.
    Truncated {
        /// The replica's last seq before.
        from_seq: Seq,
    },
}

/// Resynchronisation's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResyncReport {
    /// What was done.
    pub action: ResyncAction,
    /// Bytes written to the replica (data and zeroes).
    pub bytes_sent: u64,
}

fn diverged(what: String) -> JournalError {
    JournalError::Replica(ReplicaError::Diverged(what))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Brings `r` up to date with the local image (`local`, read through `dev`). `first` is the
/// replica's answer to `position(None)`; `local_at` the primary's `(seq, chain)` of the frame
/// that ends at the replica's end offset, if it has one.
pub(crate) fn resync(
    r: &mut dyn Replica,
    dev: &mut dyn ReadAt,
    local: &Local,
    first: ReplicaPosition,
    local_at: Option<(Seq, Chain)>,
    rebuild: bool,
) -> Result<ResyncReport, JournalError> {
    let mut tx = Sender { r, dev, sent: 0, buf: vec![0u8; CHUNK] };
    let end_block = local.end.div_ceil(ALIGN) * ALIGN;
    let window_end = |from: u64| {
        (from.saturating_add(local.sb.torn_window())).div_ceil(ALIGN).saturating_mul(ALIGN)
    };
    if rebuild {
        tx.copy(0, end_block.min(local.size))?;
        tx.zero(end_block, local.size)?;
        tx.r.sync()?;
        return Ok(ResyncReport { action: ResyncAction::Rebuilt, bytes_sent: tx.sent });
    }
    let j = match first {
        ReplicaPosition::Blank => {
            // Assumed zero throughout, like a device `create` formatted.
            tx.copy(0, end_block.min(local.size))?;
            tx.r.sync()?;
            return Ok(ResyncReport { action: ResyncAction::Initialised, bytes_sent: tx.sent });
        }
        ReplicaPosition::Foreign => {
            return Err(diverged(format!(
                "{} holds no journal superblock (and is not blank)",
                tx.r.name()
            )))
        }
        ReplicaPosition::Journal(j) => j,
    };
    check_same_journal(&j, local, tx.r.name())?;
    if !j.clean {
        return Err(diverged(format!(
            "{} has data past its torn window after offset {} (damage the scan could not pass)",
            tx.r.name(),
            j.end
        )));
    }
    if j.end <= local.end {
        let ours = if j.end == DATA_OFFSET {
            Some((local.sb.first_seq - 1, local.sb.genesis()))
        } else {
            local_at
        };
        if ours != Some((j.last_seq, j.head)) {
            return Err(diverged(format!(
                "{} ends at seq {} (offset {}, head {}), which is not a prefix of this journal's \
                 chain (here: {})",
                tx.r.name(),
                j.last_seq,
                j.end,
                hex(&j.head),
                match ours {
                    Some((seq, head)) => format!("seq {seq} head {}", hex(&head)),
                    None => "no frame ends at that offset".to_owned(),
                }
            )));
        }
        // The superblock (idempotent), what the replica lacks from the start of its last
        // block, and zeroes over the torn window after the new end.
        tx.copy(0, DATA_OFFSET)?;
        let from = (j.end / ALIGN * ALIGN).max(DATA_OFFSET);
        tx.copy(from, end_block.min(local.size))?;
        tx.zero(end_block, window_end(local.end).min(local.size))?;
        tx.r.sync()?;
        let action = if j.end == local.end {
            ResyncAction::UpToDate
        } else {
            ResyncAction::CaughtUp { from_seq: j.last_seq }
        };
        return Ok(ResyncReport { action, bytes_sent: tx.sent });
    }
    // Ahead. Only by what one torn batch could be: more means the primary lost records it
    // had flushed (and maybe acknowledged).
    if j.end > local.end.saturating_add(local.sb.torn_window()) {
        return Err(diverged(format!(
            "{} is ahead of the primary by more than one batch (its seq {} at offset {}, \
             the primary's {} at {}): the primary lost flushed records; promote the replica \
             or rebuild it",
            tx.r.name(),
            j.last_seq,
            j.end,
            local.last_seq,
            local.end
        )));
    }
    let probe = match tx.r.position(Some(local.end))? {
        ReplicaPosition::Journal(p) => {
            check_same_journal(&p, local, tx.r.name())?;
            p.probe
        }
        other => {
            return Err(diverged(format!("{} changed its answer: {other:?}", tx.r.name())));
        }
    };
    if probe != Some((local.last_seq, local.head)) {
        return Err(diverged(format!(
            "{} is ahead (seq {}) but its frames do not contain this journal's seq {} with \
             head {}",
            tx.r.name(),
            j.last_seq,
            local.last_seq,
            hex(&local.head)
        )));
    }
    // The block holding the primary's end carries its bytes before it (and zeroes after).
    tx.copy(0, DATA_OFFSET)?;
    tx.copy((local.end / ALIGN * ALIGN).max(DATA_OFFSET), end_block.min(local.size))?;
    tx.zero(end_block, window_end(j.end).min(local.size))?;
    tx.r.sync()?;
    Ok(ResyncReport {
        action: ResyncAction::Truncated { from_seq: j.last_seq },
        bytes_sent: tx.sent,
    })
}

fn check_same_journal(j: &ReplicaJournal, local: &Local, name: &str) -> Result<(), JournalError> {
    if j.journal_id != local.sb.journal_id {
        return Err(diverged(format!(
            "{name} holds journal {}, this is journal {}",
            hex(&j.journal_id),
            hex(&local.sb.journal_id)
        )));
    }
    Ok(())
}

struct Sender<'a> {
    r: &'a mut dyn Replica,
    dev: &'a mut dyn ReadAt,
    sent: u64,
    buf: Vec<u8>,
}

impl Sender<'_> {
    /// Sends the local bytes `[from, to)`.
    fn copy(&mut self, from: u64, to: u64) -> Result<(), JournalError> {
        let mut off = from;
        while off < to {
            let n = ((to - off) as usize).min(self.buf.len());
            self.dev
                .read_at(off, &mut self.buf[..n])
                .map_err(|source| JournalError::Io { op: "resync read", source })?;
            self.r.write(off, &self.buf[..n])?;
            self.sent += n as u64;
            off += n as u64;
        }
        Ok(())
    }

    /// Writes zeroes over `[from, to)` of the replica.
    fn zero(&mut self, from: u64, to: u64) -> Result<(), JournalError> {
        self.buf.fill(0);
        let mut off = from;
        while off < to {
            let n = ((to - off) as usize).min(self.buf.len());
            self.r.write(off, &self.buf[..n])?;
            self.sent += n as u64;
            off += n as u64;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::super::fault::FaultDisk;
    use super::super::{
        verify, Anchor, Durability, FileReplica, Journal, JournalConfig, JournalError, MemReplica,
        Replica, ReplicaError, ReplicaPosition, ResyncAction,
    };

    const T: Duration = Duration::from_secs(10);
    const SIZE: usize = 1 << 20;

    fn config(disk: &FaultDisk, replica: Option<Box<dyn Replica>>) -> JournalConfig {
        let mut c = JournalConfig::new(Arc::new(disk.clone()), Durability::Local);
        c.ring_bytes = 64 << 10;
        c.max_record_bytes = 1024;
        c.max_batch_bytes = 16 << 10;
        c.replica = replica;
        c
    }

    fn payload(seq: u64, salt: u8) -> Vec<u8> {
        (0..(seq * 13 % 90) as usize).map(|i| (seq as u8) ^ (i as u8) ^ salt).collect()
    }

    /// Appends seqs `from..=to` and closes; returns what open found.
    fn append(c: JournalConfig, from: u64, to: u64, salt: u8) -> super::super::Recovery {
        let j = Journal::open_or_create(c).unwrap();
        let rec = j.recovery();
        let mut tx = j.producer().unwrap();
        for s in from..=to {
            assert_eq!(tx.append_blocking(&payload(s, salt), T).unwrap(), s);
        }
        if to >= from {
            tx.wait_durable(to, T).unwrap();
        }
        drop(tx);
        j.close().unwrap();
        rec
    }

    fn mem_from(img: &[u8]) -> MemReplica {
        let m = MemReplica::new(img.len());
        m.clone().write(0, img).unwrap();
        m
    }

    /// (last seq, head) of a verified image.
    fn verified(img: &[u8]) -> (u64, [u8; 16]) {
        let r = verify(&mut &img[..], Anchor::default()).unwrap();
        assert_eq!(r.problem, None);
        (r.last_seq, r.head)
    }

    #[test]
    fn a_replica_behind_by_n_records_catches_up_on_open() {
        let disk = FaultDisk::new(vec![0; SIZE]);
        let replica = MemReplica::new(SIZE);
        let rec = append(config(&disk, Some(Box::new(replica.clone()))), 1, 200, 0);
        assert_eq!(rec.replica.unwrap().action, ResyncAction::Initialised);
        // The replica misses 201..=500 (the primary ran without it).
        append(config(&disk, None), 201, 500, 0);
        assert_eq!(verified(&replica.snapshot()).0, 200);
        let rec = append(config(&disk, Some(Box::new(replica.clone()))), 501, 520, 0);
        let report = rec.replica.unwrap();
        assert_eq!(report.action, ResyncAction::CaughtUp { from_seq: 200 });
        assert!(report.bytes_sent > 0);
        let (p, r) = (disk.durable(), replica.snapshot());
        assert_eq!(verified(&p), verified(&r));
        assert_eq!(verified(&p).0, 520);
        assert_eq!(p, r, "the replica is the primary's image");
        // Level: nothing but the superblock and the torn window.
        let rec = append(config(&disk, Some(Box::new(replica.clone()))), 521, 520, 0);
        assert_eq!(rec.replica.unwrap().action, ResyncAction::UpToDate);
    }

    #[test]
    fn a_file_replica_behind_catches_up_and_verifies_with_the_same_head() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("replica.journal");
        let file = || {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .unwrap();
            f.set_len(SIZE as u64).unwrap();
            Box::new(FileReplica::new(f)) as Box<dyn Replica>
        };
        let disk = FaultDisk::new(vec![0; SIZE]);
        append(config(&disk, Some(file())), 1, 100, 0);
        append(config(&disk, None), 101, 400, 0);
        let rec = append(config(&disk, Some(file())), 401, 450, 0);
        assert_eq!(rec.replica.unwrap().action, ResyncAction::CaughtUp { from_seq: 100 });
        let on_disk = std::fs::read(&path).unwrap();
        assert_eq!(verified(&on_disk), verified(&disk.durable()));
        assert_eq!(verified(&on_disk).0, 450);
    }

    #[test]
    fn a_diverged_replica_is_refused_untouched_and_rebuilt_on_request() {
        // Another journal altogether.
        let other = FaultDisk::new(vec![0; SIZE]);
        append(config(&other, None), 1, 50, 0);
        let disk = FaultDisk::new(vec![0; SIZE]);
        append(config(&disk, None), 1, 80, 0);
        let replica = mem_from(&other.durable());
        let before = replica.snapshot();
        let err = Journal::open(config(&disk, Some(Box::new(replica.clone())))).unwrap_err();
        assert!(
            matches!(&err, JournalError::Replica(ReplicaError::Diverged(m)) if m.contains("holds journal")),
            "{err}"
        );
        assert!(replica.snapshot() == before, "nothing written to a refused replica");
        // Creating a journal over it is refused the same way.
        let fresh = FaultDisk::new(vec![0; SIZE]);
        let err = Journal::create(config(&fresh, Some(Box::new(replica.clone())))).unwrap_err();
        assert!(matches!(err, JournalError::Replica(ReplicaError::Diverged(_))), "{err}");

        // The same journal, but a chain that went another way after seq 40.
        let base = FaultDisk::new(vec![0; SIZE]);
        append(config(&base, None), 1, 40, 0);
        let fork = FaultDisk::new(base.durable());
        append(config(&base, None), 41, 90, 0);
        append(config(&fork, None), 41, 70, 0xFF);
        let replica = mem_from(&fork.durable());
        let err = Journal::open(config(&base, Some(Box::new(replica.clone())))).unwrap_err();
        assert!(matches!(&err, JournalError::Replica(ReplicaError::Diverged(_))), "{err}");

        // Told to rebuild: the replica becomes the primary's image, zeroes included.
        let mut c = config(&base, Some(Box::new(replica.clone())));
        c.replica_rebuild = true;
        let j = Journal::open(c).unwrap();
        assert_eq!(j.recovery().replica.unwrap().action, ResyncAction::Rebuilt);
        j.close().unwrap();
        assert_eq!(replica.snapshot(), base.durable());
        assert_eq!(verified(&replica.snapshot()).0, 90);
    }

    #[test]
    fn a_replica_ahead_by_an_unflushed_batch_is_cut_back_further_ahead_is_refused() {
        // The primary lost its last batch (a power cut before the flush); the replica has it.
        let disk = FaultDisk::new(vec![0; SIZE]);
        append(config(&disk, None), 1, 250, 0);
        let lost = disk.durable();
        append(config(&disk, None), 251, 270, 0);
        let replica = mem_from(&disk.durable());
        let primary = FaultDisk::new(lost.clone());
        let rec = append(config(&primary, Some(Box::new(replica.clone()))), 251, 300, 7);
        assert_eq!(rec.replica.unwrap().action, ResyncAction::Truncated { from_seq: 270 });
        assert_eq!(verified(&replica.snapshot()), verified(&primary.durable()));
        assert_eq!(verified(&replica.snapshot()).0, 300);

        // Ahead by more than one batch: the primary lost flushed records; refused.
        let disk = FaultDisk::new(lost.clone());
        append(config(&disk, None), 251, 900, 0);
        let replica = mem_from(&disk.durable());
        let primary = FaultDisk::new(lost);
        let err = Journal::open(config(&primary, Some(Box::new(replica)))).unwrap_err();
        assert!(
            matches!(&err, JournalError::Replica(ReplicaError::Diverged(m)) if m.contains("ahead")),
            "{err}"
        );
    }

    /// A replica that claims whatever it is told to.
    struct Liar(ReplicaPosition);

    impl Replica for Liar {
        fn write(&mut self, _: u64, _: &[u8]) -> Result<(), ReplicaError> {
            Ok(())
        }
        fn sync(&mut self) -> Result<(), ReplicaError> {
            Ok(())
        }
        fn position(&mut self, _: Option<u64>) -> Result<ReplicaPosition, ReplicaError> {
            Ok(self.0)
        }
        fn name(&self) -> &str {
            "liar"
        }
    }

    #[test]
    fn impossible_claims_of_a_replica_are_refused() {
        let disk = FaultDisk::new(vec![0; SIZE]);
        append(config(&disk, None), 1, 60, 0);
        let truth = match super::super::image_position(&mut &disk.durable()[..], None).unwrap() {
            ReplicaPosition::Journal(j) => j,
            other => panic!("{other:?}"),
        };
        let lies = [
            super::ReplicaJournal { end: truth.end - 8, ..truth },
            super::ReplicaJournal { end: u64::MAX - 7, ..truth },
            super::ReplicaJournal { end: 0, ..truth },
            super::ReplicaJournal { head: [0; 16], ..truth },
            super::ReplicaJournal { last_seq: truth.last_seq + 1, ..truth },
            super::ReplicaJournal { clean: false, ..truth },
            super::ReplicaJournal { end: truth.end + 4096, probe: Some((1, [0; 16])), ..truth },
        ];
        for lie in lies {
            let liar = Liar(ReplicaPosition::Journal(lie));
            let err = Journal::open(config(&disk, Some(Box::new(liar)))).unwrap_err();
            assert!(
                matches!(err, JournalError::Replica(ReplicaError::Diverged(_))),
                "{lie:?}: {err}"
            );
        }
        let liar = Liar(ReplicaPosition::Foreign);
        assert!(Journal::open(config(&disk, Some(Box::new(liar)))).is_err());
        // The truth is accepted.
        let j = Journal::open(config(&disk, Some(Box::new(Liar(ReplicaPosition::Journal(truth))))));
        assert_eq!(j.unwrap().recovery().replica.unwrap().action, ResyncAction::UpToDate);
    }
}
