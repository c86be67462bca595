//! A real HTTP server whose clients hang up, on PostgreSQL in lease mode and
//! in session mode.
//!
//! An axum server (hyper underneath) serves `POST /pay/{id}`: the handler
//! takes the lock `order:{id}` (a few ids, so the keys are contended) with a
//! wait of a few seconds, reads and rewrites a counter row of the test's own
//! under it, holds it a few milliseconds and releases it. Many concurrent
//! clients, written by hand over TCP, post to it; in the hang-up phase each
//! drops its socket after a random 20–200 ms, and hyper drops the handler's
//! future wherever it is: waiting for the key, in the body, or releasing.
//!
//! Checked per mode once the load stops: nothing is held a moment later
//! (every key free for a try from another backend, no live row or advisory
//! lock on the server, no lease left for the watchdog to renew), no update
//! was lost, every write belongs to a handler that held the key, and in
//! session mode the server connections opened stay bounded by the callers
//! that wait, not by the hang-ups. Session mode's throughput under hang-ups
//! is compared with lease mode's. One summary line per mode is printed.
#![cfg(feature = "postgres")]

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::routing::post;
use dlock_runtime::{LockError, LockGuard, Registry};
use dlock_tests::servers_missing;
use dlock_tests::sql_db::SqlDb;
use sqlx::{AssertSqlSafe, Connection as _, PgConnection, PgPool};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// Concurrent client connections.
const CLIENTS: usize = 32;
/// Orders, hence contended keys.
const ORDERS: u32 = 4;
/// How long a handler waits for its key.
const WAIT: Duration = Duration::from_secs(3);
/// How long a handler holds its key after the write.
const HOLD: Duration = Duration::from_millis(5);
/// The phase without timeouts: the baseline.
const BASELINE: Duration = Duration::from_secs(4);
/// The phase whose clients hang up.
const HANG_UPS: Duration = Duration::from_secs(15);
/// The clients' timeouts in the hang-up phase, in milliseconds.
const TIMEOUTS_MS: std::ops::RangeInclusive<u64> = 20..=200;
/// How soon after the load everything must be free: a round trip, with
/// room for a loaded machine.
const SETTLED_WITHIN: Duration = Duration::from_secs(3);

/// Where a handler was when hyper dropped it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Waiting = 0,
    Writing = 1,
    Holding = 2,
    Releasing = 3,
}

/// What the server and the clients counted.
#[derive(Debug, Default)]
struct Stats {
    /// Requests sent.
    requests: AtomicU64,
    /// Responses `200` read by a client.
    served: AtomicU64,
    /// Responses `409` (the key stayed busy for the whole wait) read by a client.
    busy: AtomicU64,
    /// Other responses, and clients' I/O errors.
    failed: AtomicU64,
    /// Clients that gave up and dropped their socket.
    hung_up: AtomicU64,
    /// Handlers that answered `200`.
    completed: AtomicU64,
    /// Counter writes made under a held key.
    writes: AtomicU64,
    /// Handlers that failed (a backend error, a release error).
    errors: AtomicU64,
    /// Handlers dropped, by [`Stage`].
    dropped: [AtomicU64; 4],
}

impl Stats {
    fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::SeqCst)
    }

    fn dropped(&self, stage: Stage) -> u64 {
        Self::get(&self.dropped[stage as usize])
    }

    /// Handlers dropped after they had taken the key.
    fn dropped_holding(&self) -> u64 {
        self.dropped(Stage::Writing) + self.dropped(Stage::Holding) + self.dropped(Stage::Releasing)
    }
}

/// Counts the handler as dropped at its stage unless it finished.
struct Tracker {
    stats: Arc<Stats>,
    stage: Option<Stage>,
}

impl Tracker {
    fn at(&mut self, stage: Stage) {
        self.stage = Some(stage);
    }

