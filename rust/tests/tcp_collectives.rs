//! Every TCP collective, a thread per rank over loopback (port 0), 5 s deadline on every op.

use std::net::TcpStream;
use std::time::{Duration, Instant};

use half::bf16;
use shardline::collectives::ring::{Ring, RingOpts};
use shardline::collectives::{direct, ring};
use shardline::transport::tcp::{LinkOptions, TcpListenerHandle, TcpMesh};
use shardline::{DType, Error, ErrorKind, OpKind, OpSig, ReduceOp, Result};

const SECRET: &[u8] = b"correct horse battery staple";

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

/// Runs `body` on `world` ranks, each connected to all others (or failing to).
fn with_world<T: Send>(
    world: usize,
    secret: impl Fn(usize) -> &'static [u8] + Sync,
    connect_timeout: Duration,
    before: impl FnOnce(&[String]),
    body: impl Fn(usize, Result<TcpMesh>) -> T + Sync,
) -> Vec<T> {
    let listeners: Vec<_> = (0..world)
        .map(|_| TcpListenerHandle::bind("127.0.0.1").unwrap())
        .collect();
    let addrs: Vec<String> = listeners.iter().map(|l| l.address()).collect();
    before(&addrs);
    std::thread::scope(|s| {
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(r, l)| {
                let (addrs, body, secret) = (&addrs, &body, &secret);
                s.spawn(move || {
                    let peers: Vec<usize> = (0..world).filter(|&p| p != r).collect();
                    let d = Instant::now() + connect_timeout;
                    let opts = LinkOptions::default();
                    body(
                        r,
                        TcpMesh::connect(r, world, addrs, &peers, l, secret(r), "test", d, &opts),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn mesh_world<T: Send>(world: usize, body: impl Fn(usize, &mut TcpMesh) -> T + Sync) -> Vec<T> {
    with_world(
        world,
        |_| SECRET,
        Duration::from_secs(5),
        |_| {},
        |r, m| body(r, &mut m.unwrap()),
    )
}

fn value(dtype: DType, rank: usize, i: usize) -> f64 {
    match dtype {
        DType::BF16 => ((rank + 1) * (i % 5)) as f64,
        DType::I64 => ((rank as i64 + 1) * i as i64 - 5) as f64,
        _ => ((rank + 1) * (i % 7)) as f64 - 3.0,
    }
}

fn encode(dtype: DType, vals: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() * dtype.size());
    for &v in vals {
        match dtype {
            DType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            DType::I64 => out.extend_from_slice(&(v as i64).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16::from_f64(v).to_le_bytes()),
            other => panic!("test has no encoding for {other}"),
        }
    }
    out
}

fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(dtype.size())
        .map(|b| match dtype {
            DType::F32 => f32::from_le_bytes(b.try_into().unwrap()) as f64,
            DType::I64 => i64::from_le_bytes(b.try_into().unwrap()) as f64,
            DType::BF16 => bf16::from_le_bytes(b.try_into().unwrap()).to_f64(),
            other => panic!("test has no decoding for {other}"),
        })
        .collect()
}

fn input(dtype: DType, rank: usize, count: usize) -> Vec<u8> {
    encode(
        dtype,
        &(0..count)
            .map(|i| value(dtype, rank, i))
            .collect::<Vec<_>>(),
    )
}

/// The reduction over ranks of element i, as f64.
fn reference(dtype: DType, op: ReduceOp, world: usize, count: usize) -> Vec<f64> {
    (0..count)
        .map(|i| {
            let vals = (0..world).map(|r| value(dtype, r, i));
            match op {
                ReduceOp::Sum => vals.sum(),
                ReduceOp::Avg => vals.sum::<f64>() / world as f64,
                ReduceOp::Max => vals.fold(f64::MIN, f64::max),
                ReduceOp::Min => vals.fold(f64::MAX, f64::min),
                ReduceOp::Prod => vals.product(),
            }
        })
        .collect()
}

fn assert_close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs().max(1.0),
            "{what}: element {i} is {g}, expected {w}"
        );
    }
}

const CASES: [(DType, ReduceOp); 5] = [
    (DType::F32, ReduceOp::Sum),
    (DType::F32, ReduceOp::Avg),
    (DType::F32, ReduceOp::Max),
    (DType::I64, ReduceOp::Sum),
    (DType::BF16, ReduceOp::Sum),
];
const SIZES: [usize; 6] = [0, 1, 5, 13, 1000, 20_001];

/// A signature generator: every rank builds the same sequence.
struct Seq(u64);
impl Seq {
    fn next(&mut self, kind: OpKind, dtype: DType, count: usize) -> OpSig {
        self.0 += 1;
        OpSig {
            seq: self.0,
            ..OpSig::new(kind, dtype, count)
        }
    }
}

#[test]
fn reducing_collectives_match_reference() {
    for world in 1..=5 {
        mesh_world(world, |rank, mesh| {
            let members: Vec<usize> = (0..world).collect();
            let mut rings = [
                Ring::default(),
                Ring::new(RingOpts {
                    small_bytes: 0,
                    chunk_bytes: 12,
                }),
            ];
            let mut seq = Seq(0);
            for (dtype, op) in CASES {
                for (ri, ring) in rings.iter_mut().enumerate() {
                    for count in SIZES.into_iter().filter(|&c| ri == 0 || c <= 1000) {
                        let what =
                            format!("world {world} rank {rank} ring {ri} {dtype} {op:?} x{count}");
                        let sig = seq.next(OpKind::AllReduce, dtype, count).with_reduce(op);
                        let mut buf = input(dtype, rank, count);
                        ring.all_reduce(mesh, &members, &mut buf, dtype, op, &sig, deadline())
                            .unwrap();
                        assert_close(
                            &decode(dtype, &buf),
                            &reference(dtype, op, world, count),
                            &what,
                        );

                        let block = count / world + 1;
                        let sig = seq
                            .next(OpKind::ReduceScatter, dtype, block)
                            .with_reduce(op);
                        let inp = input(dtype, rank, block * world);
                        let mut out = vec![0u8; block * dtype.size()];
                        ring.reduce_scatter(
                            mesh,
                            &members,
                            &mut out,
                            &inp,
                            dtype,
                            op,
                            &sig,
                            deadline(),
                        )
                        .unwrap();
                        let want = reference(dtype, op, world, block * world);
                        assert_close(
                            &decode(dtype, &out),
                            &want[rank * block..(rank + 1) * block],
                            &what,
                        );

                        let root = count % world;
                        let sig = seq
                            .next(OpKind::Reduce, dtype, count)
                            .with_reduce(op)
                            .with_root(root);
                        let mut buf = input(dtype, rank, count);
                        direct::reduce(mesh, &members, &mut buf, dtype, op, root, &sig, deadline())
                            .unwrap();
                        if rank == root {
                            assert_close(
                                &decode(dtype, &buf),
                                &reference(dtype, op, world, count),
                                &what,
                            );
                        } else {
                            assert_eq!(
                                buf,
                                input(dtype, rank, count),
                                "{what}: non-root buffer changed"
                            );
                        }
                    }
                }
            }
        });
    }
}

#[test]
fn moving_collectives_match_reference() {
    let dtype = DType::I64;
    for world in 1..=5 {
        mesh_world(world, |rank, mesh| {
            let members: Vec<usize> = (0..world).collect();
            let mut seq = Seq(0);
            let mut ring = Ring::new(RingOpts {
                small_bytes: 0,
                chunk_bytes: 16,
            });
            for size in SIZES {
                let what = format!("world {world} rank {rank} size {size}");
                // all_gather with unequal counts (zeros included).
                let counts: Vec<usize> = (0..world).map(|i| size / (i + 1) + (i % 2) * 3).collect();
                let sig = seq.next(OpKind::AllGather, dtype, 0);
                let mut out = vec![0u8; counts.iter().sum::<usize>() * 8];
                let inp = input(dtype, rank, counts[rank]);
                ring.all_gather(
                    mesh,
                    &members,
                    &mut out,
                    &inp,
                    &counts,
                    dtype,
                    &sig,
                    deadline(),
                )
                .unwrap();
                let want: Vec<u8> = (0..world)
                    .flat_map(|r| input(dtype, r, counts[r]))
                    .collect();
                assert_eq!(out, want, "{what}: all_gather");

                for root in 0..world {
                    let sig = seq.next(OpKind::Broadcast, dtype, size).with_root(root);
                    let mut buf = if rank == root {
                        input(dtype, root, size)
                    } else {
                        vec![0u8; size * 8]
                    };
                    direct::broadcast(mesh, &members, &mut buf, root, &sig, deadline()).unwrap();
                    assert_eq!(
                        buf,
                        input(dtype, root, size),
                        "{what}: broadcast root {root}"
                    );

                    let sig = seq.next(OpKind::Gather, dtype, size).with_root(root);
                    let mut out = vec![0u8; if rank == root { size * 8 * world } else { 0 }];
                    direct::gather(
                        mesh,
                        &members,
                        &mut out,
                        &input(dtype, rank, size),
                        root,
                        &sig,
                        deadline(),
                    )
                    .unwrap();
                    if rank == root {
                        let want: Vec<u8> =
                            (0..world).flat_map(|r| input(dtype, r, size)).collect();
                        assert_eq!(out, want, "{what}: gather root {root}");
                    }

                    let sig = seq.next(OpKind::Scatter, dtype, size).with_root(root);
                    let all = input(dtype, root, size * world);
                    let inp = if rank == root { all.clone() } else { vec![] };
                    let mut out = vec![0u8; size * 8];
                    direct::scatter(mesh, &members, &mut out, &inp, root, &sig, deadline())
                        .unwrap();
                    assert_eq!(
                        out,
                        all[rank * size * 8..(rank + 1) * size * 8],
                        "{what}: scatter root {root}"
                    );
                }

                let block = size.min(50);
                let sig = seq.next(OpKind::AllToAll, dtype, block * world);
                let inp = input(dtype, rank, block * world);
                let mut out = vec![0u8; inp.len()];
                direct::all_to_all(mesh, &members, &mut out, &inp, &sig, deadline()).unwrap();
                let b = block * 8;
                for src in 0..world {
                    let theirs = input(dtype, src, block * world);
                    assert_eq!(
                        out[src * b..(src + 1) * b],
                        theirs[rank * b..(rank + 1) * b],
                        "{what}: a2a"
                    );
                }

                let sig = seq.next(OpKind::Barrier, DType::U8, 0);
                direct::barrier(mesh, &members, &sig, deadline()).unwrap();
            }
            // A broadcast big enough for the pipelined chain, and a subset group.
            let sig = seq
                .next(OpKind::Broadcast, DType::U8, 600_000)
                .with_root(world - 1);
            let want: Vec<u8> = (0..600_000u32).map(|i| (i % 251) as u8).collect();
            let mut buf = if rank == world - 1 {
                want.clone()
            } else {
                vec![0; want.len()]
            };
            direct::broadcast(mesh, &members, &mut buf, world - 1, &sig, deadline()).unwrap();
            assert_eq!(buf, want);
            let evens: Vec<usize> = (0..world).filter(|r| r % 2 == 0).collect();
            if rank % 2 == 0 {
                let sig = seq.next(OpKind::AllReduce, DType::F32, 3);
                let mut buf = input(DType::F32, rank, 3);
                ring::all_reduce(
                    mesh,
                    &evens,
                    &mut buf,
                    DType::F32,
                    ReduceOp::Sum,
                    &sig,
                    deadline(),
                )
                .unwrap();
            }
        });
    }
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
        ring::all_reduce(
            mesh,
            &members,
            &mut buf,
            DType::F32,
            ReduceOp::Sum,
            &sig,
            deadline(),
        )
        .unwrap();
        if rank == 2 {
            return None; // drops its mesh mid-job
        }
        let sig = OpSig { seq: 1, ..sig };
        run_or_abort(mesh, |m| {
            ring::all_reduce(
                m,
                &members,
                &mut buf,
                DType::F32,
                ReduceOp::Sum,
                &sig,
                deadline(),
            )
        })
        .err()
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
            ring::all_reduce(
                &mut mesh,
                &[0, 1, 2],
                &mut buf,
                DType::F32,
                ReduceOp::Sum,
                &sig,
                deadline(),
            )
            .unwrap();
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

#[test]
fn large_exchange_is_full_duplex() {
    use shardline::transport::p2p::P2p;
    // 24 MiB each way, far beyond the socket buffers: both peers send first. Also with
    // stalled receives spinning on their socket before they sleep in poll(2).
    let bytes = 24 << 20;
    for spin in [Duration::ZERO, Duration::from_micros(50)] {
        mesh_world(2, |rank, mesh| {
            mesh.set_spin(spin);
            let out: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8 ^ rank as u8).collect();
            let mut inp = vec![0u8; bytes];
            let mut seq = Seq(0);
            let sig = seq.next(OpKind::Send, DType::U8, bytes);
            mesh.exchange(1 - rank, &out, 1 - rank, &mut inp, &sig, deadline())
                .unwrap();
            assert!(
                inp.iter()
                    .enumerate()
                    .all(|(i, &b)| b == (i % 251) as u8 ^ (1 - rank) as u8),
                "spin {spin:?}"
            );
            // Small messages, where the spin is what answers them.
            for k in 0..200usize {
                let sig = seq.next(OpKind::Send, DType::U8, 64);
                let out = [(k % 251) as u8 ^ rank as u8; 64];
                let mut inp = [0u8; 64];
                mesh.exchange(1 - rank, &out, 1 - rank, &mut inp, &sig, deadline())
                    .unwrap();
                assert_eq!(
                    inp,
                    [(k % 251) as u8 ^ (1 - rank) as u8; 64],
                    "spin {spin:?}"
                );
            }
        });
    }
}

/// Not a test: prints all_reduce timings (`cargo test --release -- --ignored --nocapture`).
#[test]
#[ignore]
fn all_reduce_throughput() {
    let chunk: usize = std::env::var("CHUNK").map_or(1 << 20, |v| v.parse().unwrap());
    for world in [2, 4] {
        for bytes in [4 << 10, 1 << 20, 64 << 20] {
            let times = mesh_world(world, |rank, mesh| {
                let members: Vec<usize> = (0..world).collect();
                let mut ring = Ring::new(RingOpts {
                    chunk_bytes: chunk,
                    ..RingOpts::default()
                });
                let mut buf = input(DType::F32, rank, bytes / 4);
                let iters = if bytes > 1 << 20 { 5 } else { 200 };
                let mut best = Duration::MAX;
                for i in 0..iters {
                    let sig = OpSig {
                        seq: i,
                        ..OpSig::new(OpKind::AllReduce, DType::F32, bytes / 4)
                    };
                    let t = Instant::now();
                    let d = Instant::now() + Duration::from_secs(60);
                    ring.all_reduce(mesh, &members, &mut buf, DType::F32, ReduceOp::Sum, &sig, d)
                        .unwrap();
                    best = best.min(t.elapsed());
                }
                best
            });
            let t = times.into_iter().max().unwrap();
            let gbs = bytes as f64 / t.as_secs_f64() / 1e9;
            println!("N={world} {bytes:>9} B: {t:?} algbw {gbs:.2} GB/s");
        }
    }
}

/// Not a test: prints raw exchange timings.
#[test]
#[ignore]
fn exchange_throughput() {
    use shardline::transport::p2p::P2p;
    for bytes in [1usize << 20, 16 << 20, 64 << 20] {
        let times = mesh_world(2, |rank, mesh| {
            let out = vec![1u8; bytes];
            let mut inp = vec![0u8; bytes];
            let mut best = Duration::MAX;
            for i in 0..5 {
                let sig = OpSig {
                    seq: i,
                    ..OpSig::new(OpKind::Send, DType::U8, bytes)
                };
                let t = Instant::now();
                let d = Instant::now() + Duration::from_secs(60);
                mesh.exchange(1 - rank, &out, 1 - rank, &mut inp, &sig, d)
                    .unwrap();
                best = best.min(t.elapsed());
            }
            best
        });
        let t = times.into_iter().max().unwrap();
        println!(
            "exchange {bytes:>9} B: {t:?} {:.2} GB/s each way",
            bytes as f64 / t.as_secs_f64() / 1e9
        );
    }
}
