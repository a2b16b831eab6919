//! Thread-per-rank tests of every collective on the shared-memory arena, against a scalar
//! reference; 5 s deadline on every op.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use shardline::engine::{CommConfig, Communicator, Op, RawBuf};
use shardline::transport::shm;
use shardline::{DType, ErrorKind, ReduceOp};

static NEXT: AtomicUsize = AtomicUsize::new(0);

fn run_ranks<T: Send + 'static>(
    n: usize,
    slot: usize,
    body: impl Fn(&Communicator, usize) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    run_ranks_threads(n, slot, 1, body)
}

/// [`run_ranks`] with `comm_threads` helper threads per rank on every op (no size threshold).
fn run_ranks_threads<T: Send + 'static>(
    n: usize,
    slot: usize,
    comm_threads: usize,
    body: impl Fn(&Communicator, usize) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let tweak = move |cfg: &mut CommConfig| {
        cfg.oneshot_bytes = Some(1024);
        cfg.comm_threads = comm_threads;
        cfg.comm_threads_min_bytes = 0;
    };
    run_ranks_with(n, slot, tweak, body)
}

/// [`run_ranks`] with each rank's config changed by `tweak`.
fn run_ranks_with<T: Send + 'static>(
    n: usize,
    slot: usize,
    tweak: impl Fn(&mut CommConfig) + Send + Sync + Clone + 'static,
    body: impl Fn(&Communicator, usize) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let path = format!(
        "/dev/shm/shardline-{}-test{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    );
    shm::create(&path, n, slot).unwrap();
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let (path, body, tweak) = (path.clone(), body.clone(), tweak.clone());
            std::thread::spawn(move || {
                let mut cfg = CommConfig::new(r, n, "test");
                cfg.arena_path = (n > 1).then_some(path);
                cfg.timeout = Duration::from_secs(5);
                tweak(&mut cfg);
                let c = Communicator::new(cfg, None).unwrap();
                body(&c, r)
            })
        })
        .collect();
    let out = handles.into_iter().map(|h| h.join().unwrap()).collect();
    shm::unlink(&path).unwrap();
    out
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn run(c: &Communicator, op: Op) -> shardline::Result<()> {
    c.submit(op, Box::new(()), false)?
        .wait_for(None)
        .map(|_| ())
}

fn input(r: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| (i * 7 + r * 13) as f32 % 101.0).collect()
}

#[test]
fn all_reduce_every_size_and_op() {
    for n in 1..=4 {
        for len in [0usize, 1, 5, 255, 256, 1000, 40_000] {
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg] {
                let out = run_ranks(n, 8192, move |c, r| {
                    let mut b = f32s(&input(r, len));
                    run(
                        c,
                        Op::AllReduce {
                            buf: RawBuf::from_slice(&mut b),
                            dtype: DType::F32,
                            op,
                        },
                    )
                    .unwrap();
                    b
                });
                let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, len)).collect();
                let expect: Vec<f32> = (0..len)
                    .map(|i| {
                        let xs = inputs.iter().map(|v| v[i]);
                        match op {
                            ReduceOp::Sum => xs.sum(),
                            ReduceOp::Avg => xs.sum::<f32>() / n as f32,
                            ReduceOp::Max => xs.fold(f32::MIN, f32::max),
                            _ => xs.fold(f32::MAX, f32::min),
                        }
                    })
                    .collect();
                for o in out {
                    assert_eq!(o, f32s(&expect), "n={n} len={len} op={op:?}");
                }
            }
        }
    }
}

