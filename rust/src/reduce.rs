//! Reduction kernels: elementwise sum, avg, max, min and prod over every dtype collectives
//! move ([`DType::ALL`]).
//!
//! Kernels work on raw little-endian bytes (the engine never knows about tensors). They read
//! elements with `from_le_bytes` over `chunks_exact`, which the compiler turns into vector
//! loads; f16 and bf16 are widened to f32 with integer shifts (no per-element calls),
//! accumulated across all inputs, and rounded once to nearest-even.
//!
//! Each dtype × op pair is its own monomorphised loop (the op is a const generic, so no
//! branch sits in the inner loop); up to four sources are fused into one pass, more go
//! through an L1-resident accumulator block. The whole set is compiled twice, for the
//! baseline target (SSE2 on x86-64) and with AVX2, chosen at runtime.

use crate::dtype::DType;
use crate::error::{Error, Result};

/// A reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    /// Sum (logical or for bool).
    Sum = 0,
    /// Mean over ranks (floating-point dtypes only).
    Avg = 1,
    /// Maximum (logical or for bool).
    Max = 2,
    /// Minimum (logical and for bool).
    Min = 3,
    /// Product (logical and for bool).
    Prod = 4,
}

impl ReduceOp {
    /// Parses `"sum"`, `"avg"`/`"mean"`, `"max"`, `"min"`, `"prod"` (case-insensitive).
    pub fn parse(name: &str) -> Result<Self> {
        Ok(match name.to_ascii_lowercase().as_str() {
            "sum" => ReduceOp::Sum,
            "avg" | "mean" => ReduceOp::Avg,
            "max" => ReduceOp::Max,
            "min" => ReduceOp::Min,
            "prod" | "product" => ReduceOp::Prod,
            other => {
                return Err(Error::invalid(format!(
                    "unknown reduce op {other:?}; use one of sum, avg, max, min, prod"
                )))
            }
        })
    }

    /// The op for a wire tag.
    pub fn from_tag(tag: u8) -> Option<Self> {
        [
            ReduceOp::Sum,
            ReduceOp::Avg,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Prod,
        ]
        .get(tag as usize)
        .copied()
    }

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Prod => "prod",
        }
    }

    /// Checks that `self` is defined on `dtype` (avg needs a floating-point dtype).
    pub fn validate(self, dtype: DType) -> Result<()> {
        if self == ReduceOp::Avg && !dtype.is_float() {
            return Err(Error::invalid(format!(
                "op=avg is not defined for {dtype}; use op=sum and divide, or cast to a float dtype"
            )));
        }
        Ok(())
    }
}

/// Compile-time op tags (the `ReduceOp` discriminants), so every kernel is monomorphised per
/// op and its inner loop holds no branch on the op.
const SUM: u8 = ReduceOp::Sum as u8;
const AVG: u8 = ReduceOp::Avg as u8;
const MAX: u8 = ReduceOp::Max as u8;
const MIN: u8 = ReduceOp::Min as u8;
const PROD: u8 = ReduceOp::Prod as u8;

