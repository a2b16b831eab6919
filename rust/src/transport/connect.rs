//! Setting up a TCP mesh: listening, dialling with retries, accepting and authenticating.

use std::fmt;
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use socket2::{SockRef, TcpKeepalive};

use super::auth::{self, SECRET_HINT};
use super::sockio;
use crate::error::{Error, ErrorKind, Result};

/// Socket buffer size asked for (when the kernel allows it; otherwise autotuning stays on).
pub const SOCKET_BUFFER_BYTES: usize = 4 << 20;
/// Most incoming handshakes in flight at once; more connections are closed unread.
const MAX_PENDING_HANDSHAKES: usize = 64;
/// Longest a single incoming handshake may take, within the overall deadline.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How often a setup in progress asks [`LinkOptions::cancel`] whether to give up.
const CANCEL_EVERY: Duration = Duration::from_millis(200);

/// Asked while the mesh is being set up: `Some(error)` stops the setup with that error. The
/// bindings look in the job's store for a rank that failed while joining, so no rank waits
/// out its deadline for a peer that is gone already.
#[derive(Clone)]
pub struct Cancel(pub Arc<dyn Fn() -> Option<Error> + Send + Sync>);

impl fmt::Debug for Cancel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Cancel(..)")
    }
}

/// How the mesh's connections are set up and kept.
#[derive(Clone, Debug, Default)]
pub struct LinkOptions {
    /// A peer whose host stops acknowledging for about this long is lost, whatever the op's
    /// deadline (`SHARDLINE_KEEPALIVE`): TCP keep-alive probes on idle connections and
    /// `TCP_USER_TIMEOUT` on connections with data in flight. Zero keeps the kernel's
    /// defaults (hours). A slow but live peer is not lost: its kernel answers the probes.
    pub keepalive: Duration,
    /// Asked every `CANCEL_EVERY` while linking; see [`Cancel`].
    pub cancel: Option<Cancel>,
}

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

pub(super) fn configure(stream: &TcpStream, keepalive: Duration) -> Result<()> {
    stream
        .set_nodelay(true)
        .map_err(|e| Error::io("TCP_NODELAY", e))?;
    stream
        .set_nonblocking(true)
        .map_err(|e| Error::io("set_nonblocking", e))?;
    set_buffers(stream.as_raw_fd());
    set_keepalive(stream, keepalive)
}

/// Makes the kernel give up on a peer that stops acknowledging for about `bound`: the first
/// probe after `bound / 3` idle, then one every `bound / 6`, and `TCP_USER_TIMEOUT = bound`,
/// which also caps how long sent data may stay unacknowledged. The socket then fails with
/// `ETIMEDOUT`, which the mesh reports as a lost peer. Zero leaves the kernel's defaults.
pub(crate) fn set_keepalive(stream: &TcpStream, bound: Duration) -> Result<()> {
    if bound.is_zero() {
        return Ok(());
    }
    let second = Duration::from_secs(1);
    let params = TcpKeepalive::new()
        .with_time((bound / 3).max(second))
        .with_interval((bound / 6).max(second))
        .with_retries(3);
    let sock = SockRef::from(stream);
    sock.set_tcp_keepalive(&params)
        .map_err(|e| Error::io("TCP keep-alive", e))?;
    sock.set_tcp_user_timeout(Some(bound))
        .map_err(|e| Error::io("TCP_USER_TIMEOUT", e))
}

/// The connection whose handshake is in progress, so that a stop can shut it (a handshake
/// with a peer that accepted but never answers would otherwise wait for its deadline).
type InFlight = Mutex<Option<TcpStream>>;

