//! Bytes between ranks: a shared-memory arena inside a host, framed and authenticated TCP
//! between hosts.

pub mod auth;
mod connect;
pub mod frame;
pub mod shm;
mod sockio;
pub mod tcp;
