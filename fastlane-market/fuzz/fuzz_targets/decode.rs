//! Any bytes as an ITCH feed: the decoder never panics, accounts for every message, and what
//! it decodes re-encodes to the same bytes. Run: `cargo fuzz run decode` in fastlane-fpga/.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| fastlane_market::fuzzing::check_decoder(data));
