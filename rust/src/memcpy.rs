//! Copies into shared memory that another core reads next: streaming (non-temporal) stores.
//!
//! A plain copy leaves the destination lines dirty in this core's cache; the peer that reads
//! them next must fetch each line from that cache. When the two cores sit in different cache
//! domains (another CCX or socket, or vCPUs the host placed apart) that transfer is far slower
//! than DRAM. Streaming stores write around the cache, so the reader gets clean lines from
//! memory. Small copies stay ordinary: their lines are cheap to share and usually still hot.
//!
//! A large all-gather on symmetric memory streams too: it writes a whole output that no core
//! holds, which ordinary stores would first read into the cache ([`StreamMode::gather_streams`]).

use std::cell::RefCell;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::reduce::{self, ReduceOp};

/// Below this many bytes a copy uses ordinary stores.
pub const STREAM_MIN_BYTES: usize = 256 * 1024;

/// Below this many bytes of output an all-gather on symmetric memory copies with ordinary
/// stores: a smaller output may still be in the caches when its rank reads it next (measured:
/// 8 ranks gathering 16 MiB from symmetric shards, then reading it once, took 4.1-9.0 ms
/// streamed against 3.6-4.3 plain; 64 MiB 22.9-30.6 against 23.4-27.6; 256 MiB 92-115
/// against 104-118).
pub const GATHER_STREAM_MIN_BYTES: usize = 64 << 20;

/// Below this many ranks an all-gather on symmetric memory copies with ordinary stores
/// ([`StreamMode::gather_streams`]).
pub const GATHER_STREAM_MIN_RANKS: usize = 4;

/// Which writes into shared memory stream past the cache; a setting of each communicator
/// (`SHARDLINE_STREAM_STORES` in Python).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StreamMode {
    /// `0`: ordinary stores everywhere.
    Off,
    /// `1`: a rank's input copied into its slot and its reduced part; large all-gathers on
    /// symmetric memory.
    All,
    /// `2` (default): the input copied into the slot, by an all-reduce that runs on one
    /// thread per rank (split over helper threads, copies stay ordinary), and large
    /// all-gathers on symmetric memory. Measured: on a 2-core VM whose
    /// vCPUs sit in different cache domains for minutes at a time a 2-rank 24 MiB
    /// all_reduce takes 8.5-9 ms instead of 12 ms (3.3 ms -> 4.1 ms while they share one);
    /// on a 32-core host within +-10 % of `Off` at 2-16 ranks.
    #[default]
    CopyIn,
}

impl StreamMode {
    /// Parses the setting's text: `"0"`, `"1"` or `"2"`.
    pub fn parse(text: &str) -> Result<Self> {
        match text {
            "0" => Ok(StreamMode::Off),
            "1" => Ok(StreamMode::All),
            "2" => Ok(StreamMode::CopyIn),
            other => Err(Error::invalid(format!(
                "stream_stores must be \"0\" (ordinary stores), \"1\" (stream inputs and \
                 reduced parts) or \"2\" (stream the inputs of single-threaded all_reduces), \
                 got {other:?}"
            ))),
        }
    }

    /// The setting's text for this mode.
    pub fn name(self) -> &'static str {
        match self {
            StreamMode::Off => "0",
            StreamMode::All => "1",
            StreamMode::CopyIn => "2",
        }
    }

    /// Whether a copy of `bytes` into shared memory streams (the mode allows it, and it is
    /// large).
    pub fn streams_to_shared(self, bytes: usize) -> bool {
        bytes >= STREAM_MIN_BYTES && self != StreamMode::Off
    }

    /// Whether an all-gather on symmetric memory of `ranks` ranks whose output is `bytes` long
    /// streams what it copies from the peers into it (any mode but `Off`, from
    /// [`GATHER_STREAM_MIN_BYTES`] and [`GATHER_STREAM_MIN_RANKS`]).
    ///
    /// Those copies write most of a large output that no core holds: ordinary stores first
    /// read each line into the cache. Measured on a 16-core host (ordinary / streamed):
    /// 8 ranks, 256 MiB 59-71 / 49-51 ms, 64 MiB 13.4-17.0 / 12.4-12.9 ms; 16 ranks, 256 MiB
    /// 83 / 56-58 ms; 4 ranks, 256 MiB 31-41 / 28-30 ms, 64 MiB 5.9-8.5 / 5.0-5.3 ms. With 2
    /// ranks it gained nothing there (256 MiB 36-41 / 37-42 ms) and lost on a 2-core VM
    /// (256 MiB 24-30 / 31-33 ms), so it starts at 4. The
    /// symmetric all-reduce's write-out, which the peers read next, got slower streamed (8
    /// ranks, 256 MiB in 69-90 ms instead of 55-60), so it stays ordinary.
    pub fn gather_streams(self, bytes: usize, ranks: usize) -> bool {
        bytes >= GATHER_STREAM_MIN_BYTES
            && ranks >= GATHER_STREAM_MIN_RANKS
            && self != StreamMode::Off
    }

    /// Whether a reduction of `bytes` into shared memory streams its output.
    pub fn reduction_streams_to_shared(self, bytes: usize) -> bool {
        bytes >= STREAM_MIN_BYTES && self == StreamMode::All
    }
}

/// `dst.copy_from_slice(src)`, with streaming stores when `stream` (on x86-64; decide it for
/// the whole copy with [`StreamMode::streams_to_shared`], whatever piece of it this is).
///
/// A streamed copy ends with a store fence, so a release store after it (a phase signal)
/// orders after the data.
pub fn copy_piece_to_shared(dst: &mut [u8], src: &[u8], stream: bool) {
    if stream {
        stream_to_shared(dst, src);
    } else {
        dst.copy_from_slice(src);
    }
}

