//! A TCP proxy on a loopback port in front of one server, for network faults
//! in dlock's tests and chaos harness: it forwards, delays, holds (a
//! partition: the sockets stay open, bytes wait and are delivered once it
//! heals) or drops traffic (bytes and the closing FIN are lost), resets every
//! connection (RST), and can hold back the next client request that carries
//! given bytes, on whichever connection it comes.
//!
//! Written here rather than taken from a crate: toxiproxy and friends are
//! separate servers driven over HTTP; this is a few hundred lines with no
//! extra process to install in CI.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does to bytes going either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forward at once.
    Pass,
    /// Forward each chunk after this long.
    Delay(Duration),
    /// Hold everything until the fault ends (a partition: nothing arrives,
    /// nothing is refused); new connections are accepted and held too.
    Hold,
    /// Drop every byte, and the FIN of a side that closes: the other side
    /// hears nothing, ever.
    Drop,
}

/// The next client request carrying every one of `needles` is held back.
struct Trap {
    armed: Option<(Vec<Vec<u8>>, Duration)>,
    sprung_on: Option<usize>,
}

struct Shared {
    fault: watch::Sender<Fault>,
    resets: watch::Sender<u64>,
    stop: watch::Sender<bool>,
    accepted: AtomicUsize,
    trap: Mutex<Trap>,
}

/// One proxy: a loopback port forwarding to one upstream address. Dropping
/// it stops it and resets every connection it relays.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards to `upstream`
    /// (`host:port`), on the current runtime.
    pub async fn start(upstream: impl Into<String>) -> std::io::Result<FaultProxy> {
        let upstream = upstream.into();
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            fault: watch::channel(Fault::Pass).0,
            resets: watch::channel(0).0,
            stop: watch::channel(false).0,
            accepted: AtomicUsize::new(0),
            trap: Mutex::new(Trap {
                armed: None,
                sprung_on: None,
            }),
        });
        let serving = shared.clone();
        let mut stop = shared.stop.subscribe();
        tokio::spawn(async move {
            loop {
                let client = tokio::select! {
                    _ = stop.changed() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((client, _)) => client,
                        Err(_) => continue,
                    },
                };
                let number = serving.accepted.fetch_add(1, Ordering::SeqCst) + 1;
                tokio::spawn(serve(client, upstream.clone(), number, serving.clone()));
            }
        });
        Ok(FaultProxy { addr, shared })
    }

    /// Listens on a free loopback port and forwards to `127.0.0.1:port`.
    pub async fn to_port(port: u16) -> std::io::Result<FaultProxy> {
        FaultProxy::start(format!("127.0.0.1:{port}")).await
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Sets what happens to traffic from now on.
    pub fn set(&self, fault: Fault) {
        self.shared.fault.send_replace(fault);
    }

    /// Resets (RST) every connection open now; new ones are relayed.
    pub fn reset_all(&self) {
        self.shared.resets.send_modify(|n| *n += 1);
    }

    /// The connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Holds back, for `hold`, the next chunk a client sends that contains
    /// every one of `needles`: the connection's later bytes queue behind it
    /// (TCP order), every other connection flows. Once held, it is sent even
    /// if its client has gone meanwhile.
    pub fn hold_next(&self, needles: &[&[u8]], hold: Duration) {
        let mut trap = self.shared.trap.lock().expect("trap");
        trap.armed = Some((needles.iter().map(|n| n.to_vec()).collect(), hold));
        trap.sprung_on = None;
    }

    /// The connection (numbered from 1 in order of acceptance) on which the
    /// last [`Self::hold_next`] held a chunk back, if it did.
    pub fn held_on(&self) -> Option<usize> {
        self.shared.trap.lock().expect("trap").sprung_on
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stop.send_replace(true);
        self.reset_all();
    }
}

async fn serve(client: TcpStream, upstream: String, number: usize, shared: Arc<Shared>) {
    // Subscribed at accept, before any await: a reset sent while this
    // connection is still being set up closes it too.
    let resets = shared.resets.subscribe();
    // A server that is down: the client sees its connection closed.
    let Ok(server) = TcpStream::connect(&upstream).await else {
        return;
    };
    if resets.has_changed().unwrap_or(true) {
        return;
    }
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::spawn(pump(
        client_read,
        server_write,
        shared.clone(),
        resets.clone(),
        Some(number),
    ));
    tokio::spawn(pump(server_read, client_write, shared, resets, None));
}

/// Whether `haystack` contains `needle`.
fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// The hold of a chunk sent by a client on connection `number`, if the trap
/// is armed for it (and then disarms it).
fn trapped(shared: &Shared, number: usize, chunk: &[u8]) -> Option<Duration> {
    let mut trap = shared.trap.lock().expect("trap");
    let (needles, hold) = trap.armed.as_ref()?;
    if !needles.iter().all(|n| contains(chunk, n)) {
        return None;
    }
    let hold = *hold;
    trap.armed = None;
    trap.sprung_on = Some(number);
    Some(hold)
}

