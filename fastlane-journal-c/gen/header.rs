//! Writes `include/fastlane_journal.h` from this crate's source with cbindgen (a library call:
//! no cbindgen command to install). Shared by `examples/gen-header.rs`, which writes the
//! file, and `tests/header.rs`, which checks the checked-in copy against it.

use std::path::PathBuf;

/// The crate's directory.
pub fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Where the checked-in header lives.
pub fn header_path() -> PathBuf {
    crate_dir().join("include").join("fastlane_journal.h")
}

/// The header as this source gives it. Parses `src/lib.rs` and the modules it declares
/// (`with_src`: no `cargo metadata`, so it runs offline and while cargo holds its locks).
pub fn generate() -> Result<String, String> {
    let dir = crate_dir();
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml"))?;
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src").join("lib.rs"))
        .generate()
        .map_err(|e| format!("cbindgen: {e}"))?;
    let mut out = Vec::new();
    bindings.write(&mut out);
    String::from_utf8(out).map_err(|e| format!("cbindgen wrote something not UTF-8: {e}"))
}
