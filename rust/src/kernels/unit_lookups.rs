//! An embedding's lookups of a tied weight's rows, added onto each unit's product.
//!
//! A language model whose output layer shares its weight with the input embedding gives that
//! weight two uses per unit: the output layer's product and the embedding's lookups (each
//! token's output gradient added onto the row it read). One process adds them unit by unit,
//! the lookups in their order after the product (torch's `index_add_` adds its rows in
//! order), then the units in the canonical tree. [`crate::kernels::unit_products::tree_with`]
//! does it in its pass over the units, so the units' sums are never all in memory.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::kernels::{self, unit_products::Shape};

/// An embedding's lookups of a weight's rows, by unit: unit `u`'s are `idx[t]` for `t` in
/// `offsets[u]..offsets[u + 1]`, in order, each adding row `t` of `dy` (`ins` values).
#[derive(Clone, Copy, Debug)]
pub struct Lookups<'a> {
    /// `units + 1` nondecreasing offsets into `idx`, from 0 to `idx.len()`.
    pub offsets: &'a [i64],
    /// The weight's row each lookup read.
    pub idx: &'a [i64],
    /// Each lookup's output gradient (`idx.len() x ins`).
    pub dy: &'a [f32],
}

impl Lookups<'_> {
    /// Refuses offsets, rows or gradients that do not fit `s`.
    pub(crate) fn check(&self, s: &Shape) -> Result<()> {
        let n = self.idx.len();
        let fits = self.offsets.len() == s.units + 1
            && self.offsets.first() == Some(&0)
            && self.offsets.last() == Some(&(n as i64))
            && self.offsets.windows(2).all(|w| w[0] <= w[1])
            && self.dy.len() == n * s.ins;
        if !fits {
            return Err(Error::invalid(format!(
                "unit products: lookups of {n} rows ({} values of gradient) with {} offsets \
                 do not fit {} units of {} features",
                self.dy.len(),
                self.offsets.len(),
                s.units,
                s.ins
            )));
        }
        if let Some(bad) = self.idx.iter().find(|&&r| r < 0 || r as usize >= s.outs) {
            return Err(Error::invalid(format!(
                "unit products: a lookup of row {bad} outside the weight's {}",
                s.outs
            )));
        }
        Ok(())
    }

    /// Adds unit `u`'s lookups of rows `rows` into `out`, its columns `cols` (row-major).
    pub(crate) fn add(
        &self,
        s: &Shape,
        u: usize,
        rows: &Range<usize>,
        cols: &Range<usize>,
        out: &mut [f32],
    ) {
        let n = cols.len();
        let (lo, hi) = (self.offsets[u] as usize, self.offsets[u + 1] as usize);
        for (t, &r) in self.idx[lo..hi].iter().enumerate() {
            let r = r as usize;
            if rows.contains(&r) {
                let from = &self.dy[(lo + t) * s.ins + cols.start..(lo + t) * s.ins + cols.end];
                let into = &mut out[(r - rows.start) * n..(r - rows.start + 1) * n];
                kernels::add_into(into, from);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::same_bits;
    use crate::kernels::test_values;
    use crate::kernels::tree::tree_sum;
    use crate::kernels::unit_products::{products, tree_with};

    #[test]
    fn lookups_are_added_to_each_units_product_in_order_before_the_tree() {
        let s = Shape {
            units: 8,
            rows: 5,
            outs: 6,
            ins: 40,
        };
        let (dys, xs) = (
            test_values(s.units * s.rows * s.outs, 21),
            test_values(s.units * s.rows * s.ins, 22),
        );
        // Unit u looks up 3 + u rows of 6, so most rows more than once.
        let (mut offsets, mut idx) = (vec![0i64], vec![]);
        for u in 0..s.units {
            idx.extend((0..3 + u).map(|t| ((u * 7 + t * 5) % s.outs) as i64));
            offsets.push(idx.len() as i64);
        }
        let dy = test_values(idx.len() * s.ins, 23);
        let l = Lookups {
            offsets: &offsets,
            idx: &idx,
            dy: &dy,
        };
        // Each unit's product, its lookups added in order (`index_add_`), then the tree.
        let with_products = |each: &mut Vec<f32>, s: Shape| {
            for u in 0..s.units {
                for t in offsets[u] as usize..offsets[u + 1] as usize {
                    let r = idx[t] as usize;
                    for i in 0..s.ins {
                        each[(u * s.outs + r) * s.ins + i] += dy[t * s.ins + i];
                    }
                }
            }
            let mut want = vec![0f32; s.outs * s.ins];
            tree_sum(each, s.units, &mut want, 1).unwrap();
            want
        };
        let mut each = vec![0f32; s.units * s.outs * s.ins];
        products(&dys, &xs, s, 0, s.outs, &mut each, 1).unwrap();
        let want = with_products(&mut each, s);
        // The lookups alone (a weight no product uses): zero rows a unit.
        let alone = Shape { rows: 0, ..s };
        let want_alone = with_products(&mut vec![0f32; s.units * s.outs * s.ins], alone);
        for threads in [1, 2, 4] {
            let mut got = vec![0f32; s.outs * s.ins];
            tree_with(&dys, &xs, s, 0, s.outs, Some(l), &mut got, threads).unwrap();
            assert!(same_bits(&got, &want), "{threads} threads");
            let mut part = vec![0f32; (s.outs - 2) * s.ins];
            tree_with(&dys, &xs, s, 2, s.outs, Some(l), &mut part, threads).unwrap();
            assert!(same_bits(&part, &want[2 * s.ins..]));
            tree_with(&[], &[], alone, 0, s.outs, Some(l), &mut got, threads).unwrap();
            assert!(same_bits(&got, &want_alone));
        }
        // Lookups that do not fit are refused.
        let mut out = vec![0f32; s.outs * s.ins];
        let far = [idx[..idx.len() - 1].to_vec(), vec![s.outs as i64]].concat();
        let bad = [
            Lookups { idx: &far, ..l },
            Lookups {
                offsets: &offsets[1..],
                ..l
            },
            Lookups { dy: &dy[1..], ..l },
        ];
        for b in bad {
            assert!(tree_with(&dys, &xs, s, 0, s.outs, Some(b), &mut out, 1).is_err());
        }
    }
}
