//! Server-side access to PostgreSQL and MySQL/MariaDB for the SQL backends'
//! tests, the TCP fault proxy (black hole, reset), and the
//! server controls of `scripts/servers.sh`.
//!
//! Connections are opened per call, on the caller's runtime: every
//! `#[tokio::test]` has its own, and a connection kept from a finished
//! test's runtime would be dead.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dlock_runtime::LockError;
use futures_util::future::BoxFuture;

use crate::Faults;

/// The first 64 bits of SHA-256 of a stored key: the backend's session-mode
/// name of the key (as PostgreSQL computes it).
pub const PG_SESSION_KEY: &str =
    "('x' || left(encode(sha256(convert_to($1, 'UTF8')), 'hex'), 16))::bit(64)::bigint";

/// How a backend holds its locks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SqlMode {
    /// The lease table `dlock_leases`.
    Lease,
    /// Session locks on dedicated connections.
    Session,
}

/// Admin access to a PostgreSQL server under a backend.
#[cfg(feature = "postgres")]
pub struct PgFaults {
    /// The server (a plain `postgres://` URL without dlock's options).
    pub url: String,
    /// How the backend under test holds its locks.
    pub mode: SqlMode,
}

#[cfg(feature = "postgres")]
impl PgFaults {
    /// A connection of its own; fails the test if the server cannot be reached.
    pub async fn connect(&self) -> sqlx::PgConnection {
        use sqlx::Connection as _;
        sqlx::PgConnection::connect(&self.url)
            .await
            .unwrap_or_else(|e| crate::servers_missing(&self.url, e))
    }

    /// The backend pids holding the session lock of `stored_key`.
    pub async fn session_holders(&self, stored_key: &str) -> Vec<i32> {
        let sql = format!(
            "SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted \
             AND l.objsubid = 1 \
             AND l.classid::bigint = ({PG_SESSION_KEY} >> 32) & 4294967295 \
             AND l.objid::bigint = {PG_SESSION_KEY} & 4294967295"
        );
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .bind(stored_key)
            .fetch_all(&mut self.connect().await)
            .await
            .expect("read pg_locks")
    }

    /// Terminates the server backends `pids` (`pg_terminate_backend`).
    pub async fn terminate(&self, pids: &[i32]) {
        let mut conn = self.connect().await;
        for pid in pids {
            sqlx::query("SELECT pg_terminate_backend($1)")
                .bind(pid)
                .execute(&mut conn)
                .await
                .expect("pg_terminate_backend");
        }
    }
}

#[cfg(feature = "postgres")]
impl Faults for PgFaults {
    fn revoke<'a>(&'a self, stored_key: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            match self.mode {
                SqlMode::Lease => {
                    let mut conn = self.connect().await;
                    // Readers and permits are rows of the holder table.
                    for table in ["dlock_leases_holders", "dlock_leases"] {
                        sqlx::query(sqlx::AssertSqlSafe(format!(
                            "DELETE FROM {table} WHERE key = $1"
                        )))
                        .bind(stored_key)
                        .execute(&mut conn)
                        .await
                        .expect("delete the rows");
                    }
                }
                SqlMode::Session => {
                    let holders = self.session_holders(stored_key).await;
                    assert!(!holders.is_empty(), "{stored_key} is not held");
                    self.terminate(&holders).await;
                }
            }
        })
    }

    fn is_held<'a>(&'a self, stored_key: &'a str) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            match self.mode {
                SqlMode::Lease => sqlx::query_scalar(
                    "SELECT count(*) > 0 FROM dlock_leases WHERE key = $1 \
                     AND (owner IS NOT NULL AND expires_at > clock_timestamp() \
                          OR shared_until > clock_timestamp())",
                )
                .bind(stored_key)
                .fetch_one(&mut self.connect().await)
                .await
                .expect("read the row"),
                SqlMode::Session => !self.session_holders(stored_key).await.is_empty(),
            }
        })
    }
}

/// The `GET_LOCK` name of a stored key in session mode.
pub fn mysql_lock_name(stored_key: &str) -> String {
    format!("dlock:{:016x}", session_hash(stored_key))
}