#[test]
fn the_oneshot_limit_is_measured_and_both_algorithms_give_the_same_bits() {
    // Values whose sums round: a different order of additions would show in the bits.
    let value = |r: usize, i: usize| ((i * 2_654_435_761 + r * 40_503) % 1_000_003) as f32 / 7.0;
    let lens = [1usize, 255, 4096, 20_000, 70_000];
    for n in [2usize, 3] {
        // The limit is measured where every rank has a core; three ranks on a 2-core machine
        // are told they have (machine_ranks), or nothing would be measured here.
        let runs: Vec<Option<usize>> = vec![None, Some(0), Some(256 << 10)];
        for fixed in runs {
            let tweak = move |cfg: &mut CommConfig| {
                cfg.oneshot_bytes = fixed;
                cfg.machine_ranks = 1;
            };
            let out = run_ranks_with(n, 1 << 20, tweak, move |c, r| {
                let sums: Vec<Vec<u8>> = lens
                    .iter()
                    .map(|&len| {
                        let mut b = f32s(&(0..len).map(|i| value(r, i)).collect::<Vec<_>>());
                        let op = Op::AllReduce {
                            buf: RawBuf::from_slice(&mut b),
                            dtype: DType::F32,
                            op: ReduceOp::Sum,
                        };
                        run(c, op).unwrap();
                        b
                    })
                    .collect();
                // Measured by the first all-reduce.
                let limit = c.oneshot_bytes().expect("ranks of one host share an arena");
                (limit, sums)
            });
            let limit = out[0].0;
            assert!(
                out.iter().all(|(l, _)| *l == limit),
                "n={n}: ranks chose different limits"
            );
            match fixed {
                Some(bytes) => assert_eq!(limit, bytes, "a set limit is kept"),
                None => assert!(limit <= 256 << 10, "n={n}: measured limit {limit}"),
            }
            for (len, got) in lens.iter().zip(&out[0].1) {
                let want: Vec<f32> = (0..*len)
                    .map(|i| (1..n).fold(value(0, i), |acc, r| acc + value(r, i)))
                    .collect();
                assert_eq!(got, &f32s(&want), "n={n} len={len} limit={limit}");
            }
            assert!(
                out.iter().all(|(_, sums)| *sums == out[0].1),
                "n={n}: ranks differ"
            );
        }
    }
}

#[test]
fn reduce_scatter_all_gather_broadcast_scatter_gather_all_to_all() {
    for n in 1..=4 {
        for block in [0usize, 1, 3, 700, 5000] {
            let out = run_ranks(n, 4096, move |c, r| {
                let inp = f32s(&input(r, block * n));
                let mut rs = vec![0u8; block * 4];
                let mut inp_copy = inp.clone();
                let op = Op::ReduceScatter {
                    out: RawBuf::from_slice(&mut rs),
                    inp: RawBuf::from_slice(&mut inp_copy),
                    dtype: DType::F32,
                    op: ReduceOp::Sum,
                };
                run(c, op).unwrap();
                let mut mine = f32s(&input(r, block + r));
                let counts: Vec<usize> = (0..n).map(|q| block + q).collect();
                let mut ag = vec![0u8; counts.iter().sum::<usize>() * 4];
                let op = Op::AllGather {
                    out: RawBuf::from_slice(&mut ag),
                    inp: RawBuf::from_slice(&mut mine),
                    dtype: DType::F32,
                    counts: Some(counts),
                };
                run(c, op).unwrap();
                let mut bc = if r == n - 1 {
                    inp.clone()
                } else {
                    vec![0u8; inp.len()]
                };
                run(
                    c,
                    Op::Broadcast {
                        buf: RawBuf::from_slice(&mut bc),
                        dtype: DType::F32,
                        root: n - 1,
                    },
                )
                .unwrap();
                let mut sc = vec![0u8; block * 4];
                let mut src = inp.clone();
                let op = Op::Scatter {
                    out: RawBuf::from_slice(&mut sc),
                    inp: (r == 0).then(|| RawBuf::from_slice(&mut src)),
                    dtype: DType::F32,
                    root: 0,
                };
                run(c, op).unwrap();
                let mut ga = vec![0u8; block * 4 * n];
                let mut gi = f32s(&input(r, block));
                let op = Op::Gather {
                    out: (r == 0).then(|| RawBuf::from_slice(&mut ga)),
                    inp: RawBuf::from_slice(&mut gi),
                    dtype: DType::F32,
                    root: 0,
                };
                run(c, op).unwrap();
                let mut a2a = vec![0u8; inp.len()];
                let mut a2a_in = inp.clone();
                let op = Op::AllToAll {
                    out: RawBuf::from_slice(&mut a2a),
                    inp: RawBuf::from_slice(&mut a2a_in),
                    dtype: DType::F32,
                };
                run(c, op).unwrap();
                run(c, Op::Barrier).unwrap();
                (rs, ag, bc, sc, ga, a2a)
            });
            let full: Vec<Vec<f32>> = (0..n).map(|r| input(r, block * n)).collect();
            for (r, (rs, ag, bc, sc, ga, a2a)) in out.into_iter().enumerate() {
                let rs_ref: Vec<f32> = (0..block)
                    .map(|i| (0..n).map(|q| full[q][r * block + i]).sum())
                    .collect();
                assert_eq!(rs, f32s(&rs_ref), "reduce_scatter n={n} block={block}");
                let ag_ref: Vec<f32> = (0..n).flat_map(|q| input(q, block + q)).collect();
                assert_eq!(ag, f32s(&ag_ref), "all_gather n={n}");
                assert_eq!(bc, f32s(&full[n - 1]), "broadcast n={n}");
                assert_eq!(
                    sc,
                    f32s(&full[0][r * block..(r + 1) * block]),
                    "scatter n={n}"
                );
                if r == 0 {
                    let ga_ref: Vec<f32> = (0..n).flat_map(|q| input(q, block)).collect();
                    assert_eq!(ga, f32s(&ga_ref), "gather n={n}");
                }
                let a2a_ref: Vec<f32> = (0..n)
                    .flat_map(|q| full[q][r * block..(r + 1) * block].to_vec())
                    .collect();
                assert_eq!(a2a, f32s(&a2a_ref), "all_to_all n={n} block={block}");
            }
        }
    }
}

