//! A journal as a directory of segments: fixed-size, preallocated files, rolled when full,
//! one hash chain running through all of them, and retention that removes the oldest.
//!
//! ```text
//! DIR/                              mode 0750
//!   lock                            flock(LOCK_EX|LOCK_NB) by the writer; holds its pid
//!   00000000000000000007.seg        segment 7: superblock v2 (segment 7, prev_head), frames
//!   00000000000000000008.seg        segment 8: the active one (the newest)
//!   spare.tmp                       the next segment, zeroed ahead of time (may be absent)
//! ```
//!
//! A segment is named by its index: [`SEGMENT_INDEX_DIGITS`] decimal digits, zero-padded, then
//! [`SEGMENT_SUFFIX`], so names sort in index order. A name that ends in `.seg` but is not
//! exactly that is an error (someone renamed a segment); other files are ignored.
//!
//! Rolling is made cheap and crash-safe in two steps. [`prepare_spare`] (on any thread) writes
//! zeroes over a whole `spare.tmp` with plain writes and `fdatasync`s it: every block is
//! allocated and written, so the writer's later data-only `fdatasync`s need no metadata commit
//! (see `JournalConfig::prefill`). [`SegmentDir::install`] then writes the new segment's
//! superblock into the spare, `fdatasync`s it, renames it to the segment's name (refusing to
//! replace an existing file) and `fsync`s the directory. A crash before the rename leaves only
//! `spare.tmp` (replaced or reused later, never read as a segment); after the directory
//! `fsync` the segment is there with its superblock; in between the rename is either durable
//! or not, and the file it names is complete either way. A segment name never points at a
//! half-made file.
//!
//! Walking a directory (verify, the reader) is in [`dir_verify`](super::dir_verify).

use std::ffi::{CString, OsStr};
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use super::format::{SuperError, Superblock, DATA_OFFSET, FORMAT_VERSION, SUPER_LEN_V2};
use super::JournalError;

/// What a segment file's name ends with.
pub const SEGMENT_SUFFIX: &str = ".seg";
/// Digits of the zero-padded index in a segment's name (`u64::MAX` has 20).
pub const SEGMENT_INDEX_DIGITS: usize = 20;
/// The lock file in a segment directory.
pub const LOCK_FILE: &str = "lock";
/// The spare segment being prepared or waiting to be installed.
pub const SPARE_FILE: &str = "spare.tmp";
/// Mode of a directory `SegmentDir::open` creates.
pub const DIR_MODE: u32 = 0o750;
/// Mode of the files created in it.
const FILE_MODE: u32 = 0o640;
/// Most segment files a directory may hold (a bound on listing and on what it allocates).
pub const SEGMENTS_MAX: usize = 1 << 20;
/// Smallest segment: the superblock and one block of frames.
pub const SEGMENT_BYTES_MIN: u64 = 2 * DATA_OFFSET;
/// Bytes of zeroes per write while preparing a spare.
const ZERO_CHUNK: usize = 1 << 20;
/// Most bytes of the lock file read for the holder's pid.
const PID_TEXT_MAX: usize = 32;

/// What went wrong with a segment directory. Reaches callers inside
/// [`JournalError::Io`] (`op` "segment directory"); [`SegmentError::of`] gets it back.
#[derive(Debug, thiserror::Error)]
pub enum SegmentError {
    /// Another process (or another `SegmentDir` in this one) holds the directory's lock.
    #[error("{}: segment directory is locked by another writer{}", dir.display(), holder(*pid))]
    Locked {
        /// The directory.
        dir: PathBuf,
        /// The holder's pid, as it wrote it into the lock file.
        pid: Option<u32>,
    },
    /// The directory does not exist (and was not to be created).
    #[error("{}: no such segment directory", dir.display())]
    NotFound {
        /// The directory.
        dir: PathBuf,
    },
    /// The directory holds no segment.
    #[error("{}: no segments", dir.display())]
    Empty {
        /// The directory.
        dir: PathBuf,
    },
    /// A file named like a segment that is not one of ours.
    #[error("{}: {why}", path.display())]
    BadName {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: &'static str,
    },
    /// More segment files than [`SEGMENTS_MAX`].
    #[error("{}: more than {SEGMENTS_MAX} segments", dir.display())]
    TooMany {
        /// The directory.
        dir: PathBuf,
    },
    /// The segment to install exists already.
    #[error("{}: segment {index} exists already", path.display())]
    Exists {
        /// Its path.
        path: PathBuf,
        /// Its index.
        index: u64,
    },
    /// The segment to install does not follow the newest one.
    #[error("segment {index} does not follow the newest segment {last}")]
    NotNext {
        /// The index asked for.
        index: u64,
        /// The newest segment's index.
        last: u64,
    },
    /// A segment size that cannot work.
    #[error("segment size {bytes}: want a multiple of 4096, at least {SEGMENT_BYTES_MIN}")]
    Size {
        /// The size asked for.
        bytes: u64,
    },
    /// Segments are version 2; this superblock is not.
    #[error("segment {segment}: superblock version {version}, segments are version 2")]
    Version {
        /// Its index.
        segment: u64,
        /// The version.
        version: u32,
    },
    /// A segment's superblock does not decode.
    #[error("{}: superblock: {source}", path.display())]
    Superblock {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: SuperError,
    },
    /// A system call failed.
    #[error("{op} {}", path.display())]
    Io {
        /// Which.
        op: &'static str,
        /// On what.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
}

fn holder(pid: Option<u32>) -> String {
    pid.map(|p| format!(" (pid {p})")).unwrap_or_default()
}

impl SegmentError {
    /// The segment error inside a [`JournalError`] this module returned, if it is one.
    pub fn of(e: &JournalError) -> Option<&SegmentError> {
        match e {
            JournalError::Io { source, .. } => source.get_ref()?.downcast_ref::<SegmentError>(),
            _ => None,
        }
    }

