//! The compression side of the shard writer: worker threads compress frames (zstd, with
//! the per-tensor byte-shuffle decision made on each tensor's first frame) at most a window
//! ahead of the one thread that writes them, in order, at their reserved offsets.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};

use super::header::{Encoding, Frame, TensorEntry};
use super::writer::{Out, TensorData};
use super::{corrupt, shuffle};
use crate::error::Result;

/// One frame to compress.
pub(super) struct Job<'a> {
    pub(super) tensor: usize,
    pub(super) frame: usize,
    pub(super) raw: &'a [u8],
}

/// A compressed frame.
struct Packed {
    bytes: Vec<u8>,
    crc32c: u32,
}

#[derive(Default)]
pub(super) struct PoolState {
    /// Finished frames by job index, waiting for the writer.
    done: HashMap<usize, Result<Packed>>,
    /// Jobs written so far; workers stay within `window` jobs of it.
    written: usize,
    /// Set by the writer on failure, or by a worker that panics: everyone stops.
    failed: bool,
}

/// Compression workers feeding one in-order writer.
pub(super) struct Pool<'a> {
    pub(super) out: &'a Out<'a>,
    pub(super) tensors: &'a [TensorData<'a>],
    pub(super) jobs: &'a [Job<'a>],
    pub(super) level: i32,
    pub(super) next: AtomicUsize,
    pub(super) state: Mutex<PoolState>,
    pub(super) ready: Condvar,
    pub(super) window: usize,
    /// Per tensor: shuffle or not, decided on its first frame.
    pub(super) decisions: Vec<OnceLock<bool>>,
    /// Per tensor: the first frame, compressed while deciding.
    pub(super) first_frames: Vec<Mutex<Option<Result<Vec<u8>>>>>,
}

/// Marks the pool failed if a worker unwinds, so the writer does not wait forever.
struct PanicGuard<'a>(&'a Pool<'a>);

impl Drop for PanicGuard<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.lock().failed = true;
            self.0.ready.notify_all();
        }
    }
}

impl Pool<'_> {
    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A worker: takes jobs in order, at most `window` ahead of the writer.
    pub(super) fn work(&self) {
        let _guard = PanicGuard(self);
        let mut ctx = None;
        let mut scratch = Vec::new();
        loop {
            let j = self.next.fetch_add(1, Ordering::Relaxed);
            if j >= self.jobs.len() {
                return;
            }
            let mut st = self.lock();
            while !st.failed && j >= st.written + self.window {
                st = self.ready.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            if st.failed {
                return;
            }
            drop(st);
            let packed = self.pack(&self.jobs[j], &mut ctx, &mut scratch);
            self.lock().done.insert(j, packed);
            self.ready.notify_all();
        }
    }

    fn compress(
        &self,
        ctx: &mut Option<zstd::bulk::Compressor<'static>>,
        tensor: usize,
        bytes: &[u8],
    ) -> Result<Vec<u8>> {
        let name = &self.tensors[tensor].name;
        let fail = |e: std::io::Error| {
            corrupt(
                self.out.path,
                Some(name),
                format!("zstd compression failed: {e}"),
            )
        };
        if ctx.is_none() {
            *ctx = Some(zstd::bulk::Compressor::new(self.level).map_err(fail)?);
        }
        let Some(c) = ctx.as_mut() else {
            unreachable!("set above")
        };
        c.compress(bytes).map_err(fail)
    }

    fn compress_shuffled(
        &self,
        ctx: &mut Option<zstd::bulk::Compressor<'static>>,
        scratch: &mut Vec<u8>,
        tensor: usize,
        raw: &[u8],
    ) -> Result<Vec<u8>> {
        scratch.resize(raw.len(), 0);
        shuffle(raw, self.tensors[tensor].dtype.size(), scratch);
        self.compress(ctx, tensor, scratch)
    }

    /// Compresses one frame; a float tensor's first frame is tried both plain and shuffled,
    /// and the smaller result decides for the whole tensor.
    fn pack(
        &self,
        job: &Job<'_>,
        ctx: &mut Option<zstd::bulk::Compressor<'static>>,
        scratch: &mut Vec<u8>,
    ) -> Result<Packed> {
        let crc32c = crc32c::crc32c(job.raw);
        let t = job.tensor;
        let shuffled = if self.tensors[t].dtype.shuffles() {
            *self.decisions[t].get_or_init(|| {
                let first = &self.jobs[job_index_of_first(self.jobs, job)].raw;
                let plain = self.compress(ctx, t, first);
                let mixed = self.compress_shuffled(ctx, scratch, t, first);
                let (choice, bytes) = match (plain, mixed) {
                    (Ok(p), Ok(m)) if m.len() < p.len() => (true, Ok(m)),
                    (Ok(p), _) => (false, Ok(p)),
                    (Err(e), _) => (false, Err(e)),
                };
                *self.first_frames[t]
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = Some(bytes);
                choice
            })
        } else {
            false
        };
        if job.frame == 0 {
            let kept = self.first_frames[t]
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            if let Some(bytes) = kept {
                return bytes.map(|bytes| Packed { bytes, crc32c });
            }
        }
        let bytes = if shuffled {
            self.compress_shuffled(ctx, scratch, t, job.raw)?
        } else {
            self.compress(ctx, t, job.raw)?
        };
        Ok(Packed { bytes, crc32c })
    }

    /// The writer: frames in job order, each appended to its tensor's frame table.
    pub(super) fn write_all(&self, entries: &mut [TensorEntry], data_start: u64) -> Result<()> {
        let result = self.write_in_order(entries, data_start);
        if result.is_err() {
            self.lock().failed = true;
            self.ready.notify_all();
        }
        result
    }

    fn write_in_order(&self, entries: &mut [TensorEntry], data_start: u64) -> Result<()> {
        let mut pos = 0u64; // relative to the data section
        let mut j = 0usize;
        for entry in entries.iter_mut() {
            entry.begin = pos;
            let Encoding::Zstd { frames, .. } = &mut entry.encoding else {
                unreachable!("compressed entries were built above");
            };
            for frame in frames.iter_mut() {
                let packed = self.wait_for(j)?;
                self.out.write_at(&packed.bytes, data_start + pos)?;
                *frame = Frame {
                    offset: pos - entry.begin,
                    stored_len: packed.bytes.len() as u64,
                    raw_len: frame.raw_len,
                    crc32c: packed.crc32c,
                };
                pos += packed.bytes.len() as u64;
                j += 1;
                self.lock().written = j;
                self.ready.notify_all();
            }
            entry.end = pos;
        }
        Ok(())
    }

    fn wait_for(&self, j: usize) -> Result<Packed> {
        let mut st = self.lock();
        loop {
            if let Some(packed) = st.done.remove(&j) {
                return packed;
            }
            if st.failed {
                return Err(corrupt(
                    self.out.path,
                    None,
                    "internal error: a compression thread panicked",
                ));
            }
            st = self.ready.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Index in `jobs` of the first frame of `job`'s tensor (jobs are in tensor, frame order).
fn job_index_of_first(jobs: &[Job<'_>], job: &Job<'_>) -> usize {
    jobs.partition_point(|j| j.tensor < job.tensor)
}
