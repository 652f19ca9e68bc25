//! Regenerates `include/fastlane_journal.h` from the crate's source:
//! `cargo run -p fastlane-journal-c --example gen-header`. Commit the result;
//! `tests/header.rs` fails while the checked-in header differs.

#[path = "../gen/header.rs"]
mod header;

fn main() -> std::process::ExitCode {
    let path = header::header_path();
    let written = header::generate().and_then(|text| {
        std::fs::write(&path, text).map_err(|e| format!("write {}: {e}", path.display()))
    });
    match written {
        Ok(()) => {
            println!("wrote {}", path.display());
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gen-header: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
