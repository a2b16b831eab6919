//! HMAC-SHA256 challenge-response: both ends of a TCP connection prove the shared secret.
//!
//! 1. connector → acceptor `Hello`: its rank, a 32-byte nonce (group tag in the header);
//! 2. acceptor → connector `Challenge`: its rank, its nonce, `MAC("server")`;
//! 3. connector verifies, → acceptor `Proof`: `MAC("client")`;
//! 4. acceptor verifies, → connector `Welcome`.
//!
//! `MAC(role) = HMAC-SHA256(secret, "shardline-v1" ‖ group tag ‖ connector rank ‖ acceptor rank
//! ‖ connector nonce ‖ acceptor nonce ‖ role)`, integers little-endian. Fresh nonces on both
//! sides defeat replay; MACs are compared in constant time. A side that rejects the other sends
//! an `Abort` frame saying why before it closes, so both ends report the same cause.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::time::Instant;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::frame::{self, FrameType, Header, HEADER_BYTES};
use super::sockio::{read_full, write_full, Fail};
use crate::error::{Error, ErrorKind, Result};

/// Bytes in a handshake nonce.
pub const NONCE_BYTES: usize = 32;
/// Bytes in a handshake MAC.
pub const MAC_BYTES: usize = 32;

const HELLO_BYTES: usize = 4 + NONCE_BYTES;
const CHALLENGE_BYTES: usize = 4 + NONCE_BYTES + MAC_BYTES;

/// What a rank should check when the other side's proof is wrong.
pub const SECRET_HINT: &str = "SHARDLINE_SECRET must be identical on every rank (shardline run \
                               generates one per job and hands it to its workers); check that \
                               both ranks belong to the same job";

/// Maps a socket failure during the handshake to an error.
pub(crate) fn handshake_io_error(f: Fail, step: &str) -> Error {
    match f {
        Fail::Closed(why) => Error::new(
            ErrorKind::PeerLost,
            format!("connection closed during the handshake ({step}): {why}"),
        ),
        Fail::Timeout => Error::new(
            ErrorKind::Timeout,
            format!("handshake timed out ({step}); the peer is silent or overloaded"),
        ),
        Fail::Unanswered(why) => Error::new(
            ErrorKind::PeerLost,
            format!("the peer stopped answering during the handshake ({step}): {why}"),
        ),
        Fail::Os(e) => Error::io(format!("handshake ({step})"), e),
        Fail::Interrupted => Error::new(
            ErrorKind::Closed,
            format!("the handshake ({step}) was interrupted: a signal handler raised"),
        ),
    }
}

fn write_frame<S: Write + AsRawFd>(
    s: &mut S,
    frame_type: FrameType,
    group: u64,
    payload: &[u8],
    deadline: Instant,
) -> Result<()> {
    let header = Header {
        frame_type,
        flags: 0,
        group,
        sig: None,
        payload_len: payload.len() as u64,
    };
    write_full(s, &frame::encode_header(&header), payload, deadline)
        .map_err(|f| handshake_io_error(f, "write"))
}

/// Reads one handshake frame of `expect` type and exactly `len` payload bytes; an `Abort`
/// frame becomes the error it carries.
fn read_frame<S: Read + AsRawFd>(
    s: &mut S,
    expect: FrameType,
    group: u64,
    len: usize,
    deadline: Instant,
) -> Result<Vec<u8>> {
    let step = format!("waiting for {expect:?}");
    let mut hb = [0u8; HEADER_BYTES];
    read_full(s, &mut hb, deadline).map_err(|f| handshake_io_error(f, &step))?;
    let h = frame::decode_header(&hb)?;
    if h.frame_type == FrameType::Abort {
        // decode_header capped an abort's payload at 64 KiB + 5, so this allocation is bounded.
        let mut payload = vec![0u8; h.payload_len as usize];
        read_full(s, &mut payload, deadline).map_err(|f| handshake_io_error(f, &step))?;
        return Err(frame::abort_error(&payload));
    }
    if h.frame_type != expect || h.payload_len != len as u64 {
        return Err(Error::protocol(format!(
            "expected a {expect:?} frame of {len} bytes, got {:?} of {}",
            h.frame_type, h.payload_len
        )));
    }
    if h.group != group {
        return Err(Error::protocol(format!(
            "the peer belongs to another process group (tag {:#018x}, ours {group:#018x}); check \
             the addresses each rank publishes",
            h.group
        )));
    }
    // Only now, with type and length checked, is anything allocated.
    let mut payload = vec![0u8; len];
    read_full(s, &mut payload, deadline).map_err(|f| handshake_io_error(f, &step))?;
    Ok(payload)
}

