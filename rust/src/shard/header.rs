//! The shard header: a safetensors JSON header plus shardline's `"shardline"` metadata
//! (checksums, frame tables), encoded for the writer and validated in full for the reader.

use std::collections::{BTreeMap, HashMap};

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::{chunk_count, corrupt, FORMAT_VERSION, MAX_CHUNK_BYTES, MAX_HEADER_BYTES};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// The `__metadata__` key that holds shardline's own JSON (checksums, frame tables).
pub const META_KEY: &str = "shardline";
/// The safetensors dtype of a compressed tensor (unknown to plain readers on purpose).
pub const COMPRESSED_DTYPE: &str = "SHARDLINE_ZSTD";

/// Bytes of a tensor of `shape` and element `size`, or `None` on overflow.
pub fn shape_bytes(shape: &[u64], size: usize) -> Option<u64> {
    if shape.contains(&0) {
        return Some(0);
    }
    shape
        .iter()
        .try_fold(size as u64, |acc, &d| acc.checked_mul(d))
}

/// One zstd frame of a compressed tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame {
    /// Where the frame starts, relative to the tensor's stored bytes.
    pub offset: u64,
    /// Compressed length.
    pub stored_len: u64,
    /// Decompressed length.
    pub raw_len: u64,
    /// CRC32C of the decompressed (unshuffled) bytes.
    pub crc32c: u32,
}

/// How a tensor's bytes are stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Encoding {
    /// As is; one CRC32C per `chunk_bytes` chunk (empty for files without checksums).
    Plain {
        /// Checksum of each chunk.
        crc32c: Vec<u32>,
    },
    /// zstd frames of `chunk_bytes` raw bytes each (the last may be short).
    Zstd {
        /// Whether each frame's bytes were shuffled into byte planes before compression.
        shuffle: bool,
        /// The frame table, in order, contiguous.
        frames: Vec<Frame>,
    },
}

/// One tensor of a shard file, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    /// Key in the file (a fully qualified name, maybe with a chunk suffix).
    pub name: String,
    /// The real element type.
    pub dtype: DType,
    /// The real shape.
    pub shape: Vec<u64>,
    /// First stored byte, relative to the data section.
    pub begin: u64,
    /// One past the last stored byte, relative to the data section.
    pub end: u64,
    /// `prod(shape) * dtype.size()`.
    pub raw_bytes: u64,
    /// Plain or compressed, with checksums.
    pub encoding: Encoding,
}

impl TensorEntry {
    /// Bytes the tensor occupies in the file.
    pub fn stored_bytes(&self) -> u64 {
        self.end - self.begin
    }

    /// Whether the tensor is zstd-compressed.
    pub fn is_compressed(&self) -> bool {
        matches!(self.encoding, Encoding::Zstd { .. })
    }

    /// Number of checksummed chunks (frames, when compressed); 0 without checksums.
    pub fn num_chunks(&self) -> usize {
        match &self.encoding {
            Encoding::Plain { crc32c } => crc32c.len(),
            Encoding::Zstd { frames, .. } => frames.len(),
        }
    }

    /// CRC32C of each raw chunk (a compressed tensor's frame checksums).
    pub fn checksums(&self) -> Vec<u32> {
        match &self.encoding {
            Encoding::Plain { crc32c } => crc32c.clone(),
            Encoding::Zstd { frames, .. } => frames.iter().map(|f| f.crc32c).collect(),
        }
    }
}

/// A parsed and fully validated shard header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardHeader {
    /// Length of the JSON header (padding included), the file's first 8 bytes.
    pub json_bytes: u64,
    /// Size of the file the header was validated against.
    pub file_bytes: u64,
    /// Checksum chunk and frame size; `None` for files without shardline metadata.
    pub chunk_bytes: Option<u64>,
    /// The caller's metadata (`__metadata__` without the `"shardline"` key).
    pub metadata: BTreeMap<String, String>,
    /// The tensors in file order.
    pub tensors: Vec<TensorEntry>,
    index: HashMap<String, usize>,
}

