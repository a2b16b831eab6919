//! Reduction kernels: elementwise sum, avg, max, min and prod over every dtype.
//!
//! Kernels work on raw little-endian bytes (the engine never knows about tensors). They read
//! elements with `from_le_bytes` over `chunks_exact`, which the compiler turns into vector
//! loads; f16 and bf16 are widened to f32, accumulated across all inputs, and rounded once.

use crate::dtype::DType;
use crate::error::{Error, Result};
use half::{bf16, f16};

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

/// An element type the kernels can reduce, with its accumulator type.
trait Elem: Copy {
    const SIZE: usize;
    type Acc: Copy;
    fn load(b: &[u8]) -> Self;
    fn store(self, b: &mut [u8]);
    fn widen(self) -> Self::Acc;
    fn narrow(a: Self::Acc) -> Self;
    fn combine(op: ReduceOp, a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn divide(a: Self::Acc, n: usize) -> Self::Acc;
}

macro_rules! numeric_elem {
    ($t:ty, $acc:ty, $n:expr, float) => {
        numeric_elem!(@impl $t, $acc, $n, |a: $acc, n: usize| a / (n as $acc),
            |a: $acc, b: $acc| if a >= b || a.is_nan() { a } else { b },
            |a: $acc, b: $acc| if a <= b || a.is_nan() { a } else { b });
    };
    ($t:ty, $acc:ty, $n:expr, int) => {
        numeric_elem!(@impl $t, $acc, $n, |a: $acc, _n: usize| a,
            |a: $acc, b: $acc| a.max(b), |a: $acc, b: $acc| a.min(b));
    };
    (@impl $t:ty, $acc:ty, $n:expr, $div:expr, $max:expr, $min:expr) => {
        impl Elem for $t {
            const SIZE: usize = $n;
            type Acc = $acc;
            #[inline(always)]
            fn load(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().expect("chunk of element size"))
            }
            #[inline(always)]
            fn store(self, b: &mut [u8]) {
                b.copy_from_slice(&self.to_le_bytes())
            }
            #[inline(always)]
            fn widen(self) -> $acc {
                self as $acc
            }
            #[inline(always)]
            fn narrow(a: $acc) -> Self {
                a as $t
            }
            #[inline(always)]
            fn combine(op: ReduceOp, a: $acc, b: $acc) -> $acc {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => wrapping_add(a, b),
                    ReduceOp::Prod => wrapping_mul(a, b),
                    ReduceOp::Max => ($max)(a, b),
                    ReduceOp::Min => ($min)(a, b),
                }
            }
            #[inline(always)]
            fn divide(a: $acc, n: usize) -> $acc {
                ($div)(a, n)
            }
        }
    };
}

trait Arith: Copy {
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
}
macro_rules! arith_float {
    ($($t:ty),*) => {$(impl Arith for $t {
        #[inline(always)] fn add(self, o: Self) -> Self { self + o }
        #[inline(always)] fn mul(self, o: Self) -> Self { self * o }
    })*};
}
macro_rules! arith_int {
    ($($t:ty),*) => {$(impl Arith for $t {
        #[inline(always)] fn add(self, o: Self) -> Self { self.wrapping_add(o) }
        #[inline(always)] fn mul(self, o: Self) -> Self { self.wrapping_mul(o) }
    })*};
}
arith_float!(f32, f64);
arith_int!(i8, u8, i32, i64);
#[inline(always)]
fn wrapping_add<T: Arith>(a: T, b: T) -> T {
    a.add(b)
}
#[inline(always)]
fn wrapping_mul<T: Arith>(a: T, b: T) -> T {
    a.mul(b)
}

numeric_elem!(f32, f32, 4, float);
numeric_elem!(f64, f64, 8, float);
numeric_elem!(i8, i8, 1, int);
numeric_elem!(u8, u8, 1, int);
numeric_elem!(i32, i32, 4, int);
numeric_elem!(i64, i64, 8, int);

macro_rules! half_elem {
    ($t:ty) => {
        impl Elem for $t {
            const SIZE: usize = 2;
            type Acc = f32;
            #[inline(always)]
            fn load(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().expect("2 bytes"))
            }
            #[inline(always)]
            fn store(self, b: &mut [u8]) {
                b.copy_from_slice(&self.to_le_bytes())
            }
            #[inline(always)]
            fn widen(self) -> f32 {
                self.to_f32()
            }
            #[inline(always)]
            fn narrow(a: f32) -> Self {
                <$t>::from_f32(a)
            }
            #[inline(always)]
            fn combine(op: ReduceOp, a: f32, b: f32) -> f32 {
                <f32 as Elem>::combine(op, a, b)
            }
            #[inline(always)]
            fn divide(a: f32, n: usize) -> f32 {
                a / n as f32
            }
        }
    };
}
half_elem!(f16);
half_elem!(bf16);

