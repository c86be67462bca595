//! Launching a `redis-server` of one's own on a loopback port, and waiting
//! until it answers.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// The command that runs `redis-server` in the foreground on
/// `127.0.0.1:port`, keeping its files and its log (`redis.log`) in `dir`,
/// with `extra` arguments (persistence, replication…).
pub fn command(port: u16, dir: &Path, extra: &[&str]) -> Command {
    let mut command = Command::new("redis-server");
    command
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--dir", &dir.display().to_string()])
        .args(["--protected-mode", "no", "--daemonize", "no"])
        .args(["--logfile", &dir.join("redis.log").display().to_string()])
        .args(extra)
        .stdin(Stdio::null());
    command
}

/// Whether the server on `127.0.0.1:port` answers `PING` within 500 ms.
pub async fn answers(port: u16) -> bool {
    let attempt = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(b"PING\r\n").await?;
        let mut buf = [0u8; 7];
        s.read_exact(&mut buf).await?;
        std::io::Result::Ok(&buf == b"+PONG\r\n")
    };
    matches!(
        tokio::time::timeout(Duration::from_millis(500), attempt).await,
        Ok(Ok(true))
    )
}

/// Waits until the server on `port` answers (up to `within`); whether it did.
pub async fn wait_until_it_answers(port: u16, within: Duration) -> bool {
    crate::poll(within, Duration::from_millis(20), || answers(port)).await
}
