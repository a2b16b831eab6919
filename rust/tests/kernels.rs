//! Property tests: every dtype × op of the reduction kernels against a plain scalar reference.
//!
//! Semantics the reference pins down (and `reduce_slices` documents):
//! - Sources combine left to right: `((s0 op s1) op s2) ...`; avg is that sum divided by the
//!   number of sources once at the end. f16 and bf16 widen to f32 (exactly), accumulate in
//!   f32 and round once to nearest-even, as `half`'s `to_f32`/`from_f32` do.
//! - Float max/min propagate NaN (any NaN operand gives NaN) and keep the earlier operand on
//!   ties, so `max(-0.0, +0.0)` is `-0.0`. Results are compared bit for bit, except that any
//!   NaN matches any NaN: Rust leaves the payload of an arithmetic NaN unspecified.
//! - Integers wrap on sum and prod; avg on integers (and bool) is the plain sum.
//! - Bool: any non-zero byte is true; sum/avg/max are "or", prod/min are "and"; output 0/1.

use half::{bf16, f16};
use proptest::prelude::*;
use shardline::reduce::{reduce_into, reduce_slices, scale, ReduceOp};
use shardline::DType;

const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Avg,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Prod,
];

/// splitmix64, so one proptest seed expands into every source deterministically.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// A float drawn to hit the interesting cases: small integers (exact sums, ties, ±0),
/// specials (NaN, ±inf, subnormals, extremes) and arbitrary bit patterns.
fn float_value(rng: &mut Rng) -> f64 {
    let r = rng.next();
    match r % 8 {
        0..=3 => ((r >> 8) % 17) as f64 - 8.0,
        4 => [
            0.0,
            -0.0,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            1e-40,
            -1e-45,
            65504.0,
        ][((r >> 8) % 8) as usize],
        5 => (((r >> 8) % 2001) as f64 - 1000.0) / 64.0,
        _ => f64::NAN, // placeholder: replaced by arbitrary bits below
    }
}

/// One element of `dtype` as little-endian bytes.
fn element(dtype: DType, rng: &mut Rng) -> Vec<u8> {
    let bits = rng.next();
    let arbitrary = bits % 8 >= 6;
    let v = float_value(rng);
    match dtype {
        DType::F32 if arbitrary => (rng.next() as u32).to_le_bytes().to_vec(),
        DType::F32 => (v as f32).to_le_bytes().to_vec(),
        DType::F64 if arbitrary => rng.next().to_le_bytes().to_vec(),
        DType::F64 => v.to_le_bytes().to_vec(),
        DType::F16 if arbitrary => (rng.next() as u16).to_le_bytes().to_vec(),
        DType::F16 => f16::from_f64(v).to_le_bytes().to_vec(),
        DType::BF16 if arbitrary => (rng.next() as u16).to_le_bytes().to_vec(),
        DType::BF16 => bf16::from_f64(v).to_le_bytes().to_vec(),
        DType::I8 | DType::U8 => vec![if arbitrary {
            bits >> 8
        } else {
            (bits >> 8) % 5
        } as u8],
        DType::I32 if arbitrary => (rng.next() as u32).to_le_bytes().to_vec(),
        DType::I32 => ((((bits >> 8) % 9) as i32) - 4).to_le_bytes().to_vec(),
        DType::I64 if arbitrary => rng.next().to_le_bytes().to_vec(),
        DType::I64 => ((((bits >> 8) % 9) as i64) - 4).to_le_bytes().to_vec(),
        DType::Bool => vec![[0u8, 1, 0, 1, 2, 255, 0, 1][((bits >> 8) % 8) as usize]],
        DType::I16 | DType::F8E4M3 | DType::F8E5M2 => unreachable!("{dtype} is not reduced"),
    }
}

/// Float combine with the documented NaN and tie rules.
macro_rules! float_ref {
    ($op:expr, $a:expr, $b:expr) => {{
        let (a, b) = ($a, $b);
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => a + b,
            ReduceOp::Prod => a * b,
            ReduceOp::Max if a.is_nan() => a,
            ReduceOp::Max if b.is_nan() => b,
            ReduceOp::Max => {
                if b > a {
                    b
                } else {
                    a
                }
            }
            ReduceOp::Min if a.is_nan() => a,
            ReduceOp::Min if b.is_nan() => b,
            ReduceOp::Min => {
                if b < a {
                    b
                } else {
                    a
                }
            }
        }
    }};
}

/// Wrapping integer combine; avg is the sum.
macro_rules! int_ref {
    ($op:expr, $a:expr, $b:expr) => {{
        let (a, b) = ($a, $b);
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
            ReduceOp::Prod => a.wrapping_mul(b),
            ReduceOp::Max => a.max(b),
            ReduceOp::Min => a.min(b),
        }
    }};
}

