//! Any bytes as an ITCH feed into the order book and the BTreeMap reference model: they agree
//! after every message and nothing panics. Run: `cargo fuzz run book` in fastlane-fpga/.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| fastlane_market::fuzzing::check_book(data));
