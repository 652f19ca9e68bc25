//! Fuzzes the tenants file: any text is a tenant table whose every value the servers can use
//! (durations within the clock's range, scheduler configurations), or an error naming the
//! field; never a panic.
#![no_main]

use fastlane_openai::Tenants;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(t) = Tenants::parse(text) else { return };
    let _ = t.sched_configs();
    for e in t.entries() {
        if let Some(s) = e.max_stream_seconds {
            let fence = std::time::Duration::from_secs_f64(s);
            assert!(std::time::Instant::now().checked_add(fence).is_some());
        }
    }
});
