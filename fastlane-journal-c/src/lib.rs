//! The C API of the journal service's producer: `libfastlane_journal.so` / `.a` and
//! `include/fastlane_journal.h`, so that C and C++ processes attach to a running
//! [`journal::service::Service`] and append at the cost a Rust producer pays.
//!
//! Every function is a thin wrapper over one [`journal::JournalProducer`] call behind an
//! opaque handle ([`fl_journal_producer`]): `fl_journal_append` is the producer's `append`
//! (a copy into the shared ring: no allocation, no lock, no syscall) plus a NULL check and a
//! panic guard. Results are `int` codes of [`fl_journal_status`] (0 or negative);
//! `fl_journal_strerror` names a code and `fl_journal_last_error` holds the message of this
//! thread's last failure (the text of a refused attach, an OS error).
//!
//! What this crate does not do: run the service (that is `fastlane journal serve` or
//! [`journal::service::Service`]), read records back, or let two threads use one handle at
//! once (one handle per thread; a handle may move between threads). The header is generated
//! from this source by cbindgen (`cargo run -p fastlane-journal-c --example gen-header`) and
//! `tests/header.rs` fails when the checked-in copy differs. See `docs/journal-c.md`.

mod last_error;
mod producer;
mod status;

pub use producer::{
    fl_journal_append, fl_journal_append_blocking, fl_journal_close, fl_journal_connect,
    fl_journal_connect_with, fl_journal_durable_seq, fl_journal_max_record_bytes,
    fl_journal_producer, fl_journal_producer_id, fl_journal_wait_durable,
};
pub use status::{fl_journal_last_error, fl_journal_status, fl_journal_strerror};
