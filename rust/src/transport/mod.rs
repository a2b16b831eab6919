//! Bytes between ranks: a shared-memory arena inside a host, framed and authenticated TCP
//! between hosts.
//!
//! - [`p2p`]: the [`p2p::P2p`] interface: framed, signature-checked messages between two
//!   ranks, which the algorithms in [`crate::collectives`] use from above.
//! - [`tcp`]: the authenticated TCP mesh, which implements [`p2p::P2p`] (its sends read what
//!   reaches their rank while they wait for room: `tcp::draining`); [`frame`] and
//!   [`auth`] are its wire format and handshake.
//! - [`shm`]: the shared-memory arena of one host (slots, phase counters, signatures).

pub mod auth;
mod connect;
pub mod frame;
pub mod p2p;
pub mod shm;
mod sockio;
pub mod tcp;
