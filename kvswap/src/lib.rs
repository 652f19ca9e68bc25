//! kvswap: the KV-cache swap tier of an inference scheduler, on FastLane's transport.
//!
//! Being built (modules land as they get real content): the paged KV block manager and swap
//! tiers (host, NVMe, remote), the asynchronous swap engine, the preemptive multi-tenant
//! scheduler (`sched`) and its simulator (`sim`).