/// Sets `stop` and shuts the connection in `in_flight`, if any: the dialer returns at once.
fn halt(stop: &AtomicBool, in_flight: &InFlight) {
    stop.store(true, Ordering::Relaxed);
    if let Some(s) = in_flight.lock().unwrap_or_else(|p| p.into_inner()).take() {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
}

/// Connects to `addr` until it answers and authenticates as `peer`, or the deadline passes;
/// `None` when `stop` was set (another part of the setup failed and reports why).
#[allow(clippy::too_many_arguments)]
fn dial(
    me: usize,
    peer: usize,
    addr: &str,
    secret: &[u8],
    group: u64,
    deadline: Instant,
    keepalive: Duration,
    stop: &AtomicBool,
    in_flight: &InFlight,
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
                configure(&stream, keepalive)?;
                let mut s = stream;
                *in_flight.lock().unwrap_or_else(|p| p.into_inner()) = s.try_clone().ok();
                if stop.load(Ordering::Relaxed) {
                    return Ok(None); // stopped while connecting, before the clone was there
                }
                let shaken = auth::connect_handshake(&mut s, secret, group, me, peer, deadline);
                in_flight.lock().unwrap_or_else(|p| p.into_inner()).take();
                if stop.load(Ordering::Relaxed) {
                    return Ok(None);
                }
                match shaken {
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
    keepalive: Duration,
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
            if pending >= MAX_PENDING_HANDSHAKES || configure(&stream, keepalive).is_err() {
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
/// the authenticated streams by rank. A third thread asks `opts.cancel` every
/// [`CANCEL_EVERY`]; its error, if any, ends the setup and wins over the others.
#[allow(clippy::too_many_arguments)]
pub(super) fn link_all(
    rank: usize,
    addrs: &[String],
    peers: &[usize],
    listener: &TcpListenerHandle,
    secret: &[u8],
    tag: u64,
    deadline: Instant,
    opts: &LinkOptions,
) -> Result<Vec<(usize, TcpStream)>> {
    let lower: Vec<usize> = peers.iter().copied().filter(|&p| p < rank).collect();
    let higher: Vec<usize> = peers.iter().copied().filter(|&p| p > rank).collect();
    let stop = AtomicBool::new(false);
    let in_flight: InFlight = Mutex::new(None);
    let done = AtomicBool::new(false);
    let cancelled: Mutex<Option<Error>> = Mutex::new(None);
    let keepalive = opts.keepalive;
    let (dialed, accepted) = std::thread::scope(|sc| {
        if let Some(cancel) = &opts.cancel {
            sc.spawn(|| {
                let mut next = Instant::now() + CANCEL_EVERY;
                while !done.load(Ordering::Relaxed) && !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(10));
                    if Instant::now() < next {
                        continue;
                    }
                    next = Instant::now() + CANCEL_EVERY;
                    if let Some(e) = (cancel.0)() {
                        *cancelled.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                        halt(&stop, &in_flight);
                    }
                }
            });
        }
        let dialer = sc.spawn(|| {
            let mut out = Vec::new();
            for &p in &higher {
                let d = dial(
                    rank, p, &addrs[p], secret, tag, deadline, keepalive, &stop, &in_flight,
                );
                match d {
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
        let accepted = accept_all(
            rank, listener, &lower, addrs, secret, tag, deadline, keepalive, &stop,
        );
        if accepted.is_err() {
            halt(&stop, &in_flight);
        }
        let dialed = dialer.join().expect("dialer thread panicked");
        done.store(true, Ordering::Relaxed);
        (dialed, accepted)
    });
    if let Some(e) = cancelled.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    let mut all = dialed?;
    all.extend(accepted?);
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    #[test]
    fn keepalive_bound_sets_probes_and_user_timeout() {
        let (a, _b) = pair();
        set_keepalive(&a, Duration::from_secs(6)).unwrap();
        let s = SockRef::from(&a);
        assert!(s.keepalive().unwrap());
        assert_eq!(s.tcp_keepalive_time().unwrap(), Duration::from_secs(2));
        assert_eq!(s.tcp_keepalive_interval().unwrap(), Duration::from_secs(1));
        assert_eq!(s.tcp_keepalive_retries().unwrap(), 3);
        assert_eq!(s.tcp_user_timeout().unwrap(), Some(Duration::from_secs(6)));
    }

    #[test]
    fn zero_keepalive_keeps_the_kernel_defaults() {
        let (a, _b) = pair();
        set_keepalive(&a, Duration::ZERO).unwrap();
        let s = SockRef::from(&a);
        assert!(!s.keepalive().unwrap());
        assert_eq!(s.tcp_user_timeout().unwrap(), None);
    }
}
