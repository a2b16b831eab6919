//! The 1-bit gradient codec: the sign of each float32 value, and one float32 scale per block
//! of `block` values, the block's mean absolute value (1-bit SGD, Seide et al. 2014; 1-bit
//! Adam's compression).
//!
//! A row of `length` values (a multiple of `block`, itself a multiple of 8) encodes to
//! `length / 8` bytes of signs (most significant bit first, set for `v >= 0`) followed by
//! `length / block` little-endian f32 scales: the layout `shardline.optim.OneBit` decodes on
//! any device. A value decodes to `+scale` or `-scale`.
//!
//! [`encode`] is one pass per block (sum of magnitudes, signs, and with error feedback the
//! residual `v - decoded` written back over the input); [`decode`] sums rows while it
//! decodes. Both split blocks over the current rayon pool.

use rayon::prelude::*;

use crate::error::{Error, Result};

/// Blocks per parallel piece (16 Ki values at the default block of 256).
const PIECE_BLOCKS: usize = 64;

/// Bytes of one encoded row of `length` values.
pub fn code_bytes(length: usize, block: usize) -> usize {
    length / 8 + 4 * (length / block)
}

fn check_shape(length: usize, block: usize) -> Result<()> {
    if block == 0 || block % 8 != 0 {
        return Err(Error::invalid(format!(
            "1-bit codec: block must be a positive multiple of 8, not {block}"
        )));
    }
    if length % block != 0 {
        return Err(Error::invalid(format!(
            "1-bit codec: a row of {length} values is not a whole number of {block}-value blocks"
        )));
    }
    Ok(())
}

fn rows_of(bytes: usize, row_bytes: usize, what: &str) -> Result<usize> {
    if row_bytes == 0 || bytes % row_bytes != 0 {
        return Err(Error::invalid(format!(
            "1-bit codec: {what} holds {bytes} bytes, not a whole number of {row_bytes}-byte rows"
        )));
    }
    Ok(bytes / row_bytes)
}

#[inline]
fn get(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}

/// Encodes one block: returns its scale, writes its sign bytes, and with `feedback` leaves
/// the residual in `values`.
#[inline]
fn encode_block(values: &mut [u8], signs: &mut [u8], feedback: bool) -> f32 {
    let n = values.len() / 4;
    let mut acc = [0f32; 8];
    for c in values.chunks_exact(32) {
        for (j, a) in acc.iter_mut().enumerate() {
            *a += get(c, j).abs();
        }
    }
    let scale = acc.iter().sum::<f32>() / n as f32;
    for (c, s) in values.chunks_exact_mut(32).zip(signs.iter_mut()) {
        let mut byte = 0u8;
        for j in 0..8 {
            let v = get(c, j);
            let positive = v >= 0.0;
            byte |= (positive as u8) << (7 - j);
            if feedback {
                let r = if positive { v - scale } else { v + scale };
                c[4 * j..4 * j + 4].copy_from_slice(&r.to_le_bytes());
            }
        }
        *s = byte;
    }
    scale
}

/// Encodes `values` (rows of `length` f32) into `codes` (rows of [`code_bytes`]). With
/// `feedback`, `values` is left holding what the encoding dropped (`v - decoded`).
pub fn encode(
    values: &mut [u8],
    codes: &mut [u8],
    length: usize,
    block: usize,
    feedback: bool,
) -> Result<()> {
    check_shape(length, block)?;
    let rows = rows_of(values.len(), 4 * length, "the values")?;
    let code_rows = rows_of(codes.len(), code_bytes(length, block), "the codes")?;
    if rows != code_rows {
        return Err(Error::invalid(format!(
            "1-bit codec: {rows} rows of values but room for {code_rows} rows of codes"
        )));
    }
    let row_code = code_bytes(length, block);
    values
        .par_chunks_mut(4 * length)
        .zip(codes.par_chunks_mut(row_code))
        .for_each(|(vrow, crow)| {
            let (signs, scales) = crow.split_at_mut(length / 8);
            vrow.par_chunks_mut(4 * block * PIECE_BLOCKS)
                .zip(signs.par_chunks_mut(block / 8 * PIECE_BLOCKS))
                .zip(scales.par_chunks_mut(4 * PIECE_BLOCKS))
                .for_each(|((v, s), sc)| {
                    let blocks = v
                        .chunks_exact_mut(4 * block)
                        .zip(s.chunks_exact_mut(block / 8))
                        .zip(sc.chunks_exact_mut(4));
                    for ((vb, sb), out) in blocks {
                        let scale = encode_block(vb, sb, feedback);
                        out.copy_from_slice(&scale.to_le_bytes());
                    }
                });
        });
    Ok(())
}

