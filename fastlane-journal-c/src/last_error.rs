//! The message of the calling thread's last failure, in a fixed thread-local buffer: recording
//! it never allocates, so the failing hot path (`FL_JOURNAL_FULL`) stays allocation-free.

use std::cell::RefCell;
use std::ffi::c_char;
use std::fmt::Write as _;

/// Bytes of the buffer, the terminating NUL included; longer messages are cut (at a character
/// boundary).
const LAST_ERROR_BYTES: usize = 512;
/// Causes followed below an error (its `source()` chain), at most.
const SOURCES_MAX: usize = 8;

thread_local! {
    // Const-initialised and without a destructor: no lazy allocation, usable until the
    // thread ends.
    static LAST_ERROR: RefCell<[u8; LAST_ERROR_BYTES]> = const { RefCell::new([0; LAST_ERROR_BYTES]) };
}

/// Writes into the buffer, keeping the last byte for the NUL and cutting at a character
/// boundary.
struct Cursor<'a> {
    buf: &'a mut [u8; LAST_ERROR_BYTES],
    len: usize,
}

impl std::fmt::Write for Cursor<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let room = LAST_ERROR_BYTES - 1 - self.len;
        let mut take = s.len().min(room);
        while !s.is_char_boundary(take) {
            take -= 1;
        }
        self.buf[self.len..self.len + take].copy_from_slice(&s.as_bytes()[..take]);
        self.len += take;
        if take < s.len() {
            Err(std::fmt::Error)
        } else {
            Ok(())
        }
    }
}

/// Records `err` and its causes ("connect to the journal service failed: No such file or
/// directory (os error 2)") as this thread's last error.
pub(crate) fn set(err: &dyn std::error::Error) {
    record(|w| {
        write!(w, "{err}")?;
        let mut cause = err.source();
        for _ in 0..SOURCES_MAX {
            let Some(c) = cause else { break };
            write!(w, ": {c}")?;
            cause = c.source();
        }
        Ok(())
    });
}

/// Records a fixed message.
pub(crate) fn set_str(msg: &str) {
    record(|w| w.write_str(msg));
}

/// Records a formatted message (formatted straight into the buffer).
pub(crate) fn set_fmt(msg: std::fmt::Arguments<'_>) {
    record(|w| w.write_fmt(msg));
}

fn record(write: impl FnOnce(&mut Cursor<'_>) -> std::fmt::Result) {
    // `try_with`/`try_borrow_mut`: a thread being torn down, or a message written while one
    // is being written (a `Display` that fails in here), leaves the old text rather than
    // panicking.
    let _ = LAST_ERROR.try_with(|cell| {
        if let Ok(mut buf) = cell.try_borrow_mut() {
            let mut w = Cursor { buf: &mut buf, len: 0 };
            // A message cut short by the buffer is still a message.
            let _ = write(&mut w);
            let end = w.len;
            buf[end] = 0;
        }
    });
}

/// The buffer's address: a NUL-terminated string that lives as long as the thread (a static
/// empty string once the thread is being torn down).
pub(crate) fn as_ptr() -> *const c_char {
    LAST_ERROR.try_with(|cell| cell.as_ptr().cast::<c_char>().cast_const()).unwrap_or(c"".as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn last() -> String {
        // SAFETY: the buffer is NUL-terminated and lives as long as this thread.
        unsafe { CStr::from_ptr(as_ptr()) }.to_str().unwrap().to_string()
    }

    #[test]
    fn records_the_error_and_its_causes() {
        assert_eq!(last(), "");
        let e = journal::JournalError::Io {
            op: "connect to the journal service",
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        };
        set(&e);
        assert!(last().starts_with("connect to the journal service failed: "), "{}", last());
        set_str("short");
        assert_eq!(last(), "short");
    }

    #[test]
    fn long_messages_are_cut_at_a_character_boundary() {
        set_str(&"é".repeat(LAST_ERROR_BYTES));
        let text = last();
        assert!(text.len() < LAST_ERROR_BYTES && text.len() >= LAST_ERROR_BYTES - 3);
        assert!(text.chars().all(|c| c == 'é'));
    }
}
