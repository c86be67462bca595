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
//! If the client disconnects, axum drops the handler's future, and the lock
//! is released at once (not after the lease).
//!
//! On Ctrl-C the server drains its requests (axum's graceful shutdown), then
//! calls [`dlock_runtime::shutdown`], which releases every lease still held
//! and waits for releases on their way, so a rolling restart does not leave
//! keys held for a lease.
//!
//! `--self-test` serves on a free port and sends two concurrent requests for
//! order 7 (one must get 200, the other 409 with the JSON body), then one for
//! order 8 (200), printing what it saw.
//!
//! The lock backend comes from `DLOCK_URL` (default: a SQLite file in the
//! workspace's `target/` directory); `DLOCK_URL=memory://` works too, for a
//! single process.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::extract::{Path as UrlPath, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use dlock_examples::Args;
use dlock_runtime::{LockError, Registry, distributed_lock};
use serde_json::{Value, json};
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

/// The payments made so far. In-process here; in a real service a database
/// shared by every replica, which is why the lock must be distributed.
#[derive(Debug, Clone, Default)]
struct Ledger(Arc<Mutex<HashMap<u64, Receipt>>>);

impl Ledger {
    fn get(&self, order: u64) -> Option<Receipt> {
        self.0.lock().expect("ledger").get(&order).cloned()
    }

    fn insert(&self, receipt: Receipt) {
        self.0
            .lock()
            .expect("ledger")
            .insert(receipt.order, receipt);
    }
}

/// Pays order `id` once: check, charge, record, as one step for this order
/// across every replica. Another request for the same order waits up to
/// 200 ms, then fails with `LockError::Busy` (turned into [`ApiError::Busy`]).
#[distributed_lock(key = "order:{id}", wait = "200ms", lease = "10s")]
async fn pay(id: u64, ledger: &Ledger) -> Result<Receipt, ApiError> {
    // Without the lock, two requests could both see "not paid" and charge twice.
    if let Some(receipt) = ledger.get(id) {
        return Ok(receipt); // paid before: answer the same receipt
    }
    let fencing_token = dlock_runtime::current()
        .and_then(|lock| lock.fencing_token())
        .map(u64::from);
    tracing::info!(order = id, ?fencing_token, "charging");
    tokio::time::sleep(Duration::from_secs(1)).await; // the payment provider
    let receipt = Receipt {
        order: id,
        fencing_token,
    };
    ledger.insert(receipt.clone());
    Ok(receipt)
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
            other => ApiError::Internal(other),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match &self {
            // 409 rather than 423 Locked: 423 belongs to WebDAV, whose clients
            // can discover and remove locks; here the request merely conflicts
            // with one in progress on the same resource, what 409 says, and
            // what generic HTTP clients understand. `Retry-After` says when.
            ApiError::Busy { .. } => StatusCode::CONFLICT,
            ApiError::Lost { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(err) => {
                tracing::error!(error = %err, "lock failure");
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        let retry = !matches!(self, ApiError::Internal(_));
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

fn app() -> Router {
    Router::new()
        .route("/orders/{id}/pay", post(pay_order))
        .with_state(Ledger::default())
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
async fn self_test(addr: SocketAddr) -> anyhow::Result<bool> {
    let show = |what: &str, reply: &Reply| {
        println!(
            "  {what:<28} -> {} in {:>4} ms  {}",
            reply.status,
            reply.took.as_millis(),
            reply.body
        );
    };
    let mut failures = Vec::new();

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

    println!();
    for failure in &failures {
        println!("FAIL  {failure}");
    }
    if failures.is_empty() {
        println!("PASS: the same order is paid by one request at a time, the other gets 409");
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

    let url = dlock_examples::dlock_url();
    println!("lock backend: {url}");
    dlock_runtime::init(Registry::from_url(&url).await?)?;

    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let addr = listener.local_addr()?;
    println!("listening on http://{addr}");

    if test {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(
            axum::serve(listener, app())
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .into_future(),
        );
        let mut passed = self_test(addr).await?;
        let _ = stop.send(());
        server.await??;
        passed &= shut_down_locks().await;
        return Ok(passed);
    }

    println!("try two at once:");
    println!(
        "  curl -s -XPOST http://{addr}/orders/7/pay & curl -s -XPOST http://{addr}/orders/7/pay; wait"
    );
    axum::serve(listener, app())
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(shut_down_locks().await)
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
