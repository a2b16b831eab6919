//! Checkpoint shard files: one per rank, safetensors-compatible, checksummed, optionally zstd.
//!
//! # Layout
//!
//! | bytes | content |
//! |---|---|
//! | 0..8 | header length `n`, u64 little-endian |
//! | 8..8+n | JSON header, padded with spaces so the data section starts on a 4096 boundary |
//! | 8+n.. | the data section: every tensor's stored bytes, back to back in the caller's order |
//!
//! The JSON header is a safetensors header: `{name: {"dtype", "shape", "data_offsets"}}` plus
//! `"__metadata__"` (string to string). Under the metadata key `"shardline"` ([`META_KEY`]) it
//! holds one JSON string with what safetensors has no place for:
//!
//! ```json
//! {"version": 1, "chunk_bytes": 4194304, "tensors": {
//!    "plain.weight": {"crc32c": [123, 456]},
//!    "zipped.weight": {"dtype": "F32", "shape": [1024, 1024], "shuffle": true,
//!                      "frames": [[0, 3900000, 4194304, 789]]}}}
//! ```
//!
//! - An **uncompressed** tensor is stored as safetensors stores it, so a file without
//!   compressed tensors is a valid safetensors file; `crc32c` lists the CRC32C of each
//!   `chunk_bytes` chunk of its bytes.
//! - A **compressed** tensor is listed with dtype [`COMPRESSED_DTYPE`] and shape
//!   `[stored_bytes]` (so plain safetensors readers fail loudly instead of returning zstd
//!   bytes); its real dtype and shape, whether its float bytes were shuffled (byte planes, see
//!   [`shuffle`]) and its frame table `[offset_in_tensor_data, compressed_len, raw_len,
//!   crc32c_of_raw]` live in the `"shardline"` entry. Frame `i` holds raw bytes
//!   `[i * chunk_bytes, min((i + 1) * chunk_bytes, raw_bytes))`, so any byte range is found
//!   without a search and decoded frame by frame.
//!
//! Checksums reach the header by reserving room for it: the writer sizes the header with
//! every number at its largest possible width (CRCs as `u32::MAX`, compressed sizes as the
//! zstd bound), streams the data after that space while computing checksums, then writes the
//! real header in front, padded with spaces. Tensor memory is read once.
//!
//! Files without a `"shardline"` key (foreign safetensors files) are readable; they have no
//! checksums, so reading them with `verify` fails and asks for `verify=False`.

mod encode;
pub mod header;
mod pool;
pub mod reader;
pub mod writer;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::error::{Error, ErrorKind, Result};

pub use header::{Encoding, Frame, ShardHeader, TensorEntry, COMPRESSED_DTYPE, META_KEY};
pub use reader::{read_header, ShardReader, ShardView};
pub use writer::{write_shard, TensorData, WriteOptions, WriteReport, WrittenTensor};

/// The data section starts at a multiple of this (O_DIRECT and GPUDirect Storage friendly).
pub const DATA_ALIGN: u64 = 4096;
/// Largest JSON header read or written: safetensors' own limit (100 MB, under 100 MiB).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;
/// Largest `chunk_bytes` (and so the largest frame one read decodes at once): 1 GiB.
pub const MAX_CHUNK_BYTES: u64 = 1 << 30;
/// Default checksum chunk and compression frame size: 4 MiB.
pub const DEFAULT_CHUNK_BYTES: u64 = 4 << 20;
/// Version of the `"shardline"` metadata this code writes and reads.
pub const FORMAT_VERSION: u64 = 1;

/// A [`ErrorKind::Checkpoint`] error naming the file and, if any, the tensor.
pub(crate) fn corrupt(path: &str, tensor: Option<&str>, what: impl std::fmt::Display) -> Error {
    let message = match tensor {
        Some(name) => format!("checkpoint shard {path}: tensor {name:?}: {what}"),
        None => format!("checkpoint shard {path}: {what}"),
    };
    Error::new(ErrorKind::Checkpoint, message)
}

/// A failed system call on a shard file, as a checkpoint error.
pub(crate) fn io_error(path: &str, doing: &str, err: std::io::Error) -> Error {
    Error::new(
        ErrorKind::Checkpoint,
        format!("checkpoint shard {path}: {doing} failed: {err}"),
    )
}

/// Number of `chunk`-byte chunks in `len` bytes (the last one may be short).
pub(crate) fn chunk_count(len: u64, chunk: u64) -> u64 {
    len.div_ceil(chunk)
}

