//! # axum_handler: a locked HTTP handler; a concurrent request gets 409
//!
//! ```sh
//! cargo run --example axum_handler                        # serve until Ctrl-C
//! cargo run --example axum_handler -- --addr 127.0.0.1:3000
//! cargo run --example axum_handler -- --self-test         # check itself, exit 0/1
//! ```
//!
//! `POST /orders/{id}/pay` calls [`pay`], which holds the lock `order:{id}`
//! while it charges the order (~1 s). A second request for the same order,
//! from this process or any other replica sharing the lock backend, waits at
//! most 200 ms for the lock, then gets `409 Conflict` with a JSON body saying
//! it may retry; requests for other orders are not held up. [`ApiError`] shows
//! how a [`LockError`] becomes an HTTP response.
//!
//! The payment is recorded in the same SQLite database as the lock, through
//! the fence ([`dlock_runtime::fence::check_current`]): in the recording
//! transaction, the order's fence keeps the largest fencing token that wrote
//! it, and a request whose lease ran out while it was charging (a pause, a
//! slow provider) and whose order has since been handled by a newer holder
//! is refused (`LockError::Fenced`, `409`), its transaction rolled back.
//!
//! If the client disconnects, axum drops the handler's future, and the lock
//! is released at once (not after the lease).
//!
//! `GET /metrics` serves dlock's metrics (dlock's `metrics` feature) in the
//! Prometheus text format through `metrics-exporter-prometheus`: acquisitions,
//! busy answers, releases, losses by reason, renewals, the leases held and the
//! acquisitions waiting, and histograms of the wait, of the hold and of how
//! late a loss reached its holder — labelled with the attribute's key
//! template (`key="order:{id}"`), never with the order's own key.
//!
//! On Ctrl-C the server drains its requests (axum's graceful shutdown), then
//! calls [`dlock_runtime::shutdown`], which releases every lease still held
//! and waits for releases on their way, so a rolling restart does not leave
//! keys held for a lease.
//!
//! `--self-test` serves on a free port and sends two concurrent requests for
//! order 7 (one must get 200, the other 409 with the JSON body), then one for
//! order 8 (200), then checks that a late write with an older token is
//! refused by the fence and leaves the payment as it was, printing what it
//! saw.
//!
//! The lock backend comes from `DLOCK_URL` (default: a SQLite file in the
//! workspace's `target/` directory), and the payments go to the same file.
//! With another URL (`DLOCK_URL=memory://` works, for a single process), the
//! payments are kept in an in-memory SQLite database.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::extract::{Path as UrlPath, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dlock_examples::Args;
use dlock_runtime::{FencingToken, LockError, Registry, distributed_lock, fence};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use serde_json::{Value, json};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

// ---------------------------------------------------------------------------
// The locked operation and its error type: this is the part to copy.
// ---------------------------------------------------------------------------

/// Proof of a payment.
#[derive(Debug, Clone)]
struct Receipt {
    order: u64,
    /// The fencing token of the lock the payment was made under: the payment
    /// provider or database can refuse a late write from an older holder.
    fencing_token: Option<u64>,
}

/// The payments, in the database the locks live in: shared by every replica,
/// which is why the lock must be distributed.
#[derive(Debug, Clone)]
struct Ledger(SqlitePool);