/// An element type the kernels can reduce: how it is read from and written to little-endian
/// bytes, its accumulator type, and the ops on that accumulator.
///
/// Every method is `#[inline(always)]` and branch-free (selects, not jumps), so the loops in
/// the kernels below vectorise on baseline x86-64 (SSE2) and again under AVX2.
trait Elem {
    /// Bytes per element.
    const SIZE: usize;
    /// The accumulator (f32 for f16 and bf16).
    type Acc: Copy;
    /// Any accumulator value, to initialise scratch space.
    const ZERO: Self::Acc;
    /// Reads one element (`b.len() == SIZE`) and widens it to the accumulator.
    fn load(b: &[u8]) -> Self::Acc;
    /// Narrows an accumulator (rounding once) and writes it (`b.len() == SIZE`).
    fn store(a: Self::Acc, b: &mut [u8]);
    /// `a op b` for the op tagged `OP` (avg combines as sum).
    fn combine<const OP: u8>(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    /// The mean's final division (identity for integers and bool).
    fn divide(a: Self::Acc, n: usize) -> Self::Acc;
}

/// Float max/min: NaN-propagating (a NaN operand gives a NaN; if both are NaN the earlier
/// one wins) and on ties, including `-0.0` vs `+0.0`, the earlier operand wins.
macro_rules! float_combine {
    ($op:expr, $a:expr, $b:expr) => {{
        let (a, b) = ($a, $b);
        match $op {
            SUM | AVG => a + b,
            PROD => a * b,
            MAX => {
                if a >= b || a.is_nan() {
                    a
                } else {
                    b
                }
            }
            _ => {
                if a <= b || a.is_nan() {
                    a
                } else {
                    b
                }
            }
        }
    }};
}

macro_rules! float_elem {
    ($t:ty, $n:expr) => {
        impl Elem for $t {
            const SIZE: usize = $n;
            type Acc = $t;
            const ZERO: $t = 0.0;
            #[inline(always)]
            fn load(b: &[u8]) -> $t {
                <$t>::from_le_bytes(b.try_into().expect("chunk of element size"))
            }
            #[inline(always)]
            fn store(a: $t, b: &mut [u8]) {
                b.copy_from_slice(&a.to_le_bytes())
            }
            #[inline(always)]
            fn combine<const OP: u8>(a: $t, b: $t) -> $t {
                float_combine!(OP, a, b)
            }
            #[inline(always)]
            fn divide(a: $t, n: usize) -> $t {
                a / n as $t
            }
        }
    };
}
float_elem!(f32, 4);
float_elem!(f64, 8);

macro_rules! int_elem {
    ($t:ty, $n:expr) => {
        impl Elem for $t {
            const SIZE: usize = $n;
            type Acc = $t;
            const ZERO: $t = 0;
            #[inline(always)]
            fn load(b: &[u8]) -> $t {
                <$t>::from_le_bytes(b.try_into().expect("chunk of element size"))
            }
            #[inline(always)]
            fn store(a: $t, b: &mut [u8]) {
                b.copy_from_slice(&a.to_le_bytes())
            }
            #[inline(always)]
            fn combine<const OP: u8>(a: $t, b: $t) -> $t {
                match OP {
                    SUM | AVG => a.wrapping_add(b),
                    PROD => a.wrapping_mul(b),
                    MAX => a.max(b),
                    _ => a.min(b),
                }
            }
            #[inline(always)]
            fn divide(a: $t, _n: usize) -> $t {
                a
            }
        }
    };
}
int_elem!(i8, 1);
int_elem!(u8, 1);
int_elem!(i32, 4);
int_elem!(i64, 8);

/// bf16 bits -> f32: the bits are the top half of an f32.
///
/// `half::bf16::to_f32` also sets the quiet bit of a NaN; skipping that here changes no
/// result, since [`f32_to_bf16`] sets it again and arithmetic on a NaN quiets it anyway.
#[inline(always)]
fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// f32 -> bf16 bits, round to nearest, ties to even; NaN keeps its top payload bits, made
/// quiet. Bit-exact with `half::bf16::from_f32`, with shifts and masks LLVM vectorises.
#[inline(always)]
fn f32_to_bf16(f: f32) -> u16 {
    let x = f.to_bits();
    // All ones for NaN. A NaN gets its quiet bit and loses the 16 bits rounding would
    // carry out of, so the rounding below only truncates it.
    let nan = (f.is_nan() as u32).wrapping_neg();
    let x = (x | (nan & 0x0040_0000)) & !(nan & 0xFFFF);
    // Cannot overflow: the largest pattern left is 0xFFFF_0000.
    (x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16) as u16
}

/// f16 bits -> f32, bit-exact with `half::f16::to_f32` (NaN payloads included) without a
/// per-element call: exponent rebias, subnormals renormalised by one exact f32 subtraction.
#[inline(always)]
fn f16_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let em = h & 0x7FFF;
    // Normal numbers: shift into place and rebias the exponent by 127 - 15.
    let normal = (em << 13) + ((127 - 15) << 23);
    // Subnormals and zero: 2^-14 * (1 + m / 1024) - 2^-14, exact in f32.
    let magic = f32::from_bits(113 << 23);
    let sub = (f32::from_bits((em << 13) + (113 << 23)) - magic).to_bits();
    // Inf and NaN: all exponent bits set; a NaN gets its quiet bit, as `half` does.
    let quiet = if em > 0x7C00 { 0x0040_0000 } else { 0 };
    let special = (em << 13) | 0x7F80_0000 | quiet;
    let bits = if em >= 0x7C00 {
        special
    } else if em < 0x0400 {
        sub
    } else {
        normal
    };
    f32::from_bits(bits | sign)
}