    /// Whether this is the file system running out of space (`ENOSPC`): retry later.
    pub fn is_no_space(&self) -> bool {
        matches!(self, SegmentError::Io { source, .. } if source.raw_os_error() == Some(libc::ENOSPC))
    }

    fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> SegmentError + 'a {
        move |source| SegmentError::Io { op, path: path.to_path_buf(), source }
    }
}

impl From<SegmentError> for JournalError {
    fn from(e: SegmentError) -> JournalError {
        let kind = match &e {
            SegmentError::Io { source, .. } => source.kind(),
            SegmentError::Locked { .. } => io::ErrorKind::WouldBlock,
            SegmentError::NotFound { .. } => io::ErrorKind::NotFound,
            SegmentError::Exists { .. } => io::ErrorKind::AlreadyExists,
            _ => io::ErrorKind::InvalidData,
        };
        JournalError::Io { op: "segment directory", source: io::Error::new(kind, e) }
    }
}

/// One segment file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentInfo {
    /// Its index (from its name).
    pub index: u64,
    /// Its path.
    pub path: PathBuf,
    /// Its size in bytes.
    pub size: u64,
}

/// The file name of segment `index`: `00000000000000000042.seg`.
pub fn segment_name(index: u64) -> String {
    format!("{index:0width$}{SEGMENT_SUFFIX}", width = SEGMENT_INDEX_DIGITS)
}

/// What a directory entry's name is to us.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Name {
    /// A segment, by index.
    Segment(u64),
    /// Ends in `.seg` but is not a segment name.
    Malformed,
    /// Anything else (the lock, the spare, files of others): ignored.
    Other,
}

fn classify(name: &OsStr) -> Name {
    let b = name.as_bytes();
    let Some(stem) = b.strip_suffix(SEGMENT_SUFFIX.as_bytes()) else {
        return Name::Other;
    };
    if stem.len() != SEGMENT_INDEX_DIGITS || !stem.iter().all(u8::is_ascii_digit) {
        return Name::Malformed;
    }
    // 20 ASCII digits: valid UTF-8; over u64::MAX is malformed.
    match std::str::from_utf8(stem).ok().and_then(|s| s.parse::<u64>().ok()) {
        Some(i) => Name::Segment(i),
        None => Name::Malformed,
    }
}

/// The segments in `dir`, oldest first, without taking the lock (readers: verify, dump, an
/// exporter). Files not named like segments are ignored; one that ends in `.seg` but is not
/// exactly a segment name, or is not a regular file, is an error.
pub fn list_segments(dir: &Path) -> Result<Vec<SegmentInfo>, JournalError> {
    Ok(list(dir)?)
}

fn list(dir: &Path) -> Result<Vec<SegmentInfo>, SegmentError> {
    let entries = fs::read_dir(dir).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => SegmentError::NotFound { dir: dir.to_path_buf() },
        _ => SegmentError::Io { op: "list", path: dir.to_path_buf(), source: e },
    })?;
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(SegmentError::io("list", dir))?;
        let path = entry.path();
        match classify(&entry.file_name()) {
            Name::Other => continue,
            Name::Malformed => {
                return Err(SegmentError::BadName {
                    path,
                    why: "named like a segment, but not 20 digits then .seg",
                })
            }
            Name::Segment(index) => {
                let meta = entry.metadata().map_err(SegmentError::io("stat", &path))?;
                if !meta.is_file() {
                    return Err(SegmentError::BadName {
                        path,
                        why: "a segment name on a non-file",
                    });
                }
                if out.len() == SEGMENTS_MAX {
                    return Err(SegmentError::TooMany { dir: dir.to_path_buf() });
                }
                out.push(SegmentInfo { index, path, size: meta.len() });
            }
        }
    }
    out.sort_by_key(|s| s.index);
    Ok(out)
}

