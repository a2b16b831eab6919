//! Symmetric memory: a file per rank in `/dev/shm`, each mapped by every rank of the host.
//!
//! A rank's tensor that lives in its own segment can be read and written by the other ranks
//! of its host directly, so a collective on it needs no copy through the arena's slots
//! ([`crate::collectives::arena::symmetric`]). The files are named like arenas
//! (`shardline-<creator pid>-…`, so [`super::sweep`] removes those of dead creators), are
//! created `O_EXCL` with mode 0600 and are unlinked by their creator once every rank mapped
//! them: nothing is left in `/dev/shm` after any kind of exit.

use super::{cpath, create_exclusive, map_existing, Mapping};
use crate::error::{Error, Result};

/// One rank's file of symmetric memory, mapped read-write.
pub struct Segment {
    map: Mapping,
}

// SAFETY: the mapping is plain shared memory that outlives every reference handed out; which
// rank writes which bytes when is the business of the collectives that use it, which run one
// op at a time per communicator and order ranks through the arena's phases.
unsafe impl Send for Segment {}
// SAFETY: as for Send: `&Segment` only yields the base pointer and the length.
unsafe impl Sync for Segment {}

/// Creates the file `path` of `len` bytes (zero-filled, every page allocated) for this rank's
/// segment.
pub fn create(path: &str, len: usize) -> Result<()> {
    if len == 0 {
        return Err(Error::invalid(
            "symmetric memory needs at least one byte".to_string(),
        ));
    }
    let c = cpath(path)?;
    let fd = create_exclusive(&c, "symmetric memory", path)?;
    // Every page is allocated now: a /dev/shm too small for it fails here, with this message,
    // instead of killing the process with SIGBUS when a collective first touches the page.
    // SAFETY: `fd` is the descriptor just opened.
    let rc = unsafe { libc::posix_fallocate(fd, 0, len as libc::off_t) };
    // SAFETY: closing what we opened.
    unsafe { libc::close(fd) };
    if rc != 0 {
        let _ = super::unlink(path);
        return Err(Error::io(
            format!(
                "allocating {len} bytes of symmetric memory in {path}: /dev/shm has too little \
                 room (in a container, raise it: docker run --shm-size=...)"
            ),
            std::io::Error::from_raw_os_error(rc),
        ));
    }
    Ok(())
}

impl Segment {
    /// Maps the segment file `path`, which must hold exactly `len` bytes.
    pub fn open(path: &str, len: usize) -> Result<Self> {
        let opening =
            format!("opening symmetric memory {path} (did its rank create it on this host?)");
        let map = map_existing(path, &opening, |size| {
            if size == len {
                Ok(len)
            } else {
                Err(Error::protocol(format!(
                    "symmetric memory {path} holds {size} bytes where every rank asked for \
                     {len}: every rank must allocate the same size"
                )))
            }
        })?;
        Ok(Segment { map })
    }

    /// Start of the mapping.
    pub fn ptr(&self) -> *mut u8 {
        self.map.base
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.map.len
    }

    /// Whether the segment is empty (never: [`create`] refuses zero bytes).
    pub fn is_empty(&self) -> bool {
        self.map.len == 0
    }

    /// The offset of `ptr..ptr + len` in this segment, if it lies wholly inside.
    pub fn offset_of(&self, ptr: *const u8, len: usize) -> Option<usize> {
        let (base, addr) = (self.map.base as usize, ptr as usize);
        let off = addr.checked_sub(base)?;
        (off.checked_add(len)? <= self.map.len).then_some(off)
    }
}
