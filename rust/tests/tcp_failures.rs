//! A TCP mesh when something goes wrong: ranks that disagree on an op, a peer lost or
//! silent, a wrong secret, connections that are not ranks at all, and a setup cancelled while
//! linking (another rank failed while joining). Each ends in a clear error on every rank
//! involved, quickly, instead of a hang.

mod tcp_world;

use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shardline::collectives::direct;
use shardline::transport::tcp::{Cancel, LinkOptions, TcpListenerHandle, TcpMesh};
use shardline::{DType, Error, ErrorKind, OpKind, OpSig, ReduceOp, Result};
use tcp_world::{
    assert_close, deadline, decode, input, mesh_world, reference, sum_f32, with_world, SECRET,
};

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

/// Runs `op` on each rank; on error, aborts the mesh and returns the error.
fn run_or_abort(mesh: &mut TcpMesh, op: impl FnOnce(&mut TcpMesh) -> Result<()>) -> Result<()> {
    let r = op(mesh);
    if let Err(e) = &r {
        mesh.abort_all(e);
    }
    r
}

#[test]
fn mismatched_signatures_fail_every_rank() {
    let errs: Vec<Error> = mesh_world(4, |rank, mesh| {
        let members = [0, 1, 2, 3];
        let count = if rank == 3 { 9 } else { 8 };
        run_or_abort(mesh, |m| {
            let sig = OpSig::new(OpKind::Broadcast, DType::F32, count);
            let mut buf = vec![0u8; count * 4];
            direct::broadcast(m, &members, &mut buf, 0, &sig, deadline())?;
            direct::barrier(
                m,
                &members,
                &OpSig {
                    seq: 1,
                    ..OpSig::new(OpKind::Barrier, DType::U8, 0)
                },
                deadline(),
            )
        })
        .unwrap_err()
    });
    for (rank, e) in errs.iter().enumerate() {
        assert_eq!(e.kind, ErrorKind::Mismatch, "rank {rank}: {e}");
    }
    assert!(
        errs[3]
            .message
            .contains("while rank 3 called broadcast(float32, 9"),
        "{}",
        errs[3]
    );
    assert!(
        errs.iter().any(|e| e.message.contains("rank 3 aborted")),
        "{errs:?}"
    );
}

#[test]
fn lost_peer_fails_the_others_quickly() {
    let start = Instant::now();
    let errs = mesh_world(3, |rank, mesh| {
        let members = [0, 1, 2];
        let mut buf = input(DType::F32, rank, 100_000);
        let sig = OpSig::new(OpKind::AllReduce, DType::F32, 100_000);
        sum_f32(mesh, &members, &mut buf, &sig).unwrap();
        if rank == 2 {
            return None; // drops its mesh mid-job
        }
        let sig = OpSig { seq: 1, ..sig };
        run_or_abort(mesh, |m| sum_f32(m, &members, &mut buf, &sig)).err()
    });
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "took {:?}",
        start.elapsed()
    );
    for e in errs[..2].iter() {
        let e = e.as_ref().expect("survivor must fail");
        assert_eq!(e.kind, ErrorKind::PeerLost, "{e}");
        assert!(e.message.contains("rank 2 (127.0.0.1:"), "{e}");
    }
}

#[test]
fn wrong_secret_is_an_auth_error() {
    let secret = |r: usize| if r == 1 { &b"other secret"[..] } else { SECRET };
    let errs = with_world(
        2,
        secret,
        Duration::from_millis(1500),
        |_| {},
        |_, m| m.err().expect("must fail"),
    );
    for e in &errs {
        assert_eq!(e.kind, ErrorKind::Auth, "{e}");
        assert!(
            e.message.contains("SHARDLINE_SECRET must be identical"),
            "{e}"
        );
    }
}

#[test]
fn garbage_connections_do_not_break_the_mesh() {
    use std::io::Write;
    let mut intruders = Vec::new();
    let sums = with_world(
        3,
        |_| SECRET,
        Duration::from_secs(5),
        |addrs| {
            for a in addrs {
                let mut s = TcpStream::connect(a).unwrap();
                s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
                intruders.push(s);
                let mut s = TcpStream::connect(a).unwrap();
                let mut huge = [0u8; 48];
                huge[..4].copy_from_slice(b"SHL1");
                huge[4] = 1;
                huge[6] = 3;
                huge[40..48].copy_from_slice(&u64::MAX.to_le_bytes());
                s.write_all(&huge).unwrap();
                intruders.push(s);
                intruders.push(TcpStream::connect(a).unwrap()); // silent
            }
        },
        |rank, m| {
            let mut mesh = m.unwrap();
            let mut buf = input(DType::F32, rank, 10);
            let sig = OpSig::new(OpKind::AllReduce, DType::F32, 10);
            sum_f32(&mut mesh, &[0, 1, 2], &mut buf, &sig).unwrap();
            decode(DType::F32, &buf)
        },
    );
    for s in sums {
        assert_close(&s, &reference(DType::F32, ReduceOp::Sum, 3, 10), "sum");
    }
}

#[test]
fn silent_peer_is_a_timeout_naming_peer_and_op() {
    use shardline::transport::p2p::P2p;
    let errs = mesh_world(2, |rank, mesh| {
        let sig = OpSig::new(OpKind::Recv, DType::U8, 4);
        if rank == 1 {
            std::thread::sleep(Duration::from_millis(400));
            return None;
        }
        let d = Instant::now() + Duration::from_millis(150);
        mesh.recv(1, &sig, &mut [0u8; 4], d).err()
    });
    let e = errs[0].as_ref().expect("rank 0 must time out");
    assert_eq!(e.kind, ErrorKind::Timeout, "{e}");
    assert!(
        e.message.contains("rank 1 (127.0.0.1:") && e.message.contains("recv(uint8, 4)"),
        "{e}"
    );
}
