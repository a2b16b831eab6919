//! Failing fast while linking: a setup that is cancelled (another rank failed while joining)
//! ends at once with the cancel's error instead of waiting out its deadline.

use std::sync::Arc;
use std::time::{Duration, Instant};

use shardline::transport::tcp::{Cancel, LinkOptions, TcpListenerHandle, TcpMesh};
use shardline::{Error, ErrorKind};

const SECRET: &[u8] = b"correct horse battery staple";

/// Rank `rank` of two links while the other rank never shows up; `cancel` fires after
/// `after`. Returns the error and how long the setup took.
fn link_alone(rank: usize, after: Option<Duration>) -> (Error, Duration) {
    let mine = TcpListenerHandle::bind("127.0.0.1").unwrap();
    // The other rank's listener exists (its port accepts connections) but nobody serves it.
    let silent = TcpListenerHandle::bind("127.0.0.1").unwrap();
    let mut addrs = vec![String::new(); 2];
    addrs[rank] = mine.address();
    addrs[1 - rank] = silent.address();
    let start = Instant::now();
    let cancel = after.map(|after| {
        Cancel(Arc::new(move || {
            (start.elapsed() >= after).then(|| {
                Error::new(
                    ErrorKind::PeerLost,
                    "rank 9 failed while joining the job: it had no GPU",
                )
            })
        }))
    });
    let opts = LinkOptions {
        keepalive: Duration::from_secs(30),
        cancel,
    };
    let deadline = start + Duration::from_secs(4);
    let err = TcpMesh::connect(
        rank,
        2,
        &addrs,
        &[1 - rank],
        mine,
        SECRET,
        "g",
        deadline,
        &opts,
    )
    .err()
    .expect("the other rank never links");
    (err, start.elapsed())
}

#[test]
fn a_cancelled_setup_ends_at_once_with_the_cancels_error() {
    // Rank 0 dials (and waits in a handshake nobody answers); rank 1 accepts (and waits for
    // a connection that never comes): both are cut short.
    for rank in [0, 1] {
        let (err, took) = link_alone(rank, Some(Duration::from_millis(300)));
        assert_eq!(err.kind, ErrorKind::PeerLost, "rank {rank}: {err}");
        assert!(err.message.contains("rank 9 failed"), "rank {rank}: {err}");
        assert!(took < Duration::from_secs(2), "rank {rank} took {took:?}");
    }
}

#[test]
fn without_a_cancel_the_setup_waits_for_its_deadline() {
    let (err, took) = link_alone(1, None);
    assert_eq!(err.kind, ErrorKind::Timeout, "{err}");
    assert!(
        err.message
            .contains("timed out waiting for connections from rank 0"),
        "{err}"
    );
    assert!(took >= Duration::from_secs(4), "{took:?}");
}