    fn finished(&mut self) {
        self.stage = None;
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        if let Some(stage) = self.stage {
            self.stats.dropped[stage as usize].fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[derive(Clone)]
struct App {
    registry: Registry,
    counter: PgPool,
    table: Arc<str>,
    stats: Arc<Stats>,
}

/// `POST /pay/{id}`: the key `order:{id}`, a read-modify-write of the
/// order's counter under it, a short hold, the release.
async fn pay(State(app): State<App>, UrlPath(id): UrlPath<u32>) -> StatusCode {
    let mut tracker = Tracker {
        stats: app.stats.clone(),
        stage: Some(Stage::Waiting),
    };
    let guard = match app
        .registry
        .lock(format!("order:{id}"))
        .wait(WAIT)
        .acquire()
        .await
    {
        Ok(guard) => guard,
        Err(LockError::Busy { .. }) => {
            tracker.finished();
            return StatusCode::CONFLICT;
        }
        Err(e) => {
            tracker.finished();
            app.stats.errors.fetch_add(1, Ordering::SeqCst);
            eprintln!("acquire order:{id}: {e}");
            return StatusCode::INTERNAL_SERVER_ERROR;
        }
    };
    tracker.at(Stage::Writing);
    // The write runs to its end with the key held even if the handler is
    // dropped meanwhile: its guard comes back (or is dropped, releasing the
    // key) only once the write is done.
    let write = tokio::spawn(write_under(app.clone(), id, guard));
    let guard = match write.await.expect("the write task") {
        Ok(guard) => guard,
        Err(e) => {
            tracker.finished();
            app.stats.errors.fetch_add(1, Ordering::SeqCst);
            eprintln!("write order:{id}: {e}");
            return StatusCode::INTERNAL_SERVER_ERROR;
        }
    };
    tracker.at(Stage::Holding);
    tokio::time::sleep(HOLD).await;
    tracker.at(Stage::Releasing);
    if let Err(e) = guard.release().await {
        tracker.finished();
        app.stats.errors.fetch_add(1, Ordering::SeqCst);
        eprintln!("release order:{id}: {e}");
        return StatusCode::INTERNAL_SERVER_ERROR;
    }
    tracker.finished();
    app.stats.completed.fetch_add(1, Ordering::SeqCst);
    StatusCode::OK
}

/// Reads the order's counter and writes it back plus one, while `guard`
/// holds its key; `writes` is bumped by the server itself, so a lost
/// update shows as `n < writes`.
async fn write_under(app: App, id: u32, guard: LockGuard) -> Result<LockGuard, sqlx::Error> {
    let table = &app.table;
    let n: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT n FROM {table} WHERE id = $1"
    )))
    .bind(id as i32)
    .fetch_one(&app.counter)
    .await?;
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {table} SET n = $2, writes = writes + 1 WHERE id = $1"
    )))
    .bind(id as i32)
    .bind(n + 1)
    .execute(&app.counter)
    .await?;
    app.stats.writes.fetch_add(1, Ordering::SeqCst);
    Ok(guard)
}

/// Posts to `/pay/{id}` over a connection of its own and answers the
/// response's status; the connection is kept alive by HTTP/1.1's default,
/// so hyper keeps reading it and sees a client that goes away.
async fn post_pay(addr: SocketAddr, id: u32) -> std::io::Result<u16> {
    let mut stream = TcpStream::connect(addr).await?;
    stream
        .write_all(
            format!("POST /pay/{id} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\n\r\n")
                .as_bytes(),
        )
        .await?;
    let mut response = Vec::new();
    let mut chunk = [0u8; 1024];
    loop {
        let read = stream.read(&mut chunk).await?;
        if read == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        response.extend_from_slice(&chunk[..read]);
        let Some(end) = response.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&response[..end]).to_ascii_lowercase();
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("no status in {head:?}")))?;
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map_or(Ok(0), |l| l.trim().parse())
            .map_err(std::io::Error::other)?;
        if response.len() >= end + 4 + length {
            return Ok(status);
        }
    }
}

