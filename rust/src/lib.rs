//! shardline's collective engine.
//!
//! Table of contents (bottom up; a module uses only the ones above it in this list):
//! - [`error`]: one error type; its kind says coarsely what went wrong.
//! - [`dtype`]: element types: the ones collectives move and reduce, and the ones shard files
//!   hold, with the names torch and safetensors give them.
//! - [`reduce`]: vectorisable reduction kernels (f16/bf16 accumulate in f32).
//! - [`signature`]: op signatures, compared across ranks before any data moves.
//! - [`wait`]: spin-then-futex waiting with deadlines.
//! - [`interrupt`]: a Python caller's signal handlers, run while its thread waits in an op.
//! - [`memcpy`]: copies into shared memory, with streaming stores where they pay.
//! - [`transport`]: bytes between ranks: the point-to-point interface, a shared-memory arena
//!   inside a host, framed and authenticated TCP between hosts.
//! - [`collectives`]: the algorithms (one-shot and chunked two-phase on the arena, ring and
//!   direct exchange over point-to-point links).
//! - [`engine`]: the communicator: its settings, op queue, worker thread, inline fast path,
//!   routing of each op to an algorithm, `Work`.
//! - [`kernels`]: compute the Python layer runs on CPU tensors (the 1-bit gradient codec).
//! - [`cuda_events`]: CUDA events made and read through the driver torch loaded (the
//!   tracer's GPU times, many events a call).
//! - [`shard`]: checkpoint shard files (safetensors-compatible, CRC32C-checked, optional
//!   zstd frames), written from and read into caller memory.
//! - `python` (feature `python`): the PyO3 bindings, the only code that knows Python.
//!
//! The engine reads no environment: every setting arrives as an argument ([`CommConfig`]).
#![deny(missing_docs)]

pub mod collectives;
pub mod cuda_events;
pub mod dtype;
pub mod engine;
pub mod error;
pub mod interrupt;
pub mod kernels;
pub mod memcpy;
pub mod reduce;
pub mod shard;
pub mod signature;
pub mod transport;
pub mod wait;

#[cfg(feature = "python")]
mod python;

pub use dtype::DType;
pub use engine::{CommConfig, Communicator, Work};
pub use error::{Error, ErrorKind, Result};
pub use reduce::ReduceOp;
pub use signature::{OpKind, OpSig};
