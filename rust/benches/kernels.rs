//! Throughput of the reduction kernels next to a `memcpy` baseline.
//!
//! Each benchmark reports GB/s over the bytes read plus the bytes written: a reduction of
//! `k` sources of `n` bytes moves `(k + 1) * n` bytes, a copy moves `2 * n`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use shardline::reduce::{reduce_slices, ReduceOp};
use shardline::DType;
use std::hint::black_box;
use std::time::Duration;

const SIZES: [(usize, &str); 3] = [(64 << 10, "64KiB"), (1 << 20, "1MiB"), (16 << 20, "16MiB")];

/// Bytes of small, finite values of `dtype` (so sums never overflow to inf or NaN).
fn filled(dtype: DType, bytes: usize, seed: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes);
    let mut i = seed;
    while out.len() < bytes {
        i = i.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        let v = (i >> 9) as f32 / (1u32 << 23) as f32 - 0.5;
        match dtype {
            DType::F32 => out.extend_from_slice(&v.to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
            other => unreachable!("bench only fills f32 and bf16, not {other}"),
        }
    }
    out
}

fn bench_kernels(c: &mut Criterion) {
    for (size, label) in SIZES {
        let mut group = c.benchmark_group(format!("reduce_{label}"));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_millis(1500));

        let src = filled(DType::F32, size, 1);
        let mut dst = vec![0u8; size];
        group.throughput(Throughput::Bytes(2 * size as u64));
        group.bench_function("memcpy", |b| {
            b.iter(|| dst.copy_from_slice(black_box(&src)));
        });

        for dtype in [DType::F32, DType::BF16] {
            for nsrc in [2usize, 4] {
                let bufs: Vec<Vec<u8>> = (0..nsrc).map(|k| filled(dtype, size, k as u32)).collect();
                let srcs: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
                group.throughput(Throughput::Bytes(((nsrc + 1) * size) as u64));
                group.bench_with_input(
                    BenchmarkId::new(format!("sum_{dtype}"), format!("{nsrc}src")),
                    &srcs,
                    |b, srcs| {
                        b.iter(|| {
                            reduce_slices(
                                &mut dst,
                                black_box(srcs),
                                black_box(dtype),
                                black_box(ReduceOp::Sum),
                            )
                        });
                    },
                );
            }
        }
        group.finish();
    }
}

criterion_group!(benches, bench_kernels);
criterion_main!(benches);
