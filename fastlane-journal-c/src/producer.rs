//! The producer handle and the functions over it.
//!
//! Each function checks its pointers, then runs its one `JournalProducer` call inside
//! `catch_unwind`: a panic becomes `FL_JOURNAL_PANIC` (and poisons the handle) instead of
//! unwinding into C. `catch_unwind` costs nothing unless a panic happens (a landing pad), so
//! `fl_journal_append` is `JournalProducer::append` plus two NULL checks, a length check and
//! a poisoned flag.

// The C names are the API (see status.rs).
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void, CStr, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::time::Duration;

use journal::{JournalError, JournalProducer};

use crate::last_error;
use crate::status::fl_journal_status;

/// A producer attached to a journal service: opaque; made by `fl_journal_connect`, ended by
/// `fl_journal_close`. One thread at a time may use it (it may move between threads).
#[derive(Debug)]
pub struct fl_journal_producer {
    tx: JournalProducer,
    /// A panic was caught inside a call on this handle: its state is unknown, every later
    /// call returns `FL_JOURNAL_PANIC`.
    poisoned: bool,
}

const OK: c_int = fl_journal_status::FL_JOURNAL_OK as c_int;

/// Records `e` as the thread's last error and returns its code.
#[cold]
fn fail(e: &JournalError) -> c_int {
    last_error::set(e);
    fl_journal_status::of(e).code()
}

/// A NULL where `what` must point somewhere.
#[cold]
fn null(what: &str) -> c_int {
    last_error::set_fmt(format_args!("NULL {what} pointer"));
    fl_journal_status::FL_JOURNAL_NULL.code()
}

/// A caught panic: describes it as the last error. The payload is leaked, not dropped: a
/// payload whose destructor panics would unwind out of here.
#[cold]
fn panicked(payload: Box<dyn std::any::Any + Send>) -> c_int {
    let what = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)");
    last_error::set_fmt(format_args!("panic inside libfastlane_journal: {what}"));
    std::mem::forget(payload);
    fl_journal_status::FL_JOURNAL_PANIC.code()
}

/// Runs `call` on the handle's producer unless the handle is poisoned; a panic poisons it.
#[inline]
fn guarded(p: &mut fl_journal_producer, call: impl FnOnce(&mut JournalProducer) -> c_int) -> c_int {
    if p.poisoned {
        return poisoned();
    }
    match catch_unwind(AssertUnwindSafe(|| call(&mut p.tx))) {
        Ok(code) => code,
        Err(payload) => {
            p.poisoned = true;
            panicked(payload)
        }
    }
}

#[cold]
fn poisoned() -> c_int {
    last_error::set_str("the handle is unusable after an internal error; close it");
    fl_journal_status::FL_JOURNAL_PANIC.code()
}

/// Writes `seq` to `seq_out` unless it is NULL.
///
/// # Safety
/// `seq_out` is NULL or valid for writing an aligned `u64`.
#[inline]
unsafe fn put_seq(seq_out: *mut u64, seq: u64) {
    if !seq_out.is_null() {
        // SAFETY: not NULL, and the caller promises it is writable and aligned.
        unsafe { seq_out.write(seq) };
    }
}

/// The `len` bytes at `data` after the length check against the journal's limit.
///
/// # Safety
/// `data` is valid for reading `len` bytes (or NULL with `len == 0`), and `len` is at most
/// `isize::MAX` (the callers check it against `max_record_bytes` first).
#[inline]
unsafe fn payload<'a>(data: *const c_void, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: the caller's promise: `len` readable bytes at `data`, not changed during the
    // call (the C caller owns the buffer and does not write it while the call copies it).
    unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }
}

/// Attaches to the journal service of directory `dir` (its socket `dir/journal.sock`) as
/// `name`, with the service's default ring size. Same as `fl_journal_connect_with(dir, name,
/// 0, out)`.
///
/// # Safety
/// As for `fl_journal_connect_with`.
#[no_mangle]
pub unsafe extern "C" fn fl_journal_connect(
    dir: *const c_char,
    name: *const c_char,
    out: *mut *mut fl_journal_producer,
) -> c_int {
    // SAFETY: the same contract, passed on.
    unsafe { fl_journal_connect_with(dir, name, 0, out) }
}

