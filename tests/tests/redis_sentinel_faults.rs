//! Redis behind Sentinel under faults the failover tests of
//! `redis_sentinel.rs` do not make: a client cut off from its sentinels, a
//! sentinel that answers nothing first in the URL, a primary that stops
//! answering (SIGSTOP), and backends connected and dropped many times.
//!
//! Every test runs alone (one lock for the binary) and leaves the set-up
//! healthy: the sentinels agree on a primary whose replica is linked. Never
//! run this binary at the same time as `redis_sentinel`.
#![cfg(feature = "redis")]

use std::time::{Duration, Instant};

use dlock_runtime::{RedisBackend, Registry};
use dlock_testkit::{Fault, FaultProxy};
use dlock_tests::sentinel_support::{
    HOST, NAME, connection, named_by, primary_port, sentinel_ports, url, url_over, wait_healthy,
};
use dlock_tests::{server_url, servers_missing, unique_key};
use tokio::sync::{Mutex, MutexGuard};

/// Waits until sentinel `sentinel` names a primary other than `old`.
async fn wait_named_other_than(sentinel: u16, old: u16) -> u16 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(new) = named_by(sentinel).await
            && new != old
        {
            return new;
        }
        assert!(
            Instant::now() < deadline,
            "sentinel {sentinel} did not move the primary from {old} within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `SENTINEL FAILOVER` on sentinel `sentinel`.
fn sentinel_failover(sentinel: u16) {
    let answer = std::process::Command::new("redis-cli")
        .args([
            "-h",
            HOST,
            "-p",
            &sentinel.to_string(),
            "SENTINEL",
            "FAILOVER",
            NAME,
        ])
        .output()
        .expect("redis-cli");
    let said = String::from_utf8_lossy(&answer.stdout);
    assert!(said.trim() == "OK", "SENTINEL FAILOVER: {said}");
}

/// The remaining time to live of `key`'s lease on the node at `port`, in
/// ms (`-2`: the node has no such key).
async fn pttl_on(port: u16, key: &str) -> i64 {
    let mut conn = connection(port)
        .await
        .unwrap_or_else(|e| servers_missing(&url(), e));
    redis::cmd("PTTL")
        .arg(format!("{{dlock:{key}}}"))
        .query_async(&mut conn)
        .await
        .expect("PTTL")
}

/// One test at a time in this binary: each one may fail the primary over.
async fn alone() -> MutexGuard<'static, ()> {
    static ALONE: Mutex<()> = Mutex::const_new(());
    ALONE.lock().await
}

async fn registry(url: &str) -> Registry {
    Registry::builder()
        .default_backend(
            RedisBackend::connect(url)
                .await
                .unwrap_or_else(|e| servers_missing(url, e)),
        )
        .build()
}

/// A Redis server paused with SIGSTOP, resumed (SIGCONT) when dropped.
struct Paused(u32);

impl Paused {
    async fn pause(port: u16) -> Paused {
        let mut conn = connection(port)
            .await
            .unwrap_or_else(|e| servers_missing(&url(), e));
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut conn)
            .await
            .expect("INFO server");
        let pid: u32 = info
            .lines()
            .find_map(|l| l.strip_prefix("process_id:"))
            .expect("process_id")
            .trim()
            .parse()
            .expect("a pid");
        signal("-STOP", pid);
        Paused(pid)
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        signal("-CONT", self.0);
    }
}

