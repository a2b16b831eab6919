//! Parallel loops on the OpenMP threads that torch already runs, for kernels called between
//! torch's own operations (deterministic mode's sums, in the middle of a backward).
//!
//! torch's CPU operations run on an OpenMP pool whose threads keep spinning for a while after
//! each parallel region, waiting for the next one. Threads of another pool (rayon's) started
//! right after that find every core taken, and the spinning threads then find theirs taken
//! when the next region of torch starts: on a 16-core host, deterministic mode's per-unit
//! products on rayon threads between torch's matrix products made a step 2.3x slower (2
//! processes of 8 threads) than on torch's OpenMP threads. Here a
//! loop's tasks run on the OpenMP runtime the process has loaded (GNU's `libgomp`, which
//! torch's Linux wheels ship, or LLVM's and Intel's, which offer the same entry point), as a
//! `#pragma omp parallel` region of torch's would: the threads that are spinning take them.
//! Without such a runtime in the process, or with one thread, the tasks run in order on the
//! caller.
//!
//! Tasks are independent and write disjoint outputs, so which thread runs which changes no
//! bit of the result.

use std::any::Any;
use std::ffi::{c_uint, c_void};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// `GOMP_parallel(fn, data, num_threads, flags)`: runs `fn(data)` on a team of threads, the
/// caller included, and returns when all have returned (GCC's ABI since 4.9).
type Parallel = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);

/// The loaded runtime's entry point, looked for once.
fn runtime() -> Option<Parallel> {
    static FOUND: OnceLock<Option<Parallel>> = OnceLock::new();
    *FOUND.get_or_init(|| {
        for name in [
            c"libgomp.so.1",
            c"libomp.so",
            c"libomp.so.5",
            c"libiomp5.so",
        ] {
            // SAFETY: with RTLD_NOLOAD, dlopen only looks for a library already loaded (by
            // torch) and returns a handle to it, or null; it loads nothing and runs no code.
            let handle =
                unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
            if handle.is_null() {
                continue;
            }
            // SAFETY: `handle` is a live handle; the symbol name is a C string. The handle is
            // never closed, so the function stays mapped for the process's life.
            let symbol = unsafe { libc::dlsym(handle, c"GOMP_parallel".as_ptr()) };
            if !symbol.is_null() {
                // SAFETY: every runtime that exports `GOMP_parallel` gives it GCC's signature,
                // `void (void (*)(void *), void *, unsigned, unsigned)`, which `Parallel` is.
                return Some(unsafe { std::mem::transmute::<*mut c_void, Parallel>(symbol) });
            }
        }
        None
    })
}

struct Loop<'a> {
    tasks: usize,
    next: AtomicUsize,
    task: &'a (dyn Fn(usize) + Sync),
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

extern "C" fn worker(data: *mut c_void) {
    // SAFETY: `data` is the `Loop` that `for_each` passed to `GOMP_parallel`, which returns
    // only after every thread of the team has returned from here, so it outlives this call;
    // it is only read (its counters are atomics).
    let job = unsafe { &*(data as *const Loop<'_>) };
    loop {
        let i = job.next.fetch_add(1, Ordering::Relaxed);
        if i >= job.tasks {
            return;
        }
        // A panic must not unwind into the runtime's C frames: keep it for the caller, who
        // raises it again, and skip the tasks not started.
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| (job.task)(i))) {
            job.next.store(job.tasks, Ordering::Relaxed);
            let mut first = job.panic.lock().unwrap_or_else(|e| e.into_inner());
            first.get_or_insert(payload);
        }
    }
}

/// Runs `task(i)` for every `i` in `0..tasks`, on up to `threads` threads of the process's
/// OpenMP runtime (the caller's thread among them), or in order on the caller. A task's panic
/// is raised again on the caller.
pub fn for_each(tasks: usize, threads: usize, task: &(dyn Fn(usize) + Sync)) {
    let parallel = if threads > 1 && tasks > 1 {
        runtime()
    } else {
        None
    };
    let Some(parallel) = parallel else {
        (0..tasks).for_each(task);
        return;
    };
    let job = Loop {
        tasks,
        next: AtomicUsize::new(0),
        task,
        panic: Mutex::new(None),
    };
    let team = threads.min(tasks).min(c_uint::MAX as usize) as c_uint;
    // SAFETY: `parallel` is the runtime's `GOMP_parallel` (see `runtime`). `worker` is an
    // `extern "C"` function that never unwinds, and `job` lives on this frame until the call
    // returns, which it does after the whole team has finished with it.
    unsafe { parallel(worker, &job as *const Loop<'_> as *mut c_void, team, 0) };
    let panic = job.panic.into_inner().unwrap_or_else(|e| e.into_inner());
    if let Some(payload) = panic {
        resume_unwind(payload);
    }
}

/// `out` cut into pieces of `each` values (the last may be shorter), for [`for_each`]'s tasks
/// to write: each takes its own ([`take`]), or locks a shared one for a moment.
pub fn pieces(out: &mut [f32], each: usize) -> Vec<Mutex<&mut [f32]>> {
    out.chunks_mut(each.max(1)).map(Mutex::new).collect()
}

/// Piece `i` of [`pieces`], taken whole by the one task it belongs to (so the lock is never
/// contended; it is left empty).
pub fn take<'a>(pieces: &[Mutex<&'a mut [f32]>], i: usize) -> &'a mut [f32] {
    std::mem::take(&mut *pieces[i].lock().unwrap_or_else(|e| e.into_inner()))
}

/// `out` cut into pieces of `chunk` values (the last may be shorter); `task(i, piece)` for
/// each, as [`for_each`] runs them.
pub fn chunks_mut(
    out: &mut [f32],
    chunk: usize,
    threads: usize,
    task: impl Fn(usize, &mut [f32]) + Sync,
) {
    let pieces = pieces(out, chunk);
    for_each(pieces.len(), threads, &|i| task(i, take(&pieces, i)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_whatever_the_threads() {
        for threads in [1, 2, 8] {
            let mut out = vec![0f32; 1000];
            chunks_mut(&mut out, 7, threads, |i, piece| {
                for (j, v) in piece.iter_mut().enumerate() {
                    *v += (i * 7 + j) as f32;
                }
            });
            assert!(out.iter().enumerate().all(|(j, v)| *v == j as f32));
        }
    }
}
