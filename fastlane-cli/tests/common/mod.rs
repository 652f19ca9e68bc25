//! Helpers shared by the integration tests (`mod common;` in each test file).

pub mod cli;
pub mod daemon;
pub mod http;