/// Reads and decodes the superblock of a segment file.
pub fn read_segment_superblock(path: &Path) -> Result<Superblock, JournalError> {
    Ok(read_sb(path)?)
}

fn read_sb(path: &Path) -> Result<Superblock, SegmentError> {
    let f = File::open(path).map_err(SegmentError::io("open", path))?;
    let mut raw = [0u8; SUPER_LEN_V2];
    let len = f.metadata().map_err(SegmentError::io("stat", path))?.len();
    let n = len.min(SUPER_LEN_V2 as u64) as usize;
    f.read_exact_at(&mut raw[..n], 0).map_err(SegmentError::io("read superblock", path))?;
    Superblock::decode(&raw[..n])
        .map_err(|source| SegmentError::Superblock { path: path.to_path_buf(), source })
}

/// A segment directory opened for writing: its lock is held until this is dropped.
#[derive(Debug)]
pub struct SegmentDir {
    dir: PathBuf,
    /// The locked file; the `flock` goes with its descriptor.
    _lock: File,
    segments: Vec<SegmentInfo>,
}

impl SegmentDir {
    /// Opens the segment directory at `path` (creating it with mode [`DIR_MODE`] if
    /// `create`), takes its lock and lists its segments.
    pub fn open(path: &Path, create: bool) -> Result<SegmentDir, JournalError> {
        if create {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(DIR_MODE)
                .create(path)
                .map_err(SegmentError::io("create directory", path))?;
        } else if !path.is_dir() {
            return Err(SegmentError::NotFound { dir: path.to_path_buf() }.into());
        }
        let lock = take_lock(path)?;
        let segments = list(path)?;
        Ok(SegmentDir { dir: path.to_path_buf(), _lock: lock, segments })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The segments, oldest first.
    pub fn segments(&self) -> &[SegmentInfo] {
        &self.segments
    }

    /// The newest (active) segment.
    pub fn last(&self) -> Option<&SegmentInfo> {
        self.segments.last()
    }

    /// Installs the segment `sb` describes (version 2; `sb.segment` the newest index + 1, or
    /// any index in an empty directory: that is how the first segment is made), `bytes`
    /// long: takes `spare.tmp` if it has that size (else prepares one here, synchronously),
    /// writes the superblock block at offset 0, `fdatasync`s, renames it to
    /// [`segment_name`]`(sb.segment)` without replacing anything, `fsync`s the directory.
    /// Returns the segment's path.
    ///
    /// A spare of the right size is trusted to read as zero past its superblock: only
    /// [`prepare_spare`] writes it (an interrupted prepare leaves it shorter, or with blocks
    /// the file system reads as zero), and the directory is the writer's (mode 0750).
    pub fn install(&mut self, sb: &Superblock, bytes: u64) -> Result<PathBuf, JournalError> {
        check_size(bytes)?;
        if sb.version != FORMAT_VERSION {
            let e = SegmentError::Version { segment: sb.segment, version: sb.version };
            return Err(e.into());
        }
        if let Some(last) = self.last() {
            if last.index.checked_add(1) != Some(sb.segment) {
                return Err(SegmentError::NotNext { index: sb.segment, last: last.index }.into());
            }
        }
        let target = self.dir.join(segment_name(sb.segment));
        if fs::symlink_metadata(&target).is_ok() {
            return Err(SegmentError::Exists { path: target, index: sb.segment }.into());
        }
        let spare = self.dir.join(SPARE_FILE);
        let ready = fs::symlink_metadata(&spare).is_ok_and(|m| m.is_file() && m.len() == bytes);
        if !ready {
            prepare_spare(&self.dir, bytes)?;
        }
        let f = OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(&spare)
            .map_err(SegmentError::io("open", &spare))?;
        let mut block = vec![0u8; DATA_OFFSET as usize];
        sb.encode(&mut block);
        f.write_all_at(&block, 0).map_err(SegmentError::io("write superblock", &spare))?;
        f.sync_data().map_err(SegmentError::io("fdatasync", &spare))?;
        drop(f);
        rename_noreplace(&spare, &target)?;
        sync_dir(&self.dir)?;
        self.segments.push(SegmentInfo { index: sb.segment, path: target.clone(), size: bytes });
        Ok(target)
    }

    /// Removes the oldest segments while `r` says there are too many, too many bytes, or
    /// the oldest was closed too long ago; never the newest (active) one. A segment's
    /// closing time is its successor's `created_unix_ns` (when the roll happened). Oldest
    /// first, so a crash in the middle leaves a directory that still verifies ("from seq N").
    /// Returns what was removed. [`expire`](SegmentDir::expire) and [`remove_segments`]
    /// apart, for a caller that removes the files on another thread.
    pub fn retain(&mut self, r: &Retention) -> Result<Vec<SegmentInfo>, JournalError> {
        self.retain_at(r, super::preprocess::realtime_ns())
    }

    /// [`retain`](SegmentDir::retain) as if the time were `now_unix_ns`.
    pub fn retain_at(
        &mut self,
        r: &Retention,
        now_unix_ns: u64,
    ) -> Result<Vec<SegmentInfo>, JournalError> {
        let gone = self.expire_at(r, now_unix_ns)?;
        remove_segments(&self.dir, &gone, &|p: &Path| fs::remove_file(p))?;
        Ok(gone)
    }

    /// The segments [`retain`](SegmentDir::retain) would remove, oldest first, taken off
    /// this directory's list but left on disk: the caller removes them with
    /// [`remove_segments`] (the journal service does it on its spare's thread, because
    /// unlinking a large file is not quick: 54 ms for 256 MiB on a file system mounted with
    /// `discard`, which discards the freed blocks before `unlink` returns).
    pub fn expire(&mut self, r: &Retention) -> Result<Vec<SegmentInfo>, JournalError> {
        self.expire_at(r, super::preprocess::realtime_ns())
    }

    /// [`expire`](SegmentDir::expire) as if the time were `now_unix_ns`.
    pub fn expire_at(
        &mut self,
        r: &Retention,
        now_unix_ns: u64,
    ) -> Result<Vec<SegmentInfo>, JournalError> {
        let mut bytes: u64 = self.segments.iter().map(|s| s.size).sum();
        let mut gone = Vec::new();
        // Bounded: at most one step per segment but the newest.
        while self.segments.len() > 1 {
            let oldest = &self.segments[0];
            let count_over = r.max_segments.is_some_and(|m| self.segments.len() > m);
            let bytes_over = r.max_bytes.is_some_and(|m| bytes > m);
            let age_over = match r.max_age {
                Some(max) if !(count_over || bytes_over) => {
                    let closed = read_sb(&self.segments[1].path)?.created_unix_ns;
                    Duration::from_nanos(now_unix_ns.saturating_sub(closed)) > max
                }
                _ => false,
            };
            if !(count_over || bytes_over || age_over) {
                break;
            }
            bytes -= oldest.size;
            gone.push(self.segments.remove(0));
        }
        Ok(gone)
    }
}

fn check_size(bytes: u64) -> Result<(), SegmentError> {
    if bytes < SEGMENT_BYTES_MIN || !bytes.is_multiple_of(DATA_OFFSET) {
        return Err(SegmentError::Size { bytes });
    }
    Ok(())
}

/// Opens `dir/lock` and takes `flock(LOCK_EX|LOCK_NB)` on it; writes our pid into it.
fn take_lock(dir: &Path) -> Result<File, SegmentError> {
    let path = dir.join(LOCK_FILE);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(FILE_MODE)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(&path)
        .map_err(SegmentError::io("open", &path))?;
    // SAFETY: `f` owns the descriptor for the whole call; flock takes no memory.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            let mut text = [0u8; PID_TEXT_MAX];
            let n = f.read_at(&mut text, 0).unwrap_or(0);
            let pid = std::str::from_utf8(&text[..n]).ok().and_then(|t| t.trim().parse().ok());
            return Err(SegmentError::Locked { dir: dir.to_path_buf(), pid });
        }
        return Err(SegmentError::Io { op: "flock", path, source: e });
    }
    // For the error message of the next one who tries.
    f.set_len(0).map_err(SegmentError::io("truncate", &path))?;
    let pid = format!("{}\n", std::process::id());
    f.write_all_at(pid.as_bytes(), 0).map_err(SegmentError::io("write", &path))?;
    Ok(f)
}