/// Decodes one block of one row into `out` (f32 bytes), adding to it when `add`.
#[inline]
fn decode_block(signs: &[u8], scale: f32, out: &mut [u8], add: bool) {
    for (byte, c) in signs.iter().zip(out.chunks_exact_mut(32)) {
        for j in 0..8 {
            let v = if (byte >> (7 - j)) & 1 == 1 {
                scale
            } else {
                -scale
            };
            let v = if add { get(c, j) + v } else { v };
            c[4 * j..4 * j + 4].copy_from_slice(&v.to_le_bytes());
        }
    }
}

/// Decodes `codes` (rows of [`code_bytes`]`(length)`) into `out`: with `sum`, `out` holds
/// `length` f32, the sum of the decoded rows (added in row order); else `out` holds every
/// decoded row.
pub fn decode(codes: &[u8], length: usize, block: usize, out: &mut [u8], sum: bool) -> Result<()> {
    check_shape(length, block)?;
    let row_code = code_bytes(length, block);
    let rows = rows_of(codes.len(), row_code, "the codes")?;
    let want = 4 * length * if sum { 1 } else { rows };
    if out.len() != want {
        return Err(Error::invalid(format!(
            "1-bit codec: the output holds {} bytes, {want} expected for {rows} rows of \
             {length} values{}",
            out.len(),
            if sum { " summed" } else { "" }
        )));
    }
    if !sum {
        out.par_chunks_mut(4 * length)
            .zip(codes.par_chunks(row_code))
            .for_each(|(orow, crow)| decode_rows(&[crow], length, block, orow, 0));
        return Ok(());
    }
    let crows: Vec<&[u8]> = codes.chunks_exact(row_code).collect();
    out.par_chunks_mut(4 * block * PIECE_BLOCKS)
        .enumerate()
        .for_each(|(i, piece)| decode_rows(&crows, length, block, piece, i * PIECE_BLOCKS));
    Ok(())
}

/// Decodes blocks `first..` of every row in `crows` into `piece`, summing the rows.
fn decode_rows(crows: &[&[u8]], length: usize, block: usize, piece: &mut [u8], first: usize) {
    for (r, crow) in crows.iter().enumerate() {
        let (signs, scales) = crow.split_at(length / 8);
        for (k, ob) in piece.chunks_exact_mut(4 * block).enumerate() {
            let b = first + k;
            let scale = get(scales, b);
            decode_block(&signs[b * block / 8..(b + 1) * block / 8], scale, ob, r > 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn floats(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut i = seed;
        (0..n)
            .map(|_| {
                i = i.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (i >> 9) as f32 / (1u32 << 23) as f32 - 0.5
            })
            .collect()
    }

    #[test]
    fn roundtrip_matches_the_definition() {
        let (block, length, rows) = (16, 64, 3);
        let v = values(rows * length, 7);
        let mut work = bytes(&v);
        let mut codes = vec![0u8; rows * code_bytes(length, block)];
        encode(&mut work, &mut codes, length, block, true).unwrap();
        let mut out = vec![0u8; 4 * rows * length];
        decode(&codes, length, block, &mut out, false).unwrap();
        let (decoded, residual) = (floats(&out), floats(&work));
        for (bi, chunk) in v.chunks(block).enumerate() {
            let scale = chunk.iter().map(|x| x.abs()).sum::<f32>() / block as f32;
            for (j, &x) in chunk.iter().enumerate() {
                let i = bi * block + j;
                let want = if x >= 0.0 { scale } else { -scale };
                assert!(
                    (decoded[i] - want).abs() <= 1e-6 * scale.max(1.0),
                    "value {i}"
                );
                assert!(
                    (residual[i] - (x - decoded[i])).abs() <= 1e-6,
                    "residual {i}"
                );
            }
        }
    }

    #[test]
    fn sum_equals_the_sum_of_rows() {
        let (block, length, rows) = (8, 4096, 4);
        let mut work = bytes(&values(rows * length, 3));
        let mut codes = vec![0u8; rows * code_bytes(length, block)];
        encode(&mut work, &mut codes, length, block, false).unwrap();
        let mut each = vec![0u8; 4 * rows * length];
        decode(&codes, length, block, &mut each, false).unwrap();
        let mut sum = vec![0u8; 4 * length];
        decode(&codes, length, block, &mut sum, true).unwrap();
        let (each, sum) = (floats(&each), floats(&sum));
        for i in 0..length {
            let want: f32 = (0..rows).map(|r| each[r * length + i]).sum();
            assert_eq!(sum[i], want, "value {i}");
        }
    }

    #[test]
    fn bad_shapes_are_refused() {
        let mut v = vec![0u8; 4 * 100];
        let mut c = vec![0u8; 64];
        assert!(encode(&mut v, &mut c, 100, 8, true).is_err()); // not whole blocks
        assert!(encode(&mut v, &mut c, 50, 10, true).is_err()); // block not a multiple of 8
        let mut v = vec![0u8; 4 * 64];
        assert!(encode(&mut v, &mut c, 64, 8, true).is_err()); // codes the wrong size
        let mut out = vec![0u8; 12];
        assert!(decode(&c[..code_bytes(64, 8)], 64, 8, &mut out, true).is_err());
    }
}
