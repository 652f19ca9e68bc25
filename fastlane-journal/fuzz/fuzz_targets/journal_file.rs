//! Fuzzes recovery and `fastlane journal verify` on a corrupt or hostile journal file: any
//! bytes as the file image are scanned and verified without a panic, and what they report
//! stays inside the image (`fastlane_journal::fuzzing::check_image`). The seed corpus holds
//! real journals, so the fuzzer starts from valid superblocks and frames.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    fastlane_journal::fuzzing::check_image(data);
});
