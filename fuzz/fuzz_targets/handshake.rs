//! Both handshake roles against a peer that sends arbitrary bytes then closes: each must end
//! with a typed error (or, for the impossible forged proof, not at all), never a panic or hang.
#![no_main]

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use shardline::transport::auth;

/// Our end of a socket pair whose other end (returned second, kept open for our writes) has
/// sent `data` and closed its writing half.
fn peer_sends(data: &[u8]) -> (UnixStream, UnixStream) {
    let (mut theirs, ours) = UnixStream::pair().expect("socketpair");
    // Socket buffers hold far more than libFuzzer's default input sizes.
    let _ = theirs.write_all(&data[..data.len().min(64 * 1024)]);
    let _ = theirs.shutdown(std::net::Shutdown::Write);
    ours.set_nonblocking(true).expect("nonblocking");
    (ours, theirs)
}

fuzz_target!(|data: &[u8]| {
    let deadline = Instant::now() + Duration::from_millis(50);
    let (mut s, _peer) = peer_sends(data);
    assert!(auth::accept_handshake(&mut s, b"secret", 7, 1, &[0], deadline).is_err());
    let (mut s, _peer) = peer_sends(data);
    assert!(auth::connect_handshake(&mut s, b"secret", 7, 0, 1, deadline).is_err());
});
