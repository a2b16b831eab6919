use super::*;
use crate::shard::encode::encode_json;
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