/// The first 64 bits of SHA-256 of `key`, big-endian (computed here the
/// long way, independently of the backend's code).
pub fn session_hash(key: &str) -> u64 {
    // SHA-256 per FIPS 180-4, enough for tests.
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];
    let mut h: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
        0x5be0cd19,
    ];
    let mut data = key.as_bytes().to_vec();
    let bits = (data.len() as u64) * 8;
    data.push(0x80);
    while data.len() % 64 != 56 {
        data.push(0);
    }
    data.extend_from_slice(&bits.to_be_bytes());
    for block in data.chunks(64) {
        let mut w = [0u32; 64];
        for (i, word) in block.chunks(4).enumerate() {
            w[i] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16]
                .wrapping_add(s0)
                .wrapping_add(w[i - 7])
                .wrapping_add(s1);
        }
        let mut v = h;
        for i in 0..64 {
            let s1 = v[4].rotate_right(6) ^ v[4].rotate_right(11) ^ v[4].rotate_right(25);
            let ch = (v[4] & v[5]) ^ (!v[4] & v[6]);
            let t1 = v[7]
                .wrapping_add(s1)
                .wrapping_add(ch)
                .wrapping_add(K[i])
                .wrapping_add(w[i]);
            let s0 = v[0].rotate_right(2) ^ v[0].rotate_right(13) ^ v[0].rotate_right(22);
            let maj = (v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]);
            let t2 = s0.wrapping_add(maj);
            v = [
                t1.wrapping_add(t2),
                v[0],
                v[1],
                v[2],
                v[3].wrapping_add(t1),
                v[4],
                v[5],
                v[6],
            ];
        }
        for (a, b) in h.iter_mut().zip(v) {
            *a = a.wrapping_add(b);
        }
    }
    (u64::from(h[0]) << 32) | u64::from(h[1])
}

/// Admin access to a MySQL/MariaDB server under a backend.
#[cfg(feature = "mysql")]
pub struct MyFaults {
    /// The server (a plain `mysql://` URL without dlock's options).
    pub url: String,
    /// How the backend under test holds its locks.
    pub mode: SqlMode,
}

#[cfg(feature = "mysql")]
impl MyFaults {
    /// A connection of its own; fails the test if the server cannot be reached.
    pub async fn connect(&self) -> sqlx::MySqlConnection {
        use sqlx::Connection as _;
        sqlx::MySqlConnection::connect(&self.url)
            .await
            .unwrap_or_else(|e| crate::servers_missing(&self.url, e))
    }

    /// The connection id holding the session lock of `stored_key`, if any.
    pub async fn session_holder(&self, stored_key: &str) -> Option<i64> {
        sqlx::query_scalar::<_, Option<i64>>("SELECT CAST(IS_USED_LOCK(?) AS SIGNED)")
            .bind(mysql_lock_name(stored_key))
            .fetch_one(&mut self.connect().await)
            .await
            .expect("IS_USED_LOCK")
    }

    /// The connection ids holding `stored_key` in session mode: its plain
    /// lock's holder, and each permit holder of a semaphore (the slot locks
    /// whose counter rows, in `dlock_leases_fence`, name the key).
    pub async fn session_holders(&self, stored_key: &str) -> Vec<i64> {
        let mut holders: Vec<i64> = self.session_holder(stored_key).await.into_iter().collect();
        let slots: Vec<Option<i64>> = sqlx::query_scalar(
            "SELECT CAST(IS_USED_LOCK(CONCAT('dlock:', LPAD(LOWER(HEX(k)), 16, '0'))) AS SIGNED) \
             FROM dlock_leases_fence WHERE name = ? AND slot IS NOT NULL",
        )
        .bind(stored_key.as_bytes())
        .fetch_all(&mut self.connect().await)
        .await
        .expect("IS_USED_LOCK of the slots");
        holders.extend(slots.into_iter().flatten());
        holders
    }

    /// Kills connection `id` (`KILL`).
    pub async fn kill(&self, id: i64) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL {id}")))
            .execute(&mut self.connect().await)
            .await
            .expect("KILL");
    }
}

