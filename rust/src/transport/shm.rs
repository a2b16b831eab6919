//! The shared-memory arena: one file mapped by every rank of a communicator on one host.
//!
//! Layout (every part 4096-aligned):
//! ```text
//! [ header: magic, version, ranks, slot size, abort word + message      ]  4096 bytes
//! [ control line per rank: publish counter + sleepers, pid, departed,   ]  256 bytes each
//! [   the signature of the rank's current op, an extra word             ]
//! [ data: per rank two slots of `slot_bytes` (double buffering)         ]
//! [ point-to-point: one channel per ordered pair of ranks (`channel`)     ]
//! ```
//! A rank writes only its own control line and its own slots; it reads everybody's. The
//! protocol that makes this race-free lives in [`crate::collectives::arena`]. The file is
//! created `O_EXCL` with mode 0600 under a name carrying the creator's pid and a random
//! token; the creator unlinks it once every rank has mapped it, so nothing is left in
//! `/dev/shm` after any kind of exit, and [`sweep`] removes files of dead creators.

use std::ffi::CString;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, ErrorKind, Result, LONGER_TIMEOUT};
use crate::signature::{OpSig, SIG_BYTES};
use crate::wait::{self, Signal, SpinPolicy, Stop};

mod channel;
pub mod segment;

const MAGIC: u64 = u64::from_le_bytes(*b"SHLARENA");
const VERSION: u32 = 2;
const PAGE: usize = 4096;
const CTRL_BYTES: usize = 256;
const ABORT_MSG_BYTES: usize = 2048;
/// File-name prefix of every arena, so [`sweep`] can find them.
pub const PREFIX: &str = "shardline-";

#[repr(C)]
struct Header {
    magic: u64,
    version: u32,
    ranks: u32,
    slot_bytes: u64,
    abort_kind: AtomicU32,
    abort_rank: AtomicU32,
    abort_len: AtomicU32,
    abort_msg: [u8; ABORT_MSG_BYTES],
}

#[repr(C)]
struct Ctrl {
    signal: Signal,
    pid: AtomicU32,
    departed: AtomicU32,
    /// Per parity (double-buffered like the slots, so a fast rank's next op cannot overwrite
    /// what a slow rank is still comparing).
    extra: [AtomicU64; 2],
    sig: [[u8; SIG_BYTES]; 2],
}

const _: () = assert!(std::mem::size_of::<Header>() <= PAGE);
const _: () = assert!(std::mem::size_of::<Ctrl>() <= CTRL_BYTES);

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// Offsets of the slots and of the channels, and the file's size. The channels take
/// `ranks * (ranks - 1)` MiB of address space, but only the pages of pairs that exchange
/// messages are ever touched (and so allocated).
fn layout(ranks: usize, slot_bytes: usize) -> (usize, usize, usize) {
    let data_off = PAGE + round_up(ranks * CTRL_BYTES, PAGE);
    let chan_off = data_off + ranks * 2 * slot_bytes;
    let total = chan_off + ranks * ranks.saturating_sub(1) * channel::CHANNEL_BYTES;
    (data_off, chan_off, total)
}

fn cpath(path: &str) -> Result<CString> {
    CString::new(path)
        .map_err(|_| Error::invalid(format!("arena path {path:?} contains a NUL byte")))
}

