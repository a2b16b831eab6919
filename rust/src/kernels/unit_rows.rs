//! Per-unit sums over rows, for deterministic mode's biases and layer norms on CPU.
//!
//! A bias's gradient for one unit of the batch is the sum of its rows' output gradients; a
//! layer norm's weight gets the sum of `x_hat * dy` over the unit's rows and its bias the sum of
//! `dy`. Each feature's sum adds the unit's rows one after the other, in order, so its bits
//! depend neither on the number of units nor on the features beside it (a tensor-parallel
//! slice of them rounds as the whole does); the features are vectorised across, one lane each.
//! A layer norm's input gradient comes from the same pass over its rows ([`norm_backward`]).
//! Deterministic mode's units are then added in the canonical tree ([`crate::kernels::tree`]).

use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::kernels::{self, openmp};

/// `out[u, f] = sum over r of rows[u, r, f]` (row-major `units x per x features`), rows added
/// in order.
pub fn row_sums(
    rows: &[f32],
    units: usize,
    features: usize,
    out: &mut [f32],
    threads: usize,
) -> Result<()> {
    let per = per_unit(rows.len(), units, features, out.len(), "row sums")?;
    openmp::chunks_mut(out, features, threads, |u, sums| {
        sums.fill(0.0);
        for r in 0..per {
            let row = &rows[(u * per + r) * features..(u * per + r + 1) * features];
            kernels::add_into(sums, row);
        }
    });
    Ok(())
}

/// A layer norm's saved rows and their output gradients: `x` and `dy` are `units x per x
/// features`; `mean` and `rstd` hold one value per row.
#[derive(Clone, Copy)]
pub struct NormRows<'a> {
    /// The norm's inputs.
    pub x: &'a [f32],
    /// Each row's mean.
    pub mean: &'a [f32],
    /// Each row's reciprocal standard deviation.
    pub rstd: &'a [f32],
    /// The output gradients.
    pub dy: &'a [f32],
}

/// A layer norm's backward on CPU: the per-unit sums `weight[u, f]` of
/// `((x - mean) * rstd) * dy` and `bias[u, f]` of `dy` over unit `u`'s rows (each product
/// rounded as three separate operations), and the input's gradient `dx` (the norm's weight
/// `gamma`, if it has one, `features` values), each optional. One pass over a unit's rows
/// makes all three, where torch's backward for `dx` and then these sums read `x` and `dy`
/// twice.
#[allow(clippy::too_many_arguments)]
pub fn norm_backward(
    rows: NormRows<'_>,
    units: usize,
    features: usize,
    gamma: Option<&[f32]>,
    dx: Option<&mut [f32]>,
    weight: Option<&mut [f32]>,
    bias: Option<&mut [f32]>,
    threads: usize,
) -> Result<()> {
    let NormRows { x, mean, rstd, dy } = rows;
    let sums = units * features;
    let per = per_unit(x.len(), units, features, sums, "norm backward")?;
    if dy.len() != x.len() || mean.len() != units * per || rstd.len() != units * per {
        return Err(Error::invalid(format!(
            "norm backward: dy ({}), mean ({}) and rstd ({}) do not match x's {} rows of \
             {features}",
            dy.len(),
            mean.len(),
            rstd.len(),
            units * per
        )));
    }
    let wrong = |what: &str| Error::invalid(format!("norm backward: {what} is of the wrong size"));
    if gamma.is_some_and(|g| g.len() != features) {
        return Err(wrong("the norm's weight"));
    }
    if dx.as_ref().is_some_and(|d| d.len() != x.len()) {
        return Err(wrong("the input's gradient"));
    }
    if weight.as_ref().is_some_and(|w| w.len() != sums) {
        return Err(wrong("the weight's sums"));
    }
    if bias.as_ref().is_some_and(|b| b.len() != sums) {
        return Err(wrong("the bias's sums"));
    }
    let ones = if gamma.is_none() && dx.is_some() {
        vec![1f32; features]
    } else {
        Vec::new()
    };
    let gamma = gamma.unwrap_or(&ones);
    let sums_of = weight.map(|o| openmp::pieces(o, features));
    let biases_of = bias.map(|o| openmp::pieces(o, features));
    let grads_of = dx.map(|o| openmp::pieces(o, per * features));
    openmp::for_each(units, threads, &|u| {
        let (mut w, mut b) = (take(&sums_of, u), take(&biases_of, u));
        let mut d = take(&grads_of, u);
        for sums in [w.as_deref_mut(), b.as_deref_mut()].into_iter().flatten() {
            sums.fill(0.0);
        }
        let mut hat = vec![0f32; features];
        for r in 0..per {
            let i = u * per + r;
            let span = i * features..(i + 1) * features;
            let (xr, dyr) = (&x[span.clone()], &dy[span]);
            if let Some(b) = b.as_deref_mut() {
                kernels::add_into(b, dyr); // as `row_sums` adds them
            }
            if let Some(w) = w.as_deref_mut() {
                products(&mut hat, xr, dyr, mean[i], rstd[i]);
                kernels::add_into(w, &hat);
            }
            if let Some(d) = d.as_deref_mut() {
                let row = &mut d[r * features..(r + 1) * features];
                input_grad(row, xr, dyr, gamma, mean[i], rstd[i]);
            }
        }
    });
    Ok(())
}

