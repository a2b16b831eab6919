//! The shard header: a safetensors JSON header plus shardline's `"shardline"` metadata
//! (checksums, frame tables), encoded for the writer and validated in full for the reader.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

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

fn push_str(out: &mut String, s: &str) {
    out.push_str(&serde_json::to_string(s).expect("a string always serialises"));
}

fn push_list(out: &mut String, items: impl IntoIterator<Item = u64>) {
    out.push('[');
    for (i, x) in items.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(out, "{x}");
    }
    out.push(']');
}

/// The JSON header for `tensors` (in file order) and the caller's `metadata`, unpadded.
/// Numbers are written in full, so a header of placeholder maxima bounds the real one.
pub fn encode_json(
    tensors: &[TensorEntry],
    metadata: &BTreeMap<String, String>,
    chunk_bytes: u64,
) -> String {
    let mut ours =
        format!("{{\"version\":{FORMAT_VERSION},\"chunk_bytes\":{chunk_bytes},\"tensors\":{{");
    for (i, t) in tensors.iter().enumerate() {
        if i > 0 {
            ours.push(',');
        }
        push_str(&mut ours, &t.name);
        match &t.encoding {
            Encoding::Plain { crc32c } => {
                ours.push_str(":{\"crc32c\":");
                push_list(&mut ours, crc32c.iter().map(|&c| u64::from(c)));
            }
            Encoding::Zstd { shuffle, frames } => {
                let _ = write!(
                    ours,
                    ":{{\"dtype\":\"{}\",\"shape\":",
                    t.dtype.safetensors_name()
                );
                push_list(&mut ours, t.shape.iter().copied());
                let _ = write!(ours, ",\"shuffle\":{shuffle},\"frames\":[");
                for (j, f) in frames.iter().enumerate() {
                    if j > 0 {
                        ours.push(',');
                    }
                    push_list(
                        &mut ours,
                        [f.offset, f.stored_len, f.raw_len, u64::from(f.crc32c)],
                    );
                }
                ours.push(']');
            }
        }
        ours.push('}');
    }
    ours.push_str("}}");

    let mut meta = metadata.clone();
    meta.insert(META_KEY.to_owned(), ours);
    let mut out = String::from("{\"__metadata__\":");
    out.push_str(&serde_json::to_string(&meta).expect("a string map always serialises"));
    for t in tensors {
        out.push(',');
        push_str(&mut out, &t.name);
        match t.encoding {
            Encoding::Plain { .. } => {
                let _ = write!(
                    out,
                    ":{{\"dtype\":\"{}\",\"shape\":",
                    t.dtype.safetensors_name()
                );
                push_list(&mut out, t.shape.iter().copied());
            }
            Encoding::Zstd { .. } => {
                let _ = write!(out, ":{{\"dtype\":\"{COMPRESSED_DTYPE}\",\"shape\":");
                push_list(&mut out, [t.end - t.begin]);
            }
        }
        out.push_str(",\"data_offsets\":");
        push_list(&mut out, [t.begin, t.end]);
        out.push('}');
    }
    out.push('}');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A file of `json` (padded to 8 bytes) followed by `data` zero bytes.
    fn file(json: &str, data: usize) -> Vec<u8> {
        let mut out = (json.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(json.as_bytes());
        out.resize(out.len() + data, 0);
        out
    }

    fn err(bytes: &[u8]) -> String {
        let e = ShardHeader::parse("x.safetensors", bytes).unwrap_err();
        assert_eq!(e.kind, crate::ErrorKind::Checkpoint, "{e}");
        assert!(e.message.contains("x.safetensors"), "{e}");
        e.message
    }

    fn shardline(tensors: &str) -> String {
        let ours = format!("{{\"version\":1,\"chunk_bytes\":8,\"tensors\":{{{tensors}}}}}");
        format!(
            "\"__metadata__\":{{\"shardline\":{}}}",
            serde_json::to_string(&ours).unwrap()
        )
    }

    #[test]
    fn foreign_safetensors_parse_without_checksums() {
        let json = r#"{"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},
                       "a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},
                       "__metadata__":{"format":"pt"}}"#;
        let h = ShardHeader::parse("f", &file(json, 12)).unwrap();
        assert_eq!(h.chunk_bytes, None);
        assert_eq!(
            h.tensors
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert_eq!(h.tensor("b").unwrap().raw_bytes, 8);
        assert_eq!(h.metadata["format"], "pt");
    }

    #[test]
    fn encoded_headers_parse_back() {
        let tensors = vec![
            TensorEntry {
                name: "w\"\u{e9}".into(),
                dtype: DType::BF16,
                shape: vec![3, 3],
                begin: 0,
                end: 18,
                raw_bytes: 18,
                encoding: Encoding::Plain {
                    crc32c: vec![1, 2, u32::MAX],
                },
            },
            TensorEntry {
                name: "z".into(),
                dtype: DType::F32,
                shape: vec![3],
                begin: 18,
                end: 25,
                raw_bytes: 12,
                encoding: Encoding::Zstd {
                    shuffle: true,
                    frames: vec![
                        Frame {
                            offset: 0,
                            stored_len: 5,
                            raw_len: 8,
                            crc32c: 7,
                        },
                        Frame {
                            offset: 5,
                            stored_len: 2,
                            raw_len: 4,
                            crc32c: 9,
                        },
                    ],
                },
            },
        ];
        let meta = BTreeMap::from([("step".to_owned(), "12".to_owned())]);
        let json = encode_json(&tensors, &meta, 8);
        let h = ShardHeader::parse("f", &file(&json, 25)).unwrap();
        assert_eq!(h.tensors, tensors);
        assert_eq!(h.metadata, meta);
        assert_eq!(h.chunk_bytes, Some(8));
    }

    #[test]
    fn short_and_oversized_files_are_rejected() {
        assert!(err(b"").contains("fewer than the 8-byte"));
        assert!(err(&[1, 0, 0]).contains("fewer than the 8-byte"));
        assert!(err(&u64::MAX.to_le_bytes()).contains("exceeds"));
        assert!(err(&50u64.to_le_bytes()).contains("runs past the end"));
        let mut f = file("{}", 0);
        f.truncate(9);
        assert!(err(&f).contains("runs past the end"));
    }

    #[test]
    fn malformed_json_is_rejected() {
        assert!(err(&file("{\"a\":", 0)).contains("not a JSON object of tensors"));
        assert!(err(&file("[]", 0)).contains("not a JSON object"));
        let mut f = file("{\"\u{e9}\":1}", 0);
        f[10] = 0xff;
        assert!(err(&f).contains("UTF-8"));
        assert!(err(&file(r#"{"a":{"dtype":"F32","shape":[1]}}"#, 4)).contains("data_offsets"));
        assert!(err(&file(
            r#"{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
            4
        ))
        .contains("tensor \"a\": bad header entry: invalid value: integer `-1`, expected u64"));
        assert!(err(&file(r#"{"__metadata__":{"k":1}}"#, 0)).contains("expected a string"));
    }

    #[test]
    fn dtypes_shapes_and_offsets_are_checked() {
        // (tensors JSON, data bytes, what the error must say)
        let cases: [(&str, usize, &str); 9] = [
            (
                r#"{"a":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}}"#,
                8,
                "unknown dtype \"C64\"",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
                8,
                "needs 12 bytes",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},
                    "b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}"#,
                8,
                "overlap",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}"#,
                8,
                "gap",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
                8,
                "follow the last tensor",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#,
                5,
                "truncated",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[4294967296,4294967296,2],"data_offsets":[0,0]}}"#,
                0,
                "overflows",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,0]}}"#,
                1,
                "end before",
            ),
            (
                r#"{"a":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}}"#,
                8,
                "\"a\"",
            ),
        ];
        for (json, data, want) in cases {
            let e = err(&file(json, data));
            assert!(e.contains(want), "{json}: {e}");
        }
    }

    #[test]
    fn shardline_metadata_is_checked() {
        let t = r#""a":{"dtype":"U8","shape":[9],"data_offsets":[0,9]}"#;
        let ok = format!("{{{},{t}}}", shardline(r#""a":{"crc32c":[1,2]}"#));
        assert!(ShardHeader::parse("f", &file(&ok, 9)).is_ok());
        let e = err(&file(
            &format!("{{{},{t}}}", shardline(r#""a":{"crc32c":[1]}"#)),
            9,
        ));
        assert!(e.contains("expected 2"), "{e}");
        let e = err(&file(&format!("{{{},{t}}}", shardline("")), 9));
        assert!(e.contains("no checksums"), "{e}");
        let e = err(&file(
            &format!("{{{},{t}}}", shardline(r#""a":{"crc32c":[1,2]},"b":{}"#)),
            9,
        ));
        assert!(
            e.contains("\"b\"") && e.contains("not in the header"),
            "{e}"
        );
        let bad_version = ok.replace("\\\"version\\\":1", "\\\"version\\\":2");
        assert!(err(&file(&bad_version, 9)).contains("version 2"));
        let zero_chunk = ok.replace("\\\"chunk_bytes\\\":8", "\\\"chunk_bytes\\\":0");
        assert!(err(&file(&zero_chunk, 9)).contains("chunk_bytes 0"));
    }

    fn compressed(frames: &str, stored: u64) -> Vec<u8> {
        let meta = shardline(&format!(
            r#""z":{{"dtype":"F32","shape":[3],"shuffle":false,"frames":[{frames}]}}"#
        ));
        let json = format!(
            r#"{{{meta},"z":{{"dtype":"SHARDLINE_ZSTD","shape":[{stored}],"data_offsets":[0,{stored}]}}}}"#
        );
        file(&json, stored as usize)
    }

    #[test]
    fn frame_tables_are_checked() {
        assert!(ShardHeader::parse("f", &compressed("[0,5,8,1],[5,2,4,2]", 7)).is_ok());
        assert!(err(&compressed("[0,5,8,1]", 5)).contains("need 2"));
        assert!(err(&compressed("[0,5,8,1],[6,1,4,2]", 7)).contains("contiguous"));
        assert!(err(&compressed("[0,5,4,1],[5,2,8,2]", 7)).contains("expected 8"));
        assert!(err(&compressed("[0,5,8,1],[5,9,4,2]", 7)).contains("runs past"));
        assert!(err(&compressed("[0,5,8,1],[5,0,4,2]", 5)).contains("empty"));
        assert!(err(&compressed("[0,5,8,1],[5,1,4,2]", 7)).contains("cover 6"));
        assert!(err(&compressed("[0,5,8,1],[5,2,4,4294967296]", 7)).contains("32 bits"));
        assert!(err(&compressed("[0,5,8],[5,2,4,2]", 7)).contains("expected an array of length 4"));
        let no_meta = r#"{"z":{"dtype":"SHARDLINE_ZSTD","shape":[4],"data_offsets":[0,4]}}"#;
        assert!(err(&file(no_meta, 4)).contains("no frame table"));
    }

    /// Strings shaped like shard headers: objects of objects of lists, strings, numbers.
    fn json_like() -> impl Strategy<Value = String> {
        let value = r#"(\[[0-9,\[\]]{0,24}\]|"[A-Z0-9_]{0,8}"|[0-9]{1,20}|true)"#;
        let inner = format!(r#"\{{("[a-z_]{{1,12}}":{value},?){{0,4}}\}}"#);
        let outer = format!(r#"\{{("[a-z_]{{0,12}}":({inner}|"[a-z]{{0,4}}"),?){{0,4}}\}}"#);
        proptest::string::string_regex(&outer).expect("a valid regex")
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = ShardHeader::parse("p", &bytes);
        }

        #[test]
        fn arbitrary_json_never_panics(json in json_like(), data in 0usize..64) {
            let _ = ShardHeader::parse("p", &file(&json, data));
        }
    }
}