impl ShardHeader {
    /// Absolute offset of the data section.
    pub fn data_start(&self) -> u64 {
        8 + self.json_bytes
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorEntry> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// Parses and validates the header of `file` (the whole file's bytes); `path` names it in
    /// errors. Every length, offset, dtype and frame is checked before anything uses it.
    pub fn parse(path: &str, file: &[u8]) -> Result<Self> {
        let file_bytes = file.len() as u64;
        let Some((len_bytes, rest)) = file.split_first_chunk::<8>() else {
            return Err(corrupt(
                path,
                None,
                format!(
                    "the file has {file_bytes} bytes, fewer than the 8-byte header length \
                     (empty or truncated)"
                ),
            ));
        };
        let json_bytes = u64::from_le_bytes(*len_bytes);
        if json_bytes > MAX_HEADER_BYTES {
            return Err(corrupt(
                path,
                None,
                format!(
                    "header length {json_bytes} exceeds the {MAX_HEADER_BYTES}-byte limit \
                     (not a shard file, or corrupt)"
                ),
            ));
        }
        if json_bytes > rest.len() as u64 {
            return Err(corrupt(
                path,
                None,
                format!(
                    "header length {json_bytes} runs past the end of the {file_bytes}-byte \
                     file (truncated?)"
                ),
            ));
        }
        let (json, data) = rest.split_at(json_bytes as usize);
        let text = std::str::from_utf8(json)
            .map_err(|e| corrupt(path, None, format!("the header is not valid UTF-8: {e}")))?;
        let mut root: BTreeMap<String, Box<RawValue>> =
            serde_json::from_str(text).map_err(|e| {
                corrupt(
                    path,
                    None,
                    format!("the header is not a JSON object of tensors: {e}"),
                )
            })?;

        let file_ctx = Ctx { path, tensor: None };
        let mut metadata: BTreeMap<String, String> = match root.remove("__metadata__") {
            Some(raw) => file_ctx.typed(&raw, "__metadata__ (string to string)")?,
            None => BTreeMap::new(),
        };
        let mut ours = metadata
            .remove(META_KEY)
            .map(|text| ShardlineMeta::parse(path, &text))
            .transpose()?;
        let chunk_bytes = ours.as_ref().map(|o| o.chunk_bytes);
        let mut extras = ours
            .as_mut()
            .map(|o| std::mem::take(&mut o.tensors))
            .unwrap_or_default();
        let mut tensors = Vec::with_capacity(root.len());
        for (name, raw) in &root {
            let ctx = Ctx {
                path,
                tensor: Some(name),
            };
            let extra = extras.remove(name);
            tensors.push(parse_tensor(ctx, raw, chunk_bytes, extra.as_deref())?);
        }
        if let Some(name) = extras.keys().next() {
            return Err(corrupt(
                path,
                Some(name),
                "listed in the shardline metadata but not in the header",
            ));
        }
        check_layout(path, &mut tensors, data.len() as u64)?;
        let index = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(ShardHeader {
            json_bytes,
            file_bytes,
            chunk_bytes,
            metadata,
            tensors,
            index,
        })
    }
}

/// Error context: the file and, once known, the tensor.
#[derive(Clone, Copy)]
struct Ctx<'a> {
    path: &'a str,
    tensor: Option<&'a str>,
}

impl Ctx<'_> {
    fn err(&self, what: impl std::fmt::Display) -> Error {
        corrupt(self.path, self.tensor, what)
    }

    /// Decodes `raw` as a `T`; `what` names it in the error.
    fn typed<T: DeserializeOwned>(&self, raw: &RawValue, what: &str) -> Result<T> {
        serde_json::from_str(raw.get()).map_err(|e| self.err(format!("bad {what}: {e}")))
    }
}

/// A safetensors header entry, as stored.
#[derive(Deserialize)]
struct EntryJson {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: Vec<u64>,
}

/// A tensor's entry in the `"shardline"` metadata: `crc32c` for plain tensors; the real
/// `dtype`, `shape`, `shuffle` and the `frames` table for compressed ones. Decoded straight
/// into compact vectors, so a large header costs little more memory than its text.
#[derive(Deserialize)]
struct ExtraJson {
    crc32c: Option<Vec<u32>>,
    dtype: Option<String>,
    shape: Option<Vec<u64>>,
    shuffle: Option<bool>,
    frames: Option<Vec<[u64; 4]>>,
}

/// The `"shardline"` metadata, decoded once its version is known.
#[derive(Deserialize)]
struct ShardlineMeta {
    chunk_bytes: u64,
    tensors: BTreeMap<String, Box<RawValue>>,
}

#[derive(Deserialize)]
struct VersionJson {
    version: u64,
}

