//! Point-to-point messages through the communicator, a thread per rank: tags matched out of
//! order and receives from any source, over the arena (one host), TCP (a host per rank) and
//! both (two hosts of two ranks); 5 s deadline on every op.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use shardline::engine::{CommConfig, Communicator, Op, RawBuf, Work};
use shardline::transport::shm;
use shardline::transport::tcp::TcpListenerHandle;
use shardline::{DType, ErrorKind};

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// The layouts every test runs on: each rank's host.
const LAYOUTS: [&[&str]; 3] = [&["a", "a", "a"], &["a", "b", "c"], &["a", "a", "b", "b"]];

/// Runs `body` on one thread per rank of `hosts` (rank r on host `hosts[r]`): ranks of a host
/// share an arena, ranks of different hosts talk over loopback TCP.
fn run_ranks<T: Send>(
    hosts: &[&str],
    timeout: Duration,
    body: impl Fn(&Communicator) -> T + Sync,
) -> Vec<T> {
    let n = hosts.len();
    let id = NEXT.fetch_add(1, Ordering::SeqCst);
    let arena = |h: &str| format!("/dev/shm/shardline-{}-msg{id}-{h}", std::process::id());
    let mut distinct: Vec<&str> = hosts.to_vec();
    distinct.dedup();
    for h in &distinct {
        let ranks = hosts.iter().filter(|x| *x == h).count();
        if ranks > 1 {
            shm::create(&arena(h), ranks, 1 << 20).unwrap();
        }
    }
    let listeners: Vec<_> = (0..n)
        .map(|_| TcpListenerHandle::bind("127.0.0.1").unwrap())
        .collect();
    let addrs: Vec<String> = listeners.iter().map(|l| l.address()).collect();
    let out = std::thread::scope(|s| {
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(r, l)| {
                let (addrs, body, arena) = (&addrs, &body, &arena);
                s.spawn(move || {
                    let mut cfg = CommConfig::new(r, n, "messages");
                    cfg.host_ids = hosts.iter().map(|h| h.to_string()).collect();
                    cfg.addrs = addrs.clone();
                    cfg.secret = b"messages test secret".to_vec();
                    cfg.arena_path = Some(arena(hosts[r]));
                    cfg.timeout = timeout;
                    let c = Communicator::new(cfg, Some(l)).unwrap();
                    body(&c)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<T>>()
    });
    for h in distinct {
        let _ = shm::unlink(&arena(h));
    }
    out
}

fn send(c: &Communicator, buf: &mut [u8], peer: usize, tag: u32) -> Work {
    let op = Op::Send {
        buf: RawBuf::from_slice(buf),
        dtype: DType::U8,
        peer,
        tag,
    };
    c.submit(op, Box::new(()), true).unwrap()
}

/// A blocking receive; the rank the message came from.
fn recv(
    c: &Communicator,
    buf: &mut [u8],
    peer: Option<usize>,
    tag: u32,
) -> shardline::Result<usize> {
    let op = Op::Recv {
        buf: RawBuf::from_slice(buf),
        dtype: DType::U8,
        peer,
        tag,
    };
    let work = c.submit(op, Box::new(()), false)?;
    work.wait_for(None)?;
    Ok(work.source().expect("a finished receive knows its source"))
}

#[test]
fn receives_take_their_tag_whatever_the_order_sent() {
    for hosts in LAYOUTS {
        let last = hosts.len() - 1;
        // 3 MiB outgrows the arena's ring of 1 MiB: the parked message streams through it.
        let big = 3 << 20;
        let got = run_ranks(hosts, Duration::from_secs(5), |c| {
            if c.rank() == 0 {
                let mut a = vec![1u8; big];
                let mut b = vec![2u8; 5];
                let mut d = vec![3u8; 7];
                let works = [
                    send(c, &mut a, last, 1),
                    send(c, &mut b, last, 2),
                    send(c, &mut d, last, 1),
                ];
                for w in works {
                    w.wait_for(None).unwrap();
                }
                Vec::new()
            } else if c.rank() == last {
                let (mut b, mut a, mut d) = (vec![0u8; 5], vec![0u8; big], vec![0u8; 7]);
                assert_eq!(recv(c, &mut b, Some(0), 2).unwrap(), 0);
                assert_eq!(recv(c, &mut a, Some(0), 1).unwrap(), 0);
                assert_eq!(recv(c, &mut d, Some(0), 1).unwrap(), 0);
                vec![b, a, d]
            } else {
                Vec::new()
            }
        });
        let want = vec![vec![2u8; 5], vec![1u8; big], vec![3u8; 7]];
        assert!(got[last] == want, "{hosts:?}: wrong messages");
    }
}

#[test]
fn a_receive_from_any_source_takes_every_sender_in_turn() {
    for hosts in LAYOUTS {
        let n = hosts.len();
        let got = run_ranks(hosts, Duration::from_secs(5), |c| {
            let r = c.rank();
            if r == 0 {
                let mut seen = Vec::new();
                for _ in 0..2 * (n - 1) {
                    let mut buf = [0u8; 4];
                    let src = recv(c, &mut buf, None, 9).unwrap();
                    seen.push((src, buf));
                }
                seen
            } else {
                // Two messages, told apart by their first byte, in the order sent.
                for k in 0..2u8 {
                    let mut buf = [k, r as u8, r as u8, r as u8];
                    send(c, &mut buf, 0, 9).wait_for(None).unwrap();
                }
                Vec::new()
            }
        });
        for src in 1..n {
            let from: Vec<[u8; 4]> = got[0]
                .iter()
                .filter(|(s, _)| *s == src)
                .map(|(_, b)| *b)
                .collect();
            let s = src as u8;
            assert_eq!(
                from,
                [[0, s, s, s], [1, s, s, s]],
                "{hosts:?}: from rank {src}"
            );
        }
    }
}

#[test]
fn a_receive_from_any_source_leaves_a_collectives_message_for_the_collective() {
    // Rank 2's barrier message reaches rank 0 while it waits for rank 1's message: the
    // receive must skip it, and the barrier must still find it.
    let got = run_ranks(&["a", "b", "c"], Duration::from_secs(5), |c| {
        let mut buf = [0u8; 2];
        let mut src = None;
        match c.rank() {
            0 => src = Some(recv(c, &mut buf, None, 0).unwrap()),
            1 => {
                std::thread::sleep(Duration::from_millis(200));
                buf = [7, 7];
                send(c, &mut buf, 0, 0).wait_for(None).unwrap();
            }
            _ => {}
        }
        c.submit(Op::Barrier, Box::new(()), false)
            .unwrap()
            .wait_for(None)
            .unwrap();
        (src, buf)
    });
    assert_eq!(got[0], (Some(1), [7, 7]));
}

#[test]
fn a_receive_nobody_answers_times_out_naming_any_source() {
    for hosts in LAYOUTS {
        let got = run_ranks(hosts, Duration::from_millis(500), |c| {
            if c.rank() != 0 {
                // Stay past rank 0's deadline: a rank that left cannot be the sender.
                std::thread::sleep(Duration::from_secs(1));
                return None;
            }
            let err = recv(c, &mut [0u8; 1], None, 4).unwrap_err();
            Some((err.kind, err.message))
        });
        let (kind, message) = got[0].clone().unwrap();
        assert_eq!(kind, ErrorKind::Timeout, "{hosts:?}: {message}");
        assert!(
            message.contains("rank 0 timed out receiving send(uint8, 1, tag=4) from any source"),
            "{hosts:?}: {message}"
        );
    }
}

#[test]
fn a_receive_from_any_source_fails_once_every_other_rank_has_left() {
    for hosts in LAYOUTS {
        let got = run_ranks(hosts, Duration::from_secs(5), |c| {
            (c.rank() == 0).then(|| recv(c, &mut [0u8; 1], None, 0).unwrap_err())
        });
        let err = got[0].clone().unwrap();
        assert_eq!(err.kind, ErrorKind::PeerLost, "{hosts:?}: {err}");
        assert!(
            err.message.contains("every other rank has left"),
            "{hosts:?}: {err}"
        );
    }
}

#[test]
fn a_message_of_the_wanted_tag_but_another_size_is_a_mismatch() {
    for hosts in LAYOUTS {
        let got = run_ranks(hosts, Duration::from_secs(5), |c| match c.rank() {
            0 => {
                let _ = send(c, &mut [0u8; 8], 1, 3).wait_for(None);
                None
            }
            1 => Some(recv(c, &mut [0u8; 4], Some(0), 3).unwrap_err()),
            _ => None,
        });
        let err = got[1].clone().unwrap();
        assert_eq!(err.kind, ErrorKind::Mismatch, "{hosts:?}: {err}");
        assert!(
            err.message.contains("send(uint8, 8, tag=3)"),
            "{hosts:?}: {err}"
        );
    }
}

#[test]
fn a_send_past_the_sockets_buffers_then_a_receive_completes_on_every_rank() {
    // Each rank sends 32 MiB (more than the sockets' buffers hold) to the next rank, then
    // receives from the one before it: the send must take in what reaches this rank meanwhile
    // (kept for the receive), or every rank waits for the next until its deadline. Two ranks
    // send to each other; three or four, round a ring.
    let big = 32 << 20;
    for hosts in [&["a", "b"][..], LAYOUTS[1], LAYOUTS[2]] {
        let n = hosts.len();
        let got = run_ranks(hosts, Duration::from_secs(10), |c| {
            let r = c.rank();
            let (next, before) = ((r + 1) % n, (r + n - 1) % n);
            let mut out = vec![r as u8 + 1; big];
            let sent = send(c, &mut out, next, 5);
            let mut inp = vec![0u8; big];
            let from = recv(c, &mut inp, Some(before), 5).map_err(|e| e.to_string());
            let done = sent.wait_for(None).map(|_| ()).map_err(|e| e.to_string());
            let whole = inp.iter().all(|&b| b == before as u8 + 1);
            (from, done, whole)
        });
        for (r, (from, done, whole)) in got.into_iter().enumerate() {
            assert_eq!(from, Ok((r + n - 1) % n), "{hosts:?}: rank {r}");
            assert_eq!(done, Ok(()), "{hosts:?}: rank {r}");
            assert!(whole, "{hosts:?}: rank {r} received other bytes");
        }
    }
}

#[test]
fn messages_sent_before_a_collective_are_kept_for_the_receives_after_it() {
    // Rank 0 sends the last rank a message of 16 MiB (more than the sockets' buffers hold) and
    // a small one, then enters an all-reduce; the last rank enters it before it receives them,
    // the small one first. Over TCP the collective must take both in: the small one comes
    // ahead of the collective's message on its link (a mismatch before), and the large one
    // holds rank 0's collective back until it is read (the deadline before).
    let big = 16 << 20;
    for hosts in [
        &["a", "b"][..],
        LAYOUTS[1],
        &["a", "a", "b"],
        &["a", "b", "b"],
    ] {
        let last = hosts.len() - 1;
        let got = run_ranks(hosts, Duration::from_secs(10), |c| {
            let r = c.rank();
            let (mut large, mut small) = (vec![7u8; big], [1u8, 2, 3]);
            let sent =
                (r == 0).then(|| [send(c, &mut large, last, 1), send(c, &mut small, last, 2)]);
            let mut sum = [r as u8 + 1; 8];
            let op = Op::AllReduce {
                buf: RawBuf::from_slice(&mut sum),
                dtype: DType::U8,
                op: shardline::ReduceOp::Sum,
            };
            let reduced = c
                .submit(op, Box::new(()), false)
                .and_then(|w| w.wait_for(None).map(|_| ()))
                .map_err(|e| e.to_string());
            let (mut large, mut small) = (vec![0u8; big], [0u8; 3]);
            if r == last {
                recv(c, &mut small, Some(0), 2).unwrap();
                recv(c, &mut large, Some(0), 1).unwrap();
            }
            for w in sent.into_iter().flatten() {
                w.wait_for(None).unwrap();
            }
            let whole = r != last || (small == [1, 2, 3] && large.iter().all(|&b| b == 7));
            (reduced, sum[0], whole)
        });
        let total = (1..=hosts.len() as u8).sum::<u8>();
        for (r, (reduced, sum, whole)) in got.into_iter().enumerate() {
            assert_eq!(reduced, Ok(()), "{hosts:?}: rank {r}");
            assert_eq!(sum, total, "{hosts:?}: rank {r}");
            assert!(whole, "{hosts:?}: rank {r} received other bytes");
        }
    }
}
