//! Shard files end to end: written by `write_shard`, read back by `ShardReader`, plain and
//! zstd, whole and in ranges; corrupt, truncated and mutated files fail with checkpoint
//! errors and never panic.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use proptest::prelude::*;
use shardline::shard::{
    read_header, write_shard, Encoding, ShardHeader, ShardReader, ShardView, TensorData,
    WriteOptions, WriteReport, DATA_ALIGN,
};
use shardline::{DType, ErrorKind};

/// Deterministic pseudo-random bytes (xorshift64*).
fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
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

/// A fresh path under the system temp dir, removed on drop.
struct TempPath(String);

impl TempPath {
    fn new(suffix: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir();
        TempPath(format!(
            "{}/shardline-test-{}-{n}{suffix}",
            dir.display(),
            std::process::id()
        ))
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Smooth floats (compressible after shuffling), as f32 bytes.
fn smooth_f32(n: usize) -> Vec<u8> {
    (0..n)
        .flat_map(|i| ((i as f32 * 0.001).sin() * 3.0).to_le_bytes())
        .collect()
}

struct Case {
    name: &'static str,
    dtype: DType,
    shape: Vec<u64>,
    data: Vec<u8>,
}

fn cases() -> Vec<Case> {
    let case = |name, dtype: DType, shape: Vec<u64>, data: Option<Vec<u8>>| {
        let bytes = shape.iter().product::<u64>() as usize * dtype.size();
        Case {
            name,
            dtype,
            data: data.unwrap_or_else(|| random_bytes(bytes, bytes as u64)),
            shape,
        }
    };
    vec![
        case("big.f32", DType::F32, vec![50, 100], Some(smooth_f32(5000))),
        case("odd.u8", DType::U8, vec![3, 7], None),
        case("empty", DType::F32, vec![0, 4], None),
        case("h.bf16", DType::BF16, vec![999], None),
        case("i64", DType::I64, vec![2, 2, 3], None),
        case("scalar.f64", DType::F64, vec![], None),
        case("flags", DType::Bool, vec![5], Some(vec![0, 1, 1, 0, 1])),
        case("f8", DType::F8E4M3, vec![4097], None),
    ]
}

fn write(path: &str, cases: &[Case], compress: Option<i32>, chunk: u64) -> WriteReport {
    let tensors: Vec<_> = cases
        .iter()
        .map(|c| TensorData {
            name: c.name.to_owned(),
            dtype: c.dtype,
            shape: c.shape.clone(),
            data: &c.data,
        })
        .collect();
    let meta = BTreeMap::from([("step".to_owned(), "7".to_owned())]);
    let options = WriteOptions {
        compress,
        chunk_bytes: chunk,
        threads: 3,
    };
    write_shard(path, &tensors, &meta, &options).unwrap()
}

fn round_trip(compress: Option<i32>) {
    let path = TempPath::new(".shard");
    let cases = cases();
    let report = write(&path.0, &cases, compress, 1000);
    let file = std::fs::read(&path.0).unwrap();
    assert_eq!(report.file_bytes, file.len() as u64);
    assert_eq!(report.header_bytes % DATA_ALIGN, 0);
    let reader = ShardReader::open(&path.0).unwrap();
    let h = reader.header();
    assert_eq!(h.metadata["step"], "7");
    assert_eq!(h.data_start(), report.header_bytes);
    assert_eq!(h.tensors.len(), cases.len());
    for (c, w) in cases.iter().zip(&report.tensors) {
        let t = h.tensor(c.name).unwrap();
        assert_eq!(
            (t.dtype, &t.shape, t.raw_bytes),
            (c.dtype, &c.shape, c.data.len() as u64)
        );
        assert_eq!(t.is_compressed(), compress.is_some());
        assert_eq!(w.offset, h.data_start() + t.begin);
        assert_eq!(w.crc32c, t.checksums());
        if compress.is_none() {
            let at = w.offset as usize;
            assert_eq!(&file[at..at + c.data.len()], &c.data[..], "{}", c.name);
        }
        let mut out = vec![0xAA; c.data.len()];
        for threads in [1, 4] {
            reader
                .view()
                .read_range(c.name, 0, &mut out, true, threads)
                .unwrap();
            assert_eq!(out, c.data, "{}", c.name);
        }
        // Partial ranges across chunk boundaries, with and without checks.
        let n = c.data.len();
        for (start, len) in [
            (0, n.min(1)),
            (n / 3, n / 2),
            (n.saturating_sub(5), n.min(5)),
            (999, 2),
        ] {
            if start + len > n {
                continue;
            }
            let mut part = vec![0; len];
            for verify in [false, true] {
                reader
                    .view()
                    .read_range(c.name, start as u64, &mut part, verify, 2)
                    .unwrap();
                assert_eq!(
                    part,
                    &c.data[start..start + len],
                    "{} [{start}, +{len})",
                    c.name
                );
            }
        }
    }
    reader.view().verify(0).unwrap();
}

#[test]
fn plain_round_trip() {
    round_trip(None);
}

#[test]
fn compressed_round_trip() {
    round_trip(Some(3));
}

#[test]
fn shuffle_is_chosen_for_smooth_floats_and_shrinks_them() {
    let path = TempPath::new(".zst");
    let cases = cases();
    let report = write(&path.0, &cases, Some(3), 8000);
    let h = read_header(&path.0).unwrap();
    let t = h.tensor("big.f32").unwrap();
    assert!(
        matches!(t.encoding, Encoding::Zstd { shuffle: true, .. }),
        "{:?}",
        t.encoding
    );
    assert!(
        t.stored_bytes() < t.raw_bytes * 3 / 4,
        "{} of {}",
        t.stored_bytes(),
        t.raw_bytes
    );
    let random = h.tensor("i64").unwrap();
    assert!(matches!(
        random.encoding,
        Encoding::Zstd { shuffle: false, .. }
    ));
    assert_eq!(report.tensors[0].stored_bytes, t.stored_bytes());
}

#[test]
fn plain_files_parse_as_safetensors_layout() {
    let path = TempPath::new(".safetensors");
    write(&path.0, &cases(), None, 4 << 20);
    let file = std::fs::read(&path.0).unwrap();
    let n = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    let json: serde_json::Value = serde_json::from_slice(&file[8..8 + n]).unwrap();
    assert_eq!(json["h.bf16"]["dtype"], "BF16");
    assert_eq!(json["h.bf16"]["shape"], serde_json::json!([999]));
    assert!(file[8..8 + n].ends_with(b" "));
    assert_eq!((8 + n) % 4096, 0);
}

#[test]
fn flipped_bytes_fail_their_checksum() {
    for compress in [None, Some(1)] {
        let path = TempPath::new(".shard");
        let report = write(&path.0, &cases(), compress, 1000);
        let target = &report.tensors[0];
        let mut file = std::fs::read(&path.0).unwrap();
        let at = (target.offset + target.stored_bytes / 2) as usize;
        file[at] ^= 0x40;
        std::fs::write(&path.0, &file).unwrap();
        let reader = ShardReader::open(&path.0).unwrap();
        let e = reader.view().verify(2).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Checkpoint);
        assert!(
            e.message.contains(&path.0) && e.message.contains("big.f32"),
            "{e}"
        );
        let mut out = vec![0; target.raw_bytes as usize];
        let e = reader
            .view()
            .read_range("big.f32", 0, &mut out, true, 1)
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::Checkpoint, "{e}");
        if compress.is_none() {
            assert!(e.message.contains("chunk 10 "), "{e}");
            // Unchecked reads return the bytes as stored.
            reader
                .view()
                .read_range("big.f32", 0, &mut out, false, 1)
                .unwrap();
            // Other tensors still read.
            let mut small = vec![0; 21];
            reader
                .view()
                .read_range("odd.u8", 0, &mut small, true, 1)
                .unwrap();
        }
    }
}

