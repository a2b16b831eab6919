//! A linear layer's weight gradient per unit, and its canonical tree sum (deterministic mode).
//!
//! Unit `u` of a batch gives the weight the gradient `dys[u]^T @ xs[u]`: `dys[u]` holds its
//! rows' output gradients (`rows x outs`), `xs[u]` their inputs (`rows x ins`). Deterministic
//! mode adds the units' gradients in the canonical tree ([`crate::kernels::tree`]), so that the
//! sum does not depend on how the units were split across ranks.
//!
//! Each unit's product is one small GEMM (`matrixmultiply`'s, with its own choice of vector
//! instructions). Every element of it is a dot product over the unit's `rows` in a fixed order
//! whatever the rows and columns of the output asked for or the memory's alignment (tests
//! check it), so a unit's gradient has the same bits in every layout, one process included,
//! and in any tile of the output. [`tree`] computes a tile of the output for every unit at a
//! time into a few cache-sized buffers and adds them as they come (a binary counter: two sums
//! of the same number of units are added as soon as both exist, the rest folded from the right
//! at the end, which is the canonical tree), so the units' products are never all in memory at
//! once. With threads, the tiles are cut from rows and columns both (`tiles`): a weight of
//! few rows cut by rows alone gave each thread a GEMM a few rows high, which costs more in
//! copying its inputs than in products (64 x 256 on 8 threads took longer than on 2).
//!
//! A weight tied to an embedding (a language model's output layer) is also given rows by the
//! embedding's lookups: one process adds each unit's lookups onto that unit's product, then
//! the units in the tree. [`tree_with`] does that inside the same pass ([`Lookups`]), in the
//! lookups' order ([`crate::kernels::unit_lookups`]): the bits of the product, then
//! `index_add_`, then the tree.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::kernels::unit_lookups::Lookups;
use crate::kernels::{self, openmp};

/// The shapes of one call: `units` units of `rows` rows; `outs` output and `ins` input features.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Units of the batch (samples, or groups of them).
    pub units: usize,
    /// Rows per unit (its tokens): the length of each dot product.
    pub rows: usize,
    /// Output features: rows of the weight.
    pub outs: usize,
    /// Input features: columns of the weight.
    pub ins: usize,
}

/// Elements of one block of output rows: 64 KiB of float32, a few of which (one per level of
/// the tree) stay in the second-level cache.
const BLOCK: usize = 16 * 1024;

impl Shape {
    /// Refuses inputs of other sizes, rows outside the weight's, and an `out` of other than
    /// `per_unit` values (one unit's rows `start..stop`) times `copies`.
    fn check(
        &self,
        dys: &[f32],
        xs: &[f32],
        (start, stop): (usize, usize),
        out: usize,
        copies: usize,
    ) -> Result<()> {
        let Shape {
            units,
            rows,
            outs,
            ins,
        } = *self;
        if dys.len() != units * rows * outs || xs.len() != units * rows * ins {
            return Err(Error::invalid(format!(
                "unit products: {} and {} values are not {units} units of {rows} rows of {outs} \
                 and {ins} features",
                dys.len(),
                xs.len()
            )));
        }
        if units == 0 || start > stop || stop > outs || out != copies * (stop - start) * ins {
            return Err(Error::invalid(format!(
                "unit products: rows {start}..{stop} of {outs} ({units} units) into {out} values"
            )));
        }
        Ok(())
    }
}