/// Creates `dir/spare.tmp` (replacing a stale one), writes zeroes over all `bytes` of it with
/// plain writes (not `fallocate`: written blocks need no metadata commit at later data-only
/// `fdatasync`s), `fdatasync`s it and returns its path. Safe on a background thread while the
/// writer appends to the active segment (it touches only `spare.tmp`). On any error,
/// `ENOSPC` included ([`SegmentError::is_no_space`]: retry later), the partial spare is
/// removed; it never carries a segment's name.
pub fn prepare_spare(dir: &Path, bytes: u64) -> Result<PathBuf, JournalError> {
    prepare_spare_paced(dir, bytes, 0)
}

/// [`prepare_spare`] at most `bytes_per_s` (0: as fast as the device goes): the zeroes are
/// written in [`PACE_CHUNK`] pieces, each pushed to the device and waited for
/// (`sync_file_range`, no cache flush) before the next, with a pause that keeps the average
/// rate. A journal writing beside it then waits behind at most one piece, instead of behind
/// the writeback of a whole segment at the final `fdatasync` (measured: a 256 MiB spare
/// prepared at full speed held durable acks for ~100 ms).
pub fn prepare_spare_paced(
    dir: &Path,
    bytes: u64,
    bytes_per_s: u64,
) -> Result<PathBuf, JournalError> {
    prepare_spare_with(dir, bytes, &mut |_| bytes_per_s)
}

