//! Compute kernels the Python layer runs on CPU tensors, outside any collective.
//!
//! - [`openmp`]: parallel loops on the OpenMP threads torch runs (deterministic mode's kernels).
//! - [`onebit`]: the 1-bit gradient codec (signs plus a mean magnitude per block), with its
//!   error feedback fused into the encoding pass.
//! - [`optim`]: Adam, AdamW and SGD steps over float32 buffers (optimizer state on the CPU).
//! - [`tree`]: the canonical tree sum of deterministic mode.
//! - [`unit_products`]: a linear layer's weight gradient per unit of the batch, and their
//!   tree sum (deterministic mode).
//! - [`unit_lookups`]: an embedding's lookups added onto a tied weight's per-unit products.
//! - [`unit_rows`]: per-unit sums over rows for biases and layer norms (deterministic mode).
//!
//! Kernels take little-endian bytes, like [`crate::reduce`], and split their work over a
//! rayon pool of the size the caller asks for ([`pool`]): the Python layer passes torch's
//! intra-op thread count, so a rank uses the cores it was given and no more. Deterministic
//! mode's kernels, which run between torch's operations in a backward, use torch's own OpenMP
//! threads instead ([`openmp`]).

pub mod onebit;
pub mod openmp;
pub mod optim;
pub mod tree;
pub mod unit_lookups;
pub mod unit_products;
pub mod unit_rows;

use std::sync::{Arc, Mutex};

/// A pool of `threads` threads (shared by every call asking for that many), or `None` for
/// one thread (the caller's) or when no thread can be started.
pub fn pool(threads: usize) -> Option<Arc<rayon::ThreadPool>> {
    static POOLS: Mutex<Vec<(usize, Arc<rayon::ThreadPool>)>> = Mutex::new(Vec::new());
    if threads <= 1 {
        return None;
    }
    let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, p)) = pools.iter().find(|(n, _)| *n == threads) {
        return Some(p.clone());
    }
    let built = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("sl-kernel-{i}"))
        .build()
        .ok()
        .map(Arc::new)?;
    pools.push((threads, built.clone()));
    Some(built)
}

/// Runs `f` on a pool of `threads` threads, or on the caller when that is one thread.
pub fn run<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    match pool(threads) {
        Some(p) => p.install(f),
        None => f(),
    }
}

/// `into[i] += from[i]`, with AVX2 where the CPU has it (each element one addition: the same
/// bits on every instruction set).
pub(crate) fn add_into(into: &mut [f32], from: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 support was just detected at runtime.
        return unsafe { add_into_avx2(into, from) };
    }
    add_into_plain(into, from);
}

#[inline(always)]
fn add_into_plain(into: &mut [f32], from: &[f32]) {
    for (x, y) in into.iter_mut().zip(from) {
        *x += *y;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn add_into_avx2(into: &mut [f32], from: &[f32]) {
    add_into_plain(into, from);
}

/// Whether two float slices hold the same bits, for the kernels' tests.
#[cfg(test)]
pub(crate) fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Deterministic values in [-0.5, 0.5) for the kernels' tests.
#[cfg(test)]
pub(crate) fn test_values(n: usize, seed: u32) -> Vec<f32> {
    let mut i = seed;
    (0..n)
        .map(|_| {
            i = i.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (i >> 9) as f32 / (1u32 << 23) as f32 - 0.5
        })
        .collect()
}
