//! A TCP proxy between one worker and the lock server that can delay traffic,
//! black-hole it (sockets stay open, bytes are held as a partitioned network
//! would, and TCP delivers them once it heals) and reset every connection.
//!
//! Written here rather than taken from a crate: toxiproxy and friends are separate
//! servers driven over HTTP; this is ~150 lines inside the orchestrator, with no
//! extra process to install in CI.

use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does to bytes going either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// Forward at once.
    Pass,
    /// Forward each chunk after this long.
    Delay(Duration),
    /// Hold everything until the fault ends; new connections are accepted and held too.
    Blackhole,
}

/// One proxy: a loopback port forwarding to `upstream`.
pub(crate) struct Proxy {
    port: u16,
    fault: watch::Sender<Fault>,
    resets: watch::Sender<u64>,
}

impl Proxy {
    /// Listens on a free loopback port, forwarding to `127.0.0.1:upstream`.
    pub(crate) async fn start(upstream: u16) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let (fault, _) = watch::channel(Fault::Pass);
        let (resets, _) = watch::channel(0u64);
        let (fault_rx, resets_rx) = (fault.subscribe(), resets.subscribe());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (fault, resets) = (fault_rx.clone(), resets_rx.clone());
                tokio::spawn(async move {
                    // A server that is down: the client sees its connection closed.
                    let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    tokio::spawn(pump(
                        client_read,
                        server_write,
                        fault.clone(),
                        resets.clone(),
                    ));
                    tokio::spawn(pump(server_read, client_write, fault, resets));
                });
            }
        });
        Ok(Self {
            port,
            fault,
            resets,
        })
    }

    /// The port workers connect to.
    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// Sets what happens to traffic from now on.
    pub(crate) fn set(&self, fault: Fault) {
        self.fault.send_replace(fault);
    }

    /// Resets (RST) every open connection.
    pub(crate) fn reset(&self) {
        self.resets.send_modify(|n| *n += 1);
    }
}

/// Moves bytes one way until either side closes or a reset comes.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut fault: watch::Receiver<Fault>,
    mut resets: watch::Receiver<u64>,
) {
    resets.mark_unchanged();
    let mut buf = vec![0u8; 16 * 1024];
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
                    let _ = to.shutdown().await;
                    return;
                }
                Ok(n) => n,
            },
        };
        loop {
            let current = *fault.borrow_and_update();
            match current {
                Fault::Pass => break,
                Fault::Delay(d) => {
                    tokio::select! {
                        _ = resets.changed() => return reset(&from, &to),
                        () = tokio::time::sleep(d) => break,
                    }
                }
                Fault::Blackhole => {
                    tokio::select! {
                        _ = resets.changed() => return reset(&from, &to),
                        changed = fault.changed() => if changed.is_err() { return },
                    }
                }
            }
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

    async fn round_trip(s: &mut TcpStream) -> std::io::Result<()> {
        s.write_all(b"ping").await?;
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).await?;
        assert_eq!(&buf, b"ping");
        Ok(())
    }

    #[tokio::test]
    async fn passes_delays_holds_and_resets() {
        let proxy = Proxy::start(echo_server().await).await.unwrap();
        let mut s = TcpStream::connect(("127.0.0.1", proxy.port()))
            .await
            .unwrap();
        round_trip(&mut s).await.unwrap();

        proxy.set(Fault::Delay(Duration::from_millis(100)));
        let t = std::time::Instant::now();
        round_trip(&mut s).await.unwrap();
        assert!(
            t.elapsed() >= Duration::from_millis(200),
            "{:?}",
            t.elapsed()
        );

        proxy.set(Fault::Blackhole);
        let held = tokio::time::timeout(Duration::from_millis(300), round_trip(&mut s)).await;
        assert!(held.is_err(), "bytes went through a black hole");
        proxy.set(Fault::Pass);
        // The held "ping" arrives after the heal, as TCP would deliver it.
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).await.unwrap();

        proxy.reset();
        let mut buf = [0u8; 4];
        let after = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf))
            .await
            .unwrap();
        assert!(
            matches!(after, Err(_) | Ok(0)),
            "connection survived a reset: {after:?}"
        );
        let mut again = TcpStream::connect(("127.0.0.1", proxy.port()))
            .await
            .unwrap();
        round_trip(&mut again).await.unwrap();
    }
}