/// [`prepare_spare_paced`] at a pace that may change while it runs: `pace(done)` is asked
/// before the first piece (0 there: every piece at full speed, no waits) and then after each
/// piece and at least every [`PACE_RECHECK`] while waiting (`done`: the bytes before that
/// piece), and gives the bytes per second to keep (0: go on at once). Each piece of `n`
/// bytes but the last is followed by a wait until `n / pace` after it started, so a raised
/// pace takes effect within one recheck, not after the wait a slower pace had planned.
pub fn prepare_spare_with(
    dir: &Path,
    bytes: u64,
    pace: &mut dyn FnMut(u64) -> u64,
) -> Result<PathBuf, JournalError> {
    check_size(bytes)?;
    let path = dir.join(SPARE_FILE);
    match fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(SegmentError::Io { op: "remove", path, source: e }.into()),
    }
    let result = write_zeroes(&path, bytes, pace);
    if let Err(e) = result {
        let _ = fs::remove_file(&path);
        return Err(e.into());
    }
    Ok(path)
}

/// The piece [`prepare_spare_paced`] writes and waits for at a time.
pub const PACE_CHUNK: usize = 512 << 10;

/// How often a paced spare asks its pace again while it waits.
pub const PACE_RECHECK: std::time::Duration = std::time::Duration::from_millis(20);

fn write_zeroes(
    path: &Path,
    bytes: u64,
    pace: &mut dyn FnMut(u64) -> u64,
) -> Result<(), SegmentError> {
    let f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(FILE_MODE)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(SegmentError::io("create", path))?;
    let paced = pace(0) > 0;
    let chunk = if paced { PACE_CHUNK } else { ZERO_CHUNK };
    let zeroes = vec![0u8; chunk];
    let mut off = 0u64;
    // Bounded: `bytes / chunk + 1` writes.
    while off < bytes {
        let n = (bytes - off).min(chunk as u64) as usize;
        let started = std::time::Instant::now();
        f.write_all_at(&zeroes[..n], off).map_err(SegmentError::io("write zeroes", path))?;
        // No pause after the last piece: only its `fdatasync` follows.
        if paced && off + (n as u64) < bytes {
            use std::os::fd::AsRawFd as _;
            let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
                | libc::SYNC_FILE_RANGE_WRITE
                | libc::SYNC_FILE_RANGE_WAIT_AFTER;
            // SAFETY: sync_file_range on a descriptor this function owns; no memory passed.
            let rc = unsafe { libc::sync_file_range(f.as_raw_fd(), off as i64, n as i64, flags) };
            if rc != 0 {
                return Err(SegmentError::io("sync_file_range", path)(io::Error::last_os_error()));
            }
            // Bounded: each turn sleeps PACE_RECHECK or until the piece's time at the pace
            // asked for is up (at most `n` seconds at the lowest pace, 1 byte/s).
            loop {
                let rate = pace(off);
                if rate == 0 {
                    break;
                }
                let due = std::time::Duration::from_secs_f64(n as f64 / rate as f64);
                let Some(wait) = due.checked_sub(started.elapsed()) else { break };
                std::thread::sleep(wait.min(PACE_RECHECK));
            }
        }
        off += n as u64;
    }
    f.sync_data().map_err(SegmentError::io("fdatasync", path))
}

