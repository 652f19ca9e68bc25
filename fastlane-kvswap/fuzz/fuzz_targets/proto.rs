//! Fuzzes the `fastlane kv serve` frame parser: any bytes either decode to a request that
//! re-encodes to the same frame, or are refused with a `ProtoError`; never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    fastlane_kvswap::proto::check_frame_model(data);
});