#[cfg(feature = "mysql")]
impl Faults for MyFaults {
    fn revoke<'a>(&'a self, stored_key: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            match self.mode {
                SqlMode::Lease => {
                    let mut conn = self.connect().await;
                    // Readers and permits are rows of the holder table.
                    for table in ["dlock_leases_holders", "dlock_leases"] {
                        sqlx::query(sqlx::AssertSqlSafe(format!(
                            "DELETE FROM {table} WHERE k = ?"
                        )))
                        .bind(stored_key)
                        .execute(&mut conn)
                        .await
                        .expect("delete the rows");
                    }
                }
                SqlMode::Session => {
                    let holders = self.session_holders(stored_key).await;
                    assert!(!holders.is_empty(), "{stored_key} is not held");
                    for holder in holders {
                        self.kill(holder).await;
                    }
                }
            }
        })
    }

    fn is_held<'a>(&'a self, stored_key: &'a str) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            match self.mode {
                SqlMode::Lease => {
                    let held: i64 = sqlx::query_scalar(
                        "SELECT COUNT(*) FROM dlock_leases WHERE k = ? \
                         AND GREATEST(IF(owner IS NULL, 0, expires_us), shared_us) \
                             > TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', \
                         UTC_TIMESTAMP(6))",
                    )
                    .bind(stored_key)
                    .fetch_one(&mut self.connect().await)
                    .await
                    .expect("read the row");
                    held > 0
                }
                SqlMode::Session => !self.session_holders(stored_key).await.is_empty(),
            }
        })
    }
}

pub use dlock_testkit::{Fault, FaultProxy as Proxy};

/// A [`Proxy`] in front of `upstream` (`host:port`).
pub async fn proxy_to(upstream: &str) -> Proxy {
    Proxy::start(upstream).await.expect("start the proxy")
}

/// Runs `scripts/servers.sh <args>` (stop/start a test server) and panics if
/// it fails. Uses the same state directory as the running servers
/// (`DLOCK_SERVERS_DIR`).
pub fn servers_sh(args: &[&str]) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/servers.sh");
    let status = std::process::Command::new("bash")
        .arg(script)
        .args(args)
        .status()
        .unwrap_or_else(|e| panic!("cannot run scripts/servers.sh: {e}"));
    assert!(
        status.success(),
        "scripts/servers.sh {args:?} failed: {status}"
    );
}

/// The `host:port` of a `scheme://user:pass@host:port/db` URL.
pub fn host_port(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    rest.split(['/', '?']).next().unwrap_or(rest).to_owned()
}

/// `url` with its `host:port` replaced by `addr` (to go through a [`Proxy`]).
pub fn via(url: &str, addr: SocketAddr) -> String {
    url.replacen(&host_port(url), &addr.to_string(), 1)
}

/// The lease of [`loss_cancels_the_body`]'s holder.
pub const LOSS_LEASE: Duration = Duration::from_millis(1500);