impl Ledger {
    async fn open(url: &str) -> anyhow::Result<Ledger> {
        let options = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .busy_timeout(Duration::from_secs(5));
        // One connection for an in-memory database (each has its own).
        let connections = if url.contains(":memory:") { 1 } else { 4 };
        let pool = SqlitePoolOptions::new()
            .max_connections(connections)
            .connect_with(options)
            .await?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS payments \
             (order_id INTEGER PRIMARY KEY, fencing_token INTEGER NOT NULL)",
        )
        .execute(&pool)
        .await?;
        Ok(Ledger(pool))
    }

    async fn get(&self, order: u64) -> Result<Option<Receipt>, ApiError> {
        let token: Option<i64> =
            sqlx::query_scalar("SELECT fencing_token FROM payments WHERE order_id = ?")
                .bind(order as i64)
                .fetch_optional(&self.0)
                .await?;
        Ok(token.map(|t| Receipt {
            order,
            fencing_token: Some(t as u64),
        }))
    }

    /// Records the payment of `order`, fenced with the token of the lock the
    /// task holds (`token` overrides it): refused with `LockError::Fenced`
    /// (and rolled back) if a newer holder of `order:{order}` has written it
    /// since.
    async fn record(&self, order: u64, token: Option<FencingToken>) -> Result<Receipt, ApiError> {
        let resource = format!("order:{order}");
        let mut tx = self.0.begin().await?;
        // First in the transaction, before the writes it protects.
        let token = match token {
            Some(token) => {
                fence::check(&mut tx, &resource, token).await?;
                token
            }
            None => {
                fence::check_current(&mut tx, &resource).await?;
                let lock = dlock_runtime::current().expect("check_current passed: a lock is held");
                lock.fencing_token()
                    .expect("check_current passed: it has a token")
            }
        };
        sqlx::query(
            "INSERT INTO payments (order_id, fencing_token) VALUES (?, ?) \
             ON CONFLICT (order_id) DO UPDATE SET fencing_token = excluded.fencing_token",
        )
        .bind(order as i64)
        .bind(token.get() as i64)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Receipt {
            order,
            fencing_token: Some(token.get()),
        })
    }
}

/// Pays order `id` once: check, charge, record, as one step for this order
/// across every replica. Another request for the same order waits up to
/// 200 ms, then fails with `LockError::Busy` (turned into [`ApiError::Busy`]).
/// The record is fenced with the lock's token, so a holder whose lease ran
/// out while charging cannot overwrite a newer holder's record.
#[distributed_lock(key = "order:{id}", wait = "200ms", lease = "10s")]
async fn pay(id: u64, ledger: &Ledger) -> Result<Receipt, ApiError> {
    // Without the lock, two requests could both see "not paid" and charge twice.
    if let Some(receipt) = ledger.get(id).await? {
        return Ok(receipt); // paid before: answer the same receipt
    }
    let token = dlock_runtime::current().and_then(|lock| lock.fencing_token());
    tracing::info!(order = id, fencing_token = ?token, "charging");
    tokio::time::sleep(Duration::from_secs(1)).await; // the payment provider
    // Fenced with this lock's token (a `LockError::Config` on Redlock, which
    // has none).
    ledger.record(id, None).await
}

