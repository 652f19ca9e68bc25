//! The writer's roll to the next segment: the spare's thread prepares the segment's file,
//! opens its device and queue, closes the segments rolled from and removes those retention
//! let go, so that the roll itself (on the writer, every ack waiting) is a rename, a
//! superblock and a directory sync.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use fastlane_block::BlockDevice;

use super::super::format::{Chain, Superblock};
use super::super::io::Dev;
use super::super::segments::{self, Retention, SegmentDir};
use super::super::stats::WriterStats;
use super::super::writer::{NextSegment, Roll};
use super::super::JournalError;
use super::{spare, AcceptCounters, OpenSegment, RemoveSegment};

/// The writer's roll: the next segment from the directory, its spare prepared in the
/// background.
pub(super) struct SegmentRoll {
    pub(super) dir: PathBuf,
    pub(super) segments: SegmentDir,
    pub(super) bytes: u64,
    pub(super) pace: u64,
    pub(super) adaptive: bool,
    /// The writer's counters (its offset in the segment, for the spare's pace).
    pub(super) stats: Arc<WriterStats>,
    pub(super) open: OpenSegment,
    pub(super) remove: RemoveSegment,
    pub(super) retention: Retention,
    /// Segments retention let go, for the next spare's thread to remove first.
    pub(super) expired: Vec<segments::SegmentInfo>,
    pub(super) current: Superblock,
    pub(super) spare: Option<JoinHandle<Result<Spare, JournalError>>>,
    /// Segments rolled from, closed on the next spare's thread.
    pub(super) retired: Vec<(Dev, Arc<dyn BlockDevice>)>,
    pub(super) accept: Arc<AcceptCounters>,
}

/// A spare prepared in the background, and its device and queue opened there too (opening
/// them is ~0.5 ms here, time every ack would wait in the roll). `None`: the open failed;
/// the roll opens the segment itself and reports the error then.
pub(super) struct Spare {
    pub(super) device: Option<(Arc<dyn BlockDevice>, u64, Option<Dev>)>,
}

/// A segment's device and its queue.
type Opened = (Arc<dyn BlockDevice>, Option<Dev>);

impl Spare {
    /// The device (and queue) opened ahead, if it is the file now at `path` (same inode: the
    /// file the roll installed, not a spare `install` had to make again).
    pub(super) fn device_for(self, path: &Path) -> Option<Opened> {
        use std::os::unix::fs::MetadataExt as _;
        let (device, ino, dev) = self.device?;
        std::fs::metadata(path).is_ok_and(|m| m.ino() == ino).then_some((device, dev))
    }
}

impl SegmentRoll {
    /// Starts preparing the next segment's file (written zeroes) on a thread of its own,
    /// which first removes the segments retention let go: unlinking a large file can take
    /// tens of ms (the blocks' discard), and on the writer every ack would wait for it.
    pub(super) fn prepare_next(&mut self) {
        if self.spare.is_some() {
            return;
        }
        let (dir, bytes) = (self.dir.clone(), self.bytes);
        let expired = std::mem::take(&mut self.expired);
        let retired = std::mem::take(&mut self.retired);
        let remove = Arc::clone(&self.remove);
        let accept = Arc::clone(&self.accept);
        let mut pacer = spare::SparePacer {
            least: self.pace,
            adaptive: self.adaptive,
            segment_bytes: self.bytes,
            stats: Arc::clone(&self.stats),
            shown: Arc::clone(&self.accept.spare_pace),
            base: None,
        };
        let ready = Arc::clone(&self.accept.spare_ready);
        let open = Arc::clone(&self.open);
        self.spare = std::thread::Builder::new()
            .name("journal-spare".into())
            .spawn(move || {
                use std::os::unix::fs::MetadataExt as _;
                // Closed here: one retention unlinked frees its blocks now.
                drop(retired);
                match segments::remove_segments(&dir, &expired, &*remove) {
                    Ok(()) => {
                        accept.segments_removed.fetch_add(expired.len() as u64, Ordering::Relaxed);
                    }
                    Err(e) => accept.retention_failed(&e),
                }
                let r = segments::prepare_spare_with(&dir, bytes, &mut |w| pacer.pace(w));
                let r = r.map(|path| {
                    // The inode as the file was when opened: the roll checks the one it
                    // installs is the same.
                    let ino = std::fs::metadata(&path).map(|m| m.ino());
                    let device = open(&path).ok().zip(ino.ok());
                    Spare {
                        device: device.map(|(d, i)| {
                            let dev = crate::open_device(&*d).ok();
                            (d, i, dev)
                        }),
                    }
                });
                // Done: no spare is being written until the next roll.
                pacer.shown.store(0, Ordering::Relaxed);
                ready.store(r.is_ok(), Ordering::Release);
                r
            })
            .ok();
    }
}

impl Roll for SegmentRoll {
    fn roll(&mut self, last_seq: u64, head: Chain) -> Result<NextSegment, JournalError> {
        // The spare being prepared is finished first (install takes it); a failed one is
        // made again by `install` itself. Either is a wait, counted.
        let waited = (!self.accept.spare_ready.load(Ordering::Acquire)).then(Instant::now);
        let spare = self.spare.take().and_then(|h| h.join().ok()?.ok());
        self.accept.spare_ready.store(false, Ordering::Release);
        let sb =
            self.current.next_segment(super::super::preprocess::realtime_ns(), last_seq + 1, head);
        let path = match self.segments.install(&sb, self.bytes) {
            Ok(p) => {
                // A roll that fails (no room) is a roll failure, not a wait for the spare.
                if let Some(t) = waited {
                    self.accept.spare_waits.fetch_add(1, Ordering::Relaxed);
                    let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
                    self.accept.spare_wait_ns.fetch_add(ns, Ordering::Relaxed);
                }
                p
            }
            Err(e) => {
                self.prepare_next();
                return Err(e);
            }
        };
        let (device, dev) = match spare.and_then(|s| s.device_for(&path)) {
            Some(d) => d,
            None => ((self.open)(&path)?, None),
        };
        self.current = sb;
        self.accept.segment.store(sb.segment, Ordering::Relaxed);
        // Decided here, removed on the spare's thread (`prepare_next`).
        match self.segments.expire(&self.retention) {
            Ok(gone) => self.expired.extend(gone),
            Err(e) => self.accept.retention_failed(&e),
        }
        self.prepare_next();
        Ok((device, dev, sb))
    }

    fn retire(&mut self, old: (Dev, Arc<dyn BlockDevice>)) {
        self.retired.push(old);
    }
}
