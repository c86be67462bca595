//! What a worker prints, and what it hears from dlock's runtime.
//!
//! Every line a worker prints goes through one writer thread ([`line()`]): the
//! runtime's events arrive on its watchdog and I/O threads, which must never
//! block on a full pipe (a renewal held up by the orchestrator's reading would be
//! a fault the nemesis did not inject). Each line is stamped when it happens.
//!
//! [`TraceLayer`] is a `tracing_subscriber` layer that turns the runtime's
//! events about a lease (`dlock acquired`, `dlock renewal sent`, `dlock lease
//! renewed`, `dlock release requested`, `dlock lease lost`) into
//! [`TraceEvent`]s. Each `dlock.lock` span (one per acquisition) gets a serial
//! number when it opens, and the lease the worker asked for ([`with_lease`]),
//! so the checker can tell two leases of one key apart even without a token.

use std::fmt;
use std::future::Future;
use std::io::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde::Serialize;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Subscriber};
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::{Layer, Registry};

use crate::clock::now_ns;
use crate::history::{TraceEvent, TraceKind};

/// The writer thread's queue; `None` before [`start`] and after [`finish`].
static OUT: Mutex<Option<mpsc::Sender<Vec<u8>>>> = Mutex::new(None);
/// The writer thread, joined by [`finish`].
static WRITER: Mutex<Option<JoinHandle<()>>> = Mutex::new(None);

/// Starts the writer thread and installs the tracing subscriber: the runtime's
/// lease events become [`TraceEvent`] lines; its warnings go to standard error
/// (the worker's log file).
pub(crate) fn start(w: usize, inc: u32) -> anyhow::Result<()> {
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    let writer = std::thread::Builder::new()
        .name("chaos-out".into())
        .spawn(move || {
            let mut out = std::io::stdout().lock();
            for line in rx {
                // One write per line: a reader never sees half of one unless we
                // are killed.
                let _ = out.write_all(&line).and_then(|()| out.flush());
            }
        })?;
    *OUT.lock().unwrap_or_else(|p| p.into_inner()) = Some(tx);
    *WRITER.lock().unwrap_or_else(|p| p.into_inner()) = Some(writer);

    let subscriber = Registry::default()
        .with(
            TraceLayer { w, inc }
                .with_filter(Targets::new().with_target("dlock_runtime", LevelFilter::TRACE)),
        )
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(false)
                .with_filter(LevelFilter::WARN),
        );
    tracing::subscriber::set_global_default(subscriber)?;
    Ok(())
}

/// Queues one JSON line for standard output.
pub(crate) fn line<T: Serialize>(value: &T) {
    let mut bytes = serde_json::to_vec(value).expect("records serialize");
    bytes.push(b'\n');
    if let Some(tx) = OUT.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
        let _ = tx.send(bytes);
    }
}

/// Writes out every queued line and stops the writer thread; later lines are
/// dropped.
pub(crate) fn finish() {
    drop(OUT.lock().unwrap_or_else(|p| p.into_inner()).take());
    if let Some(writer) = WRITER.lock().unwrap_or_else(|p| p.into_inner()).take() {
        let _ = writer.join();
    }
}

tokio::task_local! {
    /// The lease (ms) the worker asks for in the acquisition polled inside.
    static LEASE_MS: u64;
}

/// Runs `future` (an acquisition) telling the layer which lease it asks for:
/// the `dlock.lock` span it opens records it.
pub(crate) async fn with_lease<F: Future>(lease: Duration, future: F) -> F::Output {
    LEASE_MS.scope(lease.as_millis() as u64, future).await
}

/// Serial numbers of the `dlock.lock` spans of this process.
static NEXT_LEASE: AtomicU64 = AtomicU64::new(1);

/// What the layer keeps in each `dlock.lock` span.
#[derive(Debug, Clone)]
struct LeaseInfo {
    serial: u64,
    lease_ms: Option<u64>,
    key: String,
    backend: String,
    /// Recorded on the span once the lock is granted (events such as a loss
    /// do not carry it themselves).
    token: Option<u64>,
}

/// The layer: see the [module docs](self).
pub(crate) struct TraceLayer {
    w: usize,
    inc: u32,
}