/// Booleans as bytes: sum/max are "or", prod/min are "and"; output is 0 or 1.
#[derive(Clone, Copy)]
struct Bool8(u8);
impl Elem for Bool8 {
    const SIZE: usize = 1;
    type Acc = u8;
    #[inline(always)]
    fn load(b: &[u8]) -> Self {
        Bool8(b[0])
    }
    #[inline(always)]
    fn store(self, b: &mut [u8]) {
        b[0] = self.0
    }
    #[inline(always)]
    fn widen(self) -> u8 {
        (self.0 != 0) as u8
    }
    #[inline(always)]
    fn narrow(a: u8) -> Self {
        Bool8(a)
    }
    #[inline(always)]
    fn combine(op: ReduceOp, a: u8, b: u8) -> u8 {
        match op {
            ReduceOp::Sum | ReduceOp::Avg | ReduceOp::Max => a | b,
            ReduceOp::Prod | ReduceOp::Min => a & b,
        }
    }
    #[inline(always)]
    fn divide(a: u8, _n: usize) -> u8 {
        a
    }
}

/// Block of elements processed per pass, so the accumulator stays in registers/L1.
const BLOCK: usize = 256;

#[inline(always)]
fn reduce_typed<T: Elem>(dst: &mut [u8], srcs: &[&[u8]], op: ReduceOp, divisor: usize) {
    let n = dst.len() / T::SIZE;
    let mut acc = [T::widen(T::load(&[0u8; 8][..T::SIZE])); BLOCK];
    let mut start = 0;
    while start < n {
        let len = BLOCK.min(n - start);
        let range = start * T::SIZE..(start + len) * T::SIZE;
        let acc = &mut acc[..len];
        for (a, b) in acc
            .iter_mut()
            .zip(srcs[0][range.clone()].chunks_exact(T::SIZE))
        {
            *a = T::load(b).widen();
        }
        for src in &srcs[1..] {
            for (a, b) in acc.iter_mut().zip(src[range.clone()].chunks_exact(T::SIZE)) {
                *a = T::combine(op, *a, T::load(b).widen());
            }
        }
        for (a, out) in acc.iter().zip(dst[range].chunks_exact_mut(T::SIZE)) {
            let v = if divisor > 1 {
                T::divide(*a, divisor)
            } else {
                *a
            };
            T::narrow(v).store(out);
        }
        start += len;
    }
}

/// `dst[i] = op(srcs[0][i], srcs[1][i], ...)`; for avg, the sum divided by `srcs.len()`.
///
/// Every slice holds the same number of bytes, a whole number of `dtype` elements.
/// f16 and bf16 accumulate in f32 across all sources and round once.
pub fn reduce_slices(dst: &mut [u8], srcs: &[&[u8]], dtype: DType, op: ReduceOp) {
    assert!(!srcs.is_empty(), "reduce_slices needs at least one source");
    assert!(
        srcs.iter().all(|s| s.len() == dst.len()),
        "reduce_slices: length mismatch"
    );
    let divisor = if op == ReduceOp::Avg { srcs.len() } else { 1 };
    dispatch(dst, srcs, dtype, op, divisor);
}

/// `dst[i] = op(dst[i], src[i])`; avg accumulates as sum (finish with [`scale`]).
pub fn reduce_into(dst: &mut [u8], src: &[u8], dtype: DType, op: ReduceOp) {
    assert_eq!(dst.len(), src.len(), "reduce_into: length mismatch");
    // Copy dst once so it can be both a source and the destination; blocks keep it cheap.
    let mut start = 0;
    let step = 64 * 1024;
    let mut tmp = vec![0u8; step.min(dst.len())];
    while start < dst.len() {
        let end = (start + step).min(dst.len());
        let t = &mut tmp[..end - start];
        t.copy_from_slice(&dst[start..end]);
        dispatch(&mut dst[start..end], &[t, &src[start..end]], dtype, op, 1);
        start = end;
    }
}

/// Divides every element by `divisor` (floating-point dtypes; integers are left as they are).
pub fn scale(dst: &mut [u8], dtype: DType, divisor: usize) {
    if divisor <= 1 || !dtype.is_float() {
        return;
    }
    let mut start = 0;
    let step = 64 * 1024;
    let mut tmp = vec![0u8; step.min(dst.len())];
    while start < dst.len() {
        let end = (start + step).min(dst.len());
        let t = &mut tmp[..end - start];
        t.copy_from_slice(&dst[start..end]);
        dispatch(&mut dst[start..end], &[t], dtype, ReduceOp::Sum, divisor);
        start = end;
    }
}

fn dispatch(dst: &mut [u8], srcs: &[&[u8]], dtype: DType, op: ReduceOp, divisor: usize) {
    match dtype {
        DType::F32 => reduce_typed::<f32>(dst, srcs, op, divisor),
        DType::F64 => reduce_typed::<f64>(dst, srcs, op, divisor),
        DType::F16 => reduce_typed::<f16>(dst, srcs, op, divisor),
        DType::BF16 => reduce_typed::<bf16>(dst, srcs, op, divisor),
        DType::I8 => reduce_typed::<i8>(dst, srcs, op, divisor),
        DType::U8 => reduce_typed::<u8>(dst, srcs, op, divisor),
        DType::I32 => reduce_typed::<i32>(dst, srcs, op, divisor),
        DType::I64 => reduce_typed::<i64>(dst, srcs, op, divisor),
        DType::Bool => reduce_typed::<Bool8>(dst, srcs, op, divisor),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn avg_rejected_for_ints() {
        assert!(ReduceOp::Avg.validate(DType::I32).is_err());
        assert!(ReduceOp::Avg.validate(DType::BF16).is_ok());
    }
}