/// f32 -> f16 bits, round to nearest, ties to even (subnormals included), overflow to inf,
/// NaN keeps its top payload bits, made quiet: bit-exact with `half::f16::from_f32`.
#[inline(always)]
fn f32_to_f16(f: f32) -> u16 {
    let x = f.to_bits();
    let sign = (x >> 16) & 0x8000;
    let a = x & 0x7FFF_FFFF;
    // |f| >= 65520 rounds to inf (2^16 as f32 bits is the first exponent that cannot fit).
    let special = if a > 0x7F80_0000 {
        0x7E00 | ((a & 0x007F_FFFF) >> 13)
    } else {
        0x7C00
    };
    // |f| < 2^-14: adding 0.5 aligns the f16 subnormal unit (2^-24) with the last mantissa
    // bit of the sum, so the f32 addition rounds to nearest even for us.
    let half_magic = f32::from_bits(126 << 23);
    let sub = (f32::from_bits(a) + half_magic)
        .to_bits()
        .wrapping_sub(126 << 23);
    // Normal: rebias, then round to nearest even on the 13 dropped bits.
    let odd = (a >> 13) & 1;
    let normal = a.wrapping_add(((15u32.wrapping_sub(127)) << 23) + 0xFFF + odd) >> 13;
    let bits = if a >= (127 + 16) << 23 {
        special
    } else if a < 113 << 23 {
        sub
    } else {
        normal
    };
    (bits | sign) as u16
}

/// IEEE binary16 as raw bits, accumulated in f32.
struct F16;
/// bfloat16 as raw bits, accumulated in f32.
struct Bf16;

macro_rules! half_elem {
    ($t:ty, $widen:ident, $narrow:ident) => {
        impl Elem for $t {
            const SIZE: usize = 2;
            type Acc = f32;
            const ZERO: f32 = 0.0;
            #[inline(always)]
            fn load(b: &[u8]) -> f32 {
                $widen(u16::from_le_bytes(b.try_into().expect("2 bytes")))
            }
            #[inline(always)]
            fn store(a: f32, b: &mut [u8]) {
                b.copy_from_slice(&$narrow(a).to_le_bytes())
            }
            #[inline(always)]
            fn combine<const OP: u8>(a: f32, b: f32) -> f32 {
                float_combine!(OP, a, b)
            }
            #[inline(always)]
            fn divide(a: f32, n: usize) -> f32 {
                a / n as f32
            }
        }
    };
}
half_elem!(F16, f16_to_f32, f32_to_f16);
half_elem!(Bf16, bf16_to_f32, f32_to_bf16);

