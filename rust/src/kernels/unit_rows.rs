//! Per-unit sums over rows, for deterministic mode's biases and layer norms on CPU.
//!
//! A bias's gradient for one unit of the batch is the sum of its rows' output gradients; a
//! layer norm's weight gets the sum of `x_hat * dy` over the unit's rows and its bias the sum of
//! `dy`. Each feature's sum adds the unit's rows one after the other, in order, so its bits
//! depend neither on the number of units nor on the features beside it (a tensor-parallel
//! slice of them rounds as the whole does); the features are vectorised across, one lane each.
//! Deterministic mode's units are then added in the canonical tree ([`crate::kernels::tree`]).

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
    })
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

/// A layer norm's per-unit sums: `weight[u, f]` of `((x - mean) * rstd) * dy` and `bias[u, f]`
/// of `dy` over unit `u`'s rows, each product rounded as three separate operations.
pub fn norm_sums(
    rows: NormRows<'_>,
    units: usize,
    features: usize,
    weight: Option<&mut [f32]>,
    bias: Option<&mut [f32]>,
    threads: usize,
) -> Result<()> {
    let NormRows { x, mean, rstd, dy } = rows;
    let sums = units * features;
    let per = per_unit(x.len(), units, features, sums, "norm sums")?;
    if dy.len() != x.len() || mean.len() != units * per || rstd.len() != units * per {
        return Err(Error::invalid(format!(
            "norm sums: dy ({}), mean ({}) and rstd ({}) do not match x's {} rows of {features}",
            dy.len(),
            mean.len(),
            rstd.len(),
            units * per
        )));
    }
    if let Some(b) = bias {
        if b.len() != sums {
            return Err(Error::invalid(
                "norm sums: the bias's sums are of the wrong size",
            ));
        }
        row_sums(dy, units, features, b, threads)?;
    }
    let Some(w) = weight else { return Ok(()) };
    if w.len() != sums {
        return Err(Error::invalid(
            "norm sums: the weight's sums are of the wrong size",
        ));
    }
    openmp::chunks_mut(w, features, threads, |u, sums| {
        sums.fill(0.0);
        let mut hat = vec![0f32; features];
        for r in u * per..(u + 1) * per {
            let span = r * features..(r + 1) * features;
            products(&mut hat, &x[span.clone()], &dy[span], mean[r], rstd[r]);
            kernels::add_into(sums, &hat);
        }
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_values;

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
    fn norm_sums_are_the_products_added_in_order() {
        let (units, per, features) = (2usize, 4usize, 19usize);
        let x = test_values(units * per * features, 1);
        let dy = test_values(units * per * features, 2);
        let mean = test_values(units * per, 3);
        let rstd: Vec<f32> = test_values(units * per, 4)
            .iter()
            .map(|v| v + 1.0)
            .collect();
        let (mut w, mut b) = (vec![0f32; units * features], vec![0f32; units * features]);
        let rows = NormRows {
            x: &x,
            mean: &mean,
            rstd: &rstd,
            dy: &dy,
        };
        norm_sums(rows, units, features, Some(&mut w), Some(&mut b), 1).unwrap();
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
        assert!(norm_sums(rows, 2, 3, Some(&mut out), None, 1).is_err());
    }
}
