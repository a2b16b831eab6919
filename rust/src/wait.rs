//! Waiting on a 32-bit counter in shared memory: spin briefly, then sleep on a futex.
//!
//! Posters bump the counter and wake sleepers only when a sleeper announced itself, so the
//! fast path is a store and a load. Sleeps are sliced (at most [`SLICE`]) so that callers can
//! check deadlines, aborts and peer liveness between slices.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Longest single futex sleep; callers re-check their conditions at least this often.
pub const SLICE: Duration = Duration::from_millis(50);

/// Longest single futex sleep while the check has work in progress (it returned `true`: a
/// message it reads for the waiting op, say), so that the work goes on at its pace.
pub const BUSY_SLICE: Duration = Duration::from_millis(1);

/// Whether `value` has reached `target` on a wrapping 32-bit counter.
#[inline(always)]
pub fn reached(value: u32, target: u32) -> bool {
    (value.wrapping_sub(target) as i32) >= 0
}

/// Sleeps while `*word == expected`, for at most `timeout`; spurious wake-ups are fine.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned u32 for the duration of the call (a reference), and
    // FUTEX_WAIT (shared, not PRIVATE, since the word may live in memory mapped by several
    // processes) only reads it; the kernel copies `ts` before returning.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every sleeper on `word`.
pub fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: `word` is a valid aligned u32; FUTEX_WAKE does not access memory beyond the key.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// A counter with a sleeper count beside it, as laid out in shared memory.
#[repr(C)]
pub struct Signal {
    /// The counter peers wait on.
    pub value: AtomicU32,
    /// How many threads are (about to be) asleep on `value`.
    pub sleepers: AtomicU32,
}

impl Signal {
    /// Publishes `value` and wakes sleepers if there are any.
    #[inline]
    pub fn post(&self, value: u32) {
        self.value.store(value, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) != 0 {
            futex_wake_all(&self.value);
        }
    }

    /// Wakes sleepers unconditionally (used when aborting).
    pub fn wake(&self) {
        futex_wake_all(&self.value);
    }
}

/// How long waits spin before they sleep by default, while every rank has a core.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// How long waits spin when ranks outnumber cores: a spinning rank would take the core of
/// the rank it waits for.
pub const OVERSUBSCRIBED_SPIN: Duration = Duration::from_micros(2);

/// How long to spin before sleeping.
#[derive(Clone, Copy, Debug)]
pub struct SpinPolicy {
    /// Busy-wait this long before the first futex sleep.
    pub spin: Duration,
}

impl SpinPolicy {
    /// Spins `spin` (the caller's setting, [`DEFAULT_SPIN`] by default) when every one of
    /// `local_ranks` has a core, [`OVERSUBSCRIBED_SPIN`] when ranks outnumber cores.
    pub fn for_ranks(local_ranks: usize, spin: Duration) -> Self {
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        let spin = if local_ranks > cores {
            OVERSUBSCRIBED_SPIN
        } else {
            spin
        };
        SpinPolicy { spin }
    }
}

/// Why [`wait_until`] stopped without the counter reaching its target.
pub enum Stop<E> {
    /// The deadline passed.
    Deadline,
    /// The check callback asked to stop.
    Check(E),
}

/// Waits until `signal.value` reaches `target`, calling `check` every slice (and every few
/// thousand spins) so that aborts and dead peers end the wait early. A check that returns
/// `true` has work in progress and is called again within [`BUSY_SLICE`].
pub fn wait_until<E>(
    signal: &Signal,
    target: u32,
    deadline: Instant,
    policy: SpinPolicy,
    mut check: impl FnMut() -> Result<bool, E>,
) -> Result<(), Stop<E>> {
    let v = signal.value.load(Ordering::Acquire);
    if reached(v, target) {
        return Ok(());
    }
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        for _ in 0..64 {
            std::hint::spin_loop();
            if reached(signal.value.load(Ordering::Acquire), target) {
                return Ok(());
            }
        }
        spins += 1;
        if spins % 64 == 0 {
            check().map_err(Stop::Check)?;
        }
        if start.elapsed() >= policy.spin {
            break;
        }
    }
    loop {
        let slice = if check().map_err(Stop::Check)? {
            BUSY_SLICE
        } else {
            SLICE
        };
        let now = Instant::now();
        if now >= deadline {
            return Err(Stop::Deadline);
        }
        signal.sleepers.fetch_add(1, Ordering::SeqCst);
        let v = signal.value.load(Ordering::SeqCst);
        if reached(v, target) {
            signal.sleepers.fetch_sub(1, Ordering::SeqCst);
            return Ok(());
        }
        futex_wait(&signal.value, v, slice.min(deadline - now));
        signal.sleepers.fetch_sub(1, Ordering::SeqCst);
        if reached(signal.value.load(Ordering::Acquire), target) {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A counter at 0 with no sleeper.
    fn at_zero() -> Signal {
        Signal {
            value: AtomicU32::new(0),
            sleepers: AtomicU32::new(0),
        }
    }

    #[test]
    fn wrapping_comparison() {
        assert!(reached(5, 5));
        assert!(reached(6, 5));
        assert!(!reached(4, 5));
        assert!(reached(1, u32::MAX));
        assert!(!reached(u32::MAX, 1));
    }

    #[test]
    fn sleeper_is_woken_by_post() {
        let s = Arc::new(at_zero());
        let s2 = s.clone();
        let t = std::thread::spawn(move || {
            let policy = SpinPolicy {
                spin: Duration::ZERO,
            };
            let deadline = Instant::now() + Duration::from_secs(5);
            wait_until::<()>(&s2, 3, deadline, policy, || Ok(false)).is_ok()
        });
        std::thread::sleep(Duration::from_millis(20));
        s.post(3);
        assert!(t.join().unwrap());
    }

    #[test]
    fn a_check_with_work_in_progress_is_called_every_busy_slice() {
        // Spinning off, a wait of 100 ms calls a busy check about every millisecond (100
        // times; at least 10 on a loaded machine), an idle one once per slice (50 ms).
        let calls = |busy: bool| {
            let s = at_zero();
            let policy = SpinPolicy {
                spin: Duration::ZERO,
            };
            let deadline = Instant::now() + Duration::from_millis(100);
            let mut n = 0;
            let r = wait_until::<()>(&s, 1, deadline, policy, || {
                n += 1;
                Ok(busy)
            });
            assert!(matches!(r, Err(Stop::Deadline)));
            n
        };
        let (busy, idle) = (calls(true), calls(false));
        assert!(busy >= 10, "a busy check was called {busy} times in 100 ms");
        assert!(idle <= 4, "an idle check was called {idle} times in 100 ms");
    }

    #[test]
    fn deadline_stops_the_wait() {
        let s = at_zero();
        let policy = SpinPolicy {
            spin: Duration::ZERO,
        };
        let deadline = Instant::now() + Duration::from_millis(30);
        let r = wait_until::<()>(&s, 1, deadline, policy, || Ok(false));
        assert!(matches!(r, Err(Stop::Deadline)));
    }
}
