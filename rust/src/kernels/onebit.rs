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

/// `values` as f32 (torch's tensors are 4-byte aligned; anything else is refused).
fn floats_mut<'a>(values: &'a mut [u8], what: &str) -> Result<&'a mut [f32]> {
    if values.is_empty() {
        return Ok(&mut []); // an empty buffer's pointer may be anything
    }
    bytemuck::try_cast_slice_mut(values).map_err(|_| {
        Error::invalid(format!(
            "1-bit codec: {what} is not a 4-byte aligned float32 buffer"
        ))
    })
}

#[inline]
fn scale_at(scales: &[u8], b: usize) -> f32 {
    f32::from_le_bytes([
        scales[4 * b],
        scales[4 * b + 1],
        scales[4 * b + 2],
        scales[4 * b + 3],
    ])
}

/// `SIGNS[byte]`: the eight values +1 or -1 a sign byte stands for (most significant bit
/// first).
static SIGNS: [[f32; 8]; 256] = {
    let mut t = [[0f32; 8]; 256];
    let mut b = 0;
    while b < 256 {
        let mut j = 0;
        while j < 8 {
            t[b][j] = if (b >> (7 - j)) & 1 == 1 { 1.0 } else { -1.0 };
            j += 1;
        }
        b += 1;
    }
    t
};

