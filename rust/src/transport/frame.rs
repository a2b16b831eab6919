//! TCP frame headers: a fixed little-endian header, checked before anything is allocated.
//!
//! Layout ([`HEADER_BYTES`] = 48 bytes):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `b"SHL1"` |
//! | 4 | 2 | version (u16) |
//! | 6 | 1 | frame type ([`FrameType`]) |
//! | 7 | 1 | flags (must be 0) |
//! | 8 | 8 | group tag ([`group_tag`] of the process-group name) |
//! | 16 | 24 | [`OpSig::encode`], or all zeros for frames that carry no op |
//! | 40 | 8 | payload length (u64) |
//!
//! The payload follows the header as raw bytes. An `Abort` frame's payload is
//! (error-kind tag u8, rank u32, UTF-8 message of at most [`MAX_ABORT_MESSAGE`] bytes).

use sha2::{Digest, Sha256};

use crate::error::{Error, ErrorKind, Result};
use crate::signature::{OpSig, SIG_BYTES};

/// First four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"SHL1";
/// Wire protocol version; peers with another version are refused.
pub const VERSION: u16 = 1;
/// Size of an encoded [`Header`].
pub const HEADER_BYTES: usize = 48;
/// Largest data payload a header may announce (1 TiB); real limits are the caller's buffer.
pub const MAX_DATA_PAYLOAD: u64 = 1 << 40;
/// Largest message an `Abort` frame carries, in bytes.
pub const MAX_ABORT_MESSAGE: usize = 64 * 1024;
/// Largest handshake payload (hello, challenge, proof).
pub const MAX_HANDSHAKE_PAYLOAD: u64 = 128;

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameType {
    /// Collective or point-to-point data, tagged with the sender's [`OpSig`].
    Data = 1,
    /// The sender failed; the payload says why ([`encode_abort`]).
    Abort = 2,
    /// Handshake step 1, connector to acceptor: rank and nonce.
    Hello = 3,
    /// Handshake step 2, acceptor to connector: rank, nonce and the acceptor's MAC.
    Challenge = 4,
    /// Handshake step 3, connector to acceptor: the connector's MAC.
    Proof = 5,
    /// Handshake step 4, acceptor to connector: the connection is accepted.
    Welcome = 6,
}

impl FrameType {
    /// The frame type for a wire tag, if known.
    pub fn from_tag(tag: u8) -> Option<Self> {
        use FrameType::*;
        [Data, Abort, Hello, Challenge, Proof, Welcome]
            .into_iter()
            .find(|t| *t as u8 == tag)
    }

    /// Largest payload a frame of this type may carry.
    pub fn max_payload(self) -> u64 {
        match self {
            FrameType::Data => MAX_DATA_PAYLOAD,
            FrameType::Abort => (5 + MAX_ABORT_MESSAGE) as u64,
            _ => MAX_HANDSHAKE_PAYLOAD,
        }
    }
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// What the frame is.
    pub frame_type: FrameType,
    /// Reserved flags (0).
    pub flags: u8,
    /// [`group_tag`] of the sender's process group.
    pub group: u64,
    /// The sender's op signature (always present on `Data` frames).
    pub sig: Option<OpSig>,
    /// Bytes of payload after the header.
    pub payload_len: u64,
}

/// A stable 64-bit tag for a process-group name (first 8 bytes of a SHA-256).
pub fn group_tag(name: &str) -> u64 {
    let digest = Sha256::new()
        .chain_update(b"shardline-group\0")
        .chain_update(name.as_bytes())
        .finalize();
    u64::from_le_bytes(digest[..8].try_into().expect("8 bytes"))
}