/// Reduces one element position: `xs[k]` is source k's element bytes. `divide` is false for
/// `reduce_into` (avg accumulates as a sum there).
fn reference_elem(dtype: DType, op: ReduceOp, xs: &[&[u8]], divide: bool) -> Vec<u8> {
    let n = xs.len();
    let avg = divide && op == ReduceOp::Avg && n > 1;
    macro_rules! fold_float {
        ($load:expr, $acc:ty) => {{
            let mut a: $acc = $load(xs[0]);
            for x in &xs[1..] {
                a = float_ref!(op, a, $load(x));
            }
            if avg {
                a / n as $acc
            } else {
                a
            }
        }};
    }
    macro_rules! fold_int {
        ($t:ty) => {{
            let load = |x: &[u8]| <$t>::from_le_bytes(x.try_into().unwrap());
            let mut a = load(xs[0]);
            for x in &xs[1..] {
                a = int_ref!(op, a, load(x));
            }
            a.to_le_bytes().to_vec()
        }};
    }
    match dtype {
        DType::F32 => fold_float!(|x: &[u8]| f32::from_le_bytes(x.try_into().unwrap()), f32)
            .to_le_bytes()
            .to_vec(),
        DType::F64 => fold_float!(|x: &[u8]| f64::from_le_bytes(x.try_into().unwrap()), f64)
            .to_le_bytes()
            .to_vec(),
        DType::F16 => {
            let v = fold_float!(|x: &[u8]| f16::from_le_bytes([x[0], x[1]]).to_f32(), f32);
            f16::from_f32(v).to_le_bytes().to_vec()
        }
        DType::BF16 => {
            let v = fold_float!(|x: &[u8]| bf16::from_le_bytes([x[0], x[1]]).to_f32(), f32);
            bf16::from_f32(v).to_le_bytes().to_vec()
        }
        DType::I8 => fold_int!(i8),
        DType::U8 => fold_int!(u8),
        DType::I32 => fold_int!(i32),
        DType::I64 => fold_int!(i64),
        DType::Bool => {
            let mut a = xs[0][0] != 0;
            for x in &xs[1..] {
                let b = x[0] != 0;
                a = match op {
                    ReduceOp::Sum | ReduceOp::Avg | ReduceOp::Max => a | b,
                    ReduceOp::Prod | ReduceOp::Min => a & b,
                };
            }
            vec![a as u8]
        }
        DType::I16 | DType::F8E4M3 | DType::F8E5M2 => unreachable!("{dtype} is not reduced"),
    }
}

fn reference(dtype: DType, op: ReduceOp, srcs: &[&[u8]], divide: bool) -> Vec<u8> {
    let size = dtype.size();
    let mut out = Vec::with_capacity(srcs[0].len());
    for i in (0..srcs[0].len()).step_by(size) {
        let xs: Vec<&[u8]> = srcs.iter().map(|s| &s[i..i + size]).collect();
        out.extend(reference_elem(dtype, op, &xs, divide));
    }
    out
}

/// True when `a` is NaN of `dtype` (little-endian element bytes).
fn is_nan(dtype: DType, a: &[u8]) -> bool {
    match dtype {
        DType::F32 => f32::from_le_bytes(a.try_into().unwrap()).is_nan(),
        DType::F64 => f64::from_le_bytes(a.try_into().unwrap()).is_nan(),
        DType::F16 => f16::from_le_bytes([a[0], a[1]]).is_nan(),
        DType::BF16 => bf16::from_le_bytes([a[0], a[1]]).is_nan(),
        _ => false,
    }
}

/// Bit-for-bit equality, except any NaN equals any NaN. Reports the first difference.
fn check_same(dtype: DType, what: &str, got: &[u8], want: &[u8]) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.len(), want.len());
    let size = dtype.size();
    for (i, (g, w)) in got.chunks(size).zip(want.chunks(size)).enumerate() {
        if g != w && !(is_nan(dtype, g) && is_nan(dtype, w)) {
            return Err(TestCaseError::fail(format!(
                "{what} {dtype}: element {i} is {g:02x?}, reference {w:02x?}"
            )));
        }
    }
    Ok(())
}

