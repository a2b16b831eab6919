//! Writes one shard file straight from the callers' buffers: checksummed while streaming,
//! optionally zstd-compressed in parallel, fsynced before returning.
//!
//! The header goes in front of the data but holds the data's checksums (and, compressed,
//! its sizes), so the writer reserves room for it first: it encodes the header with every
//! unknown number at its largest possible value, rounds `8 + that` up to [`DATA_ALIGN`],
//! streams the data from there, and finally writes the real header, padded with spaces to
//! the reserved length. The callers' memory is read once; nothing is staged but compressed
//! frames in flight.

use std::collections::{BTreeMap, HashSet};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};

use super::encode::encode_json;
use super::header::{shape_bytes, Encoding, Frame, TensorEntry, META_KEY};
use super::pool::{Job, Pool, PoolState};
use super::{
    chunk_count, corrupt, io_error, resolve_threads, DATA_ALIGN, DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES, MAX_HEADER_BYTES,
};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Bytes checksummed then written per system call when writing uncompressed tensors.
const PIECE_BYTES: usize = 1 << 20;

/// Written bytes after which the kernel is asked to start writing them to disk. Without it,
/// on a host with much memory the whole file sits in the page cache until the final fsync,
/// and the disk idles while we copy: measured on a 16-core host with 128 GiB, a 4 GB shard
/// took the time of the copy plus the time of the disk.
const WRITEBACK_BYTES: u64 = 16 << 20;

/// One tensor to write: its bytes, borrowed from the caller.
#[derive(Clone, Debug)]
pub struct TensorData<'a> {
    /// Key in the file.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape; `prod(shape) * dtype.size()` must equal `data.len()`.
    pub shape: Vec<u64>,
    /// The tensor's bytes, C-contiguous.
    pub data: &'a [u8],
}

/// How to write a shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteOptions {
    /// zstd level, or `None` for a plain safetensors file.
    pub compress: Option<i32>,
    /// Checksum chunk and compression frame size, in `1..=MAX_CHUNK_BYTES`.
    pub chunk_bytes: u64,
    /// Compression threads; 0 = the machine's parallelism. Plain files are written by the
    /// calling thread (buffered writes to one file serialise in the kernel anyway).
    pub threads: usize,
}

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions {
            compress: None,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            threads: 0,
        }
    }
}

/// Where one tensor went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WrittenTensor {
    /// Key in the file.
    pub name: String,
    /// Absolute file offset of its stored bytes.
    pub offset: u64,
    /// Bytes in the file.
    pub stored_bytes: u64,
    /// Bytes of tensor data.
    pub raw_bytes: u64,
    /// CRC32C of each `chunk_bytes` chunk of the raw bytes.
    pub crc32c: Vec<u32>,
}

/// What [`write_shard`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteReport {
    /// The tensors, in file order.
    pub tensors: Vec<WrittenTensor>,
    /// File size.
    pub file_bytes: u64,
    /// Bytes before the data section (8-byte length + padded JSON header).
    pub header_bytes: u64,
}

