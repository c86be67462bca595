//! A TCP proxy on a loopback port in front of one server, for network faults
//! in dlock's tests and chaos harness: it forwards, delays, holds (a
//! partition: the sockets stay open, bytes wait and are delivered once it
//! heals) or drops traffic (bytes and the closing FIN are lost), resets every
//! connection (RST), and can hold back the next client request that carries
//! given bytes, on whichever connection it comes. Given a [`RequestFilter`]
//! that knows the protocol's framing, it also sees every request a client
//! sends, and can cut a connection just after one: the request reaches the
//! server, its answer never reaches the client.
//!
//! Written here rather than taken from a crate: toxiproxy and friends are
//! separate servers driven over HTTP; this is a few hundred lines with no
//! extra process to install in CI.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
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

/// What a [`RequestFilter`] decides for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Forward it.
    Forward,
    /// Forward it, drop everything the server sends on its connection from
    /// then on, and close the connection this long after (time for the
    /// server to take the request in): the client never learns whether the
    /// request was carried out.
    ForwardThenCut(Duration),
}

/// A look at the requests a [`FaultProxy`] relays, for a protocol whose
/// framing it knows: the proxy splits what each client sends into frames and
/// asks about each one before forwarding it.
pub trait RequestFilter: Send + Sync + 'static {
    /// The length of the frame at the start of `bytes` (its header
    /// included), or `None` while too few bytes are there to tell.
    fn frame_len(&self, bytes: &[u8]) -> Option<usize>;

    /// One whole frame sent by a client; `index` counts the frames of its
    /// connection from 0.
    fn request(&self, index: usize, frame: &[u8]) -> Verdict;
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
    filter: Option<Arc<dyn RequestFilter>>,
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
        FaultProxy::start_with(upstream.into(), None).await
    }

    /// [`FaultProxy::start`], with `filter` looking at every request.
    pub async fn start_filtered(
        upstream: impl Into<String>,
        filter: Arc<dyn RequestFilter>,
    ) -> std::io::Result<FaultProxy> {
        FaultProxy::start_with(upstream.into(), Some(filter)).await
    }

    async fn start_with(
        upstream: String,
        filter: Option<Arc<dyn RequestFilter>>,
    ) -> std::io::Result<FaultProxy> {
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
            filter,
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
    // Set once a request is forwarded whose connection is then cut.
    let cut = Arc::new(AtomicBool::new(false));
    let requests = tokio::spawn(pump(
        client_read,
        server_write,
        shared.clone(),
        resets.clone(),
        Direction::Requests(number),
        cut.clone(),
    ));
    let answers = tokio::spawn(pump(
        server_read,
        client_write,
        shared,
        resets,
        Direction::Answers,
        cut,
    ));
    if requests.await.unwrap_or(false) {
        answers.abort();
    }
}

