//! ITCH decode and order book: fastlane-fpga against itchy (filled in below).
fn main() {}