#[test]
fn truncated_files_are_rejected() {
    let path = TempPath::new(".shard");
    let report = write(&path.0, &cases(), None, 1000);
    let file = std::fs::read(&path.0).unwrap();
    for keep in [0, 5, 100, report.header_bytes as usize + 10, file.len() - 1] {
        std::fs::write(&path.0, &file[..keep]).unwrap();
        let e = ShardReader::open(&path.0).err().unwrap();
        assert_eq!(e.kind, ErrorKind::Checkpoint, "{e}");
        assert!(e.message.contains(&path.0), "{e}");
    }
    let e = ShardReader::open("/nonexistent/x.safetensors")
        .err()
        .unwrap();
    assert_eq!(e.kind, ErrorKind::Checkpoint);
}

#[test]
fn rewritten_files_are_not_served_a_stale_header() {
    let path = TempPath::new(".shard");
    let mut cases = cases();
    write(&path.0, &cases, None, 1000);
    let first = read_header(&path.0).unwrap();
    cases[1]
        .data
        .iter_mut()
        .for_each(|b| *b = b.wrapping_add(1));
    write(&path.0, &cases, None, 1000);
    let second = read_header(&path.0).unwrap();
    assert_ne!(
        first.tensor("odd.u8").unwrap().checksums(),
        second.tensor("odd.u8").unwrap().checksums()
    );
    ShardReader::open(&path.0)
        .unwrap()
        .view()
        .verify(1)
        .unwrap();
}

