//! The runtime's side of hold modes: several keys are taken in one step
//! only as whole keys (readers and semaphores go key by key through the
//! wait loop, whose rules their modes need), and the `dlock.lock` span
//! names the mode and the slot.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use dlock_runtime::backend::{
    AcquireRequest, Attempt, AttemptAll, HoldMode, Lease, Renewal, WakeSource,
};
use dlock_runtime::{BackendError, LockBackend, LockError, MemoryBackend, Registry};
use dlock_tests::unique_key;
use futures_util::future::BoxFuture;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Level, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::{Context, SubscriberExt as _};

/// A [`MemoryBackend`] that claims a one-step path for several keys and
/// counts its use; the step itself answers an error.
#[derive(Debug, Default)]
struct OneStep {
    inner: MemoryBackend,
    one_steps: AtomicUsize,
}

impl LockBackend for OneStep {
    fn kind(&self) -> &'static str {
        "one-step-memory"
    }

    fn offers(&self, mode: HoldMode) -> Result<(), String> {
        self.inner.offers(mode)
    }

    fn try_acquire<'a>(
        &'a self,
        request: &'a AcquireRequest,
    ) -> BoxFuture<'a, Result<Attempt, BackendError>> {
        self.inner.try_acquire(request)
    }

    fn try_acquire_all<'a>(
        &'a self,
        requests: &'a [AcquireRequest],
    ) -> Option<BoxFuture<'a, Result<AttemptAll, BackendError>>> {
        let _ = requests;
        Some(Box::pin(async move {
            self.one_steps.fetch_add(1, Ordering::SeqCst);
            Err(BackendError::permanent("the one-step path was taken"))
        }))
    }

    fn wake_source<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, WakeSource> {
        self.inner.wake_source(request)
    }

    fn abandon<'a>(&'a self, request: &'a AcquireRequest) -> BoxFuture<'a, ()> {
        self.inner.abandon(request)
    }

    fn renew_all<'a>(
        &'a self,
        batch: &'a [(&'a Lease, Duration)],
    ) -> BoxFuture<'a, Vec<Result<Renewal, BackendError>>> {
        self.inner.renew_all(batch)
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<(), BackendError>> {
        self.inner.release(lease)
    }

    fn needs_io_runtime(&self) -> bool {
        false
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_keys_take_the_one_step_path_only_as_whole_keys() {
    // The collector is installed before this test's spans exist too.
    fields();
    let backend = Arc::new(OneStep::default());
    let registry = Registry::builder()
        .default_backend(backend.clone() as Arc<dyn LockBackend>)
        .build();
    let keys = [unique_key("one-step-a"), unique_key("one-step-b")];

    let read = registry
        .lock_all(&keys)
        .read()
        .acquire()
        .await
        .expect("read");
    assert!(read.permit().is_none());
    read.release().await.expect("release");
    let permit = registry
        .lock_all(&keys)
        .permits(3)
        .acquire()
        .await
        .expect("a permit of each");
    assert_eq!(permit.permit(), Some(0));
    permit.release().await.expect("release");
    assert_eq!(
        backend.one_steps.load(Ordering::SeqCst),
        0,
        "readers and permits went through the one-step path"
    );

    let whole = registry.lock_all(&keys).acquire().await;
    assert!(
        matches!(whole, Err(LockError::Backend { .. })),
        "whole keys take the one-step path: {whole:?}"
    );
    assert_eq!(backend.one_steps.load(Ordering::SeqCst), 1);
}

/// The `mode` and `slot` fields of one span.
type ModeAndSlot = (Option<String>, Option<String>);

/// The `key`, `mode` and `slot` fields of every `dlock.lock` span this
/// process opened, in order; `by_id` finds a span's entry (span ids are
/// reused once a span closes, so the newest span of an id owns it).
#[derive(Default)]
struct Fields {
    spans: Vec<(Option<String>, ModeAndSlot)>,
    by_id: HashMap<u64, usize>,
}

/// The process's one collector: installed as the global default (a
/// subscriber set per thread can miss the span's callsite while another
/// test's thread registers it with no subscriber).
fn fields() -> &'static Mutex<Fields> {
    static FIELDS: OnceLock<&'static Mutex<Fields>> = OnceLock::new();
    FIELDS.get_or_init(|| {
        let fields: &'static Mutex<Fields> = Box::leak(Box::default());
        let subscriber = tracing_subscriber::registry()
            .with(Collect(fields))
            .with(LevelFilter::from_level(Level::DEBUG));
        tracing::subscriber::set_global_default(subscriber).expect("the only global subscriber");
        fields
    })
}

struct Collect(&'static Mutex<Fields>);

struct Visitor<'a>(&'a mut (Option<String>, ModeAndSlot));

impl Visit for Visitor<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let text = || format!("{value:?}").trim_matches('"').to_owned();
        match field.name() {
            "key" => self.0.0 = Some(text()),
            "mode" => self.0.1.0 = Some(text()),
            "slot" => self.0.1.1 = Some(format!("{value:?}")),
            _ => {}
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "key" => self.0.0 = Some(value.to_owned()),
            "mode" => self.0.1.0 = Some(value.to_owned()),
            _ => {}
        }
    }
}

impl<S: Subscriber> Layer<S> for Collect {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _ctx: Context<'_, S>) {
        if attrs.metadata().name() == "dlock.lock" {
            let mut entry = (None, (None, None));
            attrs.record(&mut Visitor(&mut entry));
            let mut fields = self.0.lock().unwrap();
            let index = fields.spans.len();
            fields.spans.push(entry);
            fields.by_id.insert(id.into_u64(), index);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _ctx: Context<'_, S>) {
        let mut fields = self.0.lock().unwrap();
        if let Some(&index) = fields.by_id.get(&id.into_u64()) {
            values.record(&mut Visitor(&mut fields.spans[index]));
        }
    }
}

#[tokio::test(flavor = "current_thread")]
async fn the_lock_span_names_the_mode_and_the_slot() {
    let fields = fields();
    let registry = Registry::builder()
        .default_backend(MemoryBackend::new())
        .build();
    let key = unique_key("span-fields");
    let plain = registry.lock(&key).acquire().await.expect("plain");
    plain.release().await.expect("release");
    let reader = registry.lock(&key).read().acquire().await.expect("read");
    reader.release().await.expect("release");
    let first = registry
        .lock(&key)
        .permits(2)
        .acquire()
        .await
        .expect("permit");
    let second = registry
        .lock(&key)
        .permits(2)
        .acquire()
        .await
        .expect("permit");
    second.release().await.expect("release");
    first.release().await.expect("release");

    let mut seen: Vec<ModeAndSlot> = fields
        .lock()
        .unwrap()
        .spans
        .iter()
        .filter(|(k, _)| k.as_deref() == Some(key.as_str()))
        .map(|(_, fields)| fields.clone())
        .collect();
    seen.sort();
    let s = |v: &str| Some(v.to_owned());
    assert_eq!(
        seen,
        vec![
            (s("permit"), s("0")),
            (s("permit"), s("1")),
            (s("read"), None),
            (s("write"), None),
        ]
    );
}