#[dlock_runtime::distributed_lock(key = "{key}", lease = "1500ms")]
async fn counts_until_cancelled(key: &str, counter: &AtomicUsize) -> Result<(), LockError> {
    loop {
        counter.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Runs a body holding `key` (a [`LOSS_LEASE`] lease, `on_lost = "cancel"`)
/// on the global registry, runs `revoke` behind its back once it is running,
/// and checks that the body ends with `Lost` before its lease would have
/// ended, and stops. Answers how long after `revoke` returned the body ended.
pub async fn loss_cancels_the_body(
    key: &str,
    revoke: impl std::future::Future<Output = ()>,
) -> Duration {
    let counter = Arc::new(AtomicUsize::new(0));
    let acquired = Instant::now();
    let call = tokio::spawn({
        let (key, counter) = (key.to_owned(), counter.clone());
        async move { counts_until_cancelled(&key, &counter).await }
    });
    while counter.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    revoke.await;
    let revoked = Instant::now();
    let result = tokio::time::timeout(2 * LOSS_LEASE, call)
        .await
        .expect("the body ends")
        .expect("task");
    let ended = Instant::now();
    assert!(
        matches!(result, Err(LockError::Lost { .. })),
        "expected Lost, got {result:?}"
    );
    assert!(
        ended - acquired < LOSS_LEASE,
        "the loss reached the body {:?} after the acquisition, after its lease",
        ended - acquired
    );
    let count = counter.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(counter.load(Ordering::SeqCst), count, "the body still runs");
    ended - revoked
}

/// Network faults between a holder and its server, for any SQL backend:
///
/// - **black hole**: a holder connected through a [`Proxy`] that starts
///   dropping every byte learns that its lease is lost before the lease ends
///   (time-driven loss), and the server frees the key on its own — not
///   before the holder knows (a client of the global registry, connected
///   directly, gets it then), and not long after the lease;
/// - **reset**: once the proxy resets every connection and relays again,
///   the same backend works again (it reconnects).
///
/// `connect` opens a registry for a URL (the server's URL through the proxy,
/// with `options` appended).
pub async fn black_hole_then_reset<F, Fut>(server_url: &str, options: &str, connect: F)
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = dlock_runtime::Registry>,
{
    let proxy = proxy_to(&host_port(server_url)).await;
    let through = connect(format!("{}{options}", via(server_url, proxy.addr()))).await;
    let key = crate::unique_key("black-hole");
    let lease = Duration::from_secs(1);
    let guard = through
        .lock(&key)
        .lease(lease)
        .acquire()
        .await
        .expect("acquire through the proxy");
    let acquired = Instant::now();
    proxy.set(Fault::Drop);
    tokio::time::timeout(2 * lease, guard.lost())
        .await
        .expect("the loss reaches the holder");
    let lost_after = acquired.elapsed();
    assert!(
        lost_after < lease,
        "lost after {lost_after:?}, past the lease"
    );
    let direct = dlock_runtime::lock(&key)
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .expect("the server frees the key of a partitioned holder");
    let freed_after = acquired.elapsed();
    assert!(
        freed_after >= lost_after,
        "another client got the key {freed_after:?} after the grant, before the holder \
         learned of the loss ({lost_after:?})"
    );
    assert!(
        freed_after < lease + Duration::from_secs(3),
        "freed only {freed_after:?} after the grant"
    );
    direct.release().await.expect("release");
    drop(guard);
    proxy.reset_all();
    proxy.set(Fault::Pass);
    let again = crate::acquire_eventually(&through, &crate::unique_key("after-reset")).await;
    again.release().await.expect("release after the reconnect");
}

/// Starts a test server again when dropped (also when the test panics): the
/// servers are shared with the other tests.
pub struct RestartOnDrop(pub &'static str);

impl Drop for RestartOnDrop {
    fn drop(&mut self) {
        servers_sh(&[self.0]);
    }
}

/// The server SIGKILLed under held locks and restarted, for each registry
/// given (a lease-mode and a session-mode backend of one server, opened with
/// a 1 s `timeout`): while it is down, holders lose their leases before they
/// end and acquisitions fail within their `wait`; after the restart, locks
/// work again and tokens keep growing. `server` is `postgres` or `mysql`
/// (the `scripts/servers.sh` names).
pub async fn sigkill_and_restart(server: &'static str, registries: &[dlock_runtime::Registry]) {
    let lease = Duration::from_secs(2);
    let key = crate::unique_key(&format!("{server}-restart"));
    let mut before = Vec::new();
    let mut guards = Vec::new();
    for registry in registries {
        let guard = registry
            .lock(&key)
            .lease(lease)
            .acquire()
            .await
            .expect("acquire");
        before.push(guard.fencing_token().expect("token"));
        guards.push(guard);
    }
    let start = match server {
        "postgres" => "start-postgres",
        "mysql" => "start-mysql",
        other => panic!("no server {other}"),
    };
    let restart = RestartOnDrop(start);
    servers_sh(&[&format!("stop-{server}"), "kill"]);
    // The server answered its last renewal before it died: each lease ends
    // on the server at most `lease` after this instant (a renewal may have
    // extended it past its grant while the kill ran), and its holder must
    // hear of the loss before then.
    let killed = Instant::now();
    for (i, guard) in guards.iter().enumerate() {
        let left = lease.saturating_sub(killed.elapsed());
        tokio::time::timeout(left, guard.lost())
            .await
            .unwrap_or_else(|_| {
                panic!("holder {i} did not learn of the loss within {lease:?} of the kill")
            });
    }
    let wait = Duration::from_secs(1);
    for registry in registries {
        let started = Instant::now();
        let attempt = registry
            .lock(crate::unique_key("while-down"))
            .wait(wait)
            .acquire()
            .await;
        let took = started.elapsed();
        match attempt {
            Err(LockError::Backend { source, .. }) => {
                assert!(source.is_retryable(), "{source}")
            }
            other => panic!("a lock while the server is down: {other:?}"),
        }
        assert!(took < wait + Duration::from_millis(1500), "took {took:?}");
    }
    drop(restart);
    for (registry, before) in registries.iter().zip(before) {
        let guard = crate::acquire_eventually(registry, &key).await;
        let after = guard.fencing_token().expect("token");
        assert!(
            after > before,
            "token {after:?} after the restart, {before:?} before"
        );
        guard.release().await.expect("release");
    }
    for guard in guards {
        assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes() {
        assert_eq!(session_hash("abc"), 0xba78_16bf_8f01_cfea);
        assert_eq!(mysql_lock_name("abc"), "dlock:ba7816bf8f01cfea".to_owned());
        assert_eq!(
            host_port("postgres://u:p@127.0.0.1:5432/db?x=1"),
            "127.0.0.1:5432"
        );
    }
}