#[test]
fn all_gather_where_ranks_need_different_numbers_of_rounds() {
    // 4 KiB slots hold 1024 floats: rank 0 needs 3 rounds, rank 1 one, rank 2 none.
    for n in 2..=3 {
        for comm_threads in [1, 2] {
            let counts: Vec<usize> = [3000usize, 500, 0][..n].to_vec();
            let c2 = counts.clone();
            let out = run_ranks_threads(n, 4096, comm_threads, move |c, r| {
                let mut mine = f32s(&input(r, c2[r]));
                let mut ag = vec![0u8; c2.iter().sum::<usize>() * 4];
                let op = Op::AllGather {
                    out: RawBuf::from_slice(&mut ag),
                    inp: RawBuf::from_slice(&mut mine),
                    dtype: DType::F32,
                    counts: Some(c2.clone()),
                };
                run(c, op).unwrap();
                ag
            });
            let want: Vec<f32> = (0..n).flat_map(|q| input(q, counts[q])).collect();
            for (r, ag) in out.into_iter().enumerate() {
                assert_eq!(
                    ag,
                    f32s(&want),
                    "n={n} comm_threads={comm_threads} rank {r}"
                );
            }
        }
    }
}

#[test]
fn large_ops_split_over_helper_threads_equal_the_reference() {
    // Sizes that cut the chunks and pieces raggedly: many 64-byte pieces per lane, a last
    // chunk shorter than the slot, blocks not a multiple of the element count per piece.
    let slot = 256 * 1024;
    for n in 1..=3 {
        for comm_threads in [2, 3] {
            let (len, block) = (300_001usize, 70_003usize);
            let out = run_ranks_threads(n, slot, comm_threads, move |c, r| {
                let mut ar = f32s(&input(r, len));
                let op = Op::AllReduce {
                    buf: RawBuf::from_slice(&mut ar),
                    dtype: DType::F32,
                    op: ReduceOp::Sum,
                };
                run(c, op).unwrap();
                let mut red = f32s(&input(r, len));
                let op = Op::Reduce {
                    buf: RawBuf::from_slice(&mut red),
                    dtype: DType::F32,
                    op: ReduceOp::Max,
                    root: n - 1,
                };
                run(c, op).unwrap();
                let mut rs = vec![0u8; block * 4];
                let mut inp = f32s(&input(r, block * n));
                let op = Op::ReduceScatter {
                    out: RawBuf::from_slice(&mut rs),
                    inp: RawBuf::from_slice(&mut inp),
                    dtype: DType::F32,
                    op: ReduceOp::Sum,
                };
                run(c, op).unwrap();
                let counts: Vec<usize> = (0..n).map(|q| block + 1000 * q).collect();
                let mut mine = f32s(&input(r, counts[r]));
                let mut ag = vec![0u8; counts.iter().sum::<usize>() * 4];
                let op = Op::AllGather {
                    out: RawBuf::from_slice(&mut ag),
                    inp: RawBuf::from_slice(&mut mine),
                    dtype: DType::F32,
                    counts: Some(counts),
                };
                run(c, op).unwrap();
                let mut bc = if r == 0 {
                    f32s(&input(7, len))
                } else {
                    vec![0u8; len * 4]
                };
                let op = Op::Broadcast {
                    buf: RawBuf::from_slice(&mut bc),
                    dtype: DType::F32,
                    root: 0,
                };
                run(c, op).unwrap();
                (ar, red, rs, ag, bc)
            });
            let ins: Vec<Vec<f32>> = (0..n).map(|q| input(q, len)).collect();
            let sum: Vec<f32> = (0..len).map(|i| ins.iter().map(|v| v[i]).sum()).collect();
            let max: Vec<f32> = (0..len)
                .map(|i| ins.iter().map(|v| v[i]).fold(f32::MIN, f32::max))
                .collect();
            let blocks: Vec<Vec<f32>> = (0..n).map(|q| input(q, block * n)).collect();
            for (r, (ar, red, rs, ag, bc)) in out.into_iter().enumerate() {
                let what = format!("n={n} comm_threads={comm_threads} rank {r}");
                assert_eq!(ar, f32s(&sum), "all_reduce {what}");
                if r == n - 1 {
                    assert_eq!(red, f32s(&max), "reduce {what}");
                }
                let rs_ref: Vec<f32> = (0..block)
                    .map(|i| blocks.iter().map(|v| v[r * block + i]).sum())
                    .collect();
                assert_eq!(rs, f32s(&rs_ref), "reduce_scatter {what}");
                let ag_ref: Vec<f32> = (0..n).flat_map(|q| input(q, block + 1000 * q)).collect();
                assert_eq!(ag, f32s(&ag_ref), "all_gather {what}");
                assert_eq!(bc, f32s(&input(7, len)), "broadcast {what}");
            }
        }
    }
}

