//! Fuzz the virtio-blk request parser: arbitrary descriptor chains over guest memory with two
//! adjacent regions and a hole. `parse_one` asserts the parser's promises (segments inside one
//! region, lengths, ranges, a status byte whenever one is reported).
//!
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run request fuzz/corpus/request` (from
//! `fastlane-vhost-blk/`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    fastlane_vhost_blk::request::fuzzing::parse_one(data);
});