/// Booleans as bytes: any non-zero byte is true; sum/avg/max are "or", prod/min are "and";
/// the output is 0 or 1.
struct Bool8;
impl Elem for Bool8 {
    const SIZE: usize = 1;
    type Acc = u8;
    const ZERO: u8 = 0;
    #[inline(always)]
    fn load(b: &[u8]) -> u8 {
        (b[0] != 0) as u8
    }
    #[inline(always)]
    fn store(a: u8, b: &mut [u8]) {
        b[0] = a
    }
    #[inline(always)]
    fn combine<const OP: u8>(a: u8, b: u8) -> u8 {
        match OP {
            SUM | AVG | MAX => a | b,
            _ => a & b,
        }
    }
    #[inline(always)]
    fn divide(a: u8, _n: usize) -> u8 {
        a
    }
}

/// Elements per block when more than two sources are reduced: the f32/f64 accumulator
/// (2 or 4 KiB) stays in L1 while each source streams through it once.
const BLOCK: usize = 512;

/// The mean's division, applied once at the end (`divisor` is the number of sources).
#[inline(always)]
fn finish<T: Elem, const OP: u8>(a: T::Acc, divisor: usize) -> T::Acc {
    if OP == AVG {
        T::divide(a, divisor)
    } else {
        a
    }
}

/// `dst = finish(s0)`.
#[inline(always)]
fn map1<T: Elem, const OP: u8>(dst: &mut [u8], s0: &[u8], divisor: usize) {
    for (d, a) in dst.chunks_exact_mut(T::SIZE).zip(s0.chunks_exact(T::SIZE)) {
        T::store(finish::<T, OP>(T::load(a), divisor), d);
    }
}

/// `dst = finish(s0 op s1)`.
#[inline(always)]
fn map2<T: Elem, const OP: u8>(dst: &mut [u8], s0: &[u8], s1: &[u8], divisor: usize) {
    let it = dst.chunks_exact_mut(T::SIZE).zip(s0.chunks_exact(T::SIZE));
    for ((d, a), b) in it.zip(s1.chunks_exact(T::SIZE)) {
        let v = T::combine::<OP>(T::load(a), T::load(b));
        T::store(finish::<T, OP>(v, divisor), d);
    }
}

/// `dst = finish(s0 op s1 op s2)`.
#[inline(always)]
fn map3<T: Elem, const OP: u8>(dst: &mut [u8], s: [&[u8]; 3], divisor: usize) {
    let it = dst
        .chunks_exact_mut(T::SIZE)
        .zip(s[0].chunks_exact(T::SIZE));
    let it = it
        .zip(s[1].chunks_exact(T::SIZE))
        .zip(s[2].chunks_exact(T::SIZE));
    for (((d, a), b), c) in it {
        let v = T::combine::<OP>(T::combine::<OP>(T::load(a), T::load(b)), T::load(c));
        T::store(finish::<T, OP>(v, divisor), d);
    }
}

/// `dst = finish(s0 op s1 op s2 op s3)`.
#[inline(always)]
fn map4<T: Elem, const OP: u8>(dst: &mut [u8], s: [&[u8]; 4], divisor: usize) {
    let it = dst
        .chunks_exact_mut(T::SIZE)
        .zip(s[0].chunks_exact(T::SIZE));
    let it = it
        .zip(s[1].chunks_exact(T::SIZE))
        .zip(s[2].chunks_exact(T::SIZE));
    for ((((d, a), b), c), e) in it.zip(s[3].chunks_exact(T::SIZE)) {
        let v = T::combine::<OP>(T::load(a), T::load(b));
        let v = T::combine::<OP>(T::combine::<OP>(v, T::load(c)), T::load(e));
        T::store(finish::<T, OP>(v, divisor), d);
    }
}