#[test]
fn mismatched_collectives_fail_on_every_rank() {
    let out = run_ranks(3, 4096, |c, r| {
        let mut b = vec![0u8; 64];
        let mut ag = vec![0u8; 192];
        let op = if r == 1 {
            Op::AllGather {
                out: RawBuf::from_slice(&mut ag),
                inp: RawBuf::from_slice(&mut b),
                dtype: DType::F32,
                counts: None,
            }
        } else {
            Op::AllReduce {
                buf: RawBuf::from_slice(&mut b),
                dtype: DType::F32,
                op: ReduceOp::Sum,
            }
        };
        let first = run(c, op).unwrap_err();
        let second = run(c, Op::Barrier).unwrap_err();
        (first, second)
    });
    for (first, second) in out {
        assert_eq!(first.kind, ErrorKind::Mismatch, "{}", first.message);
        assert!(
            first.message.contains("all_gather") && first.message.contains("all_reduce"),
            "{}",
            first.message
        );
        assert_eq!(second.kind, ErrorKind::Closed, "{}", second.message);
    }
}

#[test]
fn missing_rank_times_out_naming_it() {
    let out = run_ranks(3, 4096, |c, r| {
        if r == 2 {
            std::thread::sleep(Duration::from_millis(5600));
            return None;
        }
        let t = std::time::Instant::now();
        let e = run(c, Op::Barrier).unwrap_err();
        Some((e, t.elapsed()))
    });
    for (e, dt) in out.into_iter().flatten() {
        assert_eq!(e.kind, ErrorKind::Timeout, "{}", e.message);
        assert!(e.message.contains("waiting for rank 2,"), "{}", e.message);
        assert!(dt < Duration::from_secs(7), "{dt:?}");
    }
}

#[test]
fn departed_rank_is_reported_lost() {
    let out = run_ranks(2, 4096, |c, r| {
        if r == 1 {
            c.close();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
        Some(run(c, Op::Barrier).unwrap_err())
    });
    let e = out[0].clone().unwrap();
    assert!(matches!(e.kind, ErrorKind::PeerLost), "{}", e.message);
}
