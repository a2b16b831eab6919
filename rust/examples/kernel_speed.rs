//! Quick GB/s of reduce_slices on finite and non-finite f32 inputs (developer tool; the
//! criterion bench in `benches/kernels.rs` is the real measurement).
use shardline::reduce::reduce_slices;
use shardline::{DType, ReduceOp};
use std::time::Instant;

fn main() {
    let size = 1usize << 20;
    for (name, v) in [
        ("one", 1.0f32),
        ("inf", f32::INFINITY),
        ("nan", f32::NAN),
        ("tiny", 1e-40),
    ] {
        let a: Vec<u8> = std::iter::repeat_n(v.to_le_bytes(), size / 4)
            .flatten()
            .collect();
        let mut d = vec![0u8; size];
        let it = 1000;
        let t = Instant::now();
        for _ in 0..it {
            reduce_slices(&mut d, &[&a, &a], DType::F32, ReduceOp::Sum);
        }
        let e = t.elapsed().as_secs_f64();
        println!("{name}: {:.1} GB/s of output", (size * it) as f64 / e / 1e9);
    }
}