/// An error a handler returns; `IntoResponse` picks its status and JSON body.
#[derive(Debug, thiserror::Error)]
enum ApiError {
    /// Another request holds the lock: `409 Conflict`, retry later.
    #[error("{key} is being paid by another request, retry later")]
    Busy { key: String },
    /// The lease was lost while paying, and the payment was stopped at its next
    /// `.await`: `503 Service Unavailable`, retry later.
    #[error("the lock on {key} was lost while paying, retry later")]
    Lost { key: String },
    /// A newer holder of the order's lock wrote its payment after this
    /// request's lease ran out: the fence refused this one's record, which
    /// was rolled back. `409 Conflict`; a retry answers the recorded receipt.
    #[error("{resource} was paid by a newer request meanwhile, retry to see its receipt")]
    Stale { resource: String },
    /// The payments database failed: `500`.
    #[error("internal error")]
    Database(#[source] sqlx::Error),
    /// Anything else (backend down, misconfiguration): `500`, details only in
    /// the server's log.
    #[error("internal error")]
    Internal(#[source] LockError),
}

impl From<LockError> for ApiError {
    fn from(err: LockError) -> Self {
        match err {
            LockError::Busy { key, .. } => ApiError::Busy { key },
            LockError::Lost { key, .. } => ApiError::Lost { key },
            LockError::Fenced { resource, .. } => ApiError::Stale { resource },
            other => ApiError::Internal(other),
        }
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(err: sqlx::Error) -> Self {
        ApiError::Database(err)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match &self {
            // 409 rather than 423 Locked: 423 belongs to WebDAV, whose clients
            // can discover and remove locks; here the request merely conflicts
            // with one in progress on the same resource, what 409 says, and
            // what generic HTTP clients understand. `Retry-After` says when.
            ApiError::Busy { .. } | ApiError::Stale { .. } => StatusCode::CONFLICT,
            ApiError::Lost { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(err) => {
                tracing::error!(error = %err, "lock failure");
                StatusCode::INTERNAL_SERVER_ERROR
            }
            ApiError::Database(err) => {
                tracing::error!(error = %err, "payments database failure");
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        let retry = !matches!(self, ApiError::Internal(_) | ApiError::Database(_));
        let body = Json(json!({ "error": self.to_string(), "retry": retry }));
        if retry {
            (status, [(header::RETRY_AFTER, "1")], body).into_response()
        } else {
            (status, body).into_response()
        }
    }
}

/// `POST /orders/{id}/pay`
async fn pay_order(
    State(ledger): State<Ledger>,
    UrlPath(id): UrlPath<u64>,
) -> Result<Json<Value>, ApiError> {
    let receipt = pay(id, &ledger).await?;
    Ok(Json(json!({
        "order": receipt.order,
        "paid": true,
        "fencing_token": receipt.fencing_token,
    })))
}

fn app(ledger: Ledger, metrics: PrometheusHandle) -> Router {
    Router::new()
        .route("/orders/{id}/pay", post(pay_order))
        .route(
            "/metrics",
            get(move || std::future::ready(metrics.render())),
        )
        .with_state(ledger)
}

/// Installs the Prometheus recorder that dlock's metrics go to, with
/// histogram buckets (without them the exporter renders summaries) from
/// 1 ms to 30 s, and its upkeep task.
fn install_metrics() -> anyhow::Result<PrometheusHandle> {
    let seconds = [
        0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    ];
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Prefix("dlock_".to_owned()), &seconds)?
        .install_recorder()?;
    dlock_runtime::metrics::describe();
    let upkeep = handle.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

// ---------------------------------------------------------------------------
// The self-test: plain HTTP/1.1 over a TCP stream, no client library.
// ---------------------------------------------------------------------------

/// A response as the self-test sees it.
struct Reply {
    status: u16,
    body: String,
    took: Duration,
}

/// Sends `POST path` with an empty body, and reads the whole response
/// (`Connection: close` makes the server end it).
async fn post_to(addr: SocketAddr, path: &str) -> anyhow::Result<Reply> {
    let started = Instant::now();
    let mut stream = TcpStream::connect(addr).await?;
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("no end of headers in the response")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .context("no status code in the response")?;
    Ok(Reply {
        status,
        body: body.to_owned(),
        took: started.elapsed(),
    })
}

/// Runs the checks against the server at `addr`; true if all passed.
async fn self_test(addr: SocketAddr, ledger: &Ledger) -> anyhow::Result<bool> {
    let show = |what: &str, reply: &Reply| {
        println!(
            "  {what:<28} -> {} in {:>4} ms  {}",
            reply.status,
            reply.took.as_millis(),
            reply.body
        );
    };
    let mut failures = Vec::new();
    // Orders 7 and 8 unpaid, whatever an earlier self-test on this file did.
    sqlx::query("DELETE FROM payments WHERE order_id IN (7, 8)")
        .execute(&ledger.0)
        .await?;

    println!("two concurrent requests for order 7:");
    let (a, b) = tokio::join!(
        post_to(addr, "/orders/7/pay"),
        post_to(addr, "/orders/7/pay")
    );
    let (a, b) = (a?, b?);
    show("POST /orders/7/pay", &a);
    show("POST /orders/7/pay", &b);
    let (ok, busy) = if a.status == 200 { (a, b) } else { (b, a) };
    if ok.status != 200 || busy.status != 409 {
        failures.push(format!(
            "expected one 200 and one 409, got {} and {}",
            ok.status, busy.status
        ));
    } else {
        let body: Value = serde_json::from_str(&busy.body).unwrap_or_default();
        let explained = body["error"]
            .as_str()
            .is_some_and(|e| e.contains("order:7"));
        if !explained || body["retry"] != json!(true) {
            failures.push(format!(
                "the 409 body should be {{\"error\": \"… order:7 …\", \"retry\": true}}, got {}",
                busy.body
            ));
        }
    }

    println!("then one for another order:");
    let other = post_to(addr, "/orders/8/pay").await?;
    show("POST /orders/8/pay", &other);
    if other.status != 200 {
        failures.push(format!("order 8: expected 200, got {}", other.status));
    }

    println!("then a late record of order 7 with an older token:");
    let paid = ledger
        .get(7)
        .await
        .ok()
        .flatten()
        .and_then(|r| r.fencing_token);
    match paid {
        Some(token) if token >= 1 => {
            let late = ledger.record(7, Some(FencingToken::new(token - 1))).await;
            let after = ledger
                .get(7)
                .await
                .ok()
                .flatten()
                .and_then(|r| r.fencing_token);
            println!(
                "  {:<28} -> {late:?}",
                format!("record(7, token {})", token - 1)
            );
            if !matches!(late, Err(ApiError::Stale { .. })) || after != Some(token) {
                failures.push(format!(
                    "a record with token {} should be refused and leave token {token}, \
                     got {late:?} and {after:?}",
                    token - 1
                ));
            }
        }
        other => failures.push(format!(
            "order 7 should be recorded with a token, got {other:?}"
        )),
    }

    println!();
    for failure in &failures {
        println!("FAIL  {failure}");
    }
    if failures.is_empty() {
        println!(
            "PASS: the same order is paid by one request at a time, the other gets 409, \
             and a stale record is refused"
        );
    }
    Ok(failures.is_empty())
}

// ---------------------------------------------------------------------------
// Start-up.
// ---------------------------------------------------------------------------

fn main() -> ExitCode {
    dlock_examples::main(run())
}

/// Serves, or runs the self-test; `Ok(false)` if the self-test failed.
async fn run() -> anyhow::Result<bool> {
    let mut addr: SocketAddr = ([127, 0, 0, 1], 0).into();
    let mut test = false;
    let mut args = Args::from_env("axum_handler [--addr HOST:PORT (127.0.0.1:0)] [--self-test]");
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--addr" => addr = args.value("--addr")?,
            "--self-test" => test = true,
            other => return Err(args.unknown(other)),
        }
    }

    let metrics = install_metrics()?;
    let url = dlock_examples::dlock_url();
    println!("lock backend: {url}");
    dlock_runtime::init(Registry::from_url(&url).await?)?;
    let ledger = Ledger::open(&ledger_url(&url)).await?;

    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let addr = listener.local_addr()?;
    println!("listening on http://{addr}");

    if test {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(
            axum::serve(listener, app(ledger.clone(), metrics))
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .into_future(),
        );
        let mut passed = self_test(addr, &ledger).await?;
        let _ = stop.send(());
        server.await??;
        passed &= shut_down_locks().await;
        return Ok(passed);
    }

    println!("try two at once:");
    println!(
        "  curl -s -XPOST http://{addr}/orders/7/pay & curl -s -XPOST http://{addr}/orders/7/pay; wait"
    );
    println!("  curl -s http://{addr}/metrics");
    axum::serve(listener, app(ledger, metrics))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(shut_down_locks().await)
}

/// The payments database: the lock's SQLite file (without dlock's own
/// `?options`), or an in-memory one.
fn ledger_url(lock_url: &str) -> String {
    if lock_url.starts_with("sqlite://") {
        lock_url.split('?').next().unwrap_or(lock_url).to_owned()
    } else {
        // Tokens of another backend (`memory://` restarts them in every
        // process) are not comparable with a file's stored fences.
        "sqlite::memory:".to_owned()
    }
}

/// The last step of a graceful shutdown (a rolling deploy): once the HTTP
/// server has drained its requests, release whatever locks are still held —
/// by background tasks, or releases still on their way — so the next replica
/// need not wait for their leases to run out. True if every release finished.
async fn shut_down_locks() -> bool {
    let report = dlock_runtime::shutdown(Duration::from_secs(5)).await;
    println!(
        "locks shut down: {} lease(s) released, {} release(s) unfinished",
        report.released, report.unfinished
    );
    report.unfinished == 0
}