/// Unit `u`'s piece of an optional output ([`openmp::take`]).
fn take<'a>(pieces: &Option<Vec<Mutex<&'a mut [f32]>>>, u: usize) -> Option<&'a mut [f32]> {
    pieces.as_ref().map(|p| openmp::take(p, u))
}

/// Rows per unit, checking that `len` values are `units` units of whole rows and `out` holds
/// `units * features`.
fn per_unit(len: usize, units: usize, features: usize, out: usize, what: &str) -> Result<usize> {
    if units == 0 || features == 0 || len % (units * features) != 0 || out != units * features {
        return Err(Error::invalid(format!(
            "{what}: {len} values are not {units} units of rows of {features} features, or the \
             output's {out} values are not one row per unit"
        )));
    }
    Ok(len / (units * features))
}

fn products(hat: &mut [f32], x: &[f32], dy: &[f32], mean: f32, rstd: f32) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 support was just detected at runtime.
        return unsafe { products_avx2(hat, x, dy, mean, rstd) };
    }
    products_plain(hat, x, dy, mean, rstd);
}

#[inline(always)]
fn products_plain(hat: &mut [f32], x: &[f32], dy: &[f32], mean: f32, rstd: f32) {
    for ((h, &v), &d) in hat.iter_mut().zip(x).zip(dy) {
        *h = ((v - mean) * rstd) * d; // no fused multiply-add: three roundings on every CPU
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn products_avx2(hat: &mut [f32], x: &[f32], dy: &[f32], mean: f32, rstd: f32) {
    products_plain(hat, x, dy, mean, rstd);
}

/// One row's input gradient: with `g = dy * gamma` (all ones for a norm without a weight,
/// which rounds nothing) and `h = (x - mean) * rstd`,
/// `dx = (g - mean(g) - h * mean(g * h)) * rstd` (torch's formula, rearranged). The two means
/// add the row in 8 lanes, then the lanes in a fixed tree: the bits depend on the row alone.
fn input_grad(dx: &mut [f32], x: &[f32], dy: &[f32], gamma: &[f32], mean: f32, rstd: f32) {
    let n = x.len();
    assert!(
        dy.len() == n && gamma.len() == n && dx.len() == n,
        "rows of one length"
    );
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 support was just detected at runtime.
        return unsafe { input_grad_avx2(dx, x, dy, gamma, mean, rstd) };
    }
    input_grad_plain(dx, x, dy, gamma, mean, rstd);
}

#[inline(always)]
fn input_grad_plain(dx: &mut [f32], x: &[f32], dy: &[f32], gamma: &[f32], mean: f32, rstd: f32) {
    const LANES: usize = 8;
    let (mut a, mut b) = ([0f32; LANES], [0f32; LANES]);
    // Feature `f` adds into lane `f % 8`, in order (`input_grad_avx2` keeps the lanes in
    // one register each; the compiler does not vectorise this loop).
    let (xs, ds, gs) = (
        x.chunks_exact(LANES),
        dy.chunks_exact(LANES),
        gamma.chunks_exact(LANES),
    );
    let tail = (xs.remainder(), ds.remainder(), gs.remainder());
    for ((xc, dc), gc) in xs.zip(ds).zip(gs) {
        let as_lanes = |c: &[f32]| -> [f32; LANES] { c.try_into().expect("chunks of 8") };
        let (xc, dc, gc) = (as_lanes(xc), as_lanes(dc), as_lanes(gc));
        for l in 0..LANES {
            let g = dc[l] * gc[l];
            a[l] += g;
            b[l] += g * ((xc[l] - mean) * rstd); // no fused multiply-add: the same bits on every CPU
        }
    }
    for (l, ((&v, &d), &w)) in tail.0.iter().zip(tail.1).zip(tail.2).enumerate() {
        let g = d * w;
        a[l] += g;
        b[l] += g * ((v - mean) * rstd);
    }
    let lanes = |v: [f32; LANES]| ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
    let n = x.len() as f32;
    let (ma, mb) = (lanes(a) / n, lanes(b) / n);
    for (((d, &v), &dyf), &w) in dx.iter_mut().zip(x).zip(dy).zip(gamma) {
        *d = ((dyf * w - ma) - ((v - mean) * rstd) * mb) * rstd;
    }
}

/// [`input_grad_plain`] in AVX2 registers: the same operations on the same lanes, in the
/// same order, so the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn input_grad_avx2(dx: &mut [f32], x: &[f32], dy: &[f32], gamma: &[f32], mean: f32, rstd: f32) {
    use std::arch::x86_64::*;
    let n = x.len();
    let full = n - n % 8;
    let (vm, vr) = (_mm256_set1_ps(mean), _mm256_set1_ps(rstd));
    let (mut va, mut vb) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for i in (0..full).step_by(8) {
        // SAFETY: i + 8 <= full <= n, the length of every slice (`input_grad` asserts it).
        let (xv, dv, gv) = unsafe {
            (
                _mm256_loadu_ps(x.as_ptr().add(i)),
                _mm256_loadu_ps(dy.as_ptr().add(i)),
                _mm256_loadu_ps(gamma.as_ptr().add(i)),
            )
        };
        let g = _mm256_mul_ps(dv, gv);
        va = _mm256_add_ps(va, g);
        vb = _mm256_add_ps(
            vb,
            _mm256_mul_ps(g, _mm256_mul_ps(_mm256_sub_ps(xv, vm), vr)),
        );
    }
    let (mut a, mut b) = ([0f32; 8], [0f32; 8]);
    // SAFETY: each array holds 8 floats.
    unsafe {
        _mm256_storeu_ps(a.as_mut_ptr(), va);
        _mm256_storeu_ps(b.as_mut_ptr(), vb);
    }
    for (l, f) in (full..n).enumerate() {
        let g = dy[f] * gamma[f];
        a[l] += g;
        b[l] += g * ((x[f] - mean) * rstd);
    }
    let lanes = |v: [f32; 8]| ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
    let nf = n as f32;
    let (ma, mb) = (lanes(a) / nf, lanes(b) / nf);
    let (vma, vmb) = (_mm256_set1_ps(ma), _mm256_set1_ps(mb));
    for i in (0..full).step_by(8) {
        // SAFETY: as above; `dx` has `n` values too.
        unsafe {
            let xv = _mm256_loadu_ps(x.as_ptr().add(i));
            let g = _mm256_mul_ps(
                _mm256_loadu_ps(dy.as_ptr().add(i)),
                _mm256_loadu_ps(gamma.as_ptr().add(i)),
            );
            let h = _mm256_mul_ps(_mm256_sub_ps(xv, vm), vr);
            let d = _mm256_sub_ps(_mm256_sub_ps(g, vma), _mm256_mul_ps(h, vmb));
            _mm256_storeu_ps(dx.as_mut_ptr().add(i), _mm256_mul_ps(d, vr));
        }
    }
    for f in full..n {
        dx[f] = ((dy[f] * gamma[f] - ma) - ((x[f] - mean) * rstd) * mb) * rstd;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{same_bits, test_values};

    #[test]
    fn each_feature_adds_its_unit_rows_in_order() {
        let (units, per, features) = (3usize, 5usize, 37usize);
        let rows = test_values(units * per * features, 4);
        let mut out = vec![0f32; units * features];
        row_sums(&rows, units, features, &mut out, 1).unwrap();
        for u in 0..units {
            for f in 0..features {
                let mut want = 0f32;
                for r in 0..per {
                    want += rows[(u * per + r) * features + f];
                }
                assert_eq!(out[u * features + f].to_bits(), want.to_bits());
            }
        }
        // A slice of the features (a tensor-parallel rank's) and a single unit: the same bits.
        let (lo, hi) = (5usize, 21usize);
        let sliced: Vec<f32> = rows
            .chunks(features)
            .flat_map(|r| r[lo..hi].to_vec())
            .collect();
        let mut part = vec![0f32; units * (hi - lo)];
        row_sums(&sliced, units, hi - lo, &mut part, 3).unwrap();
        for u in 0..units {
            for f in lo..hi {
                let a = part[u * (hi - lo) + f - lo];
                assert_eq!(a.to_bits(), out[u * features + f].to_bits());
            }
        }
        let mut first = vec![0f32; features];
        row_sums(&rows[..per * features], 1, features, &mut first, 1).unwrap();
        assert!(first
            .iter()
            .zip(&out[..features])
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn the_input_gradient_is_torchs_formula_and_its_bits_follow_the_row_alone() {
        let (units, per, features) = (3usize, 5usize, 45usize);
        let x = test_values(units * per * features, 7);
        let dy = test_values(units * per * features, 8);
        let gamma: Vec<f32> = test_values(features, 9).iter().map(|v| v + 0.5).collect();
        // Each row's own mean and rstd, as the forward saved them.
        let (mut mean, mut rstd) = (vec![0f32; units * per], vec![0f32; units * per]);
        for (i, row) in x.chunks(features).enumerate() {
            let m = row.iter().map(|&v| v as f64).sum::<f64>() / features as f64;
            let var = row.iter().map(|&v| (v as f64 - m).powi(2)).sum::<f64>() / features as f64;
            (mean[i], rstd[i]) = (m as f32, (1.0 / (var + 1e-5).sqrt()) as f32);
        }
        let rows = NormRows {
            x: &x,
            mean: &mean,
            rstd: &rstd,
            dy: &dy,
        };
        for g in [Some(&gamma[..]), None] {
            let mut dx = vec![0f32; x.len()];
            norm_backward(rows, units, features, g, Some(&mut dx), None, None, 1).unwrap();
            for (i, row) in dx.chunks(features).enumerate() {
                // torch's: dx = rstd * (g - mean(g) - h * mean(g * h)), in float64.
                let span = i * features..(i + 1) * features;
                let gs: Vec<f64> = span
                    .clone()
                    .map(|j| dy[j] as f64 * g.map_or(1.0, |w| w[j % features] as f64))
                    .collect();
                let hs: Vec<f64> = span
                    .map(|j| (x[j] as f64 - mean[i] as f64) * rstd[i] as f64)
                    .collect();
                let n = features as f64;
                let ma = gs.iter().sum::<f64>() / n;
                let mb = gs.iter().zip(&hs).map(|(a, b)| a * b).sum::<f64>() / n;
                for (f, &d) in row.iter().enumerate() {
                    let want = (gs[f] - ma - hs[f] * mb) * rstd[i] as f64;
                    assert!(
                        (d as f64 - want).abs() < 1e-5 * (1.0 + want.abs()),
                        "{d} {want}"
                    );
                }
            }
            // Threads, the sums beside it, or one unit of the rows: the same bits.
            let (mut again, mut w) = (vec![0f32; x.len()], vec![0f32; units * features]);
            norm_backward(
                rows,
                units,
                features,
                g,
                Some(&mut again),
                Some(&mut w),
                None,
                3,
            )
            .unwrap();
            assert!(same_bits(&dx, &again));
            let one = features * per;
            let first = NormRows {
                x: &x[..one],
                mean: &mean[..per],
                rstd: &rstd[..per],
                dy: &dy[..one],
            };
            let mut alone = vec![0f32; one];
            norm_backward(first, 1, features, g, Some(&mut alone), None, None, 1).unwrap();
            assert!(same_bits(&dx[..one], &alone));
        }
    }

    #[test]
    fn the_vector_input_gradient_has_the_plain_ones_bits() {
        for n in [1usize, 7, 8, 9, 31, 64, 100] {
            let (x, dy) = (test_values(n, 1), test_values(n, 2));
            let gamma: Vec<f32> = test_values(n, 3).iter().map(|v| v + 0.5).collect();
            let (mut plain, mut dispatched) = (vec![0f32; n], vec![0f32; n]);
            input_grad_plain(&mut plain, &x, &dy, &gamma, 0.1, 1.7);
            input_grad(&mut dispatched, &x, &dy, &gamma, 0.1, 1.7);
            assert!(same_bits(&plain, &dispatched), "{n}");
        }
    }

    /// A norm's saved rows for `units` units of `per` rows: `x`, `dy`, `mean` and `rstd`
    /// (`rstd` in 0.5..1.5), from seeds `seed..seed + 4`.
    fn norm_inputs(units: usize, per: usize, features: usize, seed: u32) -> [Vec<f32>; 4] {
        let rstd = test_values(units * per, seed + 3);
        [
            test_values(units * per * features, seed),
            test_values(units * per * features, seed + 1),
            test_values(units * per, seed + 2),
            rstd.iter().map(|v| v + 1.0).collect(),
        ]
    }

    #[test]
    fn norm_sums_are_the_products_added_in_order() {
        let (units, per, features) = (2usize, 4usize, 19usize);
        let [x, dy, mean, rstd] = norm_inputs(units, per, features, 1);
        let (mut w, mut b) = (vec![0f32; units * features], vec![0f32; units * features]);
        let rows = NormRows {
            x: &x,
            mean: &mean,
            rstd: &rstd,
            dy: &dy,
        };
        norm_backward(
            rows,
            units,
            features,
            None,
            None,
            Some(&mut w),
            Some(&mut b),
            1,
        )
        .unwrap();
        let mut sums = vec![0f32; units * features];
        row_sums(&dy, units, features, &mut sums, 1).unwrap();
        assert!(b.iter().zip(&sums).all(|(p, q)| p.to_bits() == q.to_bits()));
        for u in 0..units {
            for f in 0..features {
                let mut want = 0f32;
                for r in u * per..(u + 1) * per {
                    let i = r * features + f;
                    want += ((x[i] - mean[r]) * rstd[r]) * dy[i];
                }
                assert_eq!(w[u * features + f].to_bits(), want.to_bits());
            }
        }
    }

    #[test]
    fn the_norms_pass_has_the_same_bits_on_any_number_of_threads() {
        let (units, per, features) = (16usize, 6usize, 40usize);
        let [x, dy, mean, rstd] = norm_inputs(units, per, features, 11);
        let gamma = test_values(features, 15);
        let rows = NormRows {
            x: &x,
            mean: &mean,
            rstd: &rstd,
            dy: &dy,
        };
        let run = |threads: usize| {
            let (mut w, mut b) = (vec![0f32; units * features], vec![0f32; units * features]);
            let mut dx = vec![0f32; x.len()];
            let (g, d) = (Some(&gamma[..]), Some(&mut dx[..]));
            norm_backward(
                rows,
                units,
                features,
                g,
                d,
                Some(&mut w),
                Some(&mut b),
                threads,
            )
            .unwrap();
            [w, b, dx]
        };
        let one = run(1);
        for threads in [2, 3, 8, 32] {
            for (a, b) in run(threads).iter().zip(&one) {
                assert!(a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()));
            }
        }
    }

    #[test]
    fn wrong_sizes_are_refused() {
        let v = vec![0f32; 12];
        let mut out = vec![0f32; 6];
        assert!(row_sums(&v, 5, 3, &mut out, 1).is_err());
        assert!(row_sums(&v, 2, 3, &mut out[..5], 1).is_err());
        let m = vec![0f32; 3];
        let rows = NormRows {
            x: &v,
            mean: &m,
            rstd: &m,
            dy: &v,
        };
        assert!(norm_backward(rows, 2, 3, None, None, Some(&mut out), None, 1).is_err());
        let (x, m2) = (vec![0f32; 12], vec![1f32; 4]);
        let rows = NormRows {
            x: &x,
            mean: &m2,
            rstd: &m2,
            dy: &x,
        };
        let mut dx = vec![0f32; 11];
        assert!(norm_backward(rows, 2, 3, None, Some(&mut dx), None, None, 1).is_err());
        let mut dx = vec![0f32; 12];
        assert!(norm_backward(rows, 2, 3, Some(&m2), Some(&mut dx), None, None, 1).is_err());
    }
}
