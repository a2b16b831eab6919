//! What the TCP tests share: a world of ranks, a thread each, linked over loopback (port 0),
//! and the values each rank puts in and the reductions they should come out as.

// Each test crate that declares `mod tcp_world;` uses only a part of it.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use half::bf16;
use shardline::collectives::ring;
use shardline::transport::tcp::{LinkOptions, TcpListenerHandle, TcpMesh};
use shardline::{DType, OpSig, ReduceOp, Result};

pub const SECRET: &[u8] = b"correct horse battery staple";

/// Five seconds from now: every op's deadline.
pub fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

/// Runs `body` on `world` ranks, each connected to all others (or failing to).
pub fn with_world<T: Send>(
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

/// `with_world` with every rank linked (or the test fails), the body given its mesh.
pub fn mesh_world<T: Send>(world: usize, body: impl Fn(usize, &mut TcpMesh) -> T + Sync) -> Vec<T> {
    with_world(
        world,
        |_| SECRET,
        Duration::from_secs(5),
        |_| {},
        |r, m| body(r, &mut m.unwrap()),
    )
}

/// The value rank `rank` puts at element `i` (exact in every dtype tested).
pub fn value(dtype: DType, rank: usize, i: usize) -> f64 {
    match dtype {
        DType::BF16 => ((rank + 1) * (i % 5)) as f64,
        DType::I64 => ((rank as i64 + 1) * i as i64 - 5) as f64,
        _ => ((rank + 1) * (i % 7)) as f64 - 3.0,
    }
}

/// `vals` as `dtype`'s little-endian bytes.
pub fn encode(dtype: DType, vals: &[f64]) -> Vec<u8> {
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

/// `bytes` of `dtype` back as values.
pub fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
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

/// Rank `rank`'s `count` elements of `dtype`, as bytes.
pub fn input(dtype: DType, rank: usize, count: usize) -> Vec<u8> {
    encode(
        dtype,
        &(0..count)
            .map(|i| value(dtype, rank, i))
            .collect::<Vec<_>>(),
    )
}

/// The reduction over ranks of element i, as f64.
pub fn reference(dtype: DType, op: ReduceOp, world: usize, count: usize) -> Vec<f64> {
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

/// Each of `got` within a relative 1e-5 of `want`'s element.
pub fn assert_close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs().max(1.0),
            "{what}: element {i} is {g}, expected {w}"
        );
    }
}

/// The ring all-reduce (sum) of `buf`, float32 values, over `members`, by `deadline()`.
pub fn sum_f32(mesh: &mut TcpMesh, members: &[usize], buf: &mut [u8], sig: &OpSig) -> Result<()> {
    ring::all_reduce(
        mesh,
        members,
        buf,
        DType::F32,
        ReduceOp::Sum,
        sig,
        deadline(),
    )
}