/// The thread count to use: `threads`, or the machine's parallelism for 0.
pub(crate) fn resolve_threads(threads: usize) -> usize {
    if threads > 0 {
        return threads;
    }
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Byte-plane shuffle: for elements of `size` bytes, writes all byte 0s, then all byte 1s,
/// and so on, into `dst` (same length as `src`). Trailing bytes that do not fill an element
/// are copied unchanged. Float exponents land in one plane, which zstd compresses well.
pub fn shuffle(src: &[u8], size: usize, dst: &mut [u8]) {
    assert_eq!(src.len(), dst.len(), "shuffle: lengths differ");
    match size {
        2 => transpose::<2>(src, dst, true),
        4 => transpose::<4>(src, dst, true),
        8 => transpose::<8>(src, dst, true),
        _ => dst.copy_from_slice(src),
    }
}

/// Inverse of [`shuffle`].
pub fn unshuffle(src: &[u8], size: usize, dst: &mut [u8]) {
    assert_eq!(src.len(), dst.len(), "unshuffle: lengths differ");
    match size {
        2 => transpose::<2>(src, dst, false),
        4 => transpose::<4>(src, dst, false),
        8 => transpose::<8>(src, dst, false),
        _ => dst.copy_from_slice(src),
    }
}

/// Elements of `S` bytes to byte planes (`forward`) or back.
fn transpose<const S: usize>(src: &[u8], dst: &mut [u8], forward: bool) {
    let n = src.len() / S;
    let body = n * S;
    dst[body..].copy_from_slice(&src[body..]);
    if n == 0 {
        return;
    }
    if forward {
        let mut planes = dst[..body].chunks_exact_mut(n);
        let outs: [&mut [u8]; S] = std::array::from_fn(|_| planes.next().unwrap_or_default());
        for (i, el) in src[..body].chunks_exact(S).enumerate() {
            for b in 0..S {
                outs[b][i] = el[b];
            }
        }
    } else {
        let mut planes = src[..body].chunks_exact(n);
        let ins: [&[u8]; S] = std::array::from_fn(|_| planes.next().unwrap_or_default());
        for (i, el) in dst[..body].chunks_exact_mut(S).enumerate() {
            for b in 0..S {
                el[b] = ins[b][i];
            }
        }
    }
}

/// Runs `work` on every job across up to `threads` scoped threads, each with its own state
/// from `init` (scratch buffers, codec contexts). Stops early after a failure and returns
/// the error of the earliest failing job seen.
pub(crate) fn for_each_parallel<J, S>(
    jobs: Vec<J>,
    threads: usize,
    init: impl Fn() -> Result<S> + Sync,
    work: impl Fn(&mut S, J) -> Result<()> + Sync,
) -> Result<()>
where
    J: Send,
{
    let threads = threads.clamp(1, jobs.len().max(1));
    if threads == 1 {
        let mut state = init()?;
        return jobs.into_iter().try_for_each(|j| work(&mut state, j));
    }
    let queue = Mutex::new(jobs.into_iter().enumerate());
    let failed = AtomicBool::new(false);
    let first_error: Mutex<Option<(usize, Error)>> = Mutex::new(None);
    let record = |index: usize, err: Error| {
        failed.store(true, Ordering::Relaxed);
        let mut slot = first_error.lock().unwrap_or_else(|e| e.into_inner());
        if slot.as_ref().is_none_or(|(earliest, _)| index < *earliest) {
            *slot = Some((index, err));
        }
    };
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                let mut state = match init() {
                    Ok(s) => s,
                    Err(e) => return record(0, e),
                };
                while !failed.load(Ordering::Relaxed) {
                    let next = queue.lock().unwrap_or_else(|e| e.into_inner()).next();
                    let Some((index, job)) = next else { break };
                    if let Err(e) = work(&mut state, job) {
                        record(index, e);
                    }
                }
            });
        }
    });
    match first_error.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some((_, err)) => Err(err),
        None => Ok(()),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Deterministic pseudo-random bytes (xorshift64*), for tests.
    pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x >> 12;
                x ^= x << 25;
                x ^= x >> 27;
                (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8
            })
            .collect()
    }

    #[test]
    fn shuffle_round_trips_with_tails() {
        for size in [1, 2, 4, 8] {
            for len in [0, 1, 7, 8, 9, 64, 1001] {
                let src = random_bytes(len, len as u64 + size as u64);
                let mut mid = vec![0; len];
                let mut back = vec![0; len];
                shuffle(&src, size, &mut mid);
                unshuffle(&mid, size, &mut back);
                assert_eq!(back, src, "size {size} len {len}");
            }
        }
    }

    #[test]
    fn shuffle_groups_byte_planes() {
        let src = [1u8, 2, 3, 4, 5, 6, 7, 8, 9];
        let mut dst = [0u8; 9];
        shuffle(&src, 4, &mut dst);
        assert_eq!(dst, [1, 5, 2, 6, 3, 7, 4, 8, 9]);
    }

    #[test]
    fn parallel_reports_the_earliest_failure() {
        let jobs: Vec<usize> = (0..100).collect();
        let err = for_each_parallel(
            jobs,
            4,
            || Ok(()),
            |_, j| {
                if j == 10 {
                    Err(Error::invalid("ten"))
                } else {
                    Ok(())
                }
            },
        )
        .unwrap_err();
        assert_eq!(err.message, "ten");
        assert!(for_each_parallel(vec![1, 2, 3], 0, || Ok(()), |_, _| Ok(())).is_ok());
    }
}
