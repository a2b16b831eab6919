//! Collective algorithms.
//!
//! - [`arena`]: every collective on the shared-memory arena (one host): one-shot for small
//!   messages, chunked two-phase (reduce-scatter then all-gather through shared slots) for
//!   large ones, double-buffered so no extra barrier is needed.
//! - [`p2p`]: the [`p2p::P2p`] trait: framed, signature-checked messages between two ranks.
//! - [`ring`]: ring reduce-scatter / all-gather / all-reduce over any [`p2p::P2p`].
//! - [`direct`]: rooted ops, all-to-all and barrier over any [`p2p::P2p`].

pub mod arena;
pub mod direct;
pub mod p2p;
pub mod ring;
