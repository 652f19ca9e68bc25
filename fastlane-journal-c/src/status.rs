//! The result codes of the C API, what each means, and which journal error gives which.

// The C names are the API: `fl_journal_status` and `FL_JOURNAL_OK` in Rust too, so that the
// header cbindgen writes is exactly what C programs spell.
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, CStr};

use journal::JournalError;

/// Result codes: `FL_JOURNAL_OK` (0) or a negative error. Functions return them as `int`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum fl_journal_status {
    /// Success.
    FL_JOURNAL_OK = 0,
    /// The producer's ring is full: nothing was appended; retry once the service's writer has
    /// drained it (`fl_journal_append`), or the timeout of `fl_journal_append_blocking`
    /// passed without room.
    FL_JOURNAL_FULL = -1,
    /// The record is longer than `fl_journal_max_record_bytes`; nothing was appended.
    FL_JOURNAL_TOO_LARGE = -2,
    /// The journal service stopped (closed this producer's journal): nothing more will be
    /// written; connect again to a new service.
    FL_JOURNAL_CLOSED = -3,
    /// The service shut this producer's ring off because it held something impossible (a
    /// scribbled ring); the handle is dead, close it.
    FL_JOURNAL_PRODUCER_FAULT = -4,
    /// The service's writer stopped on an error (a failed write or flush, a full device).
    FL_JOURNAL_WRITER_FAILED = -5,
    /// `fl_journal_wait_durable`: the record was not durable before the timeout.
    FL_JOURNAL_TIMEOUT = -6,
    /// A pointer argument that must not be NULL was NULL.
    FL_JOURNAL_NULL = -7,
    /// An argument is not acceptable: a producer name that is not UTF-8, a ring size the
    /// service cannot make.
    FL_JOURNAL_INVALID_ARGUMENT = -8,
    /// A system call failed, above all connecting to `DIR/journal.sock` (no service running
    /// there, no permission); `fl_journal_last_error` has the OS error.
    FL_JOURNAL_IO = -9,
    /// The service refused the attach (user not allowed, producer limit reached, service
    /// stopping); `fl_journal_last_error` has its reason.
    FL_JOURNAL_REFUSED = -10,
    /// A bug inside this library was caught at the C boundary; the handle is unusable from
    /// then on (every call on it returns this code), close it.
    FL_JOURNAL_PANIC = -11,
    /// Any other failure (a malformed reply from the service, a ring that cannot be mapped);
    /// `fl_journal_last_error` says which.
    FL_JOURNAL_OTHER = -12,
}

impl fl_journal_status {
    /// Every code, for tests and the documentation.
    pub(crate) const ALL: [fl_journal_status; 13] = [
        fl_journal_status::FL_JOURNAL_OK,
        fl_journal_status::FL_JOURNAL_FULL,
        fl_journal_status::FL_JOURNAL_TOO_LARGE,
        fl_journal_status::FL_JOURNAL_CLOSED,
        fl_journal_status::FL_JOURNAL_PRODUCER_FAULT,
        fl_journal_status::FL_JOURNAL_WRITER_FAILED,
        fl_journal_status::FL_JOURNAL_TIMEOUT,
        fl_journal_status::FL_JOURNAL_NULL,
        fl_journal_status::FL_JOURNAL_INVALID_ARGUMENT,
        fl_journal_status::FL_JOURNAL_IO,
        fl_journal_status::FL_JOURNAL_REFUSED,
        fl_journal_status::FL_JOURNAL_PANIC,
        fl_journal_status::FL_JOURNAL_OTHER,
    ];

    /// The code of a journal error.
    pub(crate) fn of(e: &JournalError) -> fl_journal_status {
        use fl_journal_status::*;
        match e {
            JournalError::Full => FL_JOURNAL_FULL,
            JournalError::TooLarge { .. } => FL_JOURNAL_TOO_LARGE,
            JournalError::Closed => FL_JOURNAL_CLOSED,
            JournalError::ProducerFault => FL_JOURNAL_PRODUCER_FAULT,
            JournalError::WriterFailed | JournalError::DeviceFull => FL_JOURNAL_WRITER_FAILED,
            JournalError::Timeout { .. } => FL_JOURNAL_TIMEOUT,
            JournalError::Config(_) => FL_JOURNAL_INVALID_ARGUMENT,
            JournalError::Io { .. } => FL_JOURNAL_IO,
            JournalError::Refused { .. } => FL_JOURNAL_REFUSED,
            _ => FL_JOURNAL_OTHER,
        }
    }

