//! The producer side: `append` copies a record into the shared ring and returns its seq.

use std::io::Read as _;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fastlane_ring::shm::{Producer, ShmError, ShmRing};
use fastlane_ring::WaitStrategy;

use super::control::{Control, Doorbell};
use super::{JournalError, Seq, RECORD_TYPE, SEQ_PREFIX_LEN};

/// A producer of records, in the journal's process or another one attached to its shared
/// mapping. One per journal at a time (the ring has one producer role).
///
/// The seq of each record is assigned here, at append time, from a producer-local counter: it
/// starts at the control block's `next_seq` when the producer attaches, and each append
/// stores the next value back (before publishing the record) so that a later producer
/// continues the numbering. The writer checks every seq it drains; a producer that numbers
/// wrongly gets its ring shut off ([`JournalError::ProducerFault`]), nothing else.
#[derive(Debug)]
pub struct JournalProducer {
    tx: Producer,
    control: Control,
    next_seq: Seq,
    max_record_bytes: usize,
    /// Attached to the journal service: the doorbell its writer sleeps on (rung instead of
    /// the ring's own futex word), the connection whose end detaches us, and our id.
    service: Option<ServiceLink>,
}

/// How often a service producer waiting for room or for durability checks that the service is
/// still there.
const SERVICE_CHECK: Duration = Duration::from_millis(100);

#[derive(Debug)]
struct ServiceLink {
    doorbell: Doorbell,
    session: UnixStream,
    id: u32,
}

/// The path of the control block that belongs to the ring at `shm_path`.
pub fn control_path(shm_path: &Path) -> PathBuf {
    let mut p = shm_path.as_os_str().to_owned();
    p.push(".ctl");
    PathBuf::from(p)
}

impl JournalProducer {
    pub(crate) fn new(
        tx: Producer,
        control: Control,
        max_record_bytes: u32,
    ) -> Result<JournalProducer, JournalError> {
        let next_seq = control.next_seq();
        if next_seq == 0 || next_seq > u64::MAX / 2 {
            return Err(JournalError::BadControl {
                what: "next_seq out of range",
                value: next_seq,
            });
        }
        let max =
            (max_record_bytes as usize).min(tx.max_record_len().saturating_sub(SEQ_PREFIX_LEN));
        Ok(JournalProducer { tx, control, next_seq, max_record_bytes: max, service: None })
    }

    /// Attaches to the journal whose ring is at `shm_path` (its control block is at
    /// `shm_path` + `.ctl`), from any process that may open both files.
    pub fn attach(shm_path: impl AsRef<Path>) -> Result<JournalProducer, JournalError> {
        let shm_path = shm_path.as_ref();
        let (control, info) = Control::open_file(&control_path(shm_path))?;
        control.check_state()?;
        let ring = ShmRing::open_file(shm_path)?;
        let tx = ring.producer()?;
        JournalProducer::new(tx, control, info.max_record_bytes)
    }

    /// Appends `payload` and returns its seq. Copies the bytes into the shared ring: no
    /// allocation, no lock, no syscall (a `FUTEX_WAKE` only if the writer sleeps because the
    /// ring was empty). A full ring is [`JournalError::Full`]: nothing was appended, retry.
    #[inline]
    pub fn append(&mut self, payload: &[u8]) -> Result<Seq, JournalError> {
        if payload.len() > self.max_record_bytes {
            return Err(JournalError::TooLarge { len: payload.len(), max: self.max_record_bytes });
        }
        match self.tx.reserve(payload.len() + SEQ_PREFIX_LEN) {
            Ok(buf) => {
                let seq = self.next_seq;
                buf[..SEQ_PREFIX_LEN].copy_from_slice(&seq.to_le_bytes());
                buf[SEQ_PREFIX_LEN..].copy_from_slice(payload);
                self.finish(seq);
                Ok(seq)
            }
            Err(e) => Err(self.slow_error(e)),
        }
    }

