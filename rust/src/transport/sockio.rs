//! Deadline-bound I/O on non-blocking sockets: poll(2), then read or write what is ready.

use std::io::{self, IoSlice, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::time::Instant;

/// Largest piece written per call, so poll can interleave a big send with reads.
pub(crate) const WRITE_PIECE: usize = 512 * 1024;

/// Why a socket operation stopped.
#[derive(Debug)]
pub(crate) enum Fail {
    /// End of stream, reset or broken pipe: the peer is gone.
    Closed(String),
    /// The deadline passed first.
    Timeout,
    /// The kernel gave up on the peer: no acknowledgement within the keep-alive bound
    /// (`ETIMEDOUT`), or its host became unreachable. The peer's host is down or the network
    /// to it is cut.
    Unanswered(String),
    /// Any other operating-system error.
    Os(io::Error),
    /// A signal handler of the caller raised while it waited ([`crate::interrupt`]).
    Interrupted,
}

/// Result of socket helpers.
pub(crate) type IoRes<T> = std::result::Result<T, Fail>;

/// Classifies an I/O error; `None` means "not ready, poll and retry".
pub(crate) fn classify(e: io::Error) -> Option<Fail> {
    use io::ErrorKind as K;
    match e.kind() {
        K::WouldBlock | K::Interrupted => None,
        K::ConnectionReset | K::BrokenPipe | K::ConnectionAborted | K::UnexpectedEof => {
            Some(Fail::Closed(e.to_string()))
        }
        _ if matches!(
            e.raw_os_error(),
            Some(libc::ETIMEDOUT | libc::EHOSTUNREACH | libc::ENETUNREACH | libc::EHOSTDOWN)
        ) =>
        {
            Some(Fail::Unanswered(e.to_string()))
        }
        _ => Some(Fail::Os(e)),
    }
}

/// Waits until one of `fds` is ready for its events or the deadline passes; on a thread that
/// runs its caller's signal handlers ([`crate::interrupt`]), in slices between which they run.
pub(crate) fn poll_until(fds: &mut [libc::pollfd], deadline: Instant) -> IoRes<()> {
    loop {
        if crate::interrupt::raised() {
            return Err(Fail::Interrupted);
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(Fail::Timeout);
        }
        let mut wait = deadline - now;
        if crate::interrupt::polling() {
            wait = wait.min(crate::interrupt::EVERY);
        }
        let ms = wait.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int;
        // SAFETY: `fds` is a valid, exclusively borrowed slice of pollfd for the whole call and
        // its length is passed alongside it.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if rc > 0 {
            return Ok(());
        }
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(Fail::Os(e));
            }
        }
    }
}

/// A pollfd for `fd` waiting for `events`.
pub(crate) fn pollfd(fd: RawFd, events: libc::c_short) -> libc::pollfd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}

/// Waits until `fd` is ready for `events` or the deadline passes.
pub(crate) fn wait_fd(fd: RawFd, events: libc::c_short, deadline: Instant) -> IoRes<()> {
    poll_until(&mut [pollfd(fd, events)], deadline)
}

/// One non-blocking read into `buf`; `Ok(0)` when nothing is ready, `Closed` at end of stream.
pub(crate) fn read_some<S: Read>(mut s: S, buf: &mut [u8]) -> IoRes<usize> {
    if buf.is_empty() {
        return Ok(0);
    }
    match s.read(buf) {
        Ok(0) => Err(Fail::Closed("end of stream".into())),
        Ok(n) => Ok(n),
        // Interrupted and WouldBlock are both "not ready": the caller polls and retries.
        Err(e) => match classify(e) {
            None => Ok(0),
            Some(f) => Err(f),
        },
    }
}

/// One non-blocking vectored write of `head` then `body`; `Ok(0)` when the socket is full.
pub(crate) fn write_some<S: Write>(mut s: S, head: &[u8], body: &[u8]) -> IoRes<usize> {
    let body = &body[..body.len().min(WRITE_PIECE)];
    if head.is_empty() && body.is_empty() {
        return Ok(0);
    }
    match s.write_vectored(&[IoSlice::new(head), IoSlice::new(body)]) {
        Ok(0) => Err(Fail::Closed("write returned 0".into())),
        Ok(n) => Ok(n),
        Err(e) => match classify(e) {
            None => Ok(0),
            Some(f) => Err(f),
        },
    }
}

/// Reads exactly `buf.len()` bytes before `deadline`.
pub(crate) fn read_full<S: Read + AsRawFd>(
    s: &mut S,
    buf: &mut [u8],
    deadline: Instant,
) -> IoRes<()> {
    let mut got = 0;
    while got < buf.len() {
        let n = read_some(&mut *s, &mut buf[got..])?;
        if n == 0 {
            wait_fd(s.as_raw_fd(), libc::POLLIN, deadline)?;
        }
        got += n;
    }
    Ok(())
}

/// Writes all of `head` then `body` before `deadline`.
pub(crate) fn write_full<S: Write + AsRawFd>(
    s: &mut S,
    head: &[u8],
    body: &[u8],
    deadline: Instant,
) -> IoRes<()> {
    let total = head.len() + body.len();
    let mut sent = 0;
    while sent < total {
        let (h, b) = if sent < head.len() {
            (&head[sent..], body)
        } else {
            (&[][..], &body[sent - head.len()..])
        };
        let n = write_some(&mut *s, h, b)?;
        if n == 0 {
            wait_fd(s.as_raw_fd(), libc::POLLOUT, deadline)?;
        }
        sent += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_the_kernel_gave_up_on_is_unanswered_not_closed() {
        for errno in [libc::ETIMEDOUT, libc::EHOSTUNREACH, libc::ENETUNREACH] {
            let f = classify(io::Error::from_raw_os_error(errno));
            assert!(matches!(f, Some(Fail::Unanswered(_))), "{errno}: {f:?}");
        }
        let reset = classify(io::Error::from_raw_os_error(libc::ECONNRESET));
        assert!(matches!(reset, Some(Fail::Closed(_))), "{reset:?}");
        assert!(classify(io::Error::from_raw_os_error(libc::EAGAIN)).is_none());
    }
}