/// Any number of sources, a block at a time: `acc = s0 op s1`, `acc = acc op sk` for the
/// middle sources, `dst = finish(acc op s_last)`. Same left-to-right order as `map2..4`.
#[inline(always)]
fn map_blocked<T: Elem, const OP: u8>(dst: &mut [u8], srcs: &[&[u8]], divisor: usize) {
    let (first, rest) = srcs.split_at(2);
    let (last, middle) = rest.split_last().expect("at least three sources");
    let mut acc = [T::ZERO; BLOCK];
    let step = BLOCK * T::SIZE;
    let mut start = 0;
    while start < dst.len() {
        let end = (start + step).min(dst.len());
        let acc = &mut acc[..(end - start) / T::SIZE];
        let it = acc
            .iter_mut()
            .zip(first[0][start..end].chunks_exact(T::SIZE));
        for ((x, a), b) in it.zip(first[1][start..end].chunks_exact(T::SIZE)) {
            *x = T::combine::<OP>(T::load(a), T::load(b));
        }
        for src in middle {
            for (x, b) in acc.iter_mut().zip(src[start..end].chunks_exact(T::SIZE)) {
                *x = T::combine::<OP>(*x, T::load(b));
            }
        }
        let it = dst[start..end].chunks_exact_mut(T::SIZE).zip(acc.iter());
        for ((d, x), b) in it.zip(last[start..end].chunks_exact(T::SIZE)) {
            T::store(
                finish::<T, OP>(T::combine::<OP>(*x, T::load(b)), divisor),
                d,
            );
        }
        start = end;
    }
}

/// `dst = dst op src`, in place (no division).
#[inline(always)]
fn map_into<T: Elem, const OP: u8>(dst: &mut [u8], src: &[u8]) {
    for (d, b) in dst.chunks_exact_mut(T::SIZE).zip(src.chunks_exact(T::SIZE)) {
        let v = T::combine::<OP>(T::load(d), T::load(b));
        T::store(v, d);
    }
}

/// `dst = dst / divisor`, in place.
#[inline(always)]
fn map_scale<T: Elem>(dst: &mut [u8], divisor: usize) {
    for d in dst.chunks_exact_mut(T::SIZE) {
        T::store(T::divide(T::load(d), divisor), d);
    }
}

/// What a call asks of the kernels, once the public functions have checked their slices.
#[derive(Clone, Copy)]
enum Job<'a> {
    /// `dst = op(srcs...)`, the mean divided by `srcs.len()`.
    Reduce(&'a [&'a [u8]]),
    /// `dst = dst op src`.
    Into(&'a [u8]),
    /// `dst = dst / divisor`.
    Scale(usize),
}

#[inline(always)]
fn run_typed<T: Elem, const OP: u8>(dst: &mut [u8], job: Job<'_>) {
    match job {
        Job::Reduce(srcs) => {
            let n = srcs.len();
            match *srcs {
                [a] => map1::<T, OP>(dst, a, n),
                [a, b] => map2::<T, OP>(dst, a, b, n),
                [a, b, c] => map3::<T, OP>(dst, [a, b, c], n),
                [a, b, c, d] => map4::<T, OP>(dst, [a, b, c, d], n),
                _ => map_blocked::<T, OP>(dst, srcs, n),
            }
        }
        Job::Into(src) => map_into::<T, OP>(dst, src),
        Job::Scale(divisor) => map_scale::<T>(dst, divisor),
    }
}

#[inline(always)]
fn run_op<T: Elem>(dst: &mut [u8], job: Job<'_>, op: ReduceOp) {
    match op {
        ReduceOp::Sum => run_typed::<T, SUM>(dst, job),
        ReduceOp::Avg => run_typed::<T, AVG>(dst, job),
        ReduceOp::Max => run_typed::<T, MAX>(dst, job),
        ReduceOp::Min => run_typed::<T, MIN>(dst, job),
        ReduceOp::Prod => run_typed::<T, PROD>(dst, job),
    }
}

