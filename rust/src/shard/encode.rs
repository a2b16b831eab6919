//! Writing a shard header: the JSON text of [`super::header`]'s format for given entries.
//!
//! Numbers are written in full (no shortest forms), so a header encoded with placeholder
//! maxima bounds the size of the real one; the writer relies on it to reserve room.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::header::{Encoding, TensorEntry, COMPRESSED_DTYPE, META_KEY};
use super::FORMAT_VERSION;

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