fn signal(which: &str, pid: u32) {
    let status = std::process::Command::new("kill")
        .args([which, &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill {which} {pid}");
}

/// A holder that cannot reach its sentinels, while the primary it uses
/// still accepts writes (≈11 s after `SENTINEL FAILOVER`): its renewals
/// keep succeeding on the demoted node, its lease runs out on the new
/// primary, and another client is granted the key there. The holder must
/// learn it lost the key before that grant can be made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_cut_off_from_the_sentinels_is_lost_before_the_new_primary_grants_its_key() {
    let _alone = alone().await;
    wait_healthy().await;
    let mut proxies = Vec::new();
    for port in sentinel_ports() {
        proxies.push(FaultProxy::to_port(port).await.expect("proxy"));
    }
    let ports: Vec<u16> = proxies.iter().map(FaultProxy::port).collect();
    let cut_off = registry(&url_over(&ports, "")).await;
    let other = registry(&url()).await;
    let key = unique_key("sentinel-cut-off");
    let lease = Duration::from_secs(3);
    let held = cut_off
        .lock(&key)
        .lease(lease)
        .acquire()
        .await
        .expect("acquire before the failover");
    let token = held.fencing_token().expect("token").get();
    // Replicated to the replica before it is promoted.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for proxy in &proxies {
        proxy.set(Fault::Drop);
    }

    let old = primary_port().await;
    let started = Instant::now();
    sentinel_failover(sentinel_ports()[0]);
    let new = wait_named_other_than(sentinel_ports()[0], old).await;
    eprintln!(
        "the sentinels moved the primary {old} -> {new} after {:?}",
        started.elapsed()
    );
    let granted = other
        .lock(&key)
        .lease(Duration::from_secs(10))
        .wait(Duration::from_secs(30))
        .acquire()
        .await
        .expect("the other client gets the key on the new primary");
    let at_grant = started.elapsed();
    let lost_at_grant = held.is_lost();
    let other_token = granted.fencing_token().expect("token").get();
    eprintln!(
        "granted on the new primary after {at_grant:?} (token {other_token} after {token}); \
         the cut-off holder lost: {lost_at_grant}; PTTL on the old primary {} ms, on the new {} ms",
        pttl_on(old, &key).await,
        pttl_on(new, &key).await,
    );
    // How long the two overlap.
    let overlap_from = Instant::now();
    while !held.is_lost() && overlap_from.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "the cut-off holder learnt it lost the key {:?} after the other's grant",
        overlap_from.elapsed()
    );
    let _ = granted.release().await;
    drop(held);
    drop(cut_off);
    drop(proxies);
    wait_healthy().await;
    assert!(
        lost_at_grant,
        "two holders: the key was granted on the new primary {at_grant:?} after the failover \
         while the holder cut off from the sentinels still believed it held it"
    );
}