/// Creates the file `c` (O_EXCL, mode 0600) and returns its descriptor; `what` and `path`
/// name it in the error.
fn create_exclusive(c: &CString, what: &str, path: &str) -> Result<libc::c_int> {
    // SAFETY: `c` is a valid NUL-terminated path; the flags create a new file only.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
            0o600,
        )
    };
    if fd < 0 {
        return Err(Error::io(
            format!("creating {what} {path}"),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(fd)
}

/// Creates the arena file for `ranks` ranks with two slots of `slot_bytes` each.
pub fn create(path: &str, ranks: usize, slot_bytes: usize) -> Result<()> {
    if ranks == 0 || slot_bytes == 0 || slot_bytes % PAGE != 0 {
        return Err(Error::invalid(format!(
            "arena needs at least one rank and a slot size that is a positive multiple of {PAGE} \
             bytes (got {ranks} ranks, {slot_bytes} bytes); check SHARDLINE_SHM_SLOT_BYTES"
        )));
    }
    let (_, _, total) = layout(ranks, slot_bytes);
    let c = cpath(path)?;
    let fd = create_exclusive(&c, "shared-memory arena", path)?;
    // SAFETY: `fd` is the descriptor we just opened.
    let rc = unsafe { libc::ftruncate(fd, total as libc::off_t) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        // SAFETY: closing and unlinking what we created.
        unsafe {
            libc::close(fd);
            libc::unlink(c.as_ptr());
        }
        return Err(Error::io(
            format!(
                "sizing shared-memory arena {path} to {total} bytes (is /dev/shm large enough?)"
            ),
            e,
        ));
    }
    let map = Mapping::new(fd, total, path);
    // SAFETY: the mapping (if any) does not depend on the descriptor staying open.
    unsafe { libc::close(fd) };
    let map = map?;
    // SAFETY: the file is fresh and zero-filled, at least PAGE bytes long and page-aligned;
    // nobody else has its name yet, so this is the only access.
    unsafe {
        let h = map.base as *mut Header;
        (*h).slot_bytes = slot_bytes as u64;
        (*h).ranks = ranks as u32;
        (*h).version = VERSION;
        std::sync::atomic::fence(Ordering::SeqCst);
        (*h).magic = MAGIC;
    }
    Ok(())
}

/// Removes the arena's name; ranks that mapped it keep using it.
pub fn unlink(path: &str) -> Result<()> {
    let c = cpath(path)?;
    // SAFETY: valid NUL-terminated path.
    if unsafe { libc::unlink(c.as_ptr()) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::NotFound {
            return Err(Error::io(format!("removing shared-memory arena {path}"), e));
        }
    }
    Ok(())
}

/// Whether process `pid` is alive: it exists and is not a zombie (a killed rank whose parent
/// has not reaped it yet still answers `kill(pid, 0)`, so `/proc` is asked first).
pub fn pid_alive(pid: u32) -> bool {
    if pid == 0 {
        return true;
    }
    match std::fs::read(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // The state letter follows the command name, which is in parentheses.
            let state = stat
                .iter()
                .rposition(|&c| c == b')')
                .and_then(|i| stat.get(i + 2));
            !matches!(state, Some(b'Z') | Some(b'X'))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(_) => {
            // SAFETY: signal 0 only checks for existence and permission.
            let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
            rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
        }
    }
}

/// Removes arena files in `dir` whose creating process is gone; returns how many.
pub fn sweep(dir: &str) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !pid_alive(pid) && std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Opens the existing file `path` read-write and maps as many bytes as `length` says for its
/// size (or fails with `length`'s error); `opening` says what failed if it cannot be opened.
fn map_existing(
    path: &str,
    opening: &str,
    length: impl FnOnce(usize) -> Result<usize>,
) -> Result<Mapping> {
    let c = cpath(path)?;
    // SAFETY: valid path; opening an existing file read-write.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(Error::io(opening, std::io::Error::last_os_error()));
    }
    // SAFETY: `st` is written by fstat before use.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd and out-pointer.
    let size = if unsafe { libc::fstat(fd, &mut st) } == 0 {
        st.st_size as usize
    } else {
        0
    };
    let map = length(size).and_then(|len| Mapping::new(fd, len, path));
    // SAFETY: the mapping does not need the descriptor.
    unsafe { libc::close(fd) };
    map
}

/// A shared, read-write mapping of a whole file, unmapped on drop.
struct Mapping {
    base: *mut u8,
    len: usize,
}

impl Mapping {
    /// Maps the first `len` bytes of the file open as `fd` (`path` names it in errors).
    fn new(fd: libc::c_int, len: usize, path: &str) -> Result<Self> {
        // SAFETY: mapping `len` bytes of a file at least that long, shared, read-write.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Error::io(
                format!("mapping shared-memory arena {path}"),
                std::io::Error::last_os_error(),
            ));
        }
        Ok(Mapping {
            base: base as *mut u8,
            len,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `new` mapped; no references outlive the Arena.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

/// Work an arena wait does at its checks, beside waiting: `Ok(true)` while it has work in
/// progress (it is then called again within [`wait::BUSY_SLICE`]). Shared with the helper
/// threads an op may run on, hence `Sync`.
pub type Meanwhile = dyn Fn() -> Result<bool> + Send + Sync;

/// One rank's handle on a mapped arena.
pub struct Arena {
    map: Mapping,
    me: usize,
    ranks: usize,
    slot_bytes: usize,
    data_off: usize,
    /// Offset of the point-to-point channels.
    chan_off: usize,
    /// Global rank of each local index, for messages.
    global: Vec<usize>,
    policy: SpinPolicy,
}

// SAFETY: the mapping is plain shared memory; every cross-rank access goes through atomics or
// through the publish/wait protocol of `collectives::arena`, so the handle can move between
// threads (the engine's worker and the caller).
unsafe impl Send for Arena {}
// SAFETY: `&self` methods touch shared state only through atomics (counters, abort word, pid)
// or through slots whose exclusive use the phase protocol guarantees; `abort` may be called
// from another thread while an op runs, and only uses atomics and a CAS-guarded message.
unsafe impl Sync for Arena {}

impl Arena {
    /// Maps the arena at `path` as local index `me`; `global[i]` is local index i's global rank.
    /// Waits spin for `spin` before they sleep while every local rank has a core (see
    /// [`SpinPolicy::for_ranks`]).
    pub fn open(path: &str, me: usize, global: Vec<usize>, spin: Duration) -> Result<Self> {
        let ranks = global.len();
        let opening = format!(
            "opening shared-memory arena {path} (was it created by this job's local leader?)"
        );
        let map = map_existing(path, &opening, |size| {
            if size >= PAGE {
                Ok(size)
            } else {
                Err(Error::protocol(format!(
                    "shared-memory arena {path} is truncated ({size} bytes)"
                )))
            }
        })?;
        let size = map.len;
        // SAFETY: the mapping holds at least one page, which holds the header.
        let h = unsafe { &*(map.base as *const Header) };
        if h.magic != MAGIC || h.version != VERSION {
            return Err(Error::protocol(format!(
                "{path} is not a shardline arena of version {VERSION}"
            )));
        }
        let slot_bytes = h.slot_bytes as usize;
        let (data_off, chan_off, total) = layout(h.ranks as usize, slot_bytes);
        if h.ranks as usize != ranks || me >= ranks || total != size || slot_bytes % PAGE != 0 {
            return Err(Error::protocol(format!(
                "shared-memory arena {path} was made for {} ranks ({size} bytes) but this group has {ranks} local ranks",
                h.ranks
            )));
        }
        let arena = Arena {
            map,
            me,
            ranks,
            slot_bytes,
            data_off,
            chan_off,
            global,
            policy: SpinPolicy::for_ranks(ranks, spin),
        };
        let c = arena.ctrl(me);
        c.pid.store(std::process::id(), Ordering::SeqCst);
        c.departed.store(0, Ordering::SeqCst);
        Ok(arena)
    }

    /// How this rank's waits spin before they sleep.
    pub fn spin_policy(&self) -> SpinPolicy {
        self.policy
    }

    /// Number of ranks sharing the arena.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// This rank's local index.
    pub fn me(&self) -> usize {
        self.me
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Global rank of local index `i`.
    pub fn global(&self, i: usize) -> usize {
        self.global[i]
    }

    fn header(&self) -> &Header {
        // SAFETY: checked at open: the mapping starts with a valid header page.
        unsafe { &*(self.map.base as *const Header) }
    }

    fn ctrl(&self, r: usize) -> &Ctrl {
        assert!(r < self.ranks);
        // SAFETY: control lines lie inside the mapping (layout checked at open), 256-aligned.
        unsafe { &*(self.map.base.add(PAGE + r * CTRL_BYTES) as *const Ctrl) }
    }

    fn slot_ptr(&self, r: usize, parity: usize) -> *mut u8 {
        assert!(r < self.ranks && parity < 2);
        // SAFETY: slot (r, parity) lies inside the mapping by the layout checked at open.
        unsafe {
            self.map
                .base
                .add(self.data_off + (r * 2 + parity) * self.slot_bytes)
        }
    }

    /// Rank `r`'s slot `parity`, to read after a completed wait on its publication.
    pub fn slot(&self, r: usize, parity: usize) -> &[u8] {
        // SAFETY: in bounds (slot_ptr). The protocol guarantees rank r does not write this slot
        // until every rank has posted the next phase, which this rank does only after it has
        // stopped reading; so no write overlaps the lifetime of this shared borrow in practice.
        unsafe { std::slice::from_raw_parts(self.slot_ptr(r, parity), self.slot_bytes) }
    }

    /// This rank's own slot `parity`, to fill before posting.
    #[allow(clippy::mut_from_ref)]
    pub fn my_slot(&self, parity: usize) -> &mut [u8] {
        // SAFETY: in bounds; only this rank writes its own slots, and only while no peer reads
        // them (peers finished reading before they posted the phase this rank waited for).
        unsafe { std::slice::from_raw_parts_mut(self.slot_ptr(self.me, parity), self.slot_bytes) }
    }

    /// Writes this rank's op signature and extra word for the phase of `parity`, to publish
    /// with the next post.
    pub fn set_sig(&self, parity: usize, sig: &OpSig, extra: u64) {
        let enc = sig.encode();
        let c = self.ctrl(self.me);
        // SAFETY: only this rank writes its own control line; readers read it only after
        // acquiring the post that follows this write.
        unsafe {
            std::ptr::copy_nonoverlapping(
                enc.as_ptr(),
                c.sig[parity].as_ptr() as *mut u8,
                SIG_BYTES,
            )
        };
        c.extra[parity].store(extra, Ordering::Relaxed);
    }

    /// The signature and extra word rank `r` published for the phase of `parity`.
    pub fn sig_of(&self, r: usize, parity: usize) -> Result<(OpSig, u64)> {
        let c = self.ctrl(r);
        let mut buf = [0u8; SIG_BYTES];
        // SAFETY: reading the peer's signature after acquiring its post (see set_sig).
        unsafe {
            std::ptr::copy_nonoverlapping(c.sig[parity].as_ptr(), buf.as_mut_ptr(), SIG_BYTES)
        };
        Ok((
            OpSig::decode(&buf)?,
            c.extra[parity].load(Ordering::Relaxed),
        ))
    }

    /// Publishes phase `value` of this rank.
    pub fn post(&self, value: u32) {
        self.ctrl(self.me).signal.post(value);
    }

    /// The error some rank aborted the arena with, if any.
    pub fn aborted(&self) -> Option<Error> {
        let h = self.header();
        let kind = h.abort_kind.load(Ordering::Acquire);
        if kind == 0 {
            return None;
        }
        let len = (h.abort_len.load(Ordering::Acquire) as usize).min(ABORT_MSG_BYTES);
        let msg = String::from_utf8_lossy(&h.abort_msg[..len]).into_owned();
        Some(Error::new(ErrorKind::from_tag(kind as u8), msg))
    }

    /// Fails the arena for every rank with `err` (first abort wins) and wakes all sleepers.
    pub fn abort(&self, err: &Error) {
        let h = self.header();
        if h.abort_rank
            .compare_exchange(0, self.me as u32 + 1, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            let bytes = err.message.as_bytes();
            let len = bytes.len().min(ABORT_MSG_BYTES);
            // SAFETY: the CAS above makes this rank the only writer of the message, and readers
            // read it only after seeing abort_kind set below.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), h.abort_msg.as_ptr() as *mut u8, len)
            };
            h.abort_len.store(len as u32, Ordering::SeqCst);
            h.abort_kind.store(err.kind as u32, Ordering::SeqCst);
        }
        for r in 0..self.ranks {
            self.ctrl(r).signal.wake();
        }
    }

    /// Waits until every other rank posted `target`; `what` names the op for messages.
    /// `meanwhile` runs at each of the wait's checks (it returns whether it has work in
    /// progress, to be called again soon); an error from it fails the wait.
    pub fn wait_all(
        &self,
        target: u32,
        deadline: Instant,
        what: &dyn std::fmt::Display,
        meanwhile: Option<&Meanwhile>,
    ) -> Result<()> {
        for r in 0..self.ranks {
            if r == self.me {
                continue;
            }
            let c = self.ctrl(r);
            let res = wait::wait_until(&c.signal, target, deadline, self.policy, || {
                self.check_peer(r, target, what)?;
                meanwhile.map_or(Ok(false), |m| m())
            });
            match res {
                Ok(()) => {}
                Err(Stop::Check(e)) => return Err(e),
                Err(Stop::Deadline) => {
                    let missing: Vec<String> = (0..self.ranks)
                        .filter(|&q| {
                            q != self.me
                                && !wait::reached(
                                    self.ctrl(q).signal.value.load(Ordering::Acquire),
                                    target,
                                )
                        })
                        .map(|q| self.global[q].to_string())
                        .collect();
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "rank {} timed out in {what} waiting for {} {}, which did not reach this \
                             collective; check that every rank calls the same collectives, \
                             or, if a rank is legitimately slow, {LONGER_TIMEOUT}",
                            self.global[self.me],
                            if missing.len() == 1 { "rank" } else { "ranks" },
                            missing.join(", ")
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    fn check_peer(&self, r: usize, target: u32, what: &dyn std::fmt::Display) -> Result<()> {
        if let Some(e) = self.aborted() {
            return Err(e);
        }
        crate::interrupt::poll(self.global[self.me], what)?;
        let c = self.ctrl(r);
        let gone =
            c.departed.load(Ordering::Acquire) != 0 || !pid_alive(c.pid.load(Ordering::Acquire));
        if gone && !wait::reached(c.signal.value.load(Ordering::Acquire), target) {
            return Err(Error::new(
                ErrorKind::PeerLost,
                format!(
                    "rank {} lost rank {} (pid {}) during {what}: the process exited or closed its \
                     communicator; check that rank's log for the root cause",
                    self.global[self.me],
                    self.global[r],
                    c.pid.load(Ordering::Acquire)
                ),
            ));
        }
        Ok(())
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        let c = self.ctrl(self.me);
        c.departed.store(1, Ordering::SeqCst);
        for r in 0..self.ranks {
            self.ctrl(r).signal.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zombies_and_missing_processes_are_dead() {
        assert!(pid_alive(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Wait until it exits but do not reap it: a zombie.
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        while pid_alive(pid) && Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!pid_alive(pid), "zombie reported alive");
        child.wait().unwrap();
        assert!(!pid_alive(pid));
    }
}