/// The whole dtype × op dispatch, inlined into each instruction-set wrapper below.
#[inline(always)]
fn run_any(dst: &mut [u8], job: Job<'_>, dtype: DType, op: ReduceOp) {
    match dtype {
        DType::F32 => run_op::<f32>(dst, job, op),
        DType::F64 => run_op::<f64>(dst, job, op),
        DType::F16 => run_op::<F16>(dst, job, op),
        DType::BF16 => run_op::<Bf16>(dst, job, op),
        DType::I8 => run_op::<i8>(dst, job, op),
        DType::U8 => run_op::<u8>(dst, job, op),
        DType::I32 => run_op::<i32>(dst, job, op),
        DType::I64 => run_op::<i64>(dst, job, op),
        DType::Bool => run_op::<Bool8>(dst, job, op),
        DType::I16 | DType::F8E4M3 | DType::F8E5M2 => {
            panic!("the reduction kernels do not handle {dtype}, only DType::ALL")
        }
    }
}

/// The kernels compiled for the crate's baseline target (SSE2 on x86-64).
#[inline(never)]
fn run_baseline(dst: &mut [u8], job: Job<'_>, dtype: DType, op: ReduceOp) {
    run_any(dst, job, dtype, op)
}

/// The same kernels compiled with AVX2 (256-bit vectors).
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline(never)]
unsafe fn run_avx2(dst: &mut [u8], job: Job<'_>, dtype: DType, op: ReduceOp) {
    run_any(dst, job, dtype, op)
}

/// Runs the kernels with the widest instruction set this CPU has.
fn run(dst: &mut [u8], job: Job<'_>, dtype: DType, op: ReduceOp) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 support was just detected at runtime.
        return unsafe { run_avx2(dst, job, dtype, op) };
    }
    run_baseline(dst, job, dtype, op)
}

/// `dst[i] = op(srcs[0][i], srcs[1][i], ...)`; for avg, the sum divided by `srcs.len()`.
///
/// Every slice holds the same number of bytes, a whole number of `dtype` elements.
/// f16 and bf16 accumulate in f32 across all sources and round once. Sources combine left
/// to right (`((s0 op s1) op s2) ...`). Float max/min propagate NaN and keep the earlier
/// operand on ties (so `max(-0.0, +0.0)` is `-0.0`); integers wrap; avg on an integer or
/// bool dtype is the sum (use [`ReduceOp::validate`] to reject it).
///
/// # Panics
/// If the slices differ in length or `dtype` is not one collectives reduce ([`DType::ALL`]).
pub fn reduce_slices(dst: &mut [u8], srcs: &[&[u8]], dtype: DType, op: ReduceOp) {
    assert!(!srcs.is_empty(), "reduce_slices needs at least one source");
    assert!(
        srcs.iter().all(|s| s.len() == dst.len()),
        "reduce_slices: length mismatch"
    );
    // A mean over one source divides by one: skip it (x / 1 == x).
    let op = if op == ReduceOp::Avg && srcs.len() == 1 {
        ReduceOp::Sum
    } else {
        op
    };
    run(dst, Job::Reduce(srcs), dtype, op);
}

/// `dst[i] = op(dst[i], src[i])`; avg accumulates as sum (finish with [`scale`]).
pub fn reduce_into(dst: &mut [u8], src: &[u8], dtype: DType, op: ReduceOp) {
    assert_eq!(dst.len(), src.len(), "reduce_into: length mismatch");
    run(dst, Job::Into(src), dtype, op);
}

/// Whether a multi-step average (the TCP ring and tree, and across hosts) scales each input
/// by `1 / n` (divides it by `n`) before summing, as NCCL's `ncclAvg` does for floats, instead of dividing the
/// sum: float16 partial sums, kept in float16 between steps, overflow to infinity where the
/// mean does not (a loss-scaled gradient). bfloat16 has float32's range: it divides once.
pub fn premultiplied_avg(dtype: DType, op: ReduceOp) -> bool {
    op == ReduceOp::Avg && dtype == DType::F16
}

/// Divides every element by `divisor` (floating-point dtypes; integers are left as they are).
pub fn scale(dst: &mut [u8], dtype: DType, divisor: usize) {
    if divisor <= 1 || !dtype.is_float() {
        return;
    }
    run(dst, Job::Scale(divisor), dtype, ReduceOp::Avg);
}

#[cfg(test)]
mod tests;