impl ShardlineMeta {
    fn parse(path: &str, text: &str) -> Result<Self> {
        let ctx = Ctx { path, tensor: None };
        let what = format!("__metadata__[{META_KEY:?}]");
        let raw: Box<RawValue> = serde_json::from_str(text)
            .map_err(|e| ctx.err(format!("{what} is not valid JSON: {e}")))?;
        let VersionJson { version } = ctx.typed(&raw, &what)?;
        if version != FORMAT_VERSION {
            return Err(ctx.err(format!(
                "written with shardline format version {version}; this build reads version \
                 {FORMAT_VERSION}"
            )));
        }
        let meta: ShardlineMeta = ctx.typed(&raw, &what)?;
        if meta.chunk_bytes == 0 || meta.chunk_bytes > MAX_CHUNK_BYTES {
            return Err(ctx.err(format!(
                "chunk_bytes {} is outside 1..={MAX_CHUNK_BYTES}",
                meta.chunk_bytes
            )));
        }
        Ok(meta)
    }
}

/// One header entry, checked against its shardline metadata (`extra`); `chunk_bytes` is
/// `None` for files without shardline metadata.
fn parse_tensor(
    ctx: Ctx<'_>,
    raw: &RawValue,
    chunk_bytes: Option<u64>,
    extra: Option<&RawValue>,
) -> Result<TensorEntry> {
    let entry: EntryJson = ctx.typed(raw, "header entry")?;
    let [begin, end] = entry.data_offsets[..] else {
        return Err(ctx.err(format!(
            "data_offsets has {} values, expected [begin, end]",
            entry.data_offsets.len()
        )));
    };
    if begin > end {
        return Err(ctx.err(format!(
            "data_offsets [{begin}, {end}] end before they begin"
        )));
    }
    let stored = end - begin;
    let extra = match (chunk_bytes, extra) {
        (Some(chunk), Some(raw)) => Some((chunk, ctx.typed::<ExtraJson>(raw, "shardline entry")?)),
        _ => None,
    };

    if entry.dtype == COMPRESSED_DTYPE {
        let Some((chunk, extra)) = extra else {
            return Err(ctx.err(format!(
                "dtype {COMPRESSED_DTYPE} but no frame table in the shardline metadata"
            )));
        };
        if entry.shape != [stored] {
            return Err(ctx.err(format!(
                "a compressed tensor's shape must be [stored_bytes] = [{stored}], got {:?}",
                entry.shape
            )));
        }
        return parse_compressed(ctx, extra, chunk, begin, end);
    }

    let dtype = known_dtype(ctx, &entry.dtype, "dtype")?;
    let shape = entry.shape;
    let raw_bytes = shape_bytes(&shape, dtype.size())
        .ok_or_else(|| ctx.err(format!("shape {shape:?} overflows 64 bits of bytes")))?;
    if raw_bytes != stored {
        return Err(ctx.err(format!(
            "shape {shape:?} of {} needs {raw_bytes} bytes but data_offsets [{begin}, {end}] \
             hold {stored}",
            dtype.safetensors_name()
        )));
    }
    let crc32c = match (chunk_bytes, extra) {
        (None, _) => Vec::new(),
        (Some(_), None) => return Err(ctx.err("no checksums in the shardline metadata")),
        (Some(_), Some((chunk, extra))) => {
            let Some(crcs) = extra.crc32c else {
                return Err(ctx.err("its shardline entry has no crc32c list"));
            };
            let expected = chunk_count(raw_bytes, chunk);
            if crcs.len() as u64 != expected {
                return Err(ctx.err(format!(
                    "{} checksums for {raw_bytes} bytes in {chunk}-byte chunks, expected \
                     {expected}",
                    crcs.len()
                )));
            }
            crcs
        }
    };
    Ok(TensorEntry {
        name: ctx.tensor.unwrap_or_default().to_owned(),
        dtype,
        shape,
        begin,
        end,
        raw_bytes,
        encoding: Encoding::Plain { crc32c },
    })
}

fn known_dtype(ctx: Ctx<'_>, name: &str, what: &str) -> Result<DType> {
    DType::from_safetensors(name).ok_or_else(|| {
        ctx.err(format!(
            "unknown {what} {name:?} (shard files hold {})",
            DType::safetensors_names()
        ))
    })
}