/// Rows `rows` and columns `cols` of unit `u`'s gradient, written to `out` (row-major,
/// `rows.len() * cols.len()` values).
fn product(
    dys: &[f32],
    xs: &[f32],
    s: Shape,
    u: usize,
    rows: Range<usize>,
    cols: Range<usize>,
    out: &mut [f32],
) {
    let (k, m, n) = (s.rows, rows.len(), cols.len());
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out.fill(0.0);
        return;
    }
    let a = &dys[u * k * s.outs + rows.start..];
    let b = &xs[u * k * s.ins + cols.start..(u + 1) * k * s.ins];
    // SAFETY: A is `dys[u]` transposed, rows `rows`: element (r, j) at `r + j * outs` from
    // `a`, the largest index (m - 1) + (k - 1) * outs < (k * outs) - rows.start, inside `a`.
    // B is `xs[u]`'s columns `cols`, row-major with row stride `ins`: element (j, c) at
    // `j * ins + c`, the largest (k - 1) * ins + (n - 1) < k * ins - cols.start (as
    // cols.end <= ins), inside `b`. C is `out`, row-major `m x n`, which the caller sized
    // exactly. The slices borrow distinct buffers (`out` is `&mut`), and matrixmultiply reads
    // and writes only within those bounds.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            1,
            s.outs as isize,
            b.as_ptr(),
            s.ins as isize,
            1,
            0.0,
            out.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

/// Rows `start..stop` of every unit's gradient, unit by unit, into `out`
/// (`units * (stop - start) * ins` values).
pub fn products(
    dys: &[f32],
    xs: &[f32],
    s: Shape,
    start: usize,
    stop: usize,
    out: &mut [f32],
    threads: usize,
) -> Result<()> {
    s.check(dys, xs, (start, stop), out.len(), s.units)?;
    let each = (stop - start) * s.ins;
    if each == 0 {
        return Ok(());
    }
    openmp::chunks_mut(out, each, threads, |u, piece| {
        product(dys, xs, s, u, start..stop, 0..s.ins, piece)
    });
    Ok(())
}

/// Rows `start..stop` of the units' gradients summed in the canonical tree, into `out`
/// (`(stop - start) * ins` values): the same bits as [`products`] then
/// [`crate::kernels::tree::tree_sum`] over the units.
pub fn tree(
    dys: &[f32],
    xs: &[f32],
    s: Shape,
    start: usize,
    stop: usize,
    out: &mut [f32],
    threads: usize,
) -> Result<()> {
    tree_with(dys, xs, s, start, stop, None, out, threads)
}

/// [`tree`], each unit's `lookups` (if any) added onto its product before the tree.
#[allow(clippy::too_many_arguments)]
pub fn tree_with(
    dys: &[f32],
    xs: &[f32],
    s: Shape,
    start: usize,
    stop: usize,
    lookups: Option<Lookups<'_>>,
    out: &mut [f32],
    threads: usize,
) -> Result<()> {
    s.check(dys, xs, (start, stop), out.len(), 1)?;
    if let Some(l) = &lookups {
        l.check(&s)?;
    }
    if out.is_empty() {
        return Ok(());
    }
    let (rows, n) = (stop - start, s.ins);
    if threads <= 1 {
        // Output rows per block: a cache's worth.
        let per = (BLOCK / n.max(1)).max(1);
        for (b, piece) in out.chunks_mut(per * n).enumerate() {
            let lo = start + b * per;
            block(dys, xs, s, lookups, lo..lo + piece.len() / n, 0..n, piece);
        }
        return Ok(());
    }
    let (tall, wide) = tiles(rows, n, threads);
    // Bands of `tall` output rows, each cut into tiles `wide` columns wide.
    let bands = openmp::pieces(out, tall * n);
    let across = n.div_ceil(wide);
    openmp::for_each(bands.len() * across, threads, &|t| {
        let (band, c0) = (t / across, t % across * wide);
        let lo = start + band * tall;
        let (hi, c1) = ((lo + tall).min(stop), (c0 + wide).min(n));
        let mut tile = vec![0f32; (hi - lo) * (c1 - c0)];
        block(dys, xs, s, lookups, lo..hi, c0..c1, &mut tile);
        // A band's tiles are copied in one at a time: the lock is held for a copy only.
        let mut into = bands[band].lock().unwrap_or_else(|e| e.into_inner());
        for (row, values) in into.chunks_mut(n).zip(tile.chunks(c1 - c0)) {
            row[c0..c1].copy_from_slice(values);
        }
    });
    Ok(())
}