/// `rename(from, to)` that fails rather than replace `to` (`renameat2(RENAME_NOREPLACE)`;
/// on a file system without it, a check then `rename`, fine under the directory's lock).
fn rename_noreplace(from: &Path, to: &Path) -> Result<(), SegmentError> {
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes()).map_err(|_| SegmentError::BadName {
            path: p.to_path_buf(),
            why: "path holds a NUL byte",
        })
    };
    let (cf, ct) = (c(from)?, c(to)?);
    // SAFETY: both pointers are NUL-terminated strings alive for the call; renameat2 only
    // reads them.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            cf.as_ptr(),
            libc::AT_FDCWD,
            ct.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EINVAL) | Some(libc::ENOSYS) => {
            if fs::symlink_metadata(to).is_ok() {
                return Err(SegmentError::Exists { path: to.to_path_buf(), index: 0 });
            }
            fs::rename(from, to).map_err(SegmentError::io("rename", from))
        }
        _ => Err(SegmentError::Io { op: "rename", path: from.to_path_buf(), source: e }),
    }
}

fn sync_dir(dir: &Path) -> Result<(), SegmentError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(SegmentError::io("fsync directory", dir))
}

/// Removes `gone` (segments [`SegmentDir::expire`] took off the list) in order, oldest first,
/// with `remove`, then syncs the directory. A file already gone counts as removed; the first
/// other failure stops there (the rest stay on disk, and a directory opened again lists them).
pub fn remove_segments(
    dir: &Path,
    gone: &[SegmentInfo],
    remove: &dyn Fn(&Path) -> io::Result<()>,
) -> Result<(), JournalError> {
    for s in gone {
        match remove(&s.path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(
                    SegmentError::Io { op: "remove", path: s.path.clone(), source: e }.into()
                )
            }
        }
    }
    if !gone.is_empty() {
        sync_dir(dir)?;
    }
    Ok(())
}

/// How much of a segment directory to keep. `None` everywhere keeps everything.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Retention {
    /// Keep at most this many segments (the active one counts).
    pub max_segments: Option<usize>,
    /// Keep at most this many bytes of segments (the active one counts, and stays).
    pub max_bytes: Option<u64>,
    /// Remove segments closed longer ago than this.
    pub max_age: Option<Duration>,
}

/// Why a `--retain` text was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("retention {part:?}: {why}")]
pub struct RetentionParseError {
    /// The part of the text at fault.
    pub part: String,
    /// What is wrong with it.
    pub why: &'static str,
}

impl FromStr for Retention {
    type Err = RetentionParseError;

    /// `segments=10,bytes=10G,age=7d`: any of the three, each once. Sizes take K, M, G, T
    /// (powers of 1024); ages s, m, h, d or w.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = |part: &str, why| RetentionParseError { part: part.to_string(), why };
        let mut r = Retention::default();
        if text.trim().is_empty() {
            return Err(bad(text, "empty: want segments=N, bytes=SIZE and/or age=DURATION"));
        }
        for part in text.split(',') {
            let Some((key, value)) = part.split_once('=') else {
                return Err(bad(part, "want KEY=VALUE"));
            };
            let value = value.trim();
            match key.trim() {
                "segments" => {
                    let n: usize = value.parse().map_err(|_| bad(part, "not a count"))?;
                    if n == 0 {
                        return Err(bad(part, "at least 1 (the active segment stays)"));
                    }
                    if r.max_segments.replace(n).is_some() {
                        return Err(bad(part, "given twice"));
                    }
                }
                "bytes" => {
                    let n = fastlane_util::parse_size(value)
                        .map_err(|_| bad(part, "not a size (like 512M or 10G)"))?;
                    if r.max_bytes.replace(n).is_some() {
                        return Err(bad(part, "given twice"));
                    }
                }
                "age" => {
                    let d =
                        parse_age(value).ok_or_else(|| bad(part, "not an age (like 90m or 7d)"))?;
                    if r.max_age.replace(d).is_some() {
                        return Err(bad(part, "given twice"));
                    }
                }
                _ => return Err(bad(part, "unknown key: want segments, bytes or age")),
            }
        }
        Ok(r)
    }
}

fn parse_age(t: &str) -> Option<Duration> {
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(digits_end);
    let n: u64 = digits.parse().ok()?;
    let secs = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        "w" => 7 * 86_400,
        _ => return None,
    };
    n.checked_mul(secs).map(Duration::from_secs)
}

