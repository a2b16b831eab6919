//! Setting up a TCP mesh: listening, dialling with retries, accepting and authenticating.

use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::auth::{self, SECRET_HINT};
use super::sockio;
use crate::error::{Error, ErrorKind, Result};

/// Socket buffer size asked for (when the kernel allows it; otherwise autotuning stays on).
pub const SOCKET_BUFFER_BYTES: usize = 4 << 20;
/// Most incoming handshakes in flight at once; more connections are closed unread.
const MAX_PENDING_HANDSHAKES: usize = 64;
/// Longest a single incoming handshake may take, within the overall deadline.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A listening socket bound to port 0 of a host; its address is published to the other ranks.
pub struct TcpListenerHandle {
    listener: TcpListener,
    address: String,
}

impl TcpListenerHandle {
    /// Binds `host` (an IP address or name; single-host jobs pass `"127.0.0.1"`) on a free port.
    pub fn bind(host: &str) -> Result<Self> {
        let listener = TcpListener::bind((host, 0))
            .map_err(|e| Error::io(format!("cannot listen on {host} (port 0)"), e))?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::io("listener address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("listener set_nonblocking", e))?;
        set_buffers(listener.as_raw_fd());
        Ok(TcpListenerHandle {
            listener,
            address: local.to_string(),
        })
    }

    /// The `"ip:port"` other ranks connect to.
    pub fn address(&self) -> String {
        self.address.clone()
    }
}

fn kernel_max(path: &str) -> usize {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Asks for large socket buffers where the kernel allows them (asking for more than
/// `{r,w}mem_max` would cap them below what autotuning reaches).
fn set_buffers(fd: RawFd) {
    let size = SOCKET_BUFFER_BYTES as libc::c_int;
    for (opt, max) in [
        (libc::SO_SNDBUF, "/proc/sys/net/core/wmem_max"),
        (libc::SO_RCVBUF, "/proc/sys/net/core/rmem_max"),
    ] {
        if kernel_max(max) >= SOCKET_BUFFER_BYTES {
            // SAFETY: `fd` is an open socket owned by the caller; the option value points to a
            // live c_int whose size is passed with it.
            unsafe {
                libc::setsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    opt,
                    (&size as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                );
            }
        }
    }
}

pub(super) fn configure(stream: &TcpStream) -> Result<()> {
    stream
        .set_nodelay(true)
        .map_err(|e| Error::io("TCP_NODELAY", e))?;
    stream
        .set_nonblocking(true)
        .map_err(|e| Error::io("set_nonblocking", e))?;
    set_buffers(stream.as_raw_fd());
    Ok(())
}

/// Connects to `addr` until it answers and authenticates as `peer`, or the deadline passes;
/// `None` when `stop` was set (another part of the setup failed and reports why).
fn dial(
    me: usize,
    peer: usize,
    addr: &str,
    secret: &[u8],
    group: u64,
    deadline: Instant,
    stop: &AtomicBool,
) -> Result<Option<TcpStream>> {
    use std::net::ToSocketAddrs;
    let mut backoff = Duration::from_millis(5);
    let mut last = String::from("no attempt");
    loop {
        if stop.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        let attempt = addr
            .to_socket_addrs()
            .map_err(|e| e.to_string())
            .and_then(|mut it| {
                let sa = it
                    .next()
                    .ok_or_else(|| format!("{addr} resolves to nothing"))?;
                TcpStream::connect_timeout(&sa, (deadline - now).min(Duration::from_secs(2)))
                    .map_err(|e| e.to_string())
            });
        match attempt {
            Ok(stream) => {
                configure(&stream)?;
                let mut s = stream;
                match auth::connect_handshake(&mut s, secret, group, me, peer, deadline) {
                    Ok(()) => return Ok(Some(s)),
                    Err(e) if matches!(e.kind, ErrorKind::PeerLost | ErrorKind::Io) => {
                        last = e.message
                    }
                    Err(e) => {
                        return Err(
                            e.context(format!("rank {me} connecting to rank {peer} ({addr})"))
                        )
                    }
                }
            }
            Err(e) => last = e,
        }
        std::thread::sleep(backoff.min(deadline.saturating_duration_since(Instant::now())));
        backoff = (backoff * 2).min(Duration::from_millis(200));
    }
    Err(Error::new(
        ErrorKind::Timeout,
        format!(
            "rank {me} could not connect to rank {peer} at {addr} before the deadline (last error: \
             {last}); check that rank {peer} started and that the address is reachable from here"
        ),
    ))
}

type Accepted = (TcpStream, Result<usize>);

/// Accepts and authenticates connections until every rank in `expected` linked, the deadline
/// passes or `stop` is set. Connections that fail the handshake are dropped; the job goes on.
#[allow(clippy::too_many_arguments)]
fn accept_all(
    me: usize,
    listener: &TcpListenerHandle,
    expected: &[usize],
    addrs: &[String],
    secret: &[u8],
    group: u64,
    deadline: Instant,
    stop: &AtomicBool,
) -> Result<Vec<(usize, TcpStream)>> {
    let mut linked: Vec<(usize, TcpStream)> = Vec::new();
    let (tx, rx) = mpsc::channel::<Accepted>();
    let secret: Arc<[u8]> = secret.into();
    let expected_owned: Arc<[usize]> = expected.into();
    let mut rejected: Vec<String> = Vec::new();
    let mut pending = 0usize;
    while linked.len() < expected.len() && !stop.load(Ordering::Relaxed) {
        while let Ok((stream, res)) = rx.try_recv() {
            pending -= 1;
            match res {
                Ok(p) if !linked.iter().any(|(q, _)| *q == p) => linked.push((p, stream)),
                Ok(p) => rejected.push(format!("a second connection from rank {p}")),
                Err(e) => rejected.push(e.message),
            }
        }
        if linked.len() == expected.len() || Instant::now() >= deadline {
            break;
        }
        let tick = (Instant::now() + Duration::from_millis(20)).min(deadline);
        let _ = sockio::wait_fd(listener.listener.as_raw_fd(), libc::POLLIN, tick);
        while let Ok((stream, _)) = listener.listener.accept() {
            // A flood of connections gets dropped, not a thread each.
            if pending >= MAX_PENDING_HANDSHAKES || configure(&stream).is_err() {
                continue;
            }
            pending += 1;
            let (tx, secret, exp) = (tx.clone(), secret.clone(), expected_owned.clone());
            let hs_deadline = deadline.min(Instant::now() + HANDSHAKE_TIMEOUT);
            std::thread::spawn(move || {
                let mut s = stream;
                let r = auth::accept_handshake(&mut s, &secret, group, me, &exp, hs_deadline);
                let _ = tx.send((s, r));
            });
        }
    }
    if linked.len() == expected.len() || stop.load(Ordering::Relaxed) {
        return Ok(linked);
    }
    let missing: Vec<String> = expected
        .iter()
        .filter(|p| !linked.iter().any(|(q, _)| q == *p))
        .map(|&p| format!("rank {p} ({})", addrs[p]))
        .collect();
    let auth_failed = rejected.iter().any(|m| m.contains("HMAC"));
    let mut msg = format!(
        "rank {me} timed out waiting for connections from {}; they may not have started, may \
         have crashed, or cannot reach {}",
        missing.join(", "),
        listener.address
    );
    if !rejected.is_empty() {
        msg += &format!(
            "; rejected {} connection(s): {}",
            rejected.len(),
            rejected.join(" | ")
        );
    }
    if auth_failed {
        msg += &format!(". {SECRET_HINT}");
    }
    Err(Error::new(
        if auth_failed {
            ErrorKind::Auth
        } else {
            ErrorKind::Timeout
        },
        msg,
    ))
}

/// Connects to every higher rank in `peers` and accepts every lower one, concurrently; returns
/// the authenticated streams by rank.
pub(super) fn link_all(
    rank: usize,
    addrs: &[String],
    peers: &[usize],
    listener: &TcpListenerHandle,
    secret: &[u8],
    tag: u64,
    deadline: Instant,
) -> Result<Vec<(usize, TcpStream)>> {
    let lower: Vec<usize> = peers.iter().copied().filter(|&p| p < rank).collect();
    let higher: Vec<usize> = peers.iter().copied().filter(|&p| p > rank).collect();
    let stop = AtomicBool::new(false);
    let (dialed, accepted) = std::thread::scope(|sc| {
        let dialer = sc.spawn(|| {
            let mut out = Vec::new();
            for &p in &higher {
                match dial(rank, p, &addrs[p], secret, tag, deadline, &stop) {
                    Ok(Some(s)) => out.push((p, s)),
                    Ok(None) => break,
                    Err(e) => {
                        stop.store(true, Ordering::Relaxed);
                        return Err(e);
                    }
                }
            }
            Ok(out)
        });
        let accepted = accept_all(rank, listener, &lower, addrs, secret, tag, deadline, &stop);
        if accepted.is_err() {
            stop.store(true, Ordering::Relaxed);
        }
        (dialer.join().expect("dialer thread panicked"), accepted)
    });
    let mut all = dialed?;
    all.extend(accepted?);
    Ok(all)
}
