//! Measures arena barrier and all-reduce latency with one thread per rank (no Python).
use shardline::engine::{CommConfig, Communicator, Op, RawBuf};
use shardline::{DType, ReduceOp};
use std::time::Instant;

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let path = format!("/dev/shm/shardline-{}-example", std::process::id());
    let slot: usize = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1 << 20);
    shardline::transport::shm::create(&path, n, slot).unwrap();
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let path = path.clone();
            std::thread::spawn(move || {
                let mut cfg = CommConfig::new(r, n, "w");
                cfg.arena_path = Some(path);
                let c = Communicator::new(cfg, None).unwrap();
                let iters = 20000;
                for _ in 0..100 {
                    c.submit(Op::Barrier, Box::new(()), false)
                        .unwrap()
                        .wait_for(None)
                        .unwrap();
                }
                let t = Instant::now();
                for _ in 0..iters {
                    c.submit(Op::Barrier, Box::new(()), false)
                        .unwrap()
                        .wait_for(None)
                        .unwrap();
                }
                let bar = t.elapsed() / iters;
                let mut v = vec![0u8; 4096];
                let t = Instant::now();
                for _ in 0..iters {
                    let op = Op::AllReduce {
                        buf: RawBuf::from_slice(&mut v),
                        dtype: DType::F32,
                        op: ReduceOp::Sum,
                    };
                    c.submit(op, Box::new(()), false)
                        .unwrap()
                        .wait_for(None)
                        .unwrap();
                }
                let ar = t.elapsed() / iters;
                let mut big = vec![1u8; 64 << 20];
                let op = Op::AllReduce {
                    buf: RawBuf::from_slice(&mut big),
                    dtype: DType::F32,
                    op: ReduceOp::Sum,
                };
                c.submit(op, Box::new(()), false)
                    .unwrap()
                    .wait_for(None)
                    .unwrap();
                let t = Instant::now();
                for _ in 0..5 {
                    let op = Op::AllReduce {
                        buf: RawBuf::from_slice(&mut big),
                        dtype: DType::F32,
                        op: ReduceOp::Sum,
                    };
                    c.submit(op, Box::new(()), false)
                        .unwrap()
                        .wait_for(None)
                        .unwrap();
                }
                let gbs = (64 << 20) as f64 * 5.0 / t.elapsed().as_secs_f64() / 1e9;
                if r == 0 {
                    println!("n={n} barrier {bar:?} all_reduce 4KiB {ar:?} 64MiB {gbs:.2} GB/s");
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    shardline::transport::shm::unlink(&path).unwrap();
}
