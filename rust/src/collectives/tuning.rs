//! Where a shared-memory all-reduce stops being one-shot, chosen from measured costs.
//!
//! A one-shot all-reduce takes one phase, but every rank reads every rank's input: `n·s` bytes
//! per rank for `s` bytes on `n` ranks. The two-phase one takes two phases and each rank moves
//! about `3·s` bytes. Which is faster at a size depends on what a phase costs on this machine
//! (how many ranks wait on each other, across how many sockets) and on its memory system, so
//! no fixed threshold fits 2 ranks and 32 alike: at 32 ranks on a 64-core host a 64 KiB
//! one-shot all-reduce took 285 µs, where its reduce-scatter plus all-gather took about 70.
//!
//! So each communicator's first all-reduce measures both algorithms on its ranks at a few
//! sizes (a few milliseconds at 32 ranks), every rank takes the slowest rank's times (one small
//! all-reduce), and all set the same limit: the crossover of the two cost curves, interpolated
//! between the probe sizes. Both algorithms add in rank order, so the choice changes the time
//! an all-reduce takes, never its result.

use std::time::Instant;

use crate::collectives::arena::{AllReduceAlgo, ArenaComm, DEFAULT_ONESHOT_BYTES};
use crate::dtype::DType;
use crate::error::Result;
use crate::reduce::ReduceOp;
use crate::signature::OpSig;

/// The sizes both algorithms are timed at (bytes of f32), up to the largest one-shot size.
pub const PROBES: [usize; 5] = [1 << 10, 4 << 10, 16 << 10, 64 << 10, DEFAULT_ONESHOT_BYTES];

/// Timed repetitions of each (size, algorithm) after one untimed; the fastest counts.
const REPS: usize = 3;

/// The largest size at which one-shot is no slower, from times at ascending `sizes`: up to
/// the first size where two-phase wins, interpolated linearly between it and the size before
/// (0 if two-phase wins at the first; the last size if it never wins).
pub fn crossover(sizes: &[usize], oneshot: &[f64], two_phase: &[f64]) -> usize {
    let mut before: Option<(usize, f64)> = None; // (size, how much sooner one-shot was)
    for ((&size, &one), &two) in sizes.iter().zip(oneshot).zip(two_phase) {
        let lead = two - one;
        if lead < 0.0 {
            return match before {
                None => 0,
                Some((prev, prev_lead)) => {
                    let at = prev as f64 + (size - prev) as f64 * prev_lead / (prev_lead - lead);
                    (at as usize / 64 * 64).clamp(prev, size)
                }
            };
        }
        before = Some((size, lead));
    }
    sizes.last().copied().unwrap_or(0)
}

/// Times both all-reduce algorithms on `comm`'s ranks (a collective: every local rank calls it
/// at once), and sets and returns the one-shot limit every rank agrees on.
///
/// `sig` is the all-reduce the caller asked for, the one that starts the measurement: every
/// phase of it publishes and checks that signature, so a rank that called another op (or
/// another size) fails here with an error naming the ops the ranks called, not the probes.
pub fn tune_oneshot(comm: &mut ArenaComm, sig: &OpSig, deadline: Instant) -> Result<usize> {
    let slot = comm.arena().slot_bytes();
    let sizes: Vec<usize> = PROBES.iter().copied().filter(|&s| s <= slot).collect();
    let largest = sizes.last().copied().unwrap_or(0);
    let mut buf = vec![0u8; largest];
    let mut best = vec![f64::INFINITY; 2 * sizes.len()];
    for rep in 0..=REPS {
        for (i, &size) in sizes.iter().enumerate() {
            let algos = [AllReduceAlgo::OneShot, AllReduceAlgo::TwoPhase];
            for (k, algo) in algos.into_iter().enumerate() {
                let (data, f32s, sum) = (&mut buf[..size], DType::F32, ReduceOp::Sum);
                let start = Instant::now();
                comm.all_reduce(Some(algo), data, f32s, sum, sig, None, deadline)?;
                let took = start.elapsed().as_secs_f64();
                let at = 2 * i + k;
                if rep > 0 {
                    best[at] = best[at].min(took);
                }
            }
        }
    }
    // Every rank takes the slowest rank's times, so all choose the same limit.
    let mut times: Vec<u8> = best.iter().flat_map(|t| t.to_ne_bytes()).collect();
    let (one, f64s, max) = (Some(AllReduceAlgo::OneShot), DType::F64, ReduceOp::Max);
    comm.all_reduce(one, &mut times, f64s, max, sig, None, deadline)?;
    let slowest: Vec<f64> = times
        .chunks_exact(8)
        .map(|b| f64::from_ne_bytes(b.try_into().expect("8 bytes")))
        .collect();
    let oneshot: Vec<f64> = slowest.iter().step_by(2).copied().collect();
    let two_phase: Vec<f64> = slowest.iter().skip(1).step_by(2).copied().collect();
    let limit = crossover(&sizes, &oneshot, &two_phase);
    comm.set_oneshot_bytes(limit);
    Ok(limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZES: [usize; 4] = [1024, 4096, 16384, 65536];

    #[test]
    fn one_shot_everywhere_keeps_the_largest_probe() {
        let one = [1.0, 2.0, 3.0, 4.0];
        let two = [2.0, 3.0, 4.0, 5.0];
        assert_eq!(crossover(&SIZES, &one, &two), 65536);
        // A tie counts for one-shot (one phase).
        assert_eq!(crossover(&SIZES, &one, &one), 65536);
    }

    #[test]
    fn two_phase_from_the_first_probe_means_no_one_shot() {
        assert_eq!(crossover(&SIZES, &[2.0; 4], &[1.0; 4]), 0);
    }

    #[test]
    fn the_crossover_is_interpolated_between_probes() {
        // One-shot leads by 1 at 4096 and trails by 3 at 16384: a quarter of the way.
        let one = [1.0, 1.0, 5.0, 9.0];
        let two = [2.0, 2.0, 2.0, 2.0];
        assert_eq!(crossover(&SIZES, &one, &two), 4096 + (16384 - 4096) / 4);
        // Rounded down to 64 bytes, never below the last size where one-shot won.
        let at = crossover(&SIZES, &[1.0, 1.0, 2.0 + 1e-9, 9.0], &[2.0; 4]);
        assert!((4096..16384).contains(&at) && at % 64 == 0, "{at}");
    }

    #[test]
    fn it_stops_at_the_first_loss() {
        // One-shot loses at 4096 and wins again at 16384 (noise): the limit stays below 4096.
        let at = crossover(&SIZES, &[1.0, 3.0, 1.0, 1.0], &[2.0; 4]);
        assert!((1024..4096).contains(&at), "{at}");
    }
}