fn nonce() -> Result<[u8; NONCE_BYTES]> {
    let mut n = [0u8; NONCE_BYTES];
    getrandom::getrandom(&mut n).map_err(|e| {
        Error::new(
            ErrorKind::Io,
            format!("no randomness for a handshake nonce: {e}"),
        )
    })?;
    Ok(n)
}

fn mac(
    secret: &[u8],
    group: u64,
    client: u32,
    server: u32,
    cn: &[u8],
    sn: &[u8],
    role: &str,
) -> Hmac<Sha256> {
    let mut m = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes keys of any length");
    m.update(b"shardline-v1");
    m.update(&group.to_le_bytes());
    m.update(&client.to_le_bytes());
    m.update(&server.to_le_bytes());
    m.update(cn);
    m.update(sn);
    m.update(role.as_bytes());
    m
}

fn check_secret(secret: &[u8]) -> Result<()> {
    if secret.is_empty() {
        return Err(Error::invalid(
            "the shared secret is empty; set SHARDLINE_SECRET (the same value on every rank)",
        ));
    }
    Ok(())
}

/// Best-effort abort frame (the connection is about to be dropped anyway).
fn refuse<S: Write + AsRawFd>(
    s: &mut S,
    group: u64,
    my_rank: usize,
    err: &Error,
    deadline: Instant,
) {
    let payload = frame::encode_abort(err.kind, my_rank as u32, &err.message);
    let _ = write_frame(s, FrameType::Abort, group, &payload, deadline);
}

/// Runs the connector's side against the acceptor that should be rank `peer_rank`.
pub fn connect_handshake<S: Read + Write + AsRawFd>(
    s: &mut S,
    secret: &[u8],
    group: u64,
    my_rank: usize,
    peer_rank: usize,
    deadline: Instant,
) -> Result<()> {
    check_secret(secret)?;
    let cn = nonce()?;
    let mut hello = Vec::with_capacity(HELLO_BYTES);
    hello.extend_from_slice(&(my_rank as u32).to_le_bytes());
    hello.extend_from_slice(&cn);
    write_frame(s, FrameType::Hello, group, &hello, deadline)?;
    let ch = read_frame(s, FrameType::Challenge, group, CHALLENGE_BYTES, deadline)?;
    let server = u32::from_le_bytes(ch[0..4].try_into().expect("4 bytes"));
    if server as usize != peer_rank {
        let err = Error::protocol(format!(
            "expected rank {peer_rank} at this address but rank {server} answered; the address \
             list is stale or two jobs share a host"
        ));
        refuse(s, group, my_rank, &err, deadline);
        return Err(err);
    }
    let sn = &ch[4..4 + NONCE_BYTES];
    let their = &ch[4 + NONCE_BYTES..];
    if mac(secret, group, my_rank as u32, server, &cn, sn, "server")
        .verify_slice(their)
        .is_err()
    {
        let err = Error::new(
            ErrorKind::Auth,
            format!(
                "rank {peer_rank} failed the HMAC handshake with rank {my_rank}: it holds a \
                 different shared secret. {SECRET_HINT}"
            ),
        );
        refuse(s, group, my_rank, &err, deadline);
        return Err(err);
    }
    let proof = mac(secret, group, my_rank as u32, server, &cn, sn, "client")
        .finalize()
        .into_bytes();
    write_frame(s, FrameType::Proof, group, &proof, deadline)?;
    read_frame(s, FrameType::Welcome, group, 0, deadline)?;
    Ok(())
}