/// Tiles of `rows x cols` outputs for `threads` threads: `(tall, wide)`.
///
/// The columns are cut into a divisor of `threads` pieces and the rows into the rest, taking
/// the cut whose tiles copy the least input per product (`(tall + wide) / (tall * wide)`;
/// ties to fewer column pieces); pieces are at least 16 columns wide. A tile holds at most
/// [`BLOCK`] values (more bands than threads then), so that its buffers stay in cache.
fn tiles(rows: usize, cols: usize, threads: usize) -> (usize, usize) {
    let cost = |tall: usize, wide: usize| (tall + wide) as f64 / (tall * wide) as f64;
    let mut best = (rows.div_ceil(threads).max(1), cols);
    for across in (2..=threads).filter(|a| threads % a == 0) {
        let wide = cols.div_ceil(across);
        if wide < 16 {
            break;
        }
        let tall = rows.div_ceil(threads / across).max(1);
        if cost(tall, wide) < cost(best.0, best.1) {
            best = (tall, wide);
        }
    }
    let (tall, wide) = best;
    ((BLOCK / wide).clamp(1, tall), wide)
}

/// Rows `rows` and columns `cols` of [`tree`] into `out` (row-major): a binary counter over
/// the units.
fn block(
    dys: &[f32],
    xs: &[f32],
    s: Shape,
    lookups: Option<Lookups<'_>>,
    rows: Range<usize>,
    cols: Range<usize>,
    out: &mut [f32],
) {
    let len = out.len();
    let levels = (usize::BITS - s.units.leading_zeros()) as usize + 1;
    let mut bufs: Vec<Vec<f32>> = Vec::with_capacity(levels);
    let mut free: Vec<usize> = Vec::with_capacity(levels);
    // (units summed, buffer): sums of strictly fewer units towards the top.
    let mut stack: Vec<(usize, usize)> = Vec::with_capacity(levels);
    for u in 0..s.units {
        let mut buf = free.pop().unwrap_or_else(|| {
            bufs.push(vec![0f32; len]);
            bufs.len() - 1
        });
        product(dys, xs, s, u, rows.clone(), cols.clone(), &mut bufs[buf]);
        if let Some(l) = &lookups {
            l.add(&s, u, &rows, &cols, &mut bufs[buf]);
        }
        let mut size = 1;
        while let Some(&(n, left)) = stack.last() {
            if n != size {
                break;
            }
            stack.pop();
            add_into(&mut bufs, left, buf);
            free.push(buf);
            buf = left;
            size *= 2;
        }
        stack.push((size, buf));
    }
    let (_, mut right) = stack.pop().expect("at least one unit");
    while let Some((_, left)) = stack.pop() {
        add_into(&mut bufs, left, right);
        right = left;
    }
    out.copy_from_slice(&bufs[right]);
}