/// Writes `tensors` (in order) and `metadata` to a new file at `path`, replacing any file
/// there, and fsyncs it. On failure the partial file is removed.
pub fn write_shard(
    path: &str,
    tensors: &[TensorData<'_>],
    metadata: &BTreeMap<String, String>,
    options: &WriteOptions,
) -> Result<WriteReport> {
    validate(tensors, metadata, options)?;
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(|e| io_error(path, "creating the file", e))?;
    let out = Out {
        path,
        file: &file,
        metadata,
        chunk_bytes: options.chunk_bytes,
        written_back: AtomicU64::new(0),
    };
    let result = match options.compress {
        None => out.write_plain(tensors),
        Some(level) => out.write_compressed(tensors, level, resolve_threads(options.threads)),
    }
    .and_then(|(entries, data_start)| out.finish(entries, data_start));
    if result.is_err() {
        drop(file);
        let _ = std::fs::remove_file(path);
    }
    result
}

fn validate(
    tensors: &[TensorData<'_>],
    metadata: &BTreeMap<String, String>,
    options: &WriteOptions,
) -> Result<()> {
    if options.chunk_bytes == 0 || options.chunk_bytes > MAX_CHUNK_BYTES {
        return Err(Error::invalid(format!(
            "chunk_bytes must be in 1..={MAX_CHUNK_BYTES}, got {}",
            options.chunk_bytes
        )));
    }
    if let Some(level) = options.compress {
        let levels = zstd::compression_level_range();
        if !levels.contains(&level) {
            return Err(Error::invalid(format!(
                "compress must be a zstd level in {}..={} (or None), got {level}",
                levels.start(),
                levels.end()
            )));
        }
    }
    if metadata.contains_key(META_KEY) {
        return Err(Error::invalid(format!(
            "metadata key {META_KEY:?} is reserved for shardline's checksums; rename it"
        )));
    }
    let mut seen = HashSet::new();
    for t in tensors {
        if t.name == "__metadata__" || t.name == "__file__" {
            return Err(Error::invalid(format!(
                "tensor name {:?} is reserved; rename the tensor",
                t.name
            )));
        }
        if !seen.insert(t.name.as_str()) {
            return Err(Error::invalid(format!(
                "tensor {:?} appears twice; names in one shard must be unique",
                t.name
            )));
        }
        let want = shape_bytes(&t.shape, t.dtype.size());
        if want != Some(t.data.len() as u64) {
            return Err(Error::invalid(format!(
                "tensor {:?}: shape {:?} of {} needs {} bytes but its buffer has {}",
                t.name,
                t.shape,
                t.dtype.safetensors_name(),
                want.map_or("more than 2^64".to_owned(), |w| w.to_string()),
                t.data.len()
            )));
        }
    }
    Ok(())
}

/// The file being written and what every step needs.
pub(super) struct Out<'a> {
    pub(super) path: &'a str,
    file: &'a File,
    metadata: &'a BTreeMap<String, String>,
    chunk_bytes: u64,
    /// End of the bytes already handed to [`Out::start_writeback`].
    written_back: AtomicU64,
}

impl Out<'_> {
    pub(super) fn write_at(&self, bytes: &[u8], pos: u64) -> Result<()> {
        self.file
            .write_all_at(bytes, pos)
            .map_err(|e| io_error(self.path, "writing", e))?;
        let end = pos + bytes.len() as u64;
        let from = self.written_back.load(Ordering::Relaxed);
        if pos >= from && end - from >= WRITEBACK_BYTES {
            // The data is written front to back by one thread; the header (at 0) comes last.
            self.start_writeback(from, end - from);
            self.written_back.store(end, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Asks the kernel to start writing file bytes `[at, at + len)` to disk without waiting
    /// for them (the final fsync does). Advice only: an error changes nothing.
    fn start_writeback(&self, at: u64, len: u64) {
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            let (Ok(at), Ok(len)) = (i64::try_from(at), i64::try_from(len)) else {
                return;
            };
            // SAFETY: sync_file_range only reads its integer arguments; the descriptor is
            // open for as long as `self.file` is borrowed.
            let _ = unsafe {
                libc::sync_file_range(self.file.as_raw_fd(), at, len, libc::SYNC_FILE_RANGE_WRITE)
            };
        }
        #[cfg(not(target_os = "linux"))]
        let _ = (at, len);
    }

    /// Where the data section starts, given the header with every unknown at its maximum.
    fn reserve(&self, placeholders: &[TensorEntry]) -> Result<u64> {
        let json = encode_json(placeholders, self.metadata, self.chunk_bytes).len() as u64;
        let data_start = (8 + json).next_multiple_of(DATA_ALIGN);
        if data_start - 8 > MAX_HEADER_BYTES {
            return Err(Error::invalid(format!(
                "the header of {} would need {json} bytes, over the {MAX_HEADER_BYTES}-byte \
                 limit; raise chunk_bytes or split the shard",
                self.path
            )));
        }
        Ok(data_start)
    }

    /// Streams the tensors as they are, a CRC32C per chunk computed just before each write.
    fn write_plain(&self, tensors: &[TensorData<'_>]) -> Result<(Vec<TensorEntry>, u64)> {
        let mut begin = 0u64;
        let mut entries: Vec<TensorEntry> = tensors
            .iter()
            .map(|t| {
                let raw_bytes = t.data.len() as u64;
                let chunks = chunk_count(raw_bytes, self.chunk_bytes) as usize;
                let entry = TensorEntry {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    begin,
                    end: begin + raw_bytes,
                    raw_bytes,
                    encoding: Encoding::Plain {
                        crc32c: vec![u32::MAX; chunks],
                    },
                };
                begin += raw_bytes;
                entry
            })
            .collect();
        let data_start = self.reserve(&entries)?;
        let mut pos = data_start;
        for (t, entry) in tensors.iter().zip(&mut entries) {
            let Encoding::Plain { crc32c } = &mut entry.encoding else {
                unreachable!("plain entries were built above");
            };
            for (chunk, crc) in t.data.chunks(self.chunk_bytes as usize).zip(crc32c) {
                *crc = 0;
                for piece in chunk.chunks(PIECE_BYTES) {
                    *crc = crc32c::crc32c_append(*crc, piece);
                    self.write_at(piece, pos)?;
                    pos += piece.len() as u64;
                }
            }
        }
        Ok((entries, data_start))
    }

    /// Compresses every tensor's frames on `threads` workers while this thread writes them
    /// out in order.
    fn write_compressed(
        &self,
        tensors: &[TensorData<'_>],
        level: i32,
        threads: usize,
    ) -> Result<(Vec<TensorEntry>, u64)> {
        let chunk = self.chunk_bytes as usize;
        let jobs: Vec<Job<'_>> = tensors
            .iter()
            .enumerate()
            .flat_map(|(tensor, t)| {
                t.data
                    .chunks(chunk)
                    .enumerate()
                    .map(move |(frame, raw)| Job { tensor, frame, raw })
            })
            .collect();
        // No stored size or offset can exceed the sum of zstd's bounds.
        let bound: u64 = jobs
            .iter()
            .map(|j| zstd::zstd_safe::compress_bound(j.raw.len()) as u64)
            .sum();
        let mut entries: Vec<TensorEntry> = tensors
            .iter()
            .map(|t| TensorEntry {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                begin: bound,
                end: 2 * bound,
                raw_bytes: t.data.len() as u64,
                encoding: Encoding::Zstd {
                    shuffle: false,
                    frames: t
                        .data
                        .chunks(chunk)
                        .map(|raw| Frame {
                            offset: bound,
                            stored_len: bound,
                            raw_len: raw.len() as u64,
                            crc32c: u32::MAX,
                        })
                        .collect(),
                },
            })
            .collect();
        let data_start = self.reserve(&entries)?;

        let pool = Pool {
            out: self,
            tensors,
            jobs: &jobs,
            level,
            next: AtomicUsize::new(0),
            state: Mutex::new(PoolState::default()),
            ready: Condvar::new(),
            window: 2 * threads + 1,
            decisions: tensors.iter().map(|_| OnceLock::new()).collect(),
            first_frames: tensors.iter().map(|_| Mutex::new(None)).collect(),
        };
        let workers = threads.min(jobs.len());
        std::thread::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|| pool.work());
            }
            pool.write_all(&mut entries, data_start)
        })?;
        for (entry, decision) in entries.iter_mut().zip(&pool.decisions) {
            if let Encoding::Zstd { shuffle, .. } = &mut entry.encoding {
                *shuffle = decision.get().copied().unwrap_or(false);
            }
        }
        Ok((entries, data_start))
    }

    /// Writes the real header into the reserved space and fsyncs the file.
    fn finish(&self, entries: Vec<TensorEntry>, data_start: u64) -> Result<WriteReport> {
        let json = encode_json(&entries, self.metadata, self.chunk_bytes);
        let room = (data_start - 8) as usize;
        if json.len() > room {
            return Err(corrupt(
                self.path,
                None,
                format!(
                    "internal error: the header needs {} bytes but {room} were reserved",
                    json.len()
                ),
            ));
        }
        let mut head = Vec::with_capacity(data_start as usize);
        head.extend_from_slice(&(room as u64).to_le_bytes());
        head.extend_from_slice(json.as_bytes());
        head.resize(data_start as usize, b' ');
        self.write_at(&head, 0)?;
        self.file
            .sync_all()
            .map_err(|e| io_error(self.path, "fsync", e))?;
        let file_bytes = data_start + entries.last().map_or(0, |e| e.end);
        let tensors = entries
            .iter()
            .map(|e| WrittenTensor {
                name: e.name.clone(),
                offset: data_start + e.begin,
                stored_bytes: e.stored_bytes(),
                raw_bytes: e.raw_bytes,
                crc32c: e.checksums(),
            })
            .collect();
        Ok(WriteReport {
            tensors,
            file_bytes,
            header_bytes: data_start,
        })
    }
}