#[test]
fn bad_requests_are_invalid_arguments() {
    let path = TempPath::new(".shard");
    write(&path.0, &cases(), None, 1000);
    let reader = ShardReader::open(&path.0).unwrap();
    let mut out = vec![0; 4];
    let e = reader
        .view()
        .read_range("odd.u8", 18, &mut out, true, 1)
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    let e = reader
        .view()
        .read_range("nope", 0, &mut out, true, 1)
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    let e = reader
        .view()
        .read_range("odd.u8", u64::MAX, &mut out, true, 1)
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    reader
        .view()
        .read_range("empty", 0, &mut [], true, 1)
        .unwrap();
}

#[test]
fn writer_rejects_bad_input() {
    let path = TempPath::new(".shard");
    let data = [0u8; 8];
    let t = |name: &str, shape: Vec<u64>| TensorData {
        name: name.to_owned(),
        dtype: DType::F32,
        shape,
        data: &data,
    };
    let meta = BTreeMap::new();
    let opts = WriteOptions::default();
    let e = write_shard(&path.0, &[t("a", vec![3])], &meta, &opts).unwrap_err();
    assert!(
        e.kind == ErrorKind::InvalidArgument && e.message.contains("\"a\""),
        "{e}"
    );
    let e = write_shard(&path.0, &[t("a", vec![2]), t("a", vec![2])], &meta, &opts).unwrap_err();
    assert!(e.message.contains("twice"), "{e}");
    let e = write_shard(&path.0, &[t("__metadata__", vec![2])], &meta, &opts).unwrap_err();
    assert!(e.message.contains("reserved"), "{e}");
    let bad_meta = BTreeMap::from([("shardline".to_owned(), String::new())]);
    let e = write_shard(&path.0, &[], &bad_meta, &opts).unwrap_err();
    assert!(e.message.contains("reserved"), "{e}");
    let zero = WriteOptions {
        chunk_bytes: 0,
        ..opts
    };
    assert!(write_shard(&path.0, &[], &meta, &zero).is_err());
    let level = WriteOptions {
        compress: Some(1000),
        ..opts
    };
    assert!(write_shard(&path.0, &[], &meta, &level).is_err());
    assert!(!std::path::Path::new(&path.0).exists());
    // An empty shard is a valid file.
    write_shard(&path.0, &[], &meta, &opts).unwrap();
    assert!(ShardReader::open(&path.0)
        .unwrap()
        .header()
        .tensors
        .is_empty());
}

