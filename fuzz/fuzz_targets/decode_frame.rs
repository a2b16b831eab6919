//! Frame headers and abort payloads from arbitrary bytes: typed errors, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shardline::transport::frame::{self, HEADER_BYTES};

fuzz_target!(|data: &[u8]| {
    if let Some(head) = data.get(..HEADER_BYTES) {
        let head: &[u8; HEADER_BYTES] = head.try_into().expect("HEADER_BYTES bytes");
        if let Ok(h) = frame::decode_header(head) {
            // Whatever decodes re-encodes to the same bytes.
            assert_eq!(&frame::encode_header(&h), head);
            assert!(h.payload_len <= h.frame_type.max_payload());
        }
    }
    let _ = frame::decode_abort(data);
    let _ = frame::abort_error(data);
});
