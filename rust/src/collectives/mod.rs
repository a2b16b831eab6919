//! Collective algorithms, over the transports below them.
//!
//! - [`arena`]: every collective on the shared-memory arena (one host): one-shot for small
//!   messages, chunked two-phase (reduce-scatter then all-gather through shared slots) for
//!   large ones, double-buffered so no extra barrier is needed.
//! - [`tuning`]: where all-reduce on the arena switches from one-shot to two-phase, measured
//!   on each communicator's own ranks by its first all-reduce.
//! - [`comm_threads`]: threads that split a rank's large memory passes on the arena when the
//!   machine has cores to spare (`SHARDLINE_COMM_THREADS`).
//! - [`ring`]: ring reduce-scatter / all-gather / all-reduce over any
//!   [`P2p`](crate::transport::p2p::P2p).
//! - [`direct`]: rooted ops, all-to-all and barrier over any
//!   [`P2p`](crate::transport::p2p::P2p).

pub mod arena;
pub mod comm_threads;
pub mod direct;
pub mod ring;
pub mod tuning;