/// Encodes one block: returns its scale, writes its sign bytes, and with `feedback` leaves
/// the residual in `values`.
#[inline]
fn encode_block(values: &mut [f32], signs: &mut [u8], feedback: bool) -> f32 {
    let mut acc = [0f32; 8];
    for c in values.chunks_exact(8) {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += v.abs();
        }
    }
    let scale = acc.iter().sum::<f32>() / values.len() as f32;
    for (c, s) in values.chunks_exact_mut(8).zip(signs.iter_mut()) {
        let mut byte = 0u8;
        for (j, v) in c.iter().enumerate() {
            byte |= ((*v >= 0.0) as u8) << (7 - j);
        }
        *s = byte;
        if feedback {
            for (v, sign) in c.iter_mut().zip(&SIGNS[byte as usize]) {
                *v -= sign * scale;
            }
        }
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
    let values = floats_mut(values, "the values")?;
    let row_code = code_bytes(length, block);
    values
        .par_chunks_mut(length)
        .zip(codes.par_chunks_mut(row_code))
        .for_each(|(vrow, crow)| {
            let (signs, scales) = crow.split_at_mut(length / 8);
            vrow.par_chunks_mut(block * PIECE_BLOCKS)
                .zip(signs.par_chunks_mut(block / 8 * PIECE_BLOCKS))
                .zip(scales.par_chunks_mut(4 * PIECE_BLOCKS))
                .for_each(|((v, s), sc)| {
                    let blocks = v
                        .chunks_exact_mut(block)
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

/// Encodes a flat buffer cut into `rows` chunks of `chunk` values, each padded with zeros to
/// `length` (a multiple of `block`), into `codes` (rows of [`code_bytes`]`(length)`).
///
/// The value encoded at position `i` is `values[i] + residual[i]`; with a residual, it is
/// left holding what the encoding dropped (padding keeps none). One read of `values`, one
/// read and write of `residual`: no padded copy is made.
pub fn encode_chunks(
    values: &[u8],
    residual: Option<&mut [u8]>,
    codes: &mut [u8],
    chunk: usize,
    length: usize,
    block: usize,
) -> Result<()> {
    check_shape(length, block)?;
    let values: &[f32] = if values.is_empty() {
        &[]
    } else {
        bytemuck::try_cast_slice(values).map_err(|_| {
            Error::invalid("1-bit codec: the values are not a 4-byte aligned float32 buffer")
        })?
    };
    let numel = values.len();
    let row_code = code_bytes(length, block);
    let rows = rows_of(codes.len(), row_code, "the codes")?;
    if chunk == 0 || chunk > length || rows * chunk < numel {
        return Err(Error::invalid(format!(
            "1-bit codec: {rows} chunks of {chunk} values (padded to {length}) cannot hold \
             {numel} values"
        )));
    }
    let residual = match residual {
        Some(r) => {
            let r = floats_mut(r, "the residual")?;
            if r.len() != numel {
                return Err(Error::invalid(format!(
                    "1-bit codec: the residual holds {} values, the buffer {numel}",
                    r.len()
                )));
            }
            Some(r)
        }
        None => None,
    };
    let feedback = residual.is_some();
    let per = PIECE_BLOCKS * block;
    let pieces_per_row = length.div_ceil(per);
    // Each row's pieces: its values, its residual (empty past the buffer's end), its codes.
    let mut v_parts: Vec<&[f32]> = Vec::with_capacity(rows * pieces_per_row);
    let mut r_parts: Vec<&mut [f32]> = Vec::with_capacity(rows * pieces_per_row);
    let mut rest_r: &mut [f32] = residual.unwrap_or_default();
    for row in 0..rows {
        let lo = (row * chunk).min(numel);
        let hi = ((row + 1) * chunk).min(numel);
        let (mine, tail) =
            std::mem::take(&mut rest_r).split_at_mut(if feedback { hi - lo } else { 0 });
        rest_r = tail;
        let mut mine_parts = mine.chunks_mut(per);
        for i in 0..pieces_per_row {
            let (a, b) = ((lo + i * per).min(hi), (lo + (i + 1) * per).min(hi));
            v_parts.push(&values[a..b]);
            r_parts.push(mine_parts.next().unwrap_or_default());
        }
    }
    let mut c_parts: Vec<(&mut [u8], &mut [u8])> = Vec::with_capacity(rows * pieces_per_row);
    for crow in codes.chunks_exact_mut(row_code) {
        let (signs, scales) = crow.split_at_mut(length / 8);
        c_parts.extend(
            signs
                .chunks_mut(block / 8 * PIECE_BLOCKS)
                .zip(scales.chunks_mut(4 * PIECE_BLOCKS)),
        );
    }
    v_parts
        .into_par_iter()
        .zip(r_parts)
        .zip(c_parts)
        .for_each(|((v, r), (s, sc))| encode_piece(v, feedback.then_some(r), s, sc, block));
    Ok(())
}

/// Encodes the blocks of one piece: `v` (fewer values than the piece's blocks hold when the
/// row ends in padding) plus `r`, into the sign bytes `s` and scales `sc`.
fn encode_piece(v: &[f32], mut r: Option<&mut [f32]>, s: &mut [u8], sc: &mut [u8], block: usize) {
    let mut x = vec![0f32; block];
    for (b, (sb, out)) in s
        .chunks_exact_mut(block / 8)
        .zip(sc.chunks_exact_mut(4))
        .enumerate()
    {
        let lo = (b * block).min(v.len());
        let hi = ((b + 1) * block).min(v.len());
        let n = hi - lo;
        x[..n].copy_from_slice(&v[lo..hi]);
        if let Some(r) = r.as_deref() {
            for (xi, ri) in x[..n].iter_mut().zip(&r[lo..hi]) {
                *xi += ri;
            }
        }
        x[n..].fill(0.0);
        let scale = encode_block(&mut x, sb, r.is_some());
        out.copy_from_slice(&scale.to_le_bytes());
        if let Some(r) = r.as_deref_mut() {
            r[lo..hi].copy_from_slice(&x[..n]);
        }
    }
}

/// Decodes one block of one row into `out`, adding to it when `add`.
#[inline]
fn decode_block(signs: &[u8], scale: f32, out: &mut [f32], add: bool) {
    for (byte, c) in signs.iter().zip(out.chunks_exact_mut(8)) {
        let sign = &SIGNS[*byte as usize];
        if add {
            for (o, s) in c.iter_mut().zip(sign) {
                *o += s * scale;
            }
        } else {
            for (o, s) in c.iter_mut().zip(sign) {
                *o = s * scale;
            }
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
    let out = floats_mut(out, "the output")?;
    if !sum {
        out.par_chunks_mut(length)
            .zip(codes.par_chunks(row_code))
            .for_each(|(orow, crow)| {
                orow.par_chunks_mut(block * PIECE_BLOCKS)
                    .enumerate()
                    .for_each(|(i, piece)| {
                        decode_rows(&[crow], length, block, piece, i * PIECE_BLOCKS)
                    })
            });
        return Ok(());
    }
    let crows: Vec<&[u8]> = codes.chunks_exact(row_code).collect();
    out.par_chunks_mut(block * PIECE_BLOCKS)
        .enumerate()
        .for_each(|(i, piece)| decode_rows(&crows, length, block, piece, i * PIECE_BLOCKS));
    Ok(())
}

/// Decodes blocks `first..` of every row in `crows` into `piece`, summing the rows.
fn decode_rows(crows: &[&[u8]], length: usize, block: usize, piece: &mut [f32], first: usize) {
    for (r, crow) in crows.iter().enumerate() {
        let (signs, scales) = crow.split_at(length / 8);
        for (k, ob) in piece.chunks_exact_mut(block).enumerate() {
            let b = first + k;
            let bytes = &signs[b * block / 8..(b + 1) * block / 8];
            decode_block(bytes, scale_at(scales, b), ob, r > 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use bytemuck::cast_slice_mut as raw;

    use crate::kernels::test_values as values;

    #[test]
    fn roundtrip_matches_the_definition() {
        let (block, length, rows) = (16, 64, 3);
        let v = values(rows * length, 7);
        let mut residual = v.clone();
        let mut codes = vec![0u8; rows * code_bytes(length, block)];
        encode(raw(&mut residual), &mut codes, length, block, true).unwrap();
        let mut decoded = vec![0f32; rows * length];
        decode(&codes, length, block, raw(&mut decoded), false).unwrap();
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
        let mut work = values(rows * length, 3);
        let mut codes = vec![0u8; rows * code_bytes(length, block)];
        encode(raw(&mut work), &mut codes, length, block, false).unwrap();
        let mut each = vec![0f32; rows * length];
        decode(&codes, length, block, raw(&mut each), false).unwrap();
        let mut sum = vec![0f32; length];
        decode(&codes, length, block, raw(&mut sum), true).unwrap();
        for i in 0..length {
            let want: f32 = (0..rows).map(|r| each[r * length + i]).sum();
            assert_eq!(sum[i], want, "value {i}");
        }
    }

    #[test]
    fn chunks_encode_like_padded_rows() {
        // 1000 values in 3 chunks of 334, padded to 336 (block 16): the last chunk is short.
        let (block, chunk, length, rows) = (16, 334, 336, 3);
        let v = values(1000, 11);
        let r0 = values(1000, 5);
        let mut padded = vec![0f32; rows * length];
        for (i, (a, b)) in v.iter().zip(&r0).enumerate() {
            padded[(i / chunk) * length + i % chunk] = a + b;
        }
        let mut want = vec![0u8; rows * code_bytes(length, block)];
        encode(raw(&mut padded), &mut want, length, block, true).unwrap();
        let (mut got, mut r) = (vec![0u8; want.len()], r0.clone());
        let vb: &[u8] = bytemuck::cast_slice(&v);
        encode_chunks(vb, Some(raw(&mut r)), &mut got, chunk, length, block).unwrap();
        assert_eq!(got, want);
        for (i, ri) in r.iter().enumerate() {
            assert_eq!(
                *ri,
                padded[(i / chunk) * length + i % chunk],
                "residual {i}"
            );
        }
        // Without a residual: the values alone.
        let mut plain = vec![0f32; rows * length];
        for (i, a) in v.iter().enumerate() {
            plain[(i / chunk) * length + i % chunk] = *a;
        }
        encode(raw(&mut plain), &mut want, length, block, false).unwrap();
        encode_chunks(vb, None, &mut got, chunk, length, block).unwrap();
        assert_eq!(got, want);
        // Too few chunks for the values.
        assert!(encode_chunks(vb, None, &mut got, 300, length, block).is_err());
    }

    #[test]
    fn bad_shapes_are_refused() {
        let mut v = vec![0f32; 100];
        let mut c = vec![0u8; 64];
        assert!(encode(raw(&mut v), &mut c, 100, 8, true).is_err()); // not whole blocks
        assert!(encode(raw(&mut v), &mut c, 50, 10, true).is_err()); // block not a multiple of 8
        let mut v = vec![0f32; 65];
        assert!(encode(raw(&mut v[..64]), &mut c, 64, 8, true).is_err()); // codes the wrong size
        let mut out = vec![0f32; 3];
        assert!(decode(&c[..code_bytes(64, 8)], 64, 8, raw(&mut out), true).is_err());
        // A float buffer that starts off a 4-byte boundary.
        let c = vec![0u8; code_bytes(64, 8)];
        let bytes: &mut [u8] = raw(&mut v);
        let err = decode(&c, 64, 8, &mut bytes[1..257], false).unwrap_err();
        assert!(err.to_string().contains("aligned"), "{err}");
    }
}