/// A compressed tensor's real dtype, shape and frame table.
fn parse_compressed(
    ctx: Ctx<'_>,
    extra: ExtraJson,
    chunk_bytes: u64,
    begin: u64,
    end: u64,
) -> Result<TensorEntry> {
    let missing = |field: &str| ctx.err(format!("its shardline entry has no {field:?}"));
    let dtype = known_dtype(
        ctx,
        &extra.dtype.ok_or_else(|| missing("dtype"))?,
        "real dtype",
    )?;
    let shape = extra.shape.ok_or_else(|| missing("shape"))?;
    let shuffle = extra.shuffle.ok_or_else(|| missing("shuffle"))?;
    let table = extra.frames.ok_or_else(|| missing("frames"))?;
    let raw_bytes = shape_bytes(&shape, dtype.size())
        .ok_or_else(|| ctx.err(format!("shape {shape:?} overflows 64 bits of bytes")))?;
    let expected = chunk_count(raw_bytes, chunk_bytes);
    if table.len() as u64 != expected {
        return Err(ctx.err(format!(
            "the frame table has {} frames; {raw_bytes} bytes in {chunk_bytes}-byte frames \
             need {expected}",
            table.len()
        )));
    }
    let stored = end - begin;
    let mut frames = Vec::with_capacity(table.len());
    let mut next_offset = 0u64;
    for (i, [offset, stored_len, raw_len, crc]) in table.into_iter().enumerate() {
        if offset != next_offset {
            return Err(ctx.err(format!(
                "frame {i} starts at {offset}, expected {next_offset} (frames are contiguous)"
            )));
        }
        let frame_end = offset.checked_add(stored_len).filter(|&e| e <= stored);
        let Some(frame_end) = frame_end.filter(|_| stored_len > 0) else {
            return Err(ctx.err(format!(
                "frame {i} [{offset}, +{stored_len}) is empty or runs past the tensor's \
                 {stored} stored bytes"
            )));
        };
        let want_raw = chunk_bytes.min(raw_bytes - i as u64 * chunk_bytes);
        if raw_len != want_raw {
            return Err(ctx.err(format!(
                "frame {i} holds {raw_len} raw bytes, expected {want_raw}"
            )));
        }
        let crc32c = u32::try_from(crc)
            .map_err(|_| ctx.err(format!("frame {i} checksum {crc} exceeds 32 bits")))?;
        frames.push(Frame {
            offset,
            stored_len,
            raw_len,
            crc32c,
        });
        next_offset = frame_end;
    }
    if next_offset != stored {
        return Err(ctx.err(format!(
            "the frames cover {next_offset} bytes but the tensor stores {stored}"
        )));
    }
    Ok(TensorEntry {
        name: ctx.tensor.unwrap_or_default().to_owned(),
        dtype,
        shape,
        begin,
        end,
        raw_bytes,
        encoding: Encoding::Zstd { shuffle, frames },
    })
}

/// Sorts `tensors` by offset and checks that they tile the data section exactly: inside it,
/// no overlap, no gap, no trailing bytes (as safetensors demands).
fn check_layout(path: &str, tensors: &mut [TensorEntry], data_bytes: u64) -> Result<()> {
    tensors.sort_by_key(|t| (t.begin, t.end));
    if let Some(t) = tensors.iter().find(|t| t.end > data_bytes) {
        return Err(corrupt(
            path,
            Some(&t.name),
            format!(
                "its bytes [{}, {}) run past the {data_bytes}-byte data section (truncated \
                 file?)",
                t.begin, t.end
            ),
        ));
    }
    let mut expected = 0u64;
    let mut previous: Option<&TensorEntry> = None;
    for t in tensors.iter() {
        if t.begin < expected {
            let p = previous.map(|p| p.name.as_str()).unwrap_or_default();
            return Err(corrupt(
                path,
                Some(&t.name),
                format!(
                    "its bytes [{}, {}) overlap tensor {p:?} ending at {expected}",
                    t.begin, t.end
                ),
            ));
        }
        if t.begin > expected {
            return Err(corrupt(
                path,
                Some(&t.name),
                format!(
                    "it starts at {} but the previous tensor ends at {expected} (gap)",
                    t.begin
                ),
            ));
        }
        expected = t.end;
        previous = Some(t);
    }
    if expected != data_bytes {
        return Err(corrupt(
            path,
            None,
            format!(
                "{} bytes follow the last tensor in the data section",
                data_bytes - expected
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
