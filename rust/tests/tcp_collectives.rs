//! Every TCP collective, a thread per rank over loopback (port 0), 5 s deadline on every op.

mod tcp_world;

use std::time::{Duration, Instant};

use shardline::collectives::direct;
use shardline::collectives::ring::{Ring, RingOpts};
use shardline::{DType, OpKind, OpSig, ReduceOp};
use tcp_world::{assert_close, deadline, decode, input, mesh_world, reference, sum_f32};

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
                sum_f32(mesh, &evens, &mut buf, &sig).unwrap();
            }
        });
    }
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