/// `nsrc` sources of `len` elements each, every one starting `offset` bytes into its buffer
/// (so the kernels see unaligned slices too).
fn sources(dtype: DType, len: usize, nsrc: usize, offset: usize, seed: u64) -> Vec<Vec<u8>> {
    let mut rng = Rng(seed ^ (dtype.tag() as u64) << 56);
    (0..nsrc)
        .map(|_| {
            let mut v = vec![0xAAu8; offset];
            for _ in 0..len {
                v.extend(element(dtype, &mut rng));
            }
            v
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn reduce_slices_matches_reference(
        len in 0usize..2000,
        nsrc in 1usize..=6,
        offset in 0usize..8,
        seed in any::<u64>(),
    ) {
        for dtype in DType::ALL {
            let bufs = sources(dtype, len, nsrc, offset, seed);
            let srcs: Vec<&[u8]> = bufs.iter().map(|b| &b[offset..]).collect();
            for op in OPS {
                let mut dst = vec![0x55u8; offset + len * dtype.size()];
                reduce_slices(&mut dst[offset..], &srcs, dtype, op);
                let want = reference(dtype, op, &srcs, true);
                check_same(dtype, &format!("reduce_slices {op:?} x{nsrc}"), &dst[offset..], &want)?;
                prop_assert!(dst[..offset].iter().all(|&b| b == 0x55), "wrote before dst");
            }
        }
    }

    #[test]
    fn reduce_into_and_scale_match_reference(
        len in 0usize..2000,
        divisor in 0usize..6,
        seed in any::<u64>(),
    ) {
        for dtype in DType::ALL {
            let bufs = sources(dtype, len, 2, 0, seed);
            for op in OPS {
                let mut dst = bufs[0].clone();
                reduce_into(&mut dst, &bufs[1], dtype, op);
                let want = reference(dtype, op, &[&bufs[0], &bufs[1]], false);
                check_same(dtype, &format!("reduce_into {op:?}"), &dst, &want)?;
            }
            let mut dst = bufs[0].clone();
            scale(&mut dst, dtype, divisor);
            // scale: x / divisor for floats (rounded once for f16/bf16); otherwise the bytes
            // are left exactly as they are.
            let want = if dtype.is_float() && divisor > 1 {
                scale_reference(dtype, &bufs[0], divisor)
            } else {
                bufs[0].clone()
            };
            check_same(dtype, &format!("scale /{divisor}"), &dst, &want)?;
        }
    }
}

/// Each float element divided by `divisor`, widened and rounded like the kernels.
fn scale_reference(dtype: DType, src: &[u8], divisor: usize) -> Vec<u8> {
    let size = dtype.size();
    src.chunks(size)
        .flat_map(|x| match dtype {
            DType::F32 => (f32::from_le_bytes(x.try_into().unwrap()) / divisor as f32)
                .to_le_bytes()
                .to_vec(),
            DType::F64 => (f64::from_le_bytes(x.try_into().unwrap()) / divisor as f64)
                .to_le_bytes()
                .to_vec(),
            DType::F16 => {
                let v = f16::from_le_bytes([x[0], x[1]]).to_f32() / divisor as f32;
                f16::from_f32(v).to_le_bytes().to_vec()
            }
            DType::BF16 => {
                let v = bf16::from_le_bytes([x[0], x[1]]).to_f32() / divisor as f32;
                bf16::from_f32(v).to_le_bytes().to_vec()
            }
            _ => unreachable!("scale_reference is for floats"),
        })
        .collect()
}

/// Fixed cases the properties might take long to find.
#[test]
fn edge_cases() {
    let f = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut out = vec![0u8; 12];
    // NaN in either position propagates through max and min; ties keep the earlier operand.
    let a = f(&[f32::NAN, 1.0, -0.0]);
    let b = f(&[1.0, f32::NAN, 0.0]);
    for op in [ReduceOp::Max, ReduceOp::Min] {
        reduce_slices(&mut out, &[&a, &b], DType::F32, op);
        let got: Vec<f32> = out
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert!(got[0].is_nan() && got[1].is_nan(), "{op:?}: {got:?}");
        assert_eq!(
            got[2].to_bits(),
            (-0.0f32).to_bits(),
            "{op:?} tie keeps the first operand"
        );
    }
    // Integers wrap.
    let a = [127i8 as u8, 0x80];
    let b = [1u8, 0xFF];
    let mut out = [0u8; 2];
    reduce_slices(&mut out, &[&a, &b], DType::I8, ReduceOp::Sum);
    assert_eq!(out, [0x80, 0x7F]);
    reduce_slices(&mut out, &[&a, &b], DType::I8, ReduceOp::Prod);
    assert_eq!(out, [127, 0x80]);
    // bf16: 1 + 2^-8 is a tie between 1 and 1 + 2^-7; it rounds to even (1.0).
    let one = bf16::from_f32(1.0).to_le_bytes();
    let tiny = bf16::from_f32(1.0 / 256.0).to_le_bytes();
    let mut out = [0u8; 2];
    reduce_slices(&mut out, &[&one, &tiny], DType::BF16, ReduceOp::Sum);
    assert_eq!(bf16::from_le_bytes(out).to_f32(), 1.0);
}