/// A sentinel that answers nothing, first in the URL beside two healthy
/// ones: a switch announced by the others is followed within the second
/// the docs promise, not after the stalled sentinel's timeout on every
/// resolution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_first_sentinel_does_not_delay_following_a_switch() {
    let _alone = alone().await;
    wait_healthy().await;
    let sentinels = sentinel_ports();
    let stalled = FaultProxy::to_port(sentinels[0]).await.expect("proxy");
    stalled.set(Fault::Drop);
    let mut ports = vec![stalled.port()];
    ports.extend(&sentinels[1..]);
    let connecting = Instant::now();
    let behind_stall = registry(&url_over(&ports, "")).await;
    let connect_took = connecting.elapsed();
    let healthy = registry(&url()).await;
    // Both settled: listening and polling as they will during the failover.
    tokio::time::sleep(Duration::from_secs(5)).await;

    let old = primary_port().await;
    sentinel_failover(sentinels[1]);
    let new = wait_named_other_than(sentinels[1], old).await;
    let switched = Instant::now();
    // Grants made meanwhile land on the old primary (it accepts writes for
    // ≈11 s): the first grant the new primary holds went to the new one. (Not
    // "the first the old primary lacks": once the old primary is made a
    // replica of the new one, grants on the new one reach it too.)
    let follows = |registry: &'static Registry, case: &'static str| async move {
        loop {
            let key = unique_key(case);
            let guard = registry
                .lock(&key)
                .lease(Duration::from_secs(5))
                .wait(Duration::from_secs(2))
                .acquire()
                .await;
            let on_new = guard.is_ok() && pttl_on(new, &key).await > 0;
            if let Ok(guard) = guard {
                let _ = guard.release().await;
            }
            if on_new {
                return switched.elapsed();
            }
            if switched.elapsed() > Duration::from_secs(20) {
                return switched.elapsed();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let behind_stall: &'static Registry = Box::leak(Box::new(behind_stall));
    let healthy: &'static Registry = Box::leak(Box::new(healthy));
    let (stalled_lag, healthy_lag) = tokio::join!(
        follows(behind_stall, "sentinel-stalled-first"),
        follows(healthy, "sentinel-healthy")
    );
    eprintln!(
        "connect took {connect_took:?} behind the stalled sentinel; after the sentinels \
         switched {old} -> {new}: grants followed after {stalled_lag:?} behind it, \
         {healthy_lag:?} without"
    );
    drop(stalled);
    wait_healthy().await;
    assert!(
        stalled_lag < Duration::from_secs(1),
        "behind a stalled first sentinel, grants went to the demoted primary for \
         {stalled_lag:?} after the switch (without it: {healthy_lag:?})"
    );
    assert!(
        connect_took < Duration::from_secs(2),
        "connect paid the stalled sentinel's timeout: {connect_took:?}"
    );
}

/// A primary that stops answering (SIGSTOP): an acquisition is an error no
/// later than on a single server that answers nothing, and a holder hears it
/// lost the key before another client can be granted it on the new primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_primary_is_an_error_in_bounded_time_and_its_holders_are_lost_before_a_new_grant()
{
    let _alone = alone().await;
    wait_healthy().await;
    let holder = registry(&url()).await;
    let waiter = registry(&url()).await;
    let key = unique_key("sentinel-stopped");
    let held = holder
        .lock(&key)
        .lease(Duration::from_secs(3))
        .acquire()
        .await
        .expect("acquire");
    let waited_key = key.clone();
    let started = Instant::now();
    let waiting = tokio::spawn(async move {
        let answer = waiter
            .lock(&waited_key)
            .lease(Duration::from_secs(10))
            .wait(Duration::from_secs(40))
            .acquire()
            .await;
        (answer, waiter)
    });
    tokio::time::sleep(Duration::from_millis(500)).await;

    let old = primary_port().await;
    let mut failures = Vec::new();
    let paused = Paused::pause(old).await;
    let stopped_at = Instant::now();
    let wait = Duration::from_millis(500);
    let attempt = holder
        .lock(unique_key("sentinel-stopped-other"))
        .wait(wait)
        .acquire()
        .await;
    let attempt_took = stopped_at.elapsed();
    eprintln!(
        "an acquisition with a {wait:?} wait on the stopped primary: {} after {attempt_took:?}",
        match &attempt {
            Ok(_) => "granted".to_string(),
            Err(e) => e.to_string(),
        }
    );
    // A single server answering nothing costs one command timeout (2 s by
    // default; see `a_black_holed_single_redis_is_an_error_within_wait`):
    // asking the sentinels again must not add to it.
    let single_server = wait + Duration::from_secs(2) + Duration::from_millis(500);
    if attempt_took > single_server {
        failures.push(format!(
            "an acquisition with a {wait:?} wait answered after {attempt_took:?}"
        ));
    }
    drop(attempt);
    let lost_when_granted;
    let (answer, _waiter) = waiting.await.expect("the waiter's task");
    match answer {
        Ok(guard) => {
            lost_when_granted = held.is_lost();
            eprintln!(
                "the waiter got the key {:?} after the pause; the holder lost: {lost_when_granted}",
                stopped_at.elapsed()
            );
            let _ = guard.release().await;
        }
        Err(e) => {
            lost_when_granted = true;
            failures.push(format!("the waiter got no key: {e}"));
        }
    }
    if !lost_when_granted {
        failures.push(
            "two holders: the waiter was granted the key while its holder had not \
                       been told it was lost"
                .into(),
        );
    }
    eprintln!("waited {:?} in all", started.elapsed());
    drop(held);
    drop(holder);
    drop(paused);
    wait_healthy().await;
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The file descriptors this process has open.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// The threads of this process.
fn threads() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|n| n.trim().parse().ok())
        })
        .unwrap_or(0)
}

