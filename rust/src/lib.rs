//! shardline's collective engine.
//!
//! Table of contents (bottom up):
//! - [`error`]: one error type whose kinds map onto Python's exception hierarchy.
//! - [`dtype`]: element types the engine moves and reduces.
//! - [`reduce`]: vectorisable reduction kernels (f16/bf16 accumulate in f32).
//! - [`op`]: collective signatures, compared across ranks before any data moves.
//! - [`wait`]: spin-then-futex waiting with deadlines.
//! - [`transport`]: bytes between ranks: a shared-memory arena inside a host, framed and
//!   authenticated TCP between hosts.
//! - [`collectives`]: the algorithms (one-shot and chunked two-phase on the arena, ring and
//!   direct exchange over TCP, hierarchical across hosts).
//! - [`engine`]: the communicator: op queue, worker thread, inline fast path, `Work`.
//! - [`shard`]: checkpoint shard files (safetensors-compatible, CRC32C-checked, optional
//!   zstd frames), written from and read into caller memory.
//! - `python` (feature `python`): the PyO3 bindings, the only code that knows Python.
#![deny(missing_docs)]

pub mod collectives;
pub mod dtype;
pub mod engine;
pub mod error;
pub mod memcpy;
pub mod op;
pub mod reduce;
pub mod shard;
pub mod transport;
pub mod wait;

#[cfg(feature = "python")]
mod python;

pub use dtype::DType;
pub use engine::{CommConfig, Communicator, Work};
pub use error::{Error, ErrorKind, Result};
pub use op::{OpKind, OpSig};
pub use reduce::ReduceOp;
