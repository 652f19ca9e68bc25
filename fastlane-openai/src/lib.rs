//! The OpenAI-compatible front end, without an engine: what `fastlane llm serve` (which adds
//! the engine, crate `fastlane-llm`) and `fastlane router` (a proxy before any
//! OpenAI-compatible server) share, and the router itself.
//!
//! - [`api`]: errors in OpenAI's shape (`{"error": {"message", "type", "code"}}`) with their
//!   status and `Retry-After`, the tenant of a bearer key, the body limit, the default
//!   `max_tokens` and the fence's final stream event.
//! - [`protocol`]: every request, response, stream chunk, usage and error as a type.
//! - [`tenants`]: the tenants file (keys, rate, burst, slots, tier, fence).
//! - [`gate`]: admission before dispatch: per-tenant token bucket and slots, a bounded wait,
//!   dispatch by deficit round robin with the interactive tier first.
//! - [`metrics`]: the front end's Prometheus families (TTFT, inter-token, end-to-end
//!   histograms per tenant, requests by outcome, open streams, queue depth).
//! - [`router`]: `fastlane router`'s proxy.
//!
//! It links neither the engine nor the swap tier: the gate needs only the scheduler's token
//! bucket and DRR (crate `fastlane-sched`, without its simulator).

pub mod api;
pub mod gate;
pub mod listen;
pub mod metrics;
pub mod protocol;
pub mod router;
pub mod tenants;

pub use api::ApiError;
pub use axum::http::Uri;
pub use axum::Router;
pub use listen::HttpArgs;
pub use metrics::{Metrics, TenantLatency};
pub use tenants::{Tenants, TenantsError};