/// Backends connected, used and dropped many times: the tasks following the
/// primary (the `+switch-master` listener, the poll) end with them, and
/// their connections to the sentinels and the primary close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_sentinel_backends_leave_no_connections_or_threads_behind() {
    let _alone = alone().await;
    wait_healthy().await;
    // Warm: dlock's I/O runtime and its threads exist before counting.
    {
        let warm = registry(&url()).await;
        let guard = warm
            .lock(unique_key("sentinel-warm"))
            .acquire()
            .await
            .expect("acquire");
        guard.release().await.expect("release");
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (fds_before, threads_before) = (open_fds(), threads());
    for round in 0..20 {
        let options = if round % 2 == 0 { "" } else { "?replicas=1" };
        let registry = registry(&format!("{}{options}", url())).await;
        let key = unique_key("sentinel-drop");
        let guard = registry.lock(&key).acquire().await.expect("acquire");
        // A waiter too, so that the release listener subscribes.
        let waiting = registry
            .lock(&key)
            .wait(Duration::from_millis(200))
            .acquire()
            .await;
        assert!(waiting.is_err(), "a second holder");
        guard.release().await.expect("release");
    }
    // The poll is every second; give every task time to see it is alone.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (fds_after, threads_after) = (open_fds(), threads());
    eprintln!("fds {fds_before} -> {fds_after}, threads {threads_before} -> {threads_after}");
    assert!(
        fds_after <= fds_before + 4,
        "20 dropped backends left {} descriptors open",
        fds_after - fds_before
    );
    assert!(
        threads_after <= threads_before + 2,
        "threads {threads_before} -> {threads_after}"
    );
}

/// A sentinel of the test's own that names the primary it is told to (a
/// sentinel on the minority side of a partition, still naming the old
/// primary), and refuses subscriptions. It speaks just enough RESP for a
/// client: `SENTINEL GET-MASTER-ADDR-BY-NAME`, `PING`, `CLIENT …`.
struct StaleSentinel {
    port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl StaleSentinel {
    async fn naming(primary: u16) -> StaleSentinel {
        let listener = tokio::net::TcpListener::bind((HOST, 0))
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let task = tokio::spawn(async move {
            loop {
                let Ok((socket, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(Self::serve(socket, primary));
            }
        });
        StaleSentinel { port, task }
    }

    async fn serve(mut socket: tokio::net::TcpStream, primary: u16) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buffer = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            while let Some((command, used)) = parse_command(&buffer) {
                buffer.drain(..used);
                let name = command.first().map(|c| c.to_ascii_uppercase());
                let answer = match name.as_deref() {
                    Some("SENTINEL") => format!(
                        "*2\r\n${}\r\n{HOST}\r\n${}\r\n{primary}\r\n",
                        HOST.len(),
                        primary.to_string().len()
                    ),
                    Some("PING") => "+PONG\r\n".to_string(),
                    Some("CLIENT") => "+OK\r\n".to_string(),
                    _ => "-ERR unknown command\r\n".to_string(),
                };
                if socket.write_all(answer.as_bytes()).await.is_err() {
                    return;
                }
            }
            match socket.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buffer.extend_from_slice(&chunk[..n]),
            }
        }
    }
}