impl fmt::Display for Retention {
    /// The form [`FromStr`] reads (`age` in seconds); `none` when nothing is limited.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(n) = self.max_segments {
            parts.push(format!("segments={n}"));
        }
        if let Some(n) = self.max_bytes {
            parts.push(format!("bytes={n}"));
        }
        if let Some(d) = self.max_age {
            parts.push(format!("age={}s", d.as_secs()));
        }
        if parts.is_empty() {
            return f.write_str("none");
        }
        f.write_str(&parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::super::format::{Durability, CHAIN_LEN};
    use super::*;

    fn sb(segment: u64, created: u64) -> Superblock {
        let s = Superblock::new([5; 16], created, 1, 64 << 10, 1024, Durability::Local);
        Superblock { segment, prev_head: [segment as u8; CHAIN_LEN], ..s }
    }

    #[test]
    fn names_sort_and_parse_strictly() {
        assert_eq!(segment_name(42), "00000000000000000042.seg");
        assert_eq!(segment_name(u64::MAX), "18446744073709551615.seg");
        assert!(segment_name(9) < segment_name(10));
        assert_eq!(classify(OsStr::new(&segment_name(7))), Name::Segment(7));
        assert_eq!(classify(OsStr::new(&segment_name(u64::MAX))), Name::Segment(u64::MAX));
        for bad in ["7.seg", "0000000000000000000x.seg", "99999999999999999999.seg", ".seg"] {
            assert_eq!(classify(OsStr::new(bad)), Name::Malformed, "{bad}");
        }
        for other in ["lock", "spare.tmp", "notes.txt", "00000000000000000001.seg.bak"] {
            assert_eq!(classify(OsStr::new(other)), Name::Other, "{other}");
        }
    }

    #[test]
    fn open_locks_lists_and_ignores_strays() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("j");
        assert!(SegmentDir::open(&dir, false).is_err(), "missing and not created");
        let mut d = SegmentDir::open(&dir, true).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(fs::metadata(&dir).unwrap().permissions().mode() & 0o777, DIR_MODE);
        assert!(d.segments().is_empty() && d.last().is_none());
        // A second writer is refused, naming the directory and our pid.
        let err = SegmentDir::open(&dir, true).unwrap_err();
        let msg = SegmentError::of(&err).unwrap().to_string();
        assert!(msg.contains(&dir.display().to_string()), "{msg}");
        assert!(msg.contains(&format!("pid {}", std::process::id())), "{msg}");
        d.install(&Superblock { prev_head: [0; 16], ..sb(0, 1) }, 16 << 10).unwrap();
        d.install(&sb(1, 2), 16 << 10).unwrap();
        drop(d);
        fs::write(dir.join("README"), b"not ours").unwrap();
        let d = SegmentDir::open(&dir, false).unwrap();
        let idx: Vec<u64> = d.segments().iter().map(|s| s.index).collect();
        assert_eq!(idx, [0, 1]);
        assert_eq!(d.last().unwrap().size, 16 << 10);
        drop(d);
        fs::write(dir.join("12.seg"), b"renamed by hand").unwrap();
        let err = SegmentDir::open(&dir, false).unwrap_err();
        assert!(matches!(SegmentError::of(&err), Some(SegmentError::BadName { .. })), "{err:?}");
    }

    #[test]
    fn install_takes_a_ready_spare_and_replaces_a_stale_one() {
        let tmp = tempfile::tempdir().unwrap();
        let mut d = SegmentDir::open(tmp.path(), false).unwrap();
        let bytes = 32 << 10;
        // A stale, half-made spare (a crash while preparing): the wrong size, garbage.
        fs::write(tmp.path().join(SPARE_FILE), vec![0xAB; 5000]).unwrap();
        let p = d.install(&Superblock { prev_head: [0; 16], ..sb(0, 1) }, bytes).unwrap();
        assert_eq!(p, tmp.path().join(segment_name(0)));
        let img = fs::read(&p).unwrap();
        assert_eq!(img.len() as u64, bytes);
        assert_eq!(read_segment_superblock(&p).unwrap().segment, 0);
        assert!(img[SUPER_LEN_V2..].iter().all(|&b| b == 0), "zero past the superblock");
        assert!(!tmp.path().join(SPARE_FILE).exists(), "the spare became the segment");
        // A prepared spare is taken as is (same inode).
        let spare = prepare_spare(tmp.path(), bytes).unwrap();
        use std::os::unix::fs::MetadataExt;
        let ino = fs::metadata(&spare).unwrap().ino();
        let p1 = d.install(&sb(1, 2), bytes).unwrap();
        assert_eq!(fs::metadata(&p1).unwrap().ino(), ino);
        // Out of order, existing, wrong version, bad size: refused, nothing renamed.
        assert!(d.install(&sb(3, 3), bytes).is_err());
        assert!(d.install(&Superblock { version: 1, ..sb(2, 3) }, bytes).is_err());
        assert!(d.install(&sb(2, 3), 5000).is_err());
        let names: Vec<_> = fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".seg"))
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        // The rename never replaces: a segment file put there first stays.
        fs::write(tmp.path().join(segment_name(2)), b"x").unwrap();
        let err = d.install(&sb(2, 3), bytes).unwrap_err();
        assert!(matches!(SegmentError::of(&err), Some(SegmentError::Exists { .. })), "{err:?}");
        assert_eq!(fs::read(tmp.path().join(segment_name(2))).unwrap(), b"x");
    }

    #[test]
    fn rename_noreplace_refuses_an_existing_target() {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        fs::write(&a, b"a").unwrap();
        fs::write(&b, b"b").unwrap();
        assert!(rename_noreplace(&a, &b).is_err());
        assert_eq!(fs::read(&b).unwrap(), b"b");
        fs::remove_file(&b).unwrap();
        rename_noreplace(&a, &b).unwrap();
        assert_eq!(fs::read(&b).unwrap(), b"a");
    }

    #[test]
    fn retention_removes_the_oldest_and_never_the_last() {
        const DAY: u64 = 86_400 * 1_000_000_000;
        let tmp = tempfile::tempdir().unwrap();
        let mut d = SegmentDir::open(tmp.path(), false).unwrap();
        let bytes = 16 << 10;
        // Segment i created (and i - 1 closed) on day i.
        for i in 0..6u64 {
            let s = sb(i, (i + 1) * DAY);
            let s = if i == 0 { Superblock { prev_head: [0; 16], ..s } } else { s };
            d.install(&s, bytes).unwrap();
        }
        let now = 10 * DAY;
        let keep = |d: &SegmentDir| d.segments().iter().map(|s| s.index).collect::<Vec<_>>();
        assert_eq!(d.retain_at(&Retention::default(), now).unwrap(), []);
        let gone = d.retain_at(&"segments=4".parse().unwrap(), now).unwrap();
        assert_eq!(gone.iter().map(|s| s.index).collect::<Vec<_>>(), [0, 1]);
        assert!(!gone[0].path.exists() && !gone[1].path.exists());
        assert_eq!(keep(&d), [2, 3, 4, 5]);
        // Bytes: three segments' worth keeps three.
        d.retain_at(&Retention { max_bytes: Some(3 * bytes + 1), ..Default::default() }, now)
            .unwrap();
        assert_eq!(keep(&d), [3, 4, 5]);
        // Age: segment 3 closed on day 5 (segment 4's creation), 5 days before `now`.
        d.retain_at(&"age=6d".parse().unwrap(), now).unwrap();
        assert_eq!(keep(&d), [3, 4, 5]);
        d.retain_at(&"age=5d".parse().unwrap(), now + 1).unwrap();
        assert_eq!(keep(&d), [4, 5]);
        // Everything over every limit: the active segment stays.
        let all =
            Retention { max_segments: Some(1), max_bytes: Some(0), max_age: Some(Duration::ZERO) };
        d.retain_at(&all, now).unwrap();
        assert_eq!(keep(&d), [5]);
        assert!(d.last().unwrap().path.exists());
        d.retain_at(&all, now).unwrap();
        assert_eq!(keep(&d), [5]);
        let listed: Vec<u64> = list_segments(tmp.path()).unwrap().iter().map(|s| s.index).collect();
        assert_eq!(listed, [5]);
    }

    #[test]
    fn retention_text() {
        let r: Retention = "segments=10,bytes=10G,age=7d".parse().unwrap();
        assert_eq!(r.max_segments, Some(10));
        assert_eq!(r.max_bytes, Some(10 << 30));
        assert_eq!(r.max_age, Some(Duration::from_secs(7 * 86_400)));
        assert_eq!(r.to_string().parse::<Retention>().unwrap(), r);
        assert_eq!(Retention::default().to_string(), "none");
        for (text, part) in [
            ("segments=0", "segments=0"),
            ("bytes=10Q", "bytes=10Q"),
            ("age=7", "age=7"),
            ("segments=3,colour=red", "colour=red"),
            ("segments=3,segments=4", "segments=4"),
            ("segments", "segments"),
            ("", ""),
        ] {
            let e = text.parse::<Retention>().unwrap_err();
            assert_eq!(e.part, part, "{text}");
            assert!(e.to_string().contains(&format!("{part:?}")), "{e}");
        }
    }
}