/// Encodes `header` into its fixed 48-byte form.
pub fn encode_header(header: &Header) -> [u8; HEADER_BYTES] {
    let mut out = [0u8; HEADER_BYTES];
    out[0..4].copy_from_slice(&MAGIC);
    out[4..6].copy_from_slice(&VERSION.to_le_bytes());
    out[6] = header.frame_type as u8;
    out[7] = header.flags;
    out[8..16].copy_from_slice(&header.group.to_le_bytes());
    if let Some(sig) = &header.sig {
        out[16..40].copy_from_slice(&sig.encode());
    }
    out[40..48].copy_from_slice(&header.payload_len.to_le_bytes());
    out
}

/// Decodes and validates a header: magic, version, type, flags, signature and payload length
/// (against the type's limit), all before the caller allocates or reads anything else.
pub fn decode_header(bytes: &[u8; HEADER_BYTES]) -> Result<Header> {
    if bytes[0..4] != MAGIC {
        return Err(Error::protocol(format!(
            "bad frame magic {:02x?} (expected {:02x?}); the peer is not a shardline rank of this \
             version, or the stream is out of sync",
            &bytes[0..4],
            MAGIC
        )));
    }
    let version = u16::from_le_bytes([bytes[4], bytes[5]]);
    if version != VERSION {
        return Err(Error::protocol(format!(
            "peer speaks shardline wire version {version}, this rank speaks {VERSION}; install \
             the same shardline version on every host"
        )));
    }
    let frame_type = FrameType::from_tag(bytes[6])
        .ok_or_else(|| Error::protocol(format!("unknown frame type {}", bytes[6])))?;
    let flags = bytes[7];
    if flags != 0 {
        return Err(Error::protocol(format!("unknown frame flags {flags:#04x}")));
    }
    let group = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
    let sig_bytes: &[u8; SIG_BYTES] = bytes[16..40].try_into().expect("24 bytes");
    if sig_bytes[3] != 0 {
        // OpSig's padding byte: reserved, so every accepted header has one encoding.
        return Err(Error::protocol(format!(
            "reserved signature byte is {:#04x}, expected 0",
            sig_bytes[3]
        )));
    }
    let sig = if sig_bytes.iter().all(|b| *b == 0) {
        None
    } else {
        Some(OpSig::decode(sig_bytes)?)
    };
    if frame_type == FrameType::Data && sig.is_none() {
        return Err(Error::protocol("data frame without an op signature"));
    }
    let payload_len = u64::from_le_bytes(bytes[40..48].try_into().expect("8 bytes"));
    if payload_len > frame_type.max_payload() {
        return Err(Error::protocol(format!(
            "{frame_type:?} frame announces {payload_len} payload bytes, more than the limit of {}",
            frame_type.max_payload()
        )));
    }
    Ok(Header {
        frame_type,
        flags,
        group,
        sig,
        payload_len,
    })
}

/// Encodes an abort payload; the message is cut (on a character boundary) to
/// [`MAX_ABORT_MESSAGE`] bytes.
pub fn encode_abort(kind: ErrorKind, rank: u32, message: &str) -> Vec<u8> {
    let mut end = message.len().min(MAX_ABORT_MESSAGE);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    let mut out = Vec::with_capacity(5 + end);
    out.push(kind as u8);
    out.extend_from_slice(&rank.to_le_bytes());
    out.extend_from_slice(&message.as_bytes()[..end]);
    out
}

/// Decodes an abort payload into (kind, rank, message).
pub fn decode_abort(payload: &[u8]) -> Result<(ErrorKind, u32, String)> {
    if payload.len() < 5 || payload.len() > 5 + MAX_ABORT_MESSAGE {
        return Err(Error::protocol(format!(
            "abort frame payload of {} bytes (expected 5..={})",
            payload.len(),
            5 + MAX_ABORT_MESSAGE
        )));
    }
    let kind = ErrorKind::from_tag(payload[0]);
    let rank = u32::from_le_bytes(payload[1..5].try_into().expect("4 bytes"));
    let message = std::str::from_utf8(&payload[5..])
        .map_err(|_| Error::protocol("abort frame message is not UTF-8"))?
        .to_owned();
    Ok((kind, rank, message))
}