impl Drop for StaleSentinel {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One RESP command (an array of bulk strings) at the start of `bytes`, and
/// how many bytes it took; `None` while incomplete.
fn parse_command(bytes: &[u8]) -> Option<(Vec<String>, usize)> {
    fn line(bytes: &[u8], at: usize) -> Option<(&[u8], usize)> {
        let end = bytes[at..].windows(2).position(|w| w == b"\r\n")? + at;
        Some((&bytes[at..end], end + 2))
    }
    let (head, mut at) = line(bytes, 0)?;
    let count: usize = std::str::from_utf8(head.strip_prefix(b"*")?)
        .ok()?
        .parse()
        .ok()?;
    let mut words = Vec::with_capacity(count);
    for _ in 0..count {
        let (len, next) = line(bytes, at)?;
        let len: usize = std::str::from_utf8(len.strip_prefix(b"$")?)
            .ok()?
            .parse()
            .ok()?;
        if bytes.len() < next + len + 2 {
            return None;
        }
        words.push(String::from_utf8_lossy(&bytes[next..next + len]).into_owned());
        at = next + len + 2;
    }
    Some((words, at))
}

/// A switch a healthy sentinel announced (`+switch-master`) is not undone
/// by the next poll because the sentinel asked first still names the old
/// primary, which answers `ROLE` master for ≈11 s after `SENTINEL
/// FAILOVER`: once grants go to the new primary, none goes back to the old.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_announced_switch_is_not_undone_by_a_sentinel_still_naming_the_old_primary() {
    let _alone = alone().await;
    wait_healthy().await;
    let old = primary_port().await;
    let stale = StaleSentinel::naming(old).await;
    let sentinels = sentinel_ports();
    let mut ports = vec![stale.port];
    ports.extend(&sentinels);
    let following = registry(&url_over(&ports, "")).await;
    // Listening on a real sentinel (the stale one refuses subscriptions).
    tokio::time::sleep(Duration::from_secs(3)).await;

    sentinel_failover(sentinels[0]);
    let new = wait_named_other_than(sentinels[0], old).await;
    let switched = Instant::now();
    // Where each grant lands, for 8 s.
    let mut landed = Vec::new();
    while switched.elapsed() < Duration::from_secs(8) {
        let key = unique_key("sentinel-stale");
        if let Ok(guard) = following
            .lock(&key)
            .lease(Duration::from_secs(5))
            .wait(Duration::from_secs(2))
            .acquire()
            .await
        {
            let on_old = pttl_on(old, &key).await > 0;
            landed.push((switched.elapsed(), on_old));
            let _ = guard.release().await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let first_on_new = landed.iter().position(|(_, on_old)| !on_old);
    let back_on_old = first_on_new.and_then(|first| {
        landed[first..]
            .iter()
            .find(|(_, on_old)| *on_old)
            .map(|(at, _)| *at)
    });
    let on_old = landed.iter().filter(|(_, on_old)| *on_old).count();
    eprintln!(
        "{old} -> {new}: {} grants, {on_old} on the old primary; first on the new at {:?}, \
         back on the old at {back_on_old:?}",
        landed.len(),
        first_on_new.map(|i| landed[i].0)
    );
    drop(following);
    drop(stale);
    wait_healthy().await;
    assert!(
        first_on_new.is_some(),
        "no grant reached the new primary within 8 s"
    );
    assert!(
        back_on_old.is_none(),
        "grants went back to the demoted primary {back_on_old:?} after the switch \
         ({on_old} of {} grants on it)",
        landed.len()
    );
}

/// The same question as the stopped primary's, asked of a single Redis
/// (`redis://`) that answers nothing (behind a black-holing proxy): an
/// acquisition is an error within its `wait`, whatever the command timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_single_redis_is_an_error_within_wait() {
    let plain = server_url("DLOCK_TEST_REDIS_URL", "redis://127.0.0.1:46379/");
    let upstream = plain
        .split_once("://")
        .and_then(|(_, rest)| rest.split('/').next())
        .expect("host:port")
        .to_string();
    let proxy = FaultProxy::start(upstream).await.expect("proxy");
    let through = registry(&format!("redis://{}/", proxy.addr())).await;
    proxy.set(Fault::Drop);
    let wait = Duration::from_millis(500);
    let started = Instant::now();
    let attempt = through
        .lock(unique_key("black-holed"))
        .wait(wait)
        .acquire()
        .await;
    let took = started.elapsed();
    eprintln!(
        "an acquisition with a {wait:?} wait on a black-holed redis://: {} after {took:?}",
        match &attempt {
            Ok(_) => "granted".to_string(),
            Err(e) => e.to_string(),
        }
    );
    assert!(attempt.is_err(), "granted by a server that answers nothing");
    assert!(
        took <= wait + Duration::from_millis(500),
        "an acquisition with a {wait:?} wait answered after {took:?}"
    );
}
