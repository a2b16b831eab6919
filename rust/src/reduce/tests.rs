use super::*;
use half::bf16;

fn bytes_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn sums_and_averages_f32() {
    let a = bytes_f32(&[1.0, 2.0, 3.0]);
    let b = bytes_f32(&[10.0, 20.0, 30.0]);
    let mut out = vec![0u8; a.len()];
    reduce_slices(&mut out, &[&a, &b], DType::F32, ReduceOp::Sum);
    assert_eq!(out, bytes_f32(&[11.0, 22.0, 33.0]));
    reduce_slices(&mut out, &[&a, &b], DType::F32, ReduceOp::Avg);
    assert_eq!(out, bytes_f32(&[5.5, 11.0, 16.5]));
}

#[test]
fn bf16_accumulates_in_f32() {
    // 256 + 1 + 1 + ... in bf16 stays 256 pairwise; f32 accumulation sees the ones.
    let big = bf16::from_f32(256.0).to_le_bytes().to_vec();
    let one = bf16::from_f32(1.0).to_le_bytes().to_vec();
    let srcs: Vec<&[u8]> = std::iter::once(big.as_slice())
        .chain(std::iter::repeat_n(one.as_slice(), 4))
        .collect();
    let mut out = vec![0u8; 2];
    reduce_slices(&mut out, &srcs, DType::BF16, ReduceOp::Sum);
    assert_eq!(bf16::from_le_bytes([out[0], out[1]]).to_f32(), 260.0);
}

#[test]
fn bool_or_and() {
    let a = [0u8, 1, 0, 1];
    let b = [0u8, 0, 1, 1];
    let mut out = [9u8; 4];
    reduce_slices(&mut out, &[&a, &b], DType::Bool, ReduceOp::Sum);
    assert_eq!(out, [0, 1, 1, 1]);
    reduce_slices(&mut out, &[&a, &b], DType::Bool, ReduceOp::Prod);
    assert_eq!(out, [0, 0, 0, 1]);
}

/// Bit equality, where any two NaNs are equal.
fn same_f32(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

#[test]
fn f16_widening_is_exact_for_every_pattern() {
    for h in 0..=u16::MAX {
        let want = half::f16::from_bits(h).to_f32();
        // Bit-exact, NaN payloads and quiet bits included.
        assert_eq!(f16_to_f32(h).to_bits(), want.to_bits(), "f16 {h:#06x}");
    }
}

#[test]
fn bf16_widening_is_exact_for_every_pattern() {
    for h in 0..=u16::MAX {
        let want = bf16::from_bits(h).to_f32();
        assert!(same_f32(bf16_to_f32(h), want), "bf16 {h:#06x}");
        // `half` quiets a NaN on widening and we leave that to narrowing: the round trip
        // must still agree bit for bit.
        assert_eq!(f32_to_bf16(bf16_to_f32(h)), bf16::from_f32(want).to_bits());
    }
}

/// Narrowing of one f32 bit pattern, against `half`.
fn check_narrowing(x: u32) {
    let f = f32::from_bits(x);
    assert_eq!(
        f32_to_bf16(f),
        bf16::from_f32(f).to_bits(),
        "bf16 of {x:#010x}"
    );
    assert_eq!(
        f32_to_f16(f),
        half::f16::from_f32(f).to_bits(),
        "f16 of {x:#010x}"
    );
}

#[test]
fn narrowing_matches_half_on_edges() {
    for e in 0..=255u32 {
        for m in [
            0, 1, 0xFFF, 0x1000, 0x1FFF, 0x2000, 0x7FFF, 0x8000, 0x8001, 0x18000,
        ] {
            for low in [0u32, 0x7F_FFFF, 0x7F_E000, 0x40_0000] {
                let x = (e << 23) | ((m | low) & 0x7F_FFFF);
                check_narrowing(x);
                check_narrowing(x | 0x8000_0000);
            }
        }
    }
}

proptest::proptest! {
    #[test]
    fn narrowing_matches_half(x in proptest::prelude::any::<u32>()) {
        check_narrowing(x);
    }
}

/// All 2^32 patterns; about a minute in release: `cargo test --release -- --ignored`.
#[test]
#[ignore]
fn narrowing_matches_half_exhaustive() {
    for x in 0..=u32::MAX {
        check_narrowing(x);
    }
}

/// The AVX2 and baseline builds of the kernels agree (the property tests in
/// `tests/kernels.rs` only reach the build this CPU dispatches to).
#[cfg(target_arch = "x86_64")]
#[test]
fn avx2_and_baseline_agree() {
    if !std::is_x86_feature_detected!("avx2") {
        return;
    }
    let mut seed = 0x1234_5678_9ABC_DEF0u64;
    let mut bytes = |n: usize| -> Vec<u8> {
        (0..n)
            .map(|_| {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (seed >> 56) as u8
            })
            .collect()
    };
    for dtype in DType::ALL {
        for nsrc in 1..=6 {
            let len = 1037 * dtype.size();
            let bufs: Vec<Vec<u8>> = (0..nsrc).map(|_| bytes(len)).collect();
            let srcs: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
            for op in [
                ReduceOp::Sum,
                ReduceOp::Avg,
                ReduceOp::Max,
                ReduceOp::Min,
                ReduceOp::Prod,
            ] {
                let jobs = [Job::Reduce(&srcs), Job::Into(srcs[0]), Job::Scale(nsrc)];
                for job in jobs {
                    let (mut a, mut b) = (bufs[nsrc - 1].clone(), bufs[nsrc - 1].clone());
                    run_baseline(&mut a, job, dtype, op);
                    // SAFETY: AVX2 support was detected above.
                    unsafe { run_avx2(&mut b, job, dtype, op) };
                    for (x, y) in a.chunks(dtype.size()).zip(b.chunks(dtype.size())) {
                        let nan = |c: &[u8]| match dtype {
                            DType::F32 => f32::from_le_bytes(c.try_into().unwrap()).is_nan(),
                            DType::F64 => f64::from_le_bytes(c.try_into().unwrap()).is_nan(),
                            DType::F16 => half::f16::from_le_bytes([c[0], c[1]]).is_nan(),
                            DType::BF16 => bf16::from_le_bytes([c[0], c[1]]).is_nan(),
                            _ => false,
                        };
                        assert!(x == y || (nan(x) && nan(y)), "{dtype} {op:?} x{nsrc}");
                    }
                }
            }
        }
    }
}

#[test]
fn avg_rejected_for_ints() {
    assert!(ReduceOp::Avg.validate(DType::I32).is_err());
    assert!(ReduceOp::Avg.validate(DType::BF16).is_ok());
}