/// Which way a [`pump`] moves bytes.
#[derive(Clone, Copy)]
enum Direction {
    /// Client to server, on the connection with this number.
    Requests(usize),
    /// Server to client.
    Answers,
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

/// The frames of one client's requests, as its bytes come.
struct Frames {
    filter: Arc<dyn RequestFilter>,
    pending: Vec<u8>,
    seen: usize,
}

impl Frames {
    /// Takes in a chunk the client sent; the cut the filter asked for on a
    /// request it completed, if any.
    fn take(&mut self, chunk: &[u8]) -> Option<Duration> {
        self.pending.extend_from_slice(chunk);
        let mut cut = None;
        while let Some(len) = self
            .filter
            .frame_len(&self.pending)
            .filter(|len| (1..=self.pending.len()).contains(len))
        {
            if let Verdict::ForwardThenCut(after) =
                self.filter.request(self.seen, &self.pending[..len])
            {
                cut = Some(after);
            }
            self.seen += 1;
            self.pending.drain(..len);
        }
        cut
    }
}

/// Moves bytes one way until either side closes or a reset comes; whether
/// it ended by cutting the connection after a request (see [`Verdict`]).
/// Once `cut` is set, nothing more reaches the client.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: Arc<Shared>,
    mut resets: watch::Receiver<u64>,
    direction: Direction,
    cut: Arc<AtomicBool>,
) -> bool {
    let mut fault = shared.fault.subscribe();
    let mut buf = vec![0u8; 64 * 1024];
    let reset = |from: &OwnedReadHalf, to: &OwnedWriteHalf| {
        // Zero linger: dropping the sockets sends RST, not FIN.
        let _ = from.as_ref().set_zero_linger();
        let _ = to.as_ref().set_zero_linger();
        false
    };
    let mut frames = match direction {
        Direction::Requests(_) => shared.filter.clone().map(|filter| Frames {
            filter,
            pending: Vec::new(),
            seen: 0,
        }),
        Direction::Answers => None,
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
                    return false;
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
                        changed = fault.changed() => if changed.is_err() { return false },
                    }
                }
            }
        }
        if *fault.borrow() == Fault::Drop {
            continue;
        }
        let mut cut_after = None;
        match direction {
            Direction::Requests(number) => {
                cut_after = frames.as_mut().and_then(|frames| frames.take(&buf[..n]));
                if cut_after.is_some() {
                    // Before the request goes: its answer is dropped too.
                    cut.store(true, Ordering::SeqCst);
                }
                if let Some(hold) = trapped(&shared, number, &buf[..n]) {
                    tokio::time::sleep(hold).await;
                }
            }
            // The answer of a request whose connection is cut, and
            // everything after it: dropped.
            Direction::Answers if cut.load(Ordering::SeqCst) => continue,
            Direction::Answers => {}
        }
        tokio::select! {
            _ = resets.changed() => return reset(&from, &to),
            written = to.write_all(&buf[..n]) => if written.is_err() { return false },
        }
        if let Some(after) = cut_after {
            // Let the server take the request in, then close both ways.
            tokio::time::sleep(after).await;
            return true;
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

    /// Frames of a byte of length and that many bytes; the connection is
    /// cut after a frame saying `cut`. Records what it was shown.
    #[derive(Default)]
    struct CutOnWord {
        seen: Mutex<Vec<(usize, Vec<u8>)>>,
    }

    impl RequestFilter for CutOnWord {
        fn frame_len(&self, bytes: &[u8]) -> Option<usize> {
            bytes.first().map(|len| 1 + usize::from(*len))
        }

        fn request(&self, index: usize, frame: &[u8]) -> Verdict {
            self.seen.lock().unwrap().push((index, frame.to_vec()));
            if &frame[1..] == b"cut" {
                Verdict::ForwardThenCut(Duration::from_millis(200))
            } else {
                Verdict::Forward
            }
        }
    }

    /// An echo server that also keeps every byte it received.
    async fn recording_echo_server() -> (u16, Arc<Mutex<Vec<u8>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let received = Arc::new(Mutex::new(Vec::new()));
        let keep = received.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let keep = keep.clone();
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        keep.lock().unwrap().extend_from_slice(&buf[..n]);
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        (port, received)
    }

    #[tokio::test]
    async fn a_filter_sees_each_request_and_cuts_after_the_one_it_names() {
        let (port, received) = recording_echo_server().await;
        let filter = Arc::new(CutOnWord::default());
        let proxy = FaultProxy::start_filtered(format!("127.0.0.1:{port}"), filter.clone())
            .await
            .unwrap();
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        // Two frames in one write, then one frame in two writes.
        s.write_all(b"\x02ab\x01c").await.unwrap();
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).await.unwrap();
        s.write_all(b"\x03x").await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        s.write_all(b"yz").await.unwrap();
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"\x03xyz");

        let started = std::time::Instant::now();
        s.write_all(b"\x03cut").await.unwrap();
        let mut rest = Vec::new();
        // Closed (by a FIN or a reset) without the answer.
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest))
            .await
            .expect("the cut connection closes");
        assert!(
            rest.is_empty(),
            "the answer after the cut arrived: {rest:?}"
        );
        assert!(started.elapsed() >= Duration::from_millis(200));
        assert!(received.lock().unwrap().ends_with(b"\x03cut"));
        let seen: Vec<(usize, Vec<u8>)> = filter.seen.lock().unwrap().clone();
        assert_eq!(
            seen,
            vec![
                (0, b"\x02ab".to_vec()),
                (1, b"\x01c".to_vec()),
                (2, b"\x03xyz".to_vec()),
                (3, b"\x03cut".to_vec()),
            ]
        );

        // Other connections are not cut: a new one counts its frames from 0.
        let mut again = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut again, b"\x03abc").await.unwrap();
        assert_eq!(
            filter.seen.lock().unwrap().last(),
            Some(&(0, b"\x03abc".to_vec()))
        );
    }
}
