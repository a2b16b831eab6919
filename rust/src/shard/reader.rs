//! Reads shard files: a header validated once per open file, byte ranges of one tensor
//! through a memory map with their frames decoded in parallel, CRC32C checks on every chunk
//! touched. Large uncompressed pieces are read with `pread` straight into the caller's
//! buffer: a file evicted from the page cache then comes in as large requests (the disk's
//! speed), where faulting the mapping in reads it in readahead-sized steps.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use memmap2::{Advice, Mmap};

use super::header::{Encoding, Frame, ShardHeader, TensorEntry};
use super::{
    corrupt, for_each_parallel, io_error, resolve_threads, unshuffle, DEFAULT_CHUNK_BYTES,
};
use crate::error::{Error, Result};

/// Bytes copied then checksummed at a time (stays in L2 between the two).
const PIECE_BYTES: usize = 256 << 10;
/// Reads at least this large are split across threads.
const PARALLEL_BYTES: usize = 8 << 20;
/// Smallest share of a read or a verify that one thread takes.
const JOB_BYTES: u64 = 1 << 20;
/// Pieces at least this large have their pages mapped in one call before copying, or are
/// read with `pread` when the view has the file.
const POPULATE_BYTES: usize = 256 << 10;
/// Bytes read by one `pread` then checksummed (large requests, still warm in cache for the
/// checksum).
const READ_BYTES: usize = 1 << 20;

/// An open shard file: its mapping and validated header. Open it once and read from it as
/// often as needed, from any thread: the header is parsed and checked only here.
pub struct ShardReader {
    path: String,
    file: File,
    map: Mmap,
    header: Arc<ShardHeader>,
}

impl ShardReader {
    /// Opens and maps `path` and validates its header.
    pub fn open(path: &str) -> Result<Self> {
        let file = File::open(path).map_err(|e| io_error(path, "opening", e))?;
        // SAFETY: the mapping is read-only and shard files are written once, then only read
        // (writers create new files and commit by rename). Another process truncating the
        // file while it is mapped would make reads fault (SIGBUS), the known limit of every
        // mmap-based reader, safetensors included; modifying it in place would only change
        // bytes, which the checksums catch.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| io_error(path, "mapping", e))?;
        let header = Arc::new(ShardHeader::parse(path, &map)?);
        Ok(ShardReader {
            path: path.to_owned(),
            file,
            map,
            header,
        })
    }

    /// The validated header.
    pub fn header(&self) -> &ShardHeader {
        &self.header
    }

    /// The path the file was opened at.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// A borrowed view for reads.
    pub fn view(&self) -> ShardView<'_> {
        ShardView {
            path: &self.path,
            header: &self.header,
            bytes: &self.map,
            map: Some(&self.map),
            file: Some(&self.file),
        }
    }
}

/// The header of `path`, validated.
pub fn read_header(path: &str) -> Result<Arc<ShardHeader>> {
    ShardReader::open(path).map(|r| r.header)
}

/// A shard's bytes and header, borrowed: what reads and checks run on.
#[derive(Clone, Copy)]
pub struct ShardView<'a> {
    /// Names the file in errors.
    pub path: &'a str,
    /// Validated against `bytes`.
    pub header: &'a ShardHeader,
    /// The whole file.
    pub bytes: &'a [u8],
    /// The mapping behind `bytes`, if any: large reads prefault its pages in one call.
    pub map: Option<&'a Mmap>,
    /// The file behind `bytes`, if any: large plain pieces are read from it with `pread`.
    pub file: Option<&'a File>,
}

/// One chunk (plain) or frame (compressed) a read touches.
struct Piece<'o> {
    /// Chunk or frame number.
    index: usize,
    /// Raw offset of `dst[0]` in the tensor.
    offset: u64,
    /// Where its bytes go.
    dst: &'o mut [u8],
}

/// Per-thread decoding state.
#[derive(Default)]
struct Scratch {
    dctx: Option<zstd::bulk::Decompressor<'static>>,
    /// A decoded frame (byte planes when shuffled).
    decoded: Vec<u8>,
    /// An unshuffled frame.
    raw: Vec<u8>,
}