/// Bytes reduced into a cache-resident scratch buffer before they are streamed out.
const REDUCE_BLOCK: usize = 64 * 1024;

/// `reduce_slices(dst, srcs, ..)` where `dst` is shared memory a peer reads next. With
/// `stream` (decide it for the whole reduction with
/// [`StreamMode::reduction_streams_to_shared`]), the output is reduced block by block into a
/// scratch buffer that stays in cache, then streamed to `dst`.
pub fn reduce_piece_to_shared(
    dst: &mut [u8],
    srcs: &[&[u8]],
    dtype: DType,
    op: ReduceOp,
    stream: bool,
) {
    if !stream {
        reduce::reduce_slices(dst, srcs, dtype, op);
    } else {
        reduce_streamed(dst, srcs, dtype, op);
    }
}

fn reduce_streamed(dst: &mut [u8], srcs: &[&[u8]], dtype: DType, op: ReduceOp) {
    thread_local! {
        static SCRATCH: RefCell<Vec<u8>> = RefCell::new(vec![0u8; REDUCE_BLOCK]);
    }
    let block = REDUCE_BLOCK - REDUCE_BLOCK % (dtype.size() * 64);
    SCRATCH.with_borrow_mut(|scratch| {
        let mut off = 0;
        let mut parts: Vec<&[u8]> = Vec::with_capacity(srcs.len());
        while off < dst.len() {
            let len = block.min(dst.len() - off);
            parts.clear();
            parts.extend(srcs.iter().map(|s| &s[off..off + len]));
            reduce::reduce_slices(&mut scratch[..len], &parts, dtype, op);
            stream_to_shared(&mut dst[off..off + len], &scratch[..len]);
            off += len;
        }
    });
}

/// `dst.copy_from_slice(src)` with streaming stores whatever the size (x86-64).
pub fn stream_to_shared(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "stream_to_shared: length mismatch");
    // SAFETY: SSE2 is part of the x86-64 baseline, so the intrinsics exist on every x86-64
    // CPU; `stream_copy` only touches `dst[..len]` and `src[..len]` (equal lengths, asserted
    // above) and the two slices cannot overlap (one is borrowed mutably).
    #[cfg(target_arch = "x86_64")]
    unsafe {
        stream_copy(dst, src);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    let n = dst.len();
    let head = dst.as_ptr().align_offset(16).min(n);
    dst[..head].copy_from_slice(&src[..head]);
    let end = head + (n - head) / 64 * 64;
    let d = dst.as_mut_ptr();
    let s = src.as_ptr();
    let mut i = head;
    while i < end {
        // SAFETY: i + 64 <= end <= n, so both 64-byte ranges lie inside the slices;
        // d + i is 16-byte aligned (head aligned it and i advances by 64); loads are unaligned.
        unsafe {
            let sp = s.add(i).cast::<__m128i>();
            let dp = d.add(i).cast::<__m128i>();
            let (a, b) = (_mm_loadu_si128(sp), _mm_loadu_si128(sp.add(1)));
            let (c, e) = (_mm_loadu_si128(sp.add(2)), _mm_loadu_si128(sp.add(3)));
            _mm_stream_si128(dp, a);
            _mm_stream_si128(dp.add(1), b);
            _mm_stream_si128(dp.add(2), c);
            _mm_stream_si128(dp.add(3), e);
        }
        i += 64;
    }
    dst[end..].copy_from_slice(&src[end..]);
    // SAFETY: a fence has no memory-safety preconditions; it orders the streaming stores
    // before any later store (the signal that tells peers the data is there).
    unsafe { _mm_sfence() };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_large_gathers_of_four_ranks_or_more_stream() {
        let big = GATHER_STREAM_MIN_BYTES;
        for mode in [StreamMode::CopyIn, StreamMode::All] {
            assert!(mode.gather_streams(big, 4) && mode.gather_streams(big << 4, 16));
            assert!(!mode.gather_streams(big - 1, 8), "below the size");
            assert!(!mode.gather_streams(big, 2), "two ranks");
        }
        assert!(!StreamMode::Off.gather_streams(big, 8));
    }

    #[test]
    fn streamed_reduction_equals_the_plain_one() {
        let n = REDUCE_BLOCK * 2 + 4 * 1000; // two whole blocks and a ragged tail
        let a: Vec<u8> = (0..n / 4)
            .flat_map(|i| (i as f32 * 0.5).to_le_bytes())
            .collect();
        let b: Vec<u8> = (0..n / 4)
            .flat_map(|i| (1.0 - i as f32).to_le_bytes())
            .collect();
        let mut want = vec![0u8; n];
        reduce::reduce_slices(&mut want, &[&a, &b], DType::F32, ReduceOp::Sum);
        let mut got = vec![0u8; n];
        reduce_streamed(&mut got, &[&a, &b], DType::F32, ReduceOp::Sum);
        assert_eq!(got, want);
    }

    #[test]
    fn copies_every_byte_at_any_alignment_and_length() {
        let src: Vec<u8> = (0..(STREAM_MIN_BYTES * 2 + 77))
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        for (off, len) in [
            (0, STREAM_MIN_BYTES),
            (3, STREAM_MIN_BYTES + 5),
            (17, src.len() - 17),
            (1, 10),
        ] {
            let mut dst = vec![0u8; len + 64];
            copy_piece_to_shared(
                &mut dst[off..off + len],
                &src[..len],
                StreamMode::default().streams_to_shared(len),
            );
            assert_eq!(&dst[off..off + len], &src[..len]);
            assert!(dst[..off].iter().all(|&b| b == 0) && dst[off + len..].iter().all(|&b| b == 0));
        }
    }
}