    /// The code as C sees it.
    pub(crate) fn code(self) -> c_int {
        self as c_int
    }

    /// The code of an `int`, if it is one.
    pub(crate) fn from_code(code: c_int) -> Option<fl_journal_status> {
        fl_journal_status::ALL.into_iter().find(|s| s.code() == code)
    }

    /// What the code means, in a few words (the text of `fl_journal_strerror`).
    pub(crate) fn message(self) -> &'static CStr {
        use fl_journal_status::*;
        match self {
            FL_JOURNAL_OK => c"success",
            FL_JOURNAL_FULL => c"journal ring full, retry",
            FL_JOURNAL_TOO_LARGE => c"record larger than the journal's max_record_bytes",
            FL_JOURNAL_CLOSED => c"journal service stopped",
            FL_JOURNAL_PRODUCER_FAULT => c"producer fault: the service stopped reading the ring",
            FL_JOURNAL_WRITER_FAILED => c"journal writer failed",
            FL_JOURNAL_TIMEOUT => c"timed out waiting for durability",
            FL_JOURNAL_NULL => c"NULL pointer argument",
            FL_JOURNAL_INVALID_ARGUMENT => c"invalid argument",
            FL_JOURNAL_IO => c"system call failed (is the journal service running?)",
            FL_JOURNAL_REFUSED => c"the journal service refused the attach",
            FL_JOURNAL_PANIC => c"internal error in libfastlane_journal (handle unusable)",
            FL_JOURNAL_OTHER => c"journal error",
        }
    }
}

/// Text of an unknown code.
const UNKNOWN: &CStr = c"unknown fastlane journal status";

/// The meaning of `code` (a `fl_journal_status`) as a static, NUL-terminated string: never
/// NULL, never to be freed; an unknown code gives "unknown fastlane journal status". The
/// details of a particular failure are in `fl_journal_last_error`.
#[no_mangle]
pub extern "C" fn fl_journal_strerror(code: c_int) -> *const c_char {
    fl_journal_status::from_code(code).map_or(UNKNOWN, fl_journal_status::message).as_ptr()
}

/// The message of the last call on this thread that failed (a NUL-terminated string, empty if
/// none has): which OS error a connect met, why the service refused, which limit a record
/// exceeded. Successful calls leave it as it is, as `errno`. The pointer stays valid for the
/// life of the thread; the text changes at this thread's next failure, so copy it before
/// another call if it is needed later. Never NULL, never to be freed.
#[no_mangle]
pub extern "C" fn fl_journal_last_error() -> *const c_char {
    crate::last_error::as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct_negative_and_named() {
        let mut seen = std::collections::BTreeSet::new();
        for s in fl_journal_status::ALL {
            assert!(seen.insert(s.code()), "{s:?} reuses {}", s.code());
            assert_eq!(s.code() < 0, s != fl_journal_status::FL_JOURNAL_OK);
            assert_eq!(fl_journal_status::from_code(s.code()), Some(s));
            // SAFETY: strerror returns a static NUL-terminated string.
            let text = unsafe { CStr::from_ptr(fl_journal_strerror(s.code())) };
            assert_eq!(text, s.message());
        }
        // SAFETY: as above.
        let text = unsafe { CStr::from_ptr(fl_journal_strerror(12345)) };
        assert_eq!(text, UNKNOWN);
    }

    #[test]
    fn journal_errors_map_to_their_codes() {
        use fl_journal_status::*;
        assert_eq!(fl_journal_status::of(&JournalError::Full), FL_JOURNAL_FULL);
        let big = JournalError::TooLarge { len: 9, max: 8 };
        assert_eq!(fl_journal_status::of(&big), FL_JOURNAL_TOO_LARGE);
        assert_eq!(fl_journal_status::of(&JournalError::Closed), FL_JOURNAL_CLOSED);
        assert_eq!(fl_journal_status::of(&JournalError::ProducerFault), FL_JOURNAL_PRODUCER_FAULT);
        let late = JournalError::Timeout { seq: 2, durable: 1 };
        assert_eq!(fl_journal_status::of(&late), FL_JOURNAL_TIMEOUT);
        let io = JournalError::Io { op: "connect", source: std::io::Error::other("x") };
        assert_eq!(fl_journal_status::of(&io), FL_JOURNAL_IO);
        let odd = JournalError::BadControl { what: "x", value: 0 };
        assert_eq!(fl_journal_status::of(&odd), FL_JOURNAL_OTHER);
    }
}