impl<'a> ShardView<'a> {
    fn entry(&self, name: &str) -> Result<&'a TensorEntry> {
        self.header.tensor(name).ok_or_else(|| {
            Error::invalid(format!(
                "checkpoint shard {}: no tensor named {name:?} (the file holds {} tensors)",
                self.path,
                self.header.tensors.len()
            ))
        })
    }

    /// Maps the pages of file bytes `[at, at + len)` ahead of a copy: one system call
    /// instead of a page fault per 64 KiB. Advice only; errors are ignored (an old kernel
    /// without `MADV_POPULATE_READ` just faults as usual).
    fn populate(&self, at: u64, len: usize) {
        if let Some(map) = self.map.filter(|_| len >= POPULATE_BYTES) {
            let _ = map.advise_range(Advice::PopulateRead, at as usize, len);
        }
    }

    fn stored(&self, t: &TensorEntry) -> &'a [u8] {
        let start = (self.header.data_start() + t.begin) as usize;
        &self.bytes[start..start + t.stored_bytes() as usize]
    }

    fn no_checksums(&self) -> Error {
        corrupt(
            self.path,
            None,
            "the file has no shardline checksums (a plain safetensors file); read it with \
             verify=False",
        )
    }

    fn chunk_bytes(&self) -> u64 {
        self.header.chunk_bytes.unwrap_or(DEFAULT_CHUNK_BYTES)
    }

    /// Copies raw bytes `[start, start + out.len())` of tensor `name` into `out`, decoding
    /// the frames it touches; with `verify`, checks the CRC32C of every chunk or frame
    /// touched (whole). Large reads run on `threads` threads (0 = the machine's
    /// parallelism). On error `out` holds unspecified bytes.
    pub fn read_range(
        &self,
        name: &str,
        start: u64,
        out: &mut [u8],
        verify: bool,
        threads: usize,
    ) -> Result<()> {
        let t = self.entry(name)?;
        let len = out.len() as u64;
        if start.checked_add(len).is_none_or(|end| end > t.raw_bytes) {
            return Err(Error::invalid(format!(
                "checkpoint shard {}: tensor {name:?}: bytes [{start}, {start} + {len}) lie \
                 outside its {} bytes",
                self.path, t.raw_bytes
            )));
        }
        if out.is_empty() {
            return Ok(());
        }
        if verify && self.header.chunk_bytes.is_none() {
            return Err(self.no_checksums());
        }
        let chunk = self.chunk_bytes();
        // Jobs of whole chunks, at least JOB_BYTES each, so tiny chunks make few jobs.
        let jobs: Vec<Piece<'_>> = pieces(start, out, job_span(chunk)).collect();
        let threads = if len >= PARALLEL_BYTES as u64 && jobs.len() > 1 {
            resolve_threads(threads)
        } else {
            1
        };
        for_each_parallel(
            jobs,
            threads,
            || Ok(Scratch::default()),
            |s, job| {
                pieces(job.offset, job.dst, chunk)
                    .try_for_each(|piece| self.read_piece(t, piece, verify, s))
            },
        )
    }

    fn read_piece(
        &self,
        t: &TensorEntry,
        p: Piece<'_>,
        verify: bool,
        s: &mut Scratch,
    ) -> Result<()> {
        let stored = self.stored(t);
        match &t.encoding {
            Encoding::Plain { crc32c } => {
                let at = p.offset as usize;
                let src = &stored[at..at + p.dst.len()];
                let file_at = self.header.data_start() + t.begin + p.offset;
                if let Some(file) = self.file.filter(|_| p.dst.len() >= POPULATE_BYTES) {
                    return self.pread_piece(file, t, crc32c, p, file_at, verify);
                }
                self.populate(file_at, src.len());
                if !verify {
                    p.dst.copy_from_slice(src);
                    return Ok(());
                }
                let (begin, end) = self.chunk_span(t, p.index);
                let got = if begin == p.offset && end - begin == p.dst.len() as u64 {
                    copy_and_checksum(src, p.dst)
                } else {
                    p.dst.copy_from_slice(src);
                    crc32c::crc32c(&stored[begin as usize..end as usize])
                };
                self.check(t, "chunk", p.index, (begin, end), crc32c.get(p.index), got)
            }
            Encoding::Zstd { shuffle, frames } => {
                let frame = frames[p.index];
                let (begin, end) = self.chunk_span(t, p.index);
                let whole = begin == p.offset && end - begin == p.dst.len() as u64;
                if whole && !shuffle {
                    self.decode(t, p.index, frame, stored, p.dst, s)?;
                    if verify {
                        let got = crc32c::crc32c(p.dst);
                        return self.check(
                            t,
                            "frame",
                            p.index,
                            (begin, end),
                            Some(&frame.crc32c),
                            got,
                        );
                    }
                    return Ok(());
                }
                let raw = self.decode_to_scratch(t, p.index, frame, *shuffle, s)?;
                let at = (p.offset - begin) as usize;
                p.dst.copy_from_slice(&raw[at..at + p.dst.len()]);
                if verify {
                    let got = crc32c::crc32c(raw);
                    return self.check(t, "frame", p.index, (begin, end), Some(&frame.crc32c), got);
                }
                Ok(())
            }
        }
    }

    /// [`Self::read_piece`] of a large plain piece: `pread` into `p.dst` (file bytes from
    /// `file_at`), checksummed as it arrives when the piece is a whole chunk.
    fn pread_piece(
        &self,
        file: &File,
        t: &TensorEntry,
        crc32c: &[u32],
        p: Piece<'_>,
        file_at: u64,
        verify: bool,
    ) -> Result<()> {
        let (begin, end) = self.chunk_span(t, p.index);
        let whole = begin == p.offset && end - begin == p.dst.len() as u64;
        let mut crc = 0;
        let mut pos = file_at;
        for part in p.dst.chunks_mut(READ_BYTES) {
            file.read_exact_at(part, pos)
                .map_err(|e| io_error(self.path, "reading", e))?;
            if verify && whole {
                crc = crc32c::crc32c_append(crc, part);
            }
            pos += part.len() as u64;
        }
        if !verify {
            return Ok(());
        }
        if !whole {
            // Part of a chunk: check the whole chunk, as the mapped path does.
            crc = crc32c::crc32c(&self.stored(t)[begin as usize..end as usize]);
        }
        self.check(t, "chunk", p.index, (begin, end), crc32c.get(p.index), crc)
    }

    /// Raw byte span of chunk `index` of `t`.
    fn chunk_span(&self, t: &TensorEntry, index: usize) -> (u64, u64) {
        let chunk = self.chunk_bytes();
        let begin = index as u64 * chunk;
        (begin, (begin + chunk).min(t.raw_bytes))
    }

    fn check(
        &self,
        t: &TensorEntry,
        what: &str,
        index: usize,
        (begin, end): (u64, u64),
        want: Option<&u32>,
        got: u32,
    ) -> Result<()> {
        let Some(&want) = want else {
            return Err(self.no_checksums());
        };
        if want == got {
            return Ok(());
        }
        Err(corrupt(
            self.path,
            Some(&t.name),
            format!(
                "{what} {index} (raw bytes [{begin}, {end})) fails its CRC32C check (stored \
                 {want:#010x}, computed {got:#010x}); the file is corrupt: restore it from \
                 another copy or an earlier checkpoint"
            ),
        ))
    }

    /// Decompresses frame `index` into `dst` (exactly its raw length).
    fn decode(
        &self,
        t: &TensorEntry,
        index: usize,
        frame: Frame,
        stored: &[u8],
        dst: &mut [u8],
        s: &mut Scratch,
    ) -> Result<()> {
        let src = &stored[frame.offset as usize..(frame.offset + frame.stored_len) as usize];
        self.populate(self.header.data_start() + t.begin + frame.offset, src.len());
        let fail =
            |what: String| corrupt(self.path, Some(&t.name), format!("frame {index}: {what}"));
        if s.dctx.is_none() {
            s.dctx = Some(
                zstd::bulk::Decompressor::new()
                    .map_err(|e| fail(format!("cannot create a zstd decoder: {e}")))?,
            );
        }
        let Some(dctx) = s.dctx.as_mut() else {
            unreachable!("set above")
        };
        let n = dctx.decompress_to_buffer(src, dst).map_err(|e| {
            fail(format!(
                "zstd cannot decode it into its {} raw bytes: {e}; the file is corrupt",
                frame.raw_len
            ))
        })?;
        if n != dst.len() {
            return Err(fail(format!(
                "decodes to {n} bytes, expected {}; the file is corrupt",
                dst.len()
            )));
        }
        Ok(())
    }

    /// Decompresses (and unshuffles) frame `index` into scratch; returns its raw bytes.
    fn decode_to_scratch<'s>(
        &self,
        t: &TensorEntry,
        index: usize,
        frame: Frame,
        shuffled: bool,
        s: &'s mut Scratch,
    ) -> Result<&'s [u8]> {
        let n = frame.raw_len as usize;
        let mut decoded = std::mem::take(&mut s.decoded);
        decoded.resize(n, 0);
        let result = self.decode(t, index, frame, self.stored(t), &mut decoded, s);
        s.decoded = decoded;
        result?;
        if !shuffled {
            return Ok(&s.decoded);
        }
        s.raw.resize(n, 0);
        unshuffle(&s.decoded, t.dtype.size(), &mut s.raw);
        Ok(&s.raw)
    }

    /// Checks every checksum of every tensor on `threads` threads (0 = all cores).
    pub fn verify(&self, threads: usize) -> Result<()> {
        if self.header.chunk_bytes.is_none() {
            return Err(self.no_checksums());
        }
        // Per tensor, runs of whole chunks of at least JOB_BYTES each.
        let per_job = (job_span(self.chunk_bytes()) / self.chunk_bytes()) as usize;
        let jobs: Vec<(&TensorEntry, std::ops::Range<usize>)> = self
            .header
            .tensors
            .iter()
            .flat_map(|t| {
                let n = t.num_chunks();
                (0..n)
                    .step_by(per_job)
                    .map(move |first| (t, first..(first + per_job).min(n)))
            })
            .collect();
        for_each_parallel(
            jobs,
            resolve_threads(threads),
            || Ok(Scratch::default()),
            |s, (t, chunks)| {
                chunks
                    .into_iter()
                    .try_for_each(|i| self.check_chunk(t, i, s))
            },
        )
    }

    /// Checks chunk or frame `i` of `t` against its checksum.
    fn check_chunk(&self, t: &TensorEntry, i: usize, s: &mut Scratch) -> Result<()> {
        let span = self.chunk_span(t, i);
        match &t.encoding {
            Encoding::Plain { crc32c } => {
                let len = (span.1 - span.0) as usize;
                self.populate(self.header.data_start() + t.begin + span.0, len);
                let got = crc32c::crc32c(&self.stored(t)[span.0 as usize..span.1 as usize]);
                self.check(t, "chunk", i, span, crc32c.get(i), got)
            }
            Encoding::Zstd { shuffle, frames } => {
                let frame = frames[i];
                let got = crc32c::crc32c(self.decode_to_scratch(t, i, frame, *shuffle, s)?);
                self.check(t, "frame", i, span, Some(&frame.crc32c), got)
            }
        }
    }
}

fn copy_and_checksum(src: &[u8], dst: &mut [u8]) -> u32 {
    let mut crc = 0;
    for (s, d) in src.chunks(PIECE_BYTES).zip(dst.chunks_mut(PIECE_BYTES)) {
        d.copy_from_slice(s);
        crc = crc32c::crc32c_append(crc, d);
    }
    crc
}

/// Bytes one parallel job covers: whole chunks, at least [`JOB_BYTES`].
fn job_span(chunk: u64) -> u64 {
    chunk * JOB_BYTES.div_ceil(chunk).max(1)
}

/// Splits `out` (raw bytes from `start`) at multiples of `span`.
fn pieces(start: u64, out: &mut [u8], span: u64) -> impl Iterator<Item = Piece<'_>> {
    let mut rest = out;
    let mut offset = start;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let index = offset / span;
        let room = ((index + 1) * span - offset).min(rest.len() as u64) as usize;
        let (dst, tail) = std::mem::take(&mut rest).split_at_mut(room);
        let piece = Piece {
            index: index as usize,
            offset,
            dst,
        };
        rest = tail;
        offset += room as u64;
        Some(piece)
    })
}
