//! Single-copy reads of a peer's memory: `process_vm_readv` ("cross-memory attach").
//!
//! The kernel copies straight from the peer's pages into ours, so a large collective moves
//! each byte once instead of into the arena and out again. Linux allows it between processes
//! of one user that may ptrace each other; where that is refused (Yama's `ptrace_scope` 2-3,
//! a seccomp filter, different pid namespaces) the arena's two-copy path is used instead,
//! decided once per communicator by every rank together.

use std::io;

/// Copies `dst.len()` bytes at address `remote` of process `pid` into `dst`.
pub fn read(pid: u32, remote: u64, dst: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < dst.len() {
        let rest = dst.len() - done;
        let local = libc::iovec {
            iov_base: dst[done..].as_mut_ptr().cast(),
            iov_len: rest,
        };
        let far = libc::iovec {
            iov_base: (remote as usize + done) as *mut libc::c_void,
            iov_len: rest,
        };
        // SAFETY: `local` describes `rest` writable bytes of `dst`, which we borrow mutably for
        // the call; the remote range is only read, by the kernel, which checks it against the
        // peer's mappings (a bad address is EFAULT, not undefined behaviour here).
        let got = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &far, 1, 0) };
        if got < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if got == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("the range ends {done} bytes into a {}-byte read", dst.len()),
            ));
        }
        done += got as usize;
    }
    Ok(())
}

/// Under Yama's `ptrace_scope` 1 only ancestors may read a process; this names our parent
/// (the launcher, and so every sibling rank below it) as allowed. Other settings are left
/// alone: scope 0 needs nothing, scopes 2-3 cannot be relaxed by us.
pub fn allow_siblings() {
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope");
    if scope.map(|s| s.trim() == "1").unwrap_or(false) {
        // SAFETY: plain prctl with integer arguments; it only changes who may ptrace us.
        unsafe {
            libc::prctl(
                libc::PR_SET_PTRACER,
                libc::getppid() as libc::c_ulong,
                0,
                0,
                0,
            )
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_memory_and_refuses_bad_addresses() {
        let src: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        read(std::process::id(), src.as_ptr() as u64, &mut dst).unwrap();
        assert_eq!(src, dst);
        let err = read(std::process::id(), 8, &mut dst[..16]).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EFAULT));
    }
}
