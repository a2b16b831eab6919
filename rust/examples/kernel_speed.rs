//! Quick GB/s of reduce_slices and memcpy (developer tool; `cargo bench` has the real bench).
use shardline::reduce::reduce_slices;
use shardline::{DType, ReduceOp};
use std::time::Instant;
fn main() {
    for &size in &[64usize << 10, 1 << 20] {
        let a = vec![1u8; size];
        let b = vec![2u8; size];
        let mut d = vec![0u8; size];
        let it = (1usize << 30) / size;
        let t = Instant::now();
        for _ in 0..it {
            reduce_slices(&mut d, &[&a, &b], DType::F32, ReduceOp::Sum);
        }
        let e = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for _ in 0..it {
            d.copy_from_slice(&a);
        }
        let m = t.elapsed().as_secs_f64();
        println!(
            "{size}: reduce {:.1} GB/s (dst bytes), memcpy {:.1} GB/s",
            (size * it) as f64 / e / 1e9,
            (size * it) as f64 / m / 1e9
        );
    }
}
