//! Comm threads (`SHARDLINE_COMM_THREADS`): one rank's large memory passes on the arena, split.
//!
//! A rank's share of a large shared-memory collective is memory traffic: copy its input into
//! its slot, reduce its part from every slot, copy the results out. One core moves about
//! 10 GB/s; a many-core host moves several times that with more cores. When every rank has
//! cores to spare (the Python layer gives 4 threads to ranks with 4 cores each), each rank
//! splits every such pass of a blocking op over its comm threads (a rayon pool of its own per
//! communicator, started at the first large op). The phase protocol is unchanged: the passes
//! of one phase are split, joined, and only then is the phase posted, and nothing that ranks
//! must agree on (chunks, phases) depends on the split.
//!
//! The op runs on a pool thread (`ThreadPool::install`), so the splits inside it are cheap
//! fork-joins among the pool's threads. Each communicator has its own pool, and runs one op
//! at a time, so a thread that waits in a join can only pick up pieces of the same op.

use std::sync::{Arc, OnceLock};

use rayon::prelude::*;

/// Ops smaller than this run on the calling thread alone.
pub const DEFAULT_MIN_BYTES: usize = 1 << 20;

/// No piece of a split pass is smaller than this.
const MIN_PIECE: usize = 32 * 1024;

/// The helper threads of one communicator.
pub struct CommThreads {
    threads: usize,
    min_bytes: usize,
    name: String,
    pool: OnceLock<Option<Arc<rayon::ThreadPool>>>,
}

impl CommThreads {
    /// `threads` per rank (1: none) for ops of at least `min_bytes`; the threads are named
    /// `{name}-l{i}` (Linux keeps 15 bytes of a thread name: keep `name` short).
    pub fn new(threads: usize, min_bytes: usize, name: &str) -> Self {
        CommThreads {
            threads: threads.max(1),
            min_bytes,
            name: name.to_string(),
            pool: OnceLock::new(),
        }
    }

    /// Threads per rank.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The pool for an op of `bytes`, or `None` to run it on the caller.
    ///
    /// A pool that cannot be started (no threads left) leaves every op on the caller.
    pub fn pool_for(&self, bytes: usize) -> Option<Arc<rayon::ThreadPool>> {
        if self.threads <= 1 || bytes < self.min_bytes {
            return None;
        }
        self.pool
            .get_or_init(|| {
                let name = self.name.clone();
                rayon::ThreadPoolBuilder::new()
                    .num_threads(self.threads)
                    .thread_name(move |i| format!("{name}-l{i}"))
                    .build()
                    .ok()
                    .map(Arc::new)
            })
            .clone()
    }
}

/// Runs `f(offset, piece)` over `dst` cut into at most `ways` pieces (64-byte aligned, at
/// least 32 KiB), in parallel on the current rayon pool; with `ways <= 1`, once on all of it.
///
/// Call it with `ways > 1` only on a thread of a [`CommThreads`] pool.
pub fn split(dst: &mut [u8], ways: usize, f: impl Fn(usize, &mut [u8]) + Sync + Send) {
    debug_assert!(
        ways <= 1 || rayon::current_thread_index().is_some(),
        "comm_threads::split with {ways} ways outside a CommThreads pool"
    );
    let len = dst.len();
    if ways <= 1 || len < 2 * MIN_PIECE {
        f(0, dst);
        return;
    }
    let piece = len.div_ceil(ways).next_multiple_of(64).max(MIN_PIECE);
    dst.par_chunks_mut(piece)
        .enumerate()
        .for_each(|(i, d)| f(i * piece, d));
}

/// `kernel(dst, src)` over `dst` and the same bytes of `src`, cut as [`split`] cuts `dst`.
pub fn copy(
    dst: &mut [u8],
    src: &[u8],
    ways: usize,
    kernel: impl Fn(&mut [u8], &[u8]) + Sync + Send,
) {
    split(dst, ways, |a, d| kernel(d, &src[a..a + d.len()]));
}

/// `kernel(dst, srcs)` over `dst` and the same bytes of every source, cut as [`split`] cuts
/// `dst`.
pub fn reduce(
    dst: &mut [u8],
    srcs: &[&[u8]],
    ways: usize,
    kernel: impl Fn(&mut [u8], &[&[u8]]) + Sync + Send,
) {
    split(dst, ways, |a, d| {
        let pieces: Vec<&[u8]> = srcs.iter().map(|s| &s[a..a + d.len()]).collect();
        kernel(d, &pieces);
    });
}

/// Runs `f(i, region)` for every region, in parallel on the current pool when `ways > 1`.
pub fn each<T: Send>(regions: Vec<T>, ways: usize, f: impl Fn(usize, T) + Sync + Send) {
    debug_assert!(ways <= 1 || rayon::current_thread_index().is_some());
    if ways <= 1 {
        for (i, r) in regions.into_iter().enumerate() {
            f(i, r);
        }
    } else {
        regions
            .into_par_iter()
            .enumerate()
            .for_each(|(i, r)| f(i, r));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_covers_every_byte_once_in_aligned_pieces() {
        let pool = CommThreads::new(3, 0, "t").pool_for(1).expect("pool");
        for len in [0usize, 1, 100, MIN_PIECE * 2 - 1, MIN_PIECE * 2, 1_000_003] {
            for ways in [1, 2, 3, 7] {
                let mut buf = vec![0u8; len];
                pool.install(|| {
                    split(&mut buf, ways, |off, d| {
                        assert!(off % 64 == 0);
                        for (i, b) in d.iter_mut().enumerate() {
                            *b = b.wrapping_add(((off + i) % 251) as u8 + 1);
                        }
                    })
                });
                for (i, &b) in buf.iter().enumerate() {
                    assert_eq!(b, (i % 251) as u8 + 1, "len {len} ways {ways} byte {i}");
                }
            }
        }
    }

    #[test]
    fn no_pool_below_the_threshold_or_with_one_thread() {
        assert!(CommThreads::new(1, 0, "t").pool_for(1 << 30).is_none());
        let comm_threads = CommThreads::new(2, 1000, "t");
        assert!(comm_threads.pool_for(999).is_none());
        assert!(comm_threads.pool_for(1000).is_some());
    }
}