/// Attaches to the journal service of directory `dir` as `name` with a ring of `ring_bytes`
/// (a power of two from 4096 to 256 MiB; 0: the service's default) and stores the new handle
/// in `*out`.
///
/// `dir` is a NUL-terminated path (any bytes); `name` is NUL-terminated UTF-8 without control
/// characters, at most 64 bytes (longer names are cut); it goes into the service's
/// `producers.log`. Blocks until the service answers (at most 10 s). On failure `*out` is set
/// to NULL and `fl_journal_last_error` says why: `FL_JOURNAL_IO` when no service listens at
/// `dir` (or it cannot be reached), `FL_JOURNAL_REFUSED` with the service's reason,
/// `FL_JOURNAL_INVALID_ARGUMENT` for a name that is not UTF-8, `FL_JOURNAL_NULL` for a NULL
/// argument. Allocates the handle; not a hot-path call.
///
/// # Safety
/// `dir` and `name` are NULL or NUL-terminated strings; `out` is NULL or valid for writing a
/// pointer.
#[no_mangle]
pub unsafe extern "C" fn fl_journal_connect_with(
    dir: *const c_char,
    name: *const c_char,
    ring_bytes: usize,
    out: *mut *mut fl_journal_producer,
) -> c_int {
    if out.is_null() {
        return null("out");
    }
    // SAFETY: `out` is not NULL and the caller promises it is writable.
    unsafe { out.write(std::ptr::null_mut()) };
    if dir.is_null() {
        return null("dir");
    }
    if name.is_null() {
        return null("name");
    }
    // SAFETY: not NULL, and the caller promises a NUL-terminated string that lives across the
    // call.
    let dir = unsafe { CStr::from_ptr(dir) };
    // SAFETY: as for `dir`.
    let name = unsafe { CStr::from_ptr(name) };
    let Ok(name) = name.to_str() else {
        last_error::set_str("the producer name is not UTF-8");
        return fl_journal_status::FL_JOURNAL_INVALID_ARGUMENT.code();
    };
    let dir = Path::new(OsStr::from_bytes(dir.to_bytes()));
    let made = catch_unwind(|| JournalProducer::connect_with(dir, name, ring_bytes));
    match made {
        Ok(Ok(tx)) => {
            let handle = Box::into_raw(Box::new(fl_journal_producer { tx, poisoned: false }));
            // SAFETY: checked not NULL above; the caller promises it is writable.
            unsafe { out.write(handle) };
            OK
        }
        Ok(Err(e)) => fail(&e),
        Err(payload) => panicked(payload),
    }
}

/// Appends the `len` bytes at `data` as one record and stores its seq (this producer's own:
/// 1, 2, 3, ...) in `*seq_out` (which may be NULL). The hot path: one copy into the shared
/// ring, no allocation, no lock, no syscall (a `FUTEX_WAKE` only when the service's writer
/// sleeps on an empty journal).
///
/// Returns `FL_JOURNAL_OK`; `FL_JOURNAL_FULL` when the ring has no room (nothing was
/// appended: retry, or use `fl_journal_append_blocking`); `FL_JOURNAL_TOO_LARGE` when `len`
/// exceeds `fl_journal_max_record_bytes`; `FL_JOURNAL_CLOSED`, `FL_JOURNAL_PRODUCER_FAULT` or
/// `FL_JOURNAL_WRITER_FAILED` once the ring is full and the service has stopped taking this
/// producer's records (until the ring fills, appends after a stop still return OK: check
/// `fl_journal_wait_durable`); `FL_JOURNAL_NULL` for a NULL `p`, or a NULL `data` with `len`
/// above 0.
///
/// # Safety
/// `p` is NULL or a live handle from `fl_journal_connect` that no other thread uses during
/// the call; `data` is valid for reading `len` bytes (or NULL when `len` is 0); `seq_out` is
/// NULL or valid for writing a `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn fl_journal_append(
    p: *mut fl_journal_producer,
    data: *const c_void,
    len: usize,
    seq_out: *mut u64,
) -> c_int {
    // SAFETY: forwarded: the caller's promises about `p`, `data`, `len` and `seq_out`.
    unsafe { append_with(p, data, len, seq_out, |tx, bytes| tx.append(bytes)) }
}

/// What both appends share: the NULL checks, the length check (before a slice is formed), the
/// guard, and writing the seq back; `op` is the append itself.
///
/// # Safety
/// `p` is NULL or a live handle this thread alone uses; `data` names `len` readable bytes (or
/// is NULL with `len` 0); `seq_out` is NULL or writable.
unsafe fn append_with(
    p: *mut fl_journal_producer,
    data: *const c_void,
    len: usize,
    seq_out: *mut u64,
    op: impl FnOnce(&mut JournalProducer, &[u8]) -> Result<u64, JournalError>,
) -> c_int {
    // SAFETY: NULL or a live handle used by this thread only (the caller's promise).
    let Some(p) = (unsafe { p.as_mut() }) else { return null("producer") };
    if data.is_null() && len > 0 {
        return null("data");
    }
    guarded(p, |tx| {
        let max = tx.max_record_bytes();
        if len > max {
            return fail(&JournalError::TooLarge { len, max });
        }
        // SAFETY: `len` readable bytes at `data` (the caller's promise), `len` at most
        // `max_record_bytes`, far below `isize::MAX`.
        let bytes = unsafe { payload(data, len) };
        match op(tx, bytes) {
            Ok(seq) => {
                // SAFETY: NULL or writable (the caller's promise).
                unsafe { put_seq(seq_out, seq) };
                OK
            }
            Err(e) => fail(&e),
        }
    })
}