/// The error a peer's abort frame stands for: its kind, and "rank R aborted: ...".
pub fn abort_error(payload: &[u8]) -> Error {
    match decode_abort(payload) {
        Ok((kind, rank, message)) => Error::new(kind, format!("rank {rank} aborted: {message}")),
        Err(e) => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::reduce::ReduceOp;
    use crate::signature::OpKind;
    use proptest::prelude::*;

    fn any_sig() -> impl Strategy<Value = OpSig> {
        (
            1u8..=11,
            0u8..9,
            0u8..5,
            any::<u32>(),
            any::<u64>(),
            any::<u64>(),
        )
            .prop_map(|(k, d, r, root, count, seq)| OpSig {
                kind: OpKind::from_tag(k).unwrap(),
                dtype: DType::from_tag(d).unwrap(),
                reduce: ReduceOp::from_tag(r).unwrap(),
                root,
                count,
                seq,
            })
    }

    proptest! {
        #[test]
        fn header_round_trips(t in 1u8..=6, group in any::<u64>(), sig in any_sig(), len in 0u64..=128) {
            let frame_type = FrameType::from_tag(t).unwrap();
            let h = Header { frame_type, flags: 0, group, sig: Some(sig), payload_len: len };
            prop_assert_eq!(decode_header(&encode_header(&h)).unwrap(), h);
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::array::uniform32(any::<u8>()), tail in proptest::array::uniform16(any::<u8>())) {
            let mut all = [0u8; HEADER_BYTES];
            all[..32].copy_from_slice(&bytes);
            all[32..].copy_from_slice(&tail);
            let _ = decode_header(&all);
            let _ = decode_abort(&all);
        }

        #[test]
        fn abort_round_trips(tag in 1u8..=9, rank in any::<u32>(), msg in ".{0,200}") {
            let kind = ErrorKind::from_tag(tag);
            let (k, r, m) = decode_abort(&encode_abort(kind, rank, &msg)).unwrap();
            prop_assert_eq!((k, r, m), (kind, rank, msg));
        }
    }

    #[test]
    fn oversize_and_bad_fields_are_rejected() {
        let sig = OpSig::new(OpKind::AllReduce, DType::F32, 4);
        let h = Header {
            frame_type: FrameType::Data,
            flags: 0,
            group: 7,
            sig: Some(sig),
            payload_len: 16,
        };
        let good = encode_header(&h);
        let mut b = good;
        b[40..48].copy_from_slice(&(1u64 << 63).to_le_bytes());
        assert!(decode_header(&b).unwrap_err().message.contains("limit"));
        let mut b = good;
        b[6] = FrameType::Abort as u8;
        b[40..48].copy_from_slice(&(1u64 << 20).to_le_bytes());
        assert!(decode_header(&b).is_err());
        let mut b = good;
        b[0] = b'X';
        assert!(decode_header(&b).unwrap_err().message.contains("magic"));
        let mut b = good;
        b[4] = 9;
        assert!(decode_header(&b).unwrap_err().message.contains("version"));
        let mut b = good;
        b[6] = 0;
        assert!(decode_header(&b).is_err());
        let mut b = good;
        b[19] = 0x31; // padding byte of the signature (found by cargo fuzz)
        assert!(decode_header(&b).unwrap_err().message.contains("reserved"));
        let mut b = good;
        b[16..40].fill(0);
        assert!(decode_header(&b).unwrap_err().message.contains("signature"));
    }

    #[test]
    fn abort_message_is_capped_and_error_names_rank() {
        let long = "é".repeat(MAX_ABORT_MESSAGE);
        let payload = encode_abort(ErrorKind::Mismatch, 3, &long);
        assert!(payload.len() <= 5 + MAX_ABORT_MESSAGE);
        let err = abort_error(&payload);
        assert_eq!(err.kind, ErrorKind::Mismatch);
        assert!(err.message.starts_with("rank 3 aborted: é"));
        assert_ne!(group_tag("a"), group_tag("b"));
    }
}