impl<S> Layer<S> for TraceLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if attrs.metadata().name() != "dlock.lock" {
            return;
        }
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        let info = LeaseInfo {
            serial: NEXT_LEASE.fetch_add(1, Ordering::Relaxed),
            lease_ms: LEASE_MS.try_with(|ms| *ms).ok(),
            key: fields.key.unwrap_or_default(),
            backend: fields.backend.unwrap_or_default(),
            token: fields.token,
        };
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(info);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else {
            return;
        };
        let mut extensions = span.extensions_mut();
        if let Some(info) = extensions.get_mut::<LeaseInfo>() {
            let mut fields = Fields::default();
            values.record(&mut fields);
            if fields.token.is_some() {
                info.token = fields.token;
            }
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let t = now_ns();
        let mut fields = Fields::default();
        event.record(&mut fields);
        let Some(kind) = fields.message.as_deref().and_then(TraceKind::from_message) else {
            return;
        };
        let Some(info) = ctx.event_scope(event).and_then(|scope| {
            scope
                .into_iter()
                .find_map(|span| span.extensions().get::<LeaseInfo>().cloned())
        }) else {
            return;
        };
        line(&TraceEvent {
            t,
            w: self.w,
            inc: self.inc,
            event: kind,
            key: fields.key.unwrap_or(info.key),
            token: fields.token.or(info.token),
            lease: info.serial,
            lease_ms: info.lease_ms,
            backend: fields.backend.unwrap_or(info.backend),
            reason: fields.reason,
            loss_reason: fields.loss_reason,
        });
    }
}

/// The fields of the runtime's spans and events the layer reads.
#[derive(Default)]
struct Fields {
    message: Option<String>,
    key: Option<String>,
    token: Option<u64>,
    backend: Option<String>,
    reason: Option<String>,
    loss_reason: Option<String>,
}

impl Fields {
    fn set(&mut self, name: &str, value: String) {
        match name {
            "message" => self.message = Some(value),
            "key" => self.key = Some(value),
            "backend" => self.backend = Some(value),
            "reason" => self.reason = Some(value),
            "loss_reason" => self.loss_reason = Some(value),
            "token" => self.token = value.parse().ok(),
            _ => {}
        }
    }
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.set(field.name(), value.to_owned());
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "token" {
            self.token = Some(value);
        }
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        if field.name() == "token" {
            self.token = u64::try_from(value).ok();
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.set(field.name(), format!("{value:?}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One test at a time owns [`OUT`].
    static SERIAL: Mutex<()> = Mutex::new(());

    /// The layer reads the runtime's real events: a lock taken and released on
    /// the memory backend gives `acquired` then `release_requested`, with the
    /// key, the token, the lease asked for and one serial.
    #[test]
    fn captures_the_runtimes_lease_events() {
        let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let (tx, rx) = mpsc::channel();
        *OUT.lock().unwrap() = Some(tx);
        let subscriber = Registry::default().with(
            TraceLayer { w: 3, inc: 1 }
                .with_filter(Targets::new().with_target("dlock_runtime", LevelFilter::TRACE)),
        );
        let _default = tracing::subscriber::set_default(subscriber);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let registry = dlock_runtime::Registry::builder()
                .default_backend(dlock_runtime::MemoryBackend::new())
                .build();
            let guard = with_lease(
                Duration::from_millis(400),
                registry
                    .lock("k")
                    .lease(Duration::from_millis(400))
                    .acquire(),
            )
            .await
            .unwrap();
            guard.release().await.unwrap();
        });
        drop(OUT.lock().unwrap().take());
        let events: Vec<TraceEvent> = rx
            .iter()
            .map(|l| serde_json::from_slice(&l).unwrap())
            .collect();
        let kinds: Vec<TraceKind> = events.iter().map(|e| e.event).collect();
        assert_eq!(
            kinds,
            [TraceKind::Acquired, TraceKind::ReleaseRequested],
            "{events:?}"
        );
        for e in &events {
            assert_eq!((e.w, e.inc, e.key.as_str()), (3, 1, "k"));
            assert_eq!(e.lease_ms, Some(400));
            assert_eq!(e.backend, "default");
            assert!(e.token.is_some());
            assert_eq!(e.lease, events[0].lease);
        }
    }

    /// A loss carries both the runtime's description (`reason`) and the
    /// reason's short name (`loss_reason`), as `signal_lost` writes them.
    #[test]
    fn captures_both_names_of_a_loss_reason() {
        let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let (tx, rx) = mpsc::channel();
        *OUT.lock().unwrap() = Some(tx);
        let subscriber = Registry::default().with(
            TraceLayer { w: 1, inc: 0 }
                .with_filter(Targets::new().with_target("dlock_runtime", LevelFilter::TRACE)),
        );
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!(target: "dlock_runtime", "dlock.lock", key = "k", backend = "default");
            tracing::warn!(
                target: "dlock_runtime",
                parent: &span,
                key = "k",
                backend = "default",
                reason = "the key was revoked on the server",
                loss_reason = "revoked",
                "dlock lease lost"
            );
        });
        drop(OUT.lock().unwrap().take());
        let events: Vec<TraceEvent> = rx
            .iter()
            .map(|l| serde_json::from_slice(&l).unwrap())
            .collect();
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(events[0].event, TraceKind::Lost);
        assert_eq!(events[0].loss_reason.as_deref(), Some("revoked"));
        assert_eq!(
            events[0].reason.as_deref(),
            Some("the key was revoked on the server")
        );
    }
}