    /// Like [`append`](JournalProducer::append), but waits up to `timeout` for room (spin,
    /// yield, then sleep on the ring's futex).
    pub fn append_blocking(
        &mut self,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Seq, JournalError> {
        if payload.len() > self.max_record_bytes {
            return Err(JournalError::TooLarge { len: payload.len(), max: self.max_record_bytes });
        }
        let deadline = Instant::now() + timeout;
        // Bounded by the deadline; a service producer looks at its connection every slice.
        loop {
            let until = self.slice_end(deadline);
            match self.tx.reserve_blocking(payload.len() + SEQ_PREFIX_LEN, Some(until)) {
                Ok(buf) => {
                    let seq = self.next_seq;
                    buf[..SEQ_PREFIX_LEN].copy_from_slice(&seq.to_le_bytes());
                    buf[SEQ_PREFIX_LEN..].copy_from_slice(payload);
                    self.finish(seq);
                    return Ok(seq);
                }
                Err(ShmError::Timeout) if until < deadline => self.check_service()?,
                Err(e) => return Err(self.slow_error(e)),
            }
        }
    }

    /// The end of the next wait slice: `deadline`, or sooner for a service producer, which
    /// must notice a service that died (nobody else would tell it).
    fn slice_end(&self, deadline: Instant) -> Instant {
        match self.service {
            Some(_) => deadline.min(Instant::now() + SERVICE_CHECK),
            None => deadline,
        }
    }

    /// [`JournalError::ServiceGone`] if the journal service closed our connection (it exited
    /// or was killed; records it did not acknowledge may be lost, as after any crash).
    fn check_service(&self) -> Result<(), JournalError> {
        let Some(link) = &self.service else { return Ok(()) };
        let mut b = [0u8; 1];
        match (&link.session).read(&mut b) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Ok(()),
            // EOF, an error, or bytes the service never sends: the connection is over.
            _ => Err(JournalError::ServiceGone),
        }
    }

    #[inline]
    fn finish(&mut self, seq: Seq) {
        self.next_seq = seq + 1;
        // Claim before publishing: a producer killed between the two leaves a one-seq hole,
        // which the writer accepts, rather than a seq used twice.
        self.control.set_next_seq(seq + 1);
        match &self.service {
            None => self.tx.commit(RECORD_TYPE),
            Some(link) => self.tx.commit_ringing(RECORD_TYPE, link.doorbell.word()),
        }
    }

    pub(crate) fn attach_service(
        &mut self,
        doorbell: Doorbell,
        session: UnixStream,
        id: u32,
    ) -> Result<(), JournalError> {
        session
            .set_nonblocking(true)
            .map_err(|source| JournalError::Io { op: "service socket", source })?;
        self.service = Some(ServiceLink { doorbell, session, id });
        Ok(())
    }

    /// The id the journal service gave this producer (written into each of its frames), or
    /// `None` for a producer of a single journal.
    pub fn producer_id(&self) -> Option<u32> {
        self.service.as_ref().map(|l| l.id)
    }

    #[cold]
    fn slow_error(&self, e: ShmError) -> JournalError {
        if let Err(state) = self.control.check_state() {
            return state;
        }
        match e {
            ShmError::Full { .. } => JournalError::Full,
            ShmError::Timeout => JournalError::Full,
            other => JournalError::Ring(other),
        }
    }

    /// How `append_blocking` waits for room.
    pub fn set_wait_strategy(&mut self, strategy: WaitStrategy) {
        self.tx.set_wait_strategy(strategy);
    }

    /// The seq the next append gets.
    pub fn next_seq(&self) -> Seq {
        self.next_seq
    }

    /// Longest payload `append` takes.
    pub fn max_record_bytes(&self) -> usize {
        self.max_record_bytes
    }

    /// The highest seq durable at the journal's level (0: none yet). One load, no syscall.
    #[inline]
    pub fn durable_seq(&self) -> Seq {
        self.control.durable_seq()
    }

    /// Waits until `seq` is durable, the writer stops (its error), or `timeout` passes
    /// ([`JournalError::Timeout`]): a short spin, then sleep on a futex the writer wakes.
    pub fn wait_durable(&self, seq: Seq, timeout: Duration) -> Result<(), JournalError> {
        self.wait_durable_with(seq, timeout, Control::DEFAULT_WAIT)
    }

    /// [`wait_durable`](Self::wait_durable) with a chosen strategy.
    /// [`WaitStrategy::SpinYield`] never sleeps in the kernel, so the writer's publish reaches
    /// this thread without a futex wake-up (tens of µs on a VM whose vCPU went idle); pair it
    /// with [`JournalConfig::writer_wait`](super::JournalConfig::writer_wait) =
    /// `SpinYield` for the writer's side of the same trade (docs/journal.md, "Waiting").
    pub fn wait_durable_with(
        &self,
        seq: Seq,
        timeout: Duration,
        strategy: WaitStrategy,
    ) -> Result<(), JournalError> {
        if self.service.is_none() {
            return self.control.wait_durable(seq, timeout, strategy);
        }
        let deadline = Instant::now() + timeout;
        // Bounded by the deadline, in slices between which the connection is looked at.
        loop {
            let until = self.slice_end(deadline);
            let left = until.saturating_duration_since(Instant::now());
            match self.control.wait_durable(seq, left, strategy) {
                Err(JournalError::Timeout { .. }) if until < deadline => self.check_service()?,
                r => return r,
            }
        }
    }
}
