//! Optimizer steps over float32 buffers on the CPU (optimizer state kept in host memory):
//! Adam and AdamW, and SGD with momentum, with torch's formulas, one pass per element.
//!
//! Each step reads every buffer once and writes the ones it updates once (AdamW: 16 bytes
//! read and 12 written per value), so its speed is the memory's. Scalars (bias corrections,
//! step sizes) are computed in f64 and rounded to f32 once, as torch does; the per-element
//! arithmetic is f32 in torch's order, without fused multiply-adds. Work is split over the
//! current rayon pool in pieces of `PIECE` values; the loops are compiled for the baseline
//! target, with AVX2 and (Adam's sqrt and division, which decide its speed on many cores)
//! with AVX-512, chosen at runtime.

use rayon::prelude::*;

use crate::error::{Error, Result};

/// Values per parallel piece.
const PIECE: usize = 1 << 15;

/// Adam's hyperparameters for one step.
#[derive(Clone, Copy, Debug)]
pub struct Adam {
    /// Learning rate.
    pub lr: f64,
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Weight decay: decoupled (AdamW) or added to the gradient (Adam's L2).
    pub weight_decay: f64,
    /// AdamW's decoupled weight decay.
    pub decoupled: bool,
    /// The step's number, from 1 (bias correction).
    pub step: u64,
}

/// SGD's hyperparameters for one step.
#[derive(Clone, Copy, Debug)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0: none, and no buffer).
    pub momentum: f64,
    /// Dampening of the gradient added to the momentum buffer.
    pub dampening: f64,
    /// L2 weight decay added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// The first step (the buffer starts as the gradient).
    pub first: bool,
}

fn same_len(what: &str, n: usize, others: &[(&str, usize)]) -> Result<()> {
    for (name, len) in others {
        if *len != n {
            return Err(Error::invalid(format!(
                "{what}: {name} holds {len} values, the parameters {n}"
            )));
        }
    }
    Ok(())
}

/// The f32 scalars of one Adam step, computed in f64 as torch does.
#[derive(Clone, Copy)]
struct AdamScalars {
    decay: f32,
    wd: f32,
    one_minus_b1: f32,
    b2: f32,
    one_minus_b2: f32,
    bc2_sqrt: f32,
    eps: f32,
    neg_step_size: f32,
    decoupled: bool,
}

impl AdamScalars {
    fn new(h: &Adam) -> Self {
        let t = h.step as f64;
        let bc1 = 1.0 - h.beta1.powf(t);
        let bc2 = 1.0 - h.beta2.powf(t);
        AdamScalars {
            decay: (1.0 - h.lr * h.weight_decay) as f32,
            wd: h.weight_decay as f32,
            one_minus_b1: (1.0 - h.beta1) as f32,
            b2: h.beta2 as f32,
            one_minus_b2: (1.0 - h.beta2) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps: h.eps as f32,
            neg_step_size: (-(h.lr / bc1)) as f32,
            decoupled: h.decoupled,
        }
    }
}

#[inline(always)]
fn adam_piece(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: AdamScalars) {
    // One loop per kind of weight decay, so no branch sits in the loop and it vectorises.
    let it = p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut());
    if s.wd == 0.0 {
        for (((p, &g), m), v) in it {
            adam_value(p, g, m, v, &s);
        }
    } else if s.decoupled {
        for (((p, &g), m), v) in it {
            *p *= s.decay;
            adam_value(p, g, m, v, &s);
        }
    } else {
        for (((p, &g), m), v) in it {
            adam_value(p, g + s.wd * *p, m, v, &s);
        }
    }
}