#[test]
fn foreign_files_without_checksums_need_verify_off() {
    let path = TempPath::new(".safetensors");
    let json = r#"{"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}}"#;
    let mut file = (json.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(json.as_bytes());
    file.extend_from_slice(&[1, 2, 3]);
    std::fs::write(&path.0, &file).unwrap();
    let reader = ShardReader::open(&path.0).unwrap();
    let mut out = [0u8; 3];
    let e = reader
        .view()
        .read_range("a", 0, &mut out, true, 1)
        .unwrap_err();
    assert!(e.message.contains("verify=False"), "{e}");
    reader
        .view()
        .read_range("a", 0, &mut out, false, 1)
        .unwrap();
    assert_eq!(out, [1, 2, 3]);
    assert!(reader.view().verify(1).is_err());
}

/// A small plain + compressed file, built once, for the mutation proptest.
fn sample(compress: Option<i32>) -> Vec<u8> {
    let path = TempPath::new(".shard");
    let cases: Vec<Case> = cases()
        .into_iter()
        .filter(|c| c.data.len() < 3000)
        .collect();
    write(&path.0, &cases, compress, 512);
    std::fs::read(&path.0).unwrap()
}

fn read_everything(bytes: &[u8]) {
    let Ok(header) = ShardHeader::parse("p", bytes) else {
        return;
    };
    let view = ShardView {
        path: "p",
        header: &header,
        bytes,
        map: None,
        file: None,
    };
    for t in &header.tensors {
        let mut out = vec![0; t.raw_bytes.min(1 << 20) as usize];
        let _ = view.read_range(&t.name, 0, &mut out, true, 1);
        let _ = view.read_range(&t.name, 0, &mut out, false, 1);
    }
    let _ = view.verify(1);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn mutated_files_never_panic(
        compress in prop_oneof![Just(None), Just(Some(1))],
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in proptest::option::of(any::<prop::sample::Index>()),
    ) {
        static PLAIN: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        static PACKED: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        let base = match compress {
            None => PLAIN.get_or_init(|| sample(None)),
            Some(_) => PACKED.get_or_init(|| sample(Some(1))),
        };
        // The JSON without its padding.
        let json = base.iter().rposition(|&b| b == b'}').unwrap() - 7;
        let mut bytes = base.clone();
        for (at, value) in edits {
            // Mostly edit the JSON (where structure lives), else anywhere; mostly
            // digits to digits, so that many mutants still parse and get read.
            let i = if value % 3 == 0 { at.index(bytes.len()) } else { 8 + at.index(json) };
            bytes[i] = match value % 4 {
                _ if bytes[i].is_ascii_digit() && value % 5 != 0 => b'0' + value % 10,
                0 => b"[],:{}\"-0"[value as usize % 9],
                _ => value,
            };
        }
        if let Some(cut) = cut {
            bytes.truncate(cut.index(bytes.len() + 1));
        }
        read_everything(&bytes);
    }
}

#[test]
fn large_reads_split_across_threads() {
    // 12 MiB: past the size where reads go parallel; 1 MiB chunks, so several jobs.
    let data = random_bytes(12 << 20, 99);
    for compress in [None, Some(1)] {
        let path = TempPath::new(".shard");
        let tensors = [TensorData {
            name: "w".to_owned(),
            dtype: DType::U8,
            shape: vec![data.len() as u64],
            data: &data,
        }];
        let options = WriteOptions {
            compress,
            chunk_bytes: 1 << 20,
            threads: 4,
        };
        let report = write_shard(&path.0, &tensors, &BTreeMap::new(), &options).unwrap();
        let reader = ShardReader::open(&path.0).unwrap();
        let mut out = vec![0; data.len()];
        reader.view().read_range("w", 0, &mut out, true, 4).unwrap();
        assert!(out == data);
        let mut part = vec![0; 9 << 20];
        reader
            .view()
            .read_range("w", 12345, &mut part, true, 3)
            .unwrap();
        assert!(part[..] == data[12345..12345 + part.len()]);
        reader.view().verify(4).unwrap();

        // Corrupt the stored bytes of chunk/frame 7: the parallel read names it.
        drop(reader);
        let w = &report.tensors[0];
        let mut file = std::fs::read(&path.0).unwrap();
        let at = match compress {
            None => w.offset as usize + (7 << 20) + 5,
            Some(_) => {
                let h = read_header(&path.0).unwrap();
                let Encoding::Zstd { frames, .. } = &h.tensor("w").unwrap().encoding else {
                    panic!("compressed");
                };
                w.offset as usize + frames[7].offset as usize + 100
            }
        };
        file[at] ^= 1;
        std::fs::write(&path.0, &file).unwrap();
        let reader = ShardReader::open(&path.0).unwrap();
        let e = reader
            .view()
            .read_range("w", 0, &mut out, true, 4)
            .unwrap_err();
        assert!(
            e.kind == ErrorKind::Checkpoint && e.message.contains(" 7 "),
            "{e}"
        );
        let e = reader.view().verify(4).unwrap_err();
        assert!(e.message.contains(" 7 "), "{e}");
    }
}