/// Runs `CLIENTS` clients against `addr` for `length`, each hanging up
/// after a random timeout when `hang_up` is set.
async fn load(addr: SocketAddr, stats: &Arc<Stats>, length: Duration, hang_up: bool) {
    let end = Instant::now() + length;
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let stats = stats.clone();
            tokio::spawn(async move {
                while Instant::now() < end {
                    let id = rand::random_range(0..ORDERS);
                    stats.requests.fetch_add(1, Ordering::SeqCst);
                    let answer = if hang_up {
                        let timeout = Duration::from_millis(rand::random_range(TIMEOUTS_MS));
                        tokio::time::timeout(timeout, post_pay(addr, id)).await
                    } else {
                        Ok(post_pay(addr, id).await)
                    };
                    let counter = match answer {
                        Ok(Ok(200)) => &stats.served,
                        Ok(Ok(409)) => &stats.busy,
                        Ok(Ok(_) | Err(_)) => &stats.failed,
                        Err(_) => &stats.hung_up,
                    };
                    counter.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    for client in clients {
        client.await.expect("client");
    }
}

async fn admin() -> PgConnection {
    let url = SqlDb::Postgres.url();
    PgConnection::connect(&url)
        .await
        .unwrap_or_else(|e| servers_missing(&url, e))
}

/// The server connections of `app` seen in one phase of the load: those
/// opened in it (by process id and start), and the most open at once.
#[derive(Debug, Default)]
struct Connections {
    opened: HashSet<(i32, String)>,
    most_at_once: usize,
    /// What the connections were doing when most were open: how many in
    /// each state, waiting on what, with which statement.
    at_the_peak: Vec<(i64, String)>,
}

/// The phases the connection watcher tells apart.
const BASELINE_PHASE: usize = 0;
const HANG_UP_PHASE: usize = 1;
const STOP: usize = 2;

/// Samples the server connections of `app` every 50 ms, per phase (as
/// `phase` says), until `phase` is [`STOP`].
async fn watch_connections(
    app: String,
    phase: tokio::sync::watch::Receiver<usize>,
) -> [Connections; 2] {
    let mut conn = admin().await;
    let mut seen: [Connections; 2] = Default::default();
    let mut known = HashSet::new();
    loop {
        let current = *phase.borrow();
        if current == STOP {
            return seen;
        }
        let now: Vec<(i32, String, String)> = sqlx::query_as(
            "SELECT pid, backend_start::text, concat_ws(' ', state, wait_event, left(query, 48)) \
             FROM pg_stat_activity WHERE application_name = $1",
        )
        .bind(&app)
        .fetch_all(&mut conn)
        .await
        .expect("pg_stat_activity");
        let seen = &mut seen[current];
        if now.len() > seen.most_at_once {
            seen.most_at_once = now.len();
            let mut doing = HashMap::<String, i64>::new();
            for (_, _, what) in &now {
                *doing.entry(what.clone()).or_default() += 1;
            }
            seen.at_the_peak = doing.into_iter().map(|(what, n)| (n, what)).collect();
            seen.at_the_peak.sort_unstable_by(|a, b| b.cmp(a));
        }
        for (pid, start, _) in now {
            if known.insert((pid, start.clone())) {
                seen.opened.insert((pid, start));
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What is still held on the server and in the registry, as a list of
/// findings (empty when nothing is).
async fn held_anywhere(
    session: bool,
    registry: &Registry,
    prober: &Registry,
    table: &str,
    app: &str,
) -> Vec<String> {
    let mut held = Vec::new();
    if registry.held_leases() > 0 {
        held.push(format!(
            "the registry holds {} leases",
            registry.held_leases()
        ));
    }
    let mut conn = admin().await;
    let on_server: i64 = if session {
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE a.application_name = $1 AND l.locktype = 'advisory'",
        )
        .bind(app)
        .fetch_one(&mut conn)
        .await
        .expect("pg_locks")
    } else {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {table} WHERE owner IS NOT NULL AND expires_at > clock_timestamp()"
        )))
        .fetch_one(&mut conn)
        .await
        .expect("lease rows")
    };
    if on_server > 0 {
        held.push(format!("{on_server} locks held or awaited on the server"));
    }
    for id in 0..ORDERS {
        match prober
            .lock(format!("order:{id}"))
            .wait(Duration::ZERO)
            .acquire()
            .await
        {
            Ok(guard) => guard.release().await.expect("the prober's release"),
            Err(LockError::Busy { .. }) => held.push(format!("order:{id} is busy")),
            Err(e) => panic!("the prober's try of order:{id}: {e}"),
        }
    }
    held
}

/// One mode's figures.
#[derive(Debug)]
struct Figures {
    served_per_s: f64,
}

/// Serves the route on PostgreSQL in `mode`, runs the baseline phase and the
/// hang-up phase, checks what is left and answers the figures.
async fn run(session: bool) -> Figures {
    let mode = if session { "session" } else { "lease" };
    let run = format!("{:08x}", rand::random::<u32>());
    let table = format!("http_hangups_{mode}_{run}");
    let counter_table = format!("{table}_orders");
    let app_name = format!("http_hangups_{mode}_{run}");
    let prefix = format!("http-{run}:");
    let url = SqlDb::Postgres.url();

    let backend = SqlDb::Postgres
        .connect(&format!(
            "?mode={mode}&table={table}&application_name={app_name}"
        ))
        .await;
    let registry = Registry::builder()
        .default_backend(backend.postgres().clone())
        .key_prefix(&prefix)
        .build();
    let prober_backend = SqlDb::Postgres
        .connect(&format!("?mode={mode}&table={table}"))
        .await;
    let prober = Registry::builder()
        .default_backend(prober_backend.postgres().clone())
        .key_prefix(&prefix)
        .build();

    let counter = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(&format!("{url}?application_name={app_name}_orders"))
        .await
        .unwrap_or_else(|e| servers_missing(&url, e));
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {counter_table} (id int PRIMARY KEY, n bigint NOT NULL, writes bigint NOT NULL); \
         INSERT INTO {counter_table} SELECT g, 0, 0 FROM generate_series(0, {}) g",
        ORDERS - 1
    )))
    .execute(&counter)
    .await
    .expect("the counter table");
    let counters = || async {
        let rows: Vec<(i32, i64, i64)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, n, writes FROM {counter_table} ORDER BY id"
        )))
        .fetch_all(&counter)
        .await
        .expect("the counters");
        rows
    };

    let stats = Arc::new(Stats::default());
    let app = App {
        registry: registry.clone(),
        counter: counter.clone(),
        table: Arc::from(counter_table.as_str()),
        stats: stats.clone(),
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    let router = Router::new().route("/pay/{id}", post(pay)).with_state(app);
    let server = tokio::spawn(async move {
        axum::serve(listener, router).await.expect("serve");
    });
    let (phase, phases) = tokio::sync::watch::channel(BASELINE_PHASE);
    let watcher = tokio::spawn(watch_connections(app_name.clone(), phases));

    // The baseline: nobody hangs up, so every write is a response served.
    load(addr, &stats, BASELINE, false).await;
    let baseline_served = Stats::get(&stats.served);
    let baseline_writes: i64 = counters().await.iter().map(|r| r.1).sum();
    assert_eq!(
        baseline_writes as u64, baseline_served,
        "{mode}: without hang-ups the counter equals the responses served"
    );
    assert!(
        baseline_served > 0,
        "{mode}: nothing served in the baseline"
    );

    // The hang-ups.
    let before = (
        Stats::get(&stats.requests),
        Stats::get(&stats.served),
        Stats::get(&stats.busy),
    );
    phase.send(HANG_UP_PHASE).expect("the watcher");
    let started = Instant::now();
    load(addr, &stats, HANG_UPS, true).await;
    let elapsed = started.elapsed();
    let requests = Stats::get(&stats.requests) - before.0;
    let served = Stats::get(&stats.served) - before.1;
    let busy = Stats::get(&stats.busy) - before.2;
    let hung_up = Stats::get(&stats.hung_up);

    // Everything is free within a round trip (and room for the load).
    let load_stopped = Instant::now();
    let settled = loop {
        let held = held_anywhere(session, &registry, &prober, &table, &app_name).await;
        if held.is_empty() {
            break load_stopped.elapsed();
        }
        assert!(
            load_stopped.elapsed() < SETTLED_WITHIN,
            "{mode}: {:?} after the load stopped, still held: {held:?}",
            load_stopped.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    phase.send(STOP).expect("the watcher");
    let [baseline_connections, connections] = watcher.await.expect("the watcher");

    // No renewal goes on: the lease rows stay as they are.
    let expiries = || async {
        let rows: Vec<(String, String)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT key, expires_at::text FROM {table} ORDER BY key"
        )))
        .fetch_all(&mut admin().await)
        .await
        .expect("the lease rows");
        rows
    };
    if !session {
        let first = expiries().await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(first, expiries().await, "{mode}: a lease row was renewed");
    }
    assert_eq!(registry.held_leases(), 0, "{mode}: a lease is still held");

    // No lost update; every write was made by a handler that held the key.
    let rows = counters().await;
    let lost: HashMap<i32, (i64, i64)> = rows
        .iter()
        .filter(|(_, n, writes)| n != writes)
        .map(|&(id, n, writes)| (id, (n, writes)))
        .collect();
    assert!(
        lost.is_empty(),
        "{mode}: lost updates (order: (counter, writes)): {lost:?}"
    );
    let counted: i64 = rows.iter().map(|r| r.1).sum();
    assert_eq!(
        counted as u64,
        Stats::get(&stats.writes),
        "{mode}: the counter equals the writes the handlers made"
    );
    assert_eq!(
        Stats::get(&stats.writes),
        Stats::get(&stats.completed) + stats.dropped_holding(),
        "{mode}: every write belongs to a handler that answered or was dropped holding the key"
    );
    assert!(
        Stats::get(&stats.served) <= Stats::get(&stats.completed),
        "{mode}: more responses read than handlers answered"
    );
    assert_eq!(Stats::get(&stats.errors), 0, "{mode}: handlers failed");
    assert_eq!(Stats::get(&stats.failed), 0, "{mode}: requests failed");
    assert!(
        stats.dropped(Stage::Waiting) > 0,
        "{mode}: no handler was dropped while waiting: the clients never hung up on one"
    );

    let opened = connections.opened.len();
    let served_per_s = served as f64 / elapsed.as_secs_f64();
    println!(
        "http hang-ups, PostgreSQL {mode} mode: {CLIENTS} clients, {ORDERS} keys, \
         timeouts {}–{} ms, {:.1} s: {requests} requests, {served} served, {busy} busy, \
         {hung_up} hung up (handlers dropped waiting {}, writing {}, holding {}, releasing {}), \
         {served_per_s:.1} served/s (baseline {:.1}/s), connections opened {opened} \
         (at most {} at once; baseline {} opened, at most {} at once), \
         keys left 0 ({} ms after the load)",
        TIMEOUTS_MS.start(),
        TIMEOUTS_MS.end(),
        elapsed.as_secs_f64(),
        stats.dropped(Stage::Waiting),
        stats.dropped(Stage::Writing),
        stats.dropped(Stage::Holding),
        stats.dropped(Stage::Releasing),
        baseline_served as f64 / BASELINE.as_secs_f64(),
        connections.most_at_once,
        baseline_connections.opened.len(),
        baseline_connections.most_at_once,
        settled.as_millis(),
    );
    if session {
        // Each waiting or holding caller has one connection, and a cancel
        // borrows at most one more; hang-ups do not add to that.
        let bound = CLIENTS * 2 + 8;
        let opened = opened + baseline_connections.opened.len();
        assert!(
            opened <= bound,
            "{mode}: {opened} server connections opened for {CLIENTS} clients (bound {bound}); \
             at the peak of the hang-up phase ({} at once): {:?}",
            connections.most_at_once,
            connections.at_the_peak
        );
    }

    server.abort();
    let _ = server.await;
    drop(registry);
    drop(prober);
    counter.close().await;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS {counter_table}, {table}, {table}_fence"
    )))
    .execute(&mut admin().await)
    .await
    .expect("drop the tables");
    Figures { served_per_s }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_hang_up_leave_no_key_held_no_lost_update_and_bounded_connections() {
    let lease = run(false).await;
    let session = run(true).await;
    println!(
        "http hang-ups: session/lease served/s under hang-ups = {:.2}",
        session.served_per_s / lease.served_per_s
    );
    assert!(
        session.served_per_s >= lease.served_per_s / 4.0,
        "session mode serves {:.1}/s under hang-ups, lease mode {:.1}/s",
        session.served_per_s,
        lease.served_per_s
    );
}