/// Runs the acceptor's side; returns the connector's authenticated rank, which must be one of
/// `expected`.
pub fn accept_handshake<S: Read + Write + AsRawFd>(
    s: &mut S,
    secret: &[u8],
    group: u64,
    my_rank: usize,
    expected: &[usize],
    deadline: Instant,
) -> Result<usize> {
    check_secret(secret)?;
    let hello = read_frame(s, FrameType::Hello, group, HELLO_BYTES, deadline)?;
    let client = u32::from_le_bytes(hello[0..4].try_into().expect("4 bytes"));
    if !expected.contains(&(client as usize)) {
        let err = Error::protocol(format!(
            "rank {client} connected to rank {my_rank}, which expects connections only from \
             ranks {expected:?}"
        ));
        refuse(s, group, my_rank, &err, deadline);
        return Err(err);
    }
    let cn = &hello[4..];
    let sn = nonce()?;
    let mut ch = Vec::with_capacity(CHALLENGE_BYTES);
    ch.extend_from_slice(&(my_rank as u32).to_le_bytes());
    ch.extend_from_slice(&sn);
    ch.extend_from_slice(
        &mac(secret, group, client, my_rank as u32, cn, &sn, "server")
            .finalize()
            .into_bytes(),
    );
    write_frame(s, FrameType::Challenge, group, &ch, deadline)?;
    let proof = read_frame(s, FrameType::Proof, group, MAC_BYTES, deadline)?;
    if mac(secret, group, client, my_rank as u32, cn, &sn, "client")
        .verify_slice(&proof)
        .is_err()
    {
        let err = Error::new(
            ErrorKind::Auth,
            format!(
                "a connection claiming to be rank {client} failed the HMAC handshake with rank \
                 {my_rank}: it holds a different shared secret. {SECRET_HINT}"
            ),
        );
        refuse(s, group, my_rank, &err, deadline);
        return Err(err);
    }
    write_frame(s, FrameType::Welcome, group, &[], deadline)?;
    Ok(client as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;
    use std::time::Duration;

    fn pair() -> (UnixStream, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        b.set_nonblocking(true).unwrap();
        (a, b)
    }

    fn run(cs: &'static [u8], ss: &'static [u8], cg: u64, sg: u64) -> (Result<()>, Result<usize>) {
        let (mut a, mut b) = pair();
        let deadline = Instant::now() + Duration::from_secs(5);
        let t = std::thread::spawn(move || accept_handshake(&mut b, ss, sg, 1, &[0], deadline));
        let c = connect_handshake(&mut a, cs, cg, 0, 1, deadline);
        (c, t.join().unwrap())
    }

    #[test]
    fn same_secret_succeeds() {
        let (c, s) = run(b"s3cret", b"s3cret", 9, 9);
        c.unwrap();
        assert_eq!(s.unwrap(), 0);
    }

    #[test]
    fn wrong_secret_fails_with_auth_on_both_sides() {
        let (c, s) = run(b"one", b"two", 9, 9);
        let (c, s) = (c.unwrap_err(), s.unwrap_err());
        assert_eq!(c.kind, ErrorKind::Auth, "{c}");
        assert!(c.message.contains("SHARDLINE_SECRET"), "{c}");
        assert_eq!(s.kind, ErrorKind::Auth, "{s}");
    }

    #[test]
    fn other_group_is_refused() {
        let (c, s) = run(b"k", b"k", 1, 2);
        assert_eq!(s.unwrap_err().kind, ErrorKind::Protocol);
        assert!(c.is_err());
    }

    #[test]
    fn garbage_and_silence_are_typed_errors() {
        let (mut a, mut b) = pair();
        a.write_all(&[0xAB; 100]).unwrap();
        let d = Instant::now() + Duration::from_millis(200);
        assert_eq!(
            accept_handshake(&mut b, b"k", 0, 1, &[0], d)
                .unwrap_err()
                .kind,
            ErrorKind::Protocol
        );
        let (_a, mut b) = pair();
        let d = Instant::now() + Duration::from_millis(50);
        assert_eq!(
            accept_handshake(&mut b, b"k", 0, 1, &[0], d)
                .unwrap_err()
                .kind,
            ErrorKind::Timeout
        );
    }

    // Bounded stand-in for the cargo-fuzz `handshake` target, run by every `cargo test`.
    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        #[test]
        fn garbage_handshakes_are_typed_errors(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400)) {
            for connector in [false, true] {
                let (mut ours, mut theirs) = pair();
                theirs.write_all(&data).unwrap();
                theirs.shutdown(std::net::Shutdown::Write).unwrap();
                let d = Instant::now() + Duration::from_millis(100);
                let r = if connector {
                    connect_handshake(&mut ours, b"k", 7, 0, 1, d)
                } else {
                    accept_handshake(&mut ours, b"k", 7, 1, &[0], d).map(|_| ())
                };
                proptest::prop_assert!(r.is_err());
            }
        }
    }

    #[test]
    fn huge_data_frame_in_handshake_is_rejected_without_allocating() {
        // Found by cargo fuzz: a Data header announcing ~350 GB used to be allocated for.
        let (mut ours, mut theirs) = pair();
        let sig = crate::signature::OpSig::new(
            crate::signature::OpKind::Send,
            crate::dtype::DType::U8,
            1,
        );
        let h = Header {
            frame_type: FrameType::Data,
            flags: 0,
            group: 7,
            sig: Some(sig),
            payload_len: 0x53_0000_0000,
        };
        theirs.write_all(&frame::encode_header(&h)).unwrap();
        let d = Instant::now() + Duration::from_millis(100);
        let e = accept_handshake(&mut ours, b"k", 7, 1, &[0], d).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Protocol, "{e}");
    }

    #[test]
    fn empty_secret_is_invalid() {
        let (mut a, _b) = pair();
        let d = Instant::now() + Duration::from_millis(50);
        let e = connect_handshake(&mut a, b"", 0, 0, 1, d).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
    }
}