#[inline(always)]
fn adam_value(p: &mut f32, g: f32, m: &mut f32, v: &mut f32, s: &AdamScalars) {
    *m += s.one_minus_b1 * (g - *m); // torch's lerp with a weight below 1/2
    *v = *v * s.b2 + s.one_minus_b2 * g * g;
    let denom = v.sqrt() / s.bc2_sqrt + s.eps;
    *p += s.neg_step_size * *m / denom;
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn adam_piece_avx2(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: AdamScalars) {
    adam_piece(p, g, m, v, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn adam_piece_avx512(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: AdamScalars) {
    adam_piece(p, g, m, v, s)
}

fn adam_dispatch(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: AdamScalars) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F support was just detected at runtime.
        return unsafe { adam_piece_avx512(p, g, m, v, s) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 support was just detected at runtime.
        return unsafe { adam_piece_avx2(p, g, m, v, s) };
    }
    adam_piece(p, g, m, v, s)
}

/// One Adam or AdamW step of `param` with `grad`, updating both moments in place.
pub fn adam(
    param: &mut [f32],
    grad: &[f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    h: &Adam,
) -> Result<()> {
    same_len(
        "adam",
        param.len(),
        &[
            ("the gradient", grad.len()),
            ("exp_avg", exp_avg.len()),
            ("exp_avg_sq", exp_avg_sq.len()),
        ],
    )?;
    if h.step == 0 {
        return Err(Error::invalid("adam: steps count from 1"));
    }
    let s = AdamScalars::new(h);
    param
        .par_chunks_mut(PIECE)
        .zip(grad.par_chunks(PIECE))
        .zip(exp_avg.par_chunks_mut(PIECE))
        .zip(exp_avg_sq.par_chunks_mut(PIECE))
        .for_each(|(((p, g), m), v)| adam_dispatch(p, g, m, v, s));
    Ok(())
}

#[inline(always)]
fn sgd_piece(p: &mut [f32], g: &[f32], buf: Option<&mut [f32]>, h: &Sgd) {
    let (lr, wd) = ((-h.lr) as f32, h.weight_decay as f32);
    let (mom, keep) = (h.momentum as f32, (1.0 - h.dampening) as f32);
    match buf {
        None => {
            for (p, &g) in p.iter_mut().zip(g) {
                let d = if wd != 0.0 { g + wd * *p } else { g };
                *p += lr * d;
            }
        }
        Some(b) => {
            for ((p, &g), b) in p.iter_mut().zip(g).zip(b.iter_mut()) {
                let d = if wd != 0.0 { g + wd * *p } else { g };
                *b = if h.first { d } else { *b * mom + keep * d };
                let step = if h.nesterov { d + mom * *b } else { *b };
                *p += lr * step;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn sgd_piece_avx2(p: &mut [f32], g: &[f32], buf: Option<&mut [f32]>, h: &Sgd) {
    sgd_piece(p, g, buf, h)
}

fn sgd_dispatch(p: &mut [f32], g: &[f32], buf: Option<&mut [f32]>, h: &Sgd) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 support was just detected at runtime.
        return unsafe { sgd_piece_avx2(p, g, buf, h) };
    }
    sgd_piece(p, g, buf, h)
}

/// One SGD step of `param` with `grad`; `momentum_buffer` is required when `h.momentum != 0`.
pub fn sgd(
    param: &mut [f32],
    grad: &[f32],
    momentum_buffer: Option<&mut [f32]>,
    h: &Sgd,
) -> Result<()> {
    same_len("sgd", param.len(), &[("the gradient", grad.len())])?;
    match momentum_buffer {
        None if h.momentum != 0.0 => Err(Error::invalid("sgd: momentum needs a momentum buffer")),
        None => {
            param
                .par_chunks_mut(PIECE)
                .zip(grad.par_chunks(PIECE))
                .for_each(|(p, g)| sgd_dispatch(p, g, None, h));
            Ok(())
        }
        Some(b) => {
            same_len("sgd", param.len(), &[("the momentum buffer", b.len())])?;
            param
                .par_chunks_mut(PIECE)
                .zip(grad.par_chunks(PIECE))
                .zip(b.par_chunks_mut(PIECE))
                .for_each(|((p, g), b)| sgd_dispatch(p, g, Some(b), h));
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::kernels::test_values as values;

    #[test]
    fn adamw_matches_its_formula_in_f64() {
        let n = 100_000;
        let (mut p, g) = (values(n, 1), values(n, 2));
        let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
        let p0 = p.clone();
        let h = Adam {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decoupled: true,
            step: 1,
        };
        adam(&mut p, &g, &mut m, &mut v, &h).unwrap();
        for i in 0..n {
            let (p0, g) = (p0[i] as f64, g[i] as f64);
            let m1 = 0.1 * g;
            let v1 = 0.001 * g * g;
            let denom = (v1 / 0.001).sqrt() + 1e-8;
            let want = p0 * (1.0 - 1e-5) - 1e-3 / 0.1 * m1 / denom;
            assert!((p[i] as f64 - want).abs() < 1e-6, "value {i}");
        }
    }

    #[test]
    fn sgd_momentum_and_nesterov() {
        let n = 70_000;
        let g = values(n, 3);
        for nesterov in [false, true] {
            let mut p = vec![1f32; n];
            let mut b = vec![0f32; n];
            for first in [true, false] {
                let h = Sgd {
                    lr: 0.1,
                    momentum: 0.9,
                    dampening: 0.0,
                    weight_decay: 0.0,
                    nesterov,
                    first,
                };
                sgd(&mut p, &g, Some(&mut b), &h).unwrap();
            }
            for i in 0..n {
                let g = g[i];
                let b2 = 0.9 * g + g;
                let steps = if nesterov {
                    (g + 0.9 * g) + (g + 0.9 * b2)
                } else {
                    g + b2
                };
                assert!((p[i] - (1.0 - 0.1 * steps)).abs() < 1e-5, "value {i}");
            }
        }
    }

    #[test]
    fn mismatched_buffers_are_refused() {
        let (mut p, g) = (vec![0f32; 4], vec![0f32; 3]);
        let (mut m, mut v) = (vec![0f32; 4], vec![0f32; 4]);
        let h = Adam {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
            step: 1,
        };
        assert!(adam(&mut p, &g, &mut m, &mut v, &h).is_err());
        let h = Sgd {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            first: true,
        };
        assert!(sgd(&mut p, &g[..], None, &h).is_err());
    }
}