/// Like `fl_journal_append`, but waits up to `timeout_ns` nanoseconds for room in the ring
/// (spin, yield, then sleep on a futex the writer wakes). `FL_JOURNAL_FULL` means the
/// timeout passed without room; nothing was appended.
///
/// # Safety
/// As for `fl_journal_append`.
#[no_mangle]
pub unsafe extern "C" fn fl_journal_append_blocking(
    p: *mut fl_journal_producer,
    data: *const c_void,
    len: usize,
    timeout_ns: u64,
    seq_out: *mut u64,
) -> c_int {
    let timeout = Duration::from_nanos(timeout_ns);
    // SAFETY: forwarded: the caller's promises about `p`, `data`, `len` and `seq_out`.
    unsafe { append_with(p, data, len, seq_out, |tx, bytes| tx.append_blocking(bytes, timeout)) }
}

/// The highest of this producer's seqs that is durable (0: none yet, or `p` is NULL). One
/// load from shared memory, no syscall.
///
/// # Safety
/// `p` is NULL or a live handle that no other thread uses during the call.
#[no_mangle]
pub unsafe extern "C" fn fl_journal_durable_seq(p: *const fl_journal_producer) -> u64 {
    // SAFETY: NULL or a live handle (the caller's promise).
    let Some(p) = (unsafe { p.as_ref() }) else { return 0 };
    catch_unwind(|| p.tx.durable_seq()).unwrap_or(0)
}

/// Waits until this producer's record `seq` is durable (`FL_JOURNAL_OK`), `timeout_ns`
/// nanoseconds pass (`FL_JOURNAL_TIMEOUT`), or the service stops taking this producer's
/// records (`FL_JOURNAL_CLOSED`, `FL_JOURNAL_PRODUCER_FAULT`, `FL_JOURNAL_WRITER_FAILED`).
/// Spins briefly, then sleeps on a futex the service's writer wakes.
///
/// # Safety
/// `p` is NULL or a live handle that no other thread uses during the call.
#[no_mangle]
pub unsafe extern "C" fn fl_journal_wait_durable(
    p: *const fl_journal_producer,
    seq: u64,
    timeout_ns: u64,
) -> c_int {
    // SAFETY: NULL or a live handle (the caller's promise).
    let Some(p) = (unsafe { p.as_ref() }) else { return null("producer") };
    if p.poisoned {
        return poisoned();
    }
    match catch_unwind(|| p.tx.wait_durable(seq, Duration::from_nanos(timeout_ns))) {
        Ok(Ok(())) => OK,
        Ok(Err(e)) => fail(&e),
        Err(payload) => panicked(payload),
    }
}

/// The id the service gave this producer: it is in the flags of each of its records' frames
/// and in the service's `producers.log`. 0 if `p` is NULL.
///
/// # Safety
/// `p` is NULL or a live handle that no other thread uses during the call.
#[no_mangle]
pub unsafe extern "C" fn fl_journal_producer_id(p: *const fl_journal_producer) -> u32 {
    // SAFETY: NULL or a live handle (the caller's promise).
    let Some(p) = (unsafe { p.as_ref() }) else { return 0 };
    catch_unwind(|| p.tx.producer_id().unwrap_or(0)).unwrap_or(0)
}

/// The longest record `fl_journal_append` takes, in bytes (the journal's limit; 0 if `p` is
/// NULL).
///
/// # Safety
/// `p` is NULL or a live handle that no other thread uses during the call.
#[no_mangle]
pub unsafe extern "C" fn fl_journal_max_record_bytes(p: *const fl_journal_producer) -> usize {
    // SAFETY: NULL or a live handle (the caller's promise).
    let Some(p) = (unsafe { p.as_ref() }) else { return 0 };
    catch_unwind(|| p.tx.max_record_bytes()).unwrap_or(0)
}

/// Detaches from the service and frees the handle. What was appended is still written (the
/// service drains the ring of a producer that detaches). NULL is a no-op.
///
/// # Safety
/// `p` is NULL or a live handle from `fl_journal_connect` that no other thread uses; it is
/// invalid after this call.
#[no_mangle]
pub unsafe extern "C" fn fl_journal_close(p: *mut fl_journal_producer) {
    if p.is_null() {
        return;
    }
    // SAFETY: a live handle made by `Box::into_raw` in `fl_journal_connect_with`, given back
    // once (the caller's promise); ownership returns to the box, which the drop below ends.
    let handle = unsafe { Box::from_raw(p) };
    if let Err(payload) = catch_unwind(AssertUnwindSafe(|| drop(handle))) {
        panicked(payload);
    }
}

// The documentation lets a handle move between threads (one at a time): that is sound only
// while the producer is `Send`. This fails to compile if it stops being so.
const _: fn() = || {
    fn send<T: Send>() {}
    send::<fl_journal_producer>();
};
