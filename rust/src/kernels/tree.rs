//! The canonical tree sum: `units` rows of float32 added element by element in one fixed
//! binary tree, the same bits whatever splits the rows into blocks (deterministic mode).
//!
//! The tree over `n` rows puts the largest power of two below `n` (`n / 2` when `n` is one) on
//! the left and the rest on the right, recursively; each node adds its left sum to its right.
//! Every block of `2^k` consecutive rows is then a subtree, so a rank that sums its block and
//! a group that sums the ranks' sums in the same tree get what one process gets from all rows.
//! The Python layer's `tree_sum` (torch ops, any device and dtype) adds in the same order;
//! this is its one-pass form for CPU float32: the rows of a few columns at a time are summed
//! in cache.

use crate::error::{Error, Result};
use crate::kernels::openmp;

/// Columns summed together: `units * COLUMNS` floats stay in the first-level cache.
const COLUMNS: usize = 256;

/// Sums the `units` rows of `parts` (row-major, `units * out.len()` values) into `out`.
///
/// Columns are independent: with `threads` above one, threads of torch's OpenMP runtime
/// ([`crate::kernels::openmp`]) each take their own runs of them; the bits do not depend on how
/// many threads there are. With one, everything runs on the caller's thread.
pub fn tree_sum(parts: &[f32], units: usize, out: &mut [f32], threads: usize) -> Result<()> {
    let n = out.len();
    if units == 0 || parts.len() != units * n {
        return Err(Error::invalid(format!(
            "tree_sum: {} values are not {units} rows of {n}",
            parts.len()
        )));
    }
    if threads <= 1 {
        sum_columns(parts, units, n, 0, out);
        return Ok(());
    }
    // Runs of columns big enough to be worth a task.
    let run = (COLUMNS * 16).max(n.div_ceil(threads));
    openmp::chunks_mut(out, run, threads, |i, piece| {
        sum_columns(parts, units, n, i * run, piece);
    });
    Ok(())
}

/// Columns `first..first + out.len()` of the tree sum, `COLUMNS` at a time in cache.
fn sum_columns(parts: &[f32], units: usize, n: usize, first: usize, out: &mut [f32]) {
    let mut scratch = vec![0f32; units * COLUMNS.min(out.len().max(1))];
    let mut done = 0;
    while done < out.len() {
        let width = COLUMNS.min(out.len() - done);
        let start = first + done;
        for u in 0..units {
            scratch[u * width..(u + 1) * width]
                .copy_from_slice(&parts[u * n + start..u * n + start + width]);
        }
        let root = reduce(&mut scratch[..units * width], width, 0, units);
        out[done..done + width].copy_from_slice(&scratch[root * width..(root + 1) * width]);
        done += width;
    }
}

/// Sums rows `lo..hi` of `rows` (each `width` long) in place; the row that holds the sum.
fn reduce(rows: &mut [f32], width: usize, lo: usize, hi: usize) -> usize {
    let n = hi - lo;
    if n == 1 {
        return lo;
    }
    let left = 1usize << (usize::BITS - 1 - (n - 1).leading_zeros()); // largest power of 2 < n
    let a = reduce(rows, width, lo, lo + left);
    let b = reduce(rows, width, lo + left, hi);
    let (head, tail) = rows.split_at_mut(b * width);
    for (x, y) in head[a * width..(a + 1) * width]
        .iter_mut()
        .zip(&tail[..width])
    {
        *x += *y;
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_values;

    /// The definition, node by node.
    fn reference(rows: &[Vec<f32>]) -> Vec<f32> {
        if rows.len() == 1 {
            return rows[0].clone();
        }
        let n = rows.len();
        let left = 1usize << (usize::BITS - 1 - (n - 1).leading_zeros());
        let (a, b) = (reference(&rows[..left]), reference(&rows[left..]));
        a.iter().zip(&b).map(|(x, y)| x + y).collect()
    }

    #[test]
    fn matches_the_tree_node_by_node() {
        for units in [1usize, 2, 3, 5, 8, 13, 16] {
            for n in [1usize, 7, 256, 300, 1000] {
                let rows: Vec<Vec<f32>> = (0..units)
                    .map(|u| {
                        let scale = 10f32.powi(u as i32 % 7 - 3);
                        test_values(n, u as u32 + 1)
                            .iter()
                            .map(|v| v * scale)
                            .collect()
                    })
                    .collect();
                let flat: Vec<f32> = rows.concat();
                let mut out = vec![0f32; n];
                tree_sum(&flat, units, &mut out, 1).unwrap();
                let want = reference(&rows);
                assert!(out
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()));
            }
        }
    }

    #[test]
    fn blocks_of_a_power_of_two_are_subtrees() {
        let (b, w, n) = (4usize, 3usize, 50usize);
        let flat: Vec<f32> = (0..b * w)
            .flat_map(|u| {
                test_values(n, 7 * u as u32 + 3)
                    .into_iter()
                    .map(move |v| v * (u as f32 + 0.37).powi(5))
            })
            .collect();
        let mut whole = vec![0f32; n];
        tree_sum(&flat, b * w, &mut whole, 1).unwrap();
        let mut blocks = vec![0f32; w * n];
        for r in 0..w {
            tree_sum(
                &flat[r * b * n..(r + 1) * b * n],
                b,
                &mut blocks[r * n..(r + 1) * n],
                1,
            )
            .unwrap();
        }
        let mut twice = vec![0f32; n];
        tree_sum(&blocks, w, &mut twice, 1).unwrap();
        assert!(whole
            .iter()
            .zip(&twice)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn threads_give_the_same_bits() {
        let (units, n) = (16usize, 100_000usize);
        let flat: Vec<f32> = (0..units)
            .flat_map(|u| test_values(n, u as u32 + 11))
            .collect();
        let mut one = vec![0f32; n];
        tree_sum(&flat, units, &mut one, 1).unwrap();
        let mut four = vec![0f32; n];
        tree_sum(&flat, units, &mut four, 4).unwrap();
        assert!(one
            .iter()
            .zip(&four)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn a_wrong_size_is_refused() {
        let mut out = vec![0f32; 3];
        assert!(tree_sum(&[0.0; 7], 2, &mut out, 1).is_err());
        assert!(tree_sum(&[], 0, &mut out, 4).is_err());
    }
}