/// Moves bytes one way until either side closes or a reset comes.
/// `client` is the connection's number on the client-to-server direction.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: Arc<Shared>,
    mut resets: watch::Receiver<u64>,
    client: Option<usize>,
) {
    let mut fault = shared.fault.subscribe();
    let mut buf = vec![0u8; 64 * 1024];
    let reset = |from: &OwnedReadHalf, to: &OwnedWriteHalf| {
        // Zero linger: dropping the sockets sends RST, not FIN.
        let _ = from.as_ref().set_zero_linger();
        let _ = to.as_ref().set_zero_linger();
    };
    loop {
        let n = tokio::select! {
            _ = resets.changed() => return reset(&from, &to),
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => {
                    // Dropped traffic loses the FIN too.
                    if *fault.borrow() != Fault::Drop {
                        let _ = to.shutdown().await;
                    }
                    return;
                }
                Ok(n) => n,
            },
        };
        loop {
            let current = *fault.borrow_and_update();
            match current {
                Fault::Pass | Fault::Drop => break,
                Fault::Delay(d) => {
                    tokio::select! {
                        _ = resets.changed() => return reset(&from, &to),
                        () = tokio::time::sleep(d) => break,
                    }
                }
                Fault::Hold => {
                    tokio::select! {
                        _ = resets.changed() => return reset(&from, &to),
                        changed = fault.changed() => if changed.is_err() { return },
                    }
                }
            }
        }
        if *fault.borrow() == Fault::Drop {
            continue;
        }
        if let Some(hold) = client.and_then(|number| trapped(&shared, number, &buf[..n])) {
            tokio::time::sleep(hold).await;
        }
        tokio::select! {
            _ = resets.changed() => return reset(&from, &to),
            written = to.write_all(&buf[..n]) => if written.is_err() { return },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn echo_server() -> u16 {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        port
    }

    async fn round_trip(s: &mut TcpStream, what: &[u8; 4]) -> std::io::Result<()> {
        s.write_all(what).await?;
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).await?;
        assert_eq!(&buf, what);
        Ok(())
    }

    #[tokio::test]
    async fn passes_delays_holds_and_resets() {
        let proxy = FaultProxy::to_port(echo_server().await).await.unwrap();
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut s, b"ping").await.unwrap();

        proxy.set(Fault::Delay(Duration::from_millis(100)));
        let t = std::time::Instant::now();
        round_trip(&mut s, b"ping").await.unwrap();
        assert!(
            t.elapsed() >= Duration::from_millis(200),
            "{:?}",
            t.elapsed()
        );

        proxy.set(Fault::Hold);
        let held =
            tokio::time::timeout(Duration::from_millis(300), round_trip(&mut s, b"ping")).await;
        assert!(held.is_err(), "bytes went through a hold");
        proxy.set(Fault::Pass);
        // The held "ping" arrives after the heal, as TCP would deliver it.
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).await.unwrap();

        proxy.reset_all();
        let mut buf = [0u8; 4];
        let after = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf))
            .await
            .unwrap();
        assert!(
            matches!(after, Err(_) | Ok(0)),
            "connection survived a reset: {after:?}"
        );
        let mut again = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut again, b"ping").await.unwrap();
    }

    #[tokio::test]
    async fn dropped_bytes_never_arrive() {
        let proxy = FaultProxy::to_port(echo_server().await).await.unwrap();
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut s, b"ping").await.unwrap();
        proxy.set(Fault::Drop);
        let lost =
            tokio::time::timeout(Duration::from_millis(300), round_trip(&mut s, b"lost")).await;
        assert!(lost.is_err(), "bytes went through a drop");
        proxy.set(Fault::Pass);
        // "lost" is gone for good: the next round trip sees only its own bytes.
        round_trip(&mut s, b"next").await.unwrap();
    }

    #[tokio::test]
    async fn holds_back_the_next_chunk_with_its_needles() {
        let proxy = FaultProxy::to_port(echo_server().await).await.unwrap();
        let mut a = TcpStream::connect(proxy.addr()).await.unwrap();
        let mut b = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut a, b"warm").await.unwrap();
        round_trip(&mut b, b"warm").await.unwrap();
        proxy.hold_next(&[b"ke", b"y!"], Duration::from_millis(400));
        let t = std::time::Instant::now();
        round_trip(&mut a, b"ke..").await.unwrap();
        assert!(
            t.elapsed() < Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
        let held = tokio::spawn(async move {
            let t = std::time::Instant::now();
            round_trip(&mut b, b"key!").await.unwrap();
            t.elapsed()
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        round_trip(&mut a, b"free").await.unwrap();
        assert!(held.await.unwrap() >= Duration::from_millis(400));
        assert_eq!(proxy.held_on(), Some(2));
        assert_eq!(proxy.accepted(), 2);
    }
}
