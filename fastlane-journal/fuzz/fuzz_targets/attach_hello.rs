//! Fuzzes the journal service's attach protocol: any bytes as a producer's hello (and as the
//! service's reply) either decode to a message that encodes back to itself or are refused;
//! never a panic (`fastlane_journal::fuzzing::check_hello`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    fastlane_journal::fuzzing::check_hello(data);
});