/// `bufs[into] += bufs[from]` (float addition commutes: the bits are those of either order).
fn add_into(bufs: &mut [Vec<f32>], into: usize, from: usize) {
    debug_assert_ne!(into, from);
    let (a, b) = if into < from {
        let (head, tail) = bufs.split_at_mut(from);
        (&mut head[into], &tail[0])
    } else {
        let (head, tail) = bufs.split_at_mut(into);
        (&mut tail[0], &head[from])
    };
    kernels::add_into(a, b);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::tree::tree_sum;
    use crate::kernels::{same_bits, test_values};

    /// Unit `u`'s gradient by the definition, element by element (a dot product in row order
    /// need not round as the GEMM does: only used where bits are not compared).
    fn naive(dys: &[f32], xs: &[f32], s: Shape, u: usize) -> Vec<f64> {
        let mut g = vec![0f64; s.outs * s.ins];
        for r in 0..s.rows {
            for o in 0..s.outs {
                let d = dys[(u * s.rows + r) * s.outs + o] as f64;
                for i in 0..s.ins {
                    g[o * s.ins + i] += d * xs[(u * s.rows + r) * s.ins + i] as f64;
                }
            }
        }
        g
    }

    fn inputs(s: Shape, seed: u32) -> (Vec<f32>, Vec<f32>) {
        (
            test_values(s.units * s.rows * s.outs, seed),
            test_values(s.units * s.rows * s.ins, seed + 1),
        )
    }

    /// Inputs of these shapes and their whole tree, on one thread.
    fn summed(units: usize, rows: usize, outs: usize, ins: usize, seed: u32) -> Summed {
        let s = Shape {
            units,
            rows,
            outs,
            ins,
        };
        let (dys, xs) = inputs(s, seed);
        let mut want = vec![0f32; outs * ins];
        tree(&dys, &xs, s, 0, outs, &mut want, 1).unwrap();
        (s, dys, xs, want)
    }

    type Summed = (Shape, Vec<f32>, Vec<f32>, Vec<f32>);

    #[test]
    fn each_unit_is_its_product_and_any_rows_have_the_same_bits() {
        let s = Shape {
            units: 3,
            rows: 37,
            outs: 45,
            ins: 19,
        };
        let (dys, xs) = inputs(s, 5);
        let mut all = vec![0f32; s.units * s.outs * s.ins];
        products(&dys, &xs, s, 0, s.outs, &mut all, 1).unwrap();
        for u in 0..s.units {
            let want = naive(&dys, &xs, s, u);
            let got = &all[u * s.outs * s.ins..(u + 1) * s.outs * s.ins];
            for (g, w) in got.iter().zip(&want) {
                assert!((*g as f64 - w).abs() < 1e-5, "{g} vs {w}");
            }
        }
        for (start, stop) in [(0, 1), (3, 11), (44, 45), (7, 45)] {
            let mut part = vec![0f32; s.units * (stop - start) * s.ins];
            products(&dys, &xs, s, start, stop, &mut part, 4).unwrap();
            for u in 0..s.units {
                for r in start..stop {
                    for i in 0..s.ins {
                        let a = part[(u * (stop - start) + r - start) * s.ins + i];
                        let b = all[(u * s.outs + r) * s.ins + i];
                        assert_eq!(a.to_bits(), b.to_bits());
                    }
                }
            }
        }
    }

    #[test]
    fn the_tree_is_the_products_summed_by_tree_sum_and_blocks_of_units_are_subtrees() {
        for (units, rows, outs, ins) in [(1, 5, 3, 2), (16, 64, 300, 70), (13, 9, 40, 600)] {
            let s = Shape {
                units,
                rows,
                outs,
                ins,
            };
            let (dys, xs) = inputs(s, units as u32);
            let mut each = vec![0f32; units * outs * ins];
            products(&dys, &xs, s, 0, outs, &mut each, 1).unwrap();
            let mut want = vec![0f32; outs * ins];
            tree_sum(&each, units, &mut want, 1).unwrap();
            for threads in [1, 3] {
                let mut got = vec![0f32; outs * ins];
                tree(&dys, &xs, s, 0, outs, &mut got, threads).unwrap();
                assert!(same_bits(&got, &want));
                let (start, stop) = (outs / 3, outs);
                let mut part = vec![0f32; (stop - start) * ins];
                tree(&dys, &xs, s, start, stop, &mut part, threads).unwrap();
                assert!(same_bits(&part, &want[start * ins..]));
            }
        }
        // Four ranks of 4 units each, their sums added in the tree: the 16 units' tree.
        let (s, dys, xs, whole) = summed(16, 8, 33, 17, 99);
        let quarter = Shape { units: 4, ..s };
        let mut ranks = vec![0f32; 4 * s.outs * s.ins];
        for (r, piece) in ranks.chunks_mut(s.outs * s.ins).enumerate() {
            let d = &dys[r * 4 * s.rows * s.outs..(r + 1) * 4 * s.rows * s.outs];
            let x = &xs[r * 4 * s.rows * s.ins..(r + 1) * 4 * s.rows * s.ins];
            tree(d, x, quarter, 0, s.outs, piece, 1).unwrap();
        }
        let mut summed = vec![0f32; s.outs * s.ins];
        tree_sum(&ranks, 4, &mut summed, 1).unwrap();
        assert!(same_bits(&whole, &summed));
    }

    #[test]
    fn the_threads_cut_the_rows_without_changing_a_bit() {
        // The blocks of output rows follow `threads` alone, so this cuts them differently
        // even where no OpenMP runtime is loaded.
        for units in [16usize, 13, 2] {
            let (s, dys, xs, want) = summed(units, 9, 6, 30, 7 + units as u32);
            for threads in [2, 3, 8, 64] {
                let mut got = vec![0f32; s.outs * s.ins];
                tree(&dys, &xs, s, 0, s.outs, &mut got, threads).unwrap();
                assert!(same_bits(&got, &want));
            }
        }
    }

    #[test]
    fn the_threads_cut_the_columns_without_changing_a_bit() {
        // Few rows and many columns: the tiles are cut from the columns too.
        for (units, outs, ins) in [(16usize, 6, 64), (5, 64, 256), (3, 2, 100)] {
            let (s, dys, xs, want) = summed(units, 9, outs, ins, 11 + units as u32);
            for threads in [2, 4, 8, 12] {
                let (tall, wide) = tiles(outs, ins, threads);
                assert!(tall >= 1 && (16..=ins).contains(&wide), "{tall} x {wide}");
                let mut got = vec![0f32; s.outs * s.ins];
                tree(&dys, &xs, s, 0, s.outs, &mut got, threads).unwrap();
                assert!(same_bits(&got, &want), "{units} {outs} {ins} {threads}");
                let (start, stop) = (1, outs);
                let mut part = vec![0f32; (stop - start) * ins];
                tree(&dys, &xs, s, start, stop, &mut part, threads).unwrap();
                assert!(same_bits(&part, &want[start * ins..]));
            }
        }
    }

    #[test]
    fn tiles_copy_the_least_input_per_product() {
        assert_eq!(tiles(64, 256, 8), (32, 64)); // rows alone: 8 x 256
        assert_eq!(tiles(256, 64, 8), (32, 64));
        assert_eq!(tiles(64, 64, 8), (16, 32));
        assert_eq!(tiles(4, 20, 8), (1, 20)); // columns no narrower than 16
        assert_eq!(tiles(4096, 4096, 4), (8, 2048)); // a tile within BLOCK values
    }

    #[test]
    fn the_bits_do_not_depend_on_alignment() {
        let (s, dys, xs, want) = summed(2, 70, 21, 35, 3);
        let shifted = |v: &[f32], by: usize| {
            let mut w = vec![0f32; v.len() + by];
            w[by..].copy_from_slice(v);
            w
        };
        let (d, x) = (shifted(&dys, 1), shifted(&xs, 3));
        let mut got = vec![0f32; s.outs * s.ins + 2];
        tree(&d[1..], &x[3..], s, 0, s.outs, &mut got[2..], 1).unwrap();
        assert!(same_bits(&got[2..], &want));
    }

    #[test]
    fn wrong_sizes_are_refused() {
        let s = Shape {
            units: 2,
            rows: 3,
            outs: 4,
            ins: 5,
        };
        let (dys, xs) = inputs(s, 1);
        let mut out = vec![0f32; 4 * 5];
        assert!(tree(&dys[1..], &xs, s, 0, 4, &mut out, 1).is_err());
        assert!(tree(&dys, &xs, s, 0, 5, &mut out, 1).is_err());
        assert!(tree(&dys, &xs, s, 0, 3, &mut out, 1).is_err());
        assert!(products(&dys, &xs, s, 0, 4, &mut out, 1).is_err());
    }
}
