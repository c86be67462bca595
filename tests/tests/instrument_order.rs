//! `#[distributed_lock]` together with `#[tracing::instrument]`.
//!
//! Attribute macros expand top-down: the upper one sees the function as written, the
//! lower one then sees the function the upper one produced. Both keep the signature
//! and wrap the body, so the *lower* attribute's code ends up outermost:
//!
//! - `#[distributed_lock]` above `#[tracing::instrument]`: the user's span wraps the
//!   whole locked function, so the runtime's `dlock.lock` span (opened per
//!   acquisition) is a child of the user's span.
//! - `#[tracing::instrument]` above `#[distributed_lock]`: the user's span is created
//!   inside the locked body, as a child of `dlock.lock`; the acquisition happens
//!   outside it.

use std::fmt;
use std::sync::{Arc, Mutex, Once, OnceLock};

use dlock_runtime::{MemoryBackend, Registry, distributed_lock};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing::{Span, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::registry::LookupSpan;

/// A span as it was opened.
#[derive(Debug, Clone)]
struct NewSpan {
    id: Id,
    name: &'static str,
    /// The `key` field (set on `dlock.lock` spans).
    key: Option<String>,
    /// The name of the parent span, explicit or contextual.
    parent: Option<&'static str>,
}

/// Records every span opened anywhere in the process, with its parent.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<NewSpan>>>);

impl Recorder {
    fn spans(&self) -> Vec<NewSpan> {
        self.0.lock().expect("not poisoned").clone()
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Recorder {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        // The registry has already resolved the parent: `attrs.parent()` if given
        // explicitly, else the span current at creation (`ctx.current_span()`).
        let parent = ctx
            .span(id)
            .and_then(|span| span.parent())
            .map(|parent| parent.name());
        let mut key = KeyField(None);
        attrs.record(&mut key);
        self.0.lock().expect("not poisoned").push(NewSpan {
            id: id.clone(),
            name: attrs.metadata().name(),
            key: key.0,
            parent,
        });
    }
}

/// Reads the `key` field of a span.
struct KeyField(Option<String>);

impl Visit for KeyField {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "key" {
            self.0 = Some(value.to_owned());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "key" {
            self.0 = Some(format!("{value:?}"));
        }
    }
}

/// Installs the recorder as the global subscriber and initialises the runtime with
/// the in-memory backend, once for the whole test binary.
fn setup() -> &'static Recorder {
    static RECORDER: OnceLock<Recorder> = OnceLock::new();
    static INIT: Once = Once::new();
    let recorder = RECORDER.get_or_init(Recorder::default);
    INIT.call_once(|| {
        tracing::subscriber::set_global_default(
            tracing_subscriber::registry().with(recorder.clone()),
        )
        .expect("the only global subscriber");
        dlock_runtime::init(
            Registry::builder()
                .default_backend(MemoryBackend::new())
                .build(),
        )
        .expect("the first init");
    });
    recorder
}

/// The one span opened with `name` (and `key`, if given).
fn only(spans: &[NewSpan], name: &str, key: Option<&str>) -> NewSpan {
    let found: Vec<&NewSpan> = spans
        .iter()
        .filter(|s| s.name == name && (key.is_none() || s.key.as_deref() == key))
        .collect();
    assert_eq!(found.len(), 1, "one `{name}` span expected in {spans:#?}");
    found[0].clone()
}

// Expanded first, `#[tracing::instrument]` rewrites the body; `#[distributed_lock]`
// then runs that instrumented body under the lock.
#[tracing::instrument(name = "user_span_inside")]
#[distributed_lock(key = "instrument:above")]
async fn instrument_above() -> Option<Option<Id>> {
    tokio::task::yield_now().await;
    Some(Span::current().id())
}

// Expanded first, `#[distributed_lock]` rewrites the body (acquisition included);
// `#[tracing::instrument]` then wraps all of it in the user's span.
#[distributed_lock(key = "instrument:below")]
#[tracing::instrument(name = "user_span")]
async fn instrument_below() -> Option<Option<Id>> {
    tokio::task::yield_now().await;
    Some(Span::current().id())
}

#[tokio::test]
async fn instrument_below_the_lock_wraps_the_acquisition() {
    let recorder = setup();
    let body_span = instrument_below()
        .await
        .expect("the lock was free")
        .expect("the body runs in a span");

    let spans = recorder.spans();
    let user = only(&spans, "user_span", None);
    assert_eq!(user.parent, None);
    let lock = only(&spans, "dlock.lock", Some("instrument:below"));
    assert_eq!(
        lock.parent,
        Some("user_span"),
        "the acquisition runs inside the user's span"
    );
    // The body runs in the acquisition's span.
    assert_eq!(body_span, lock.id);
}

#[tokio::test]
async fn instrument_above_the_lock_is_inside_the_body() {
    let recorder = setup();
    let body_span = instrument_above()
        .await
        .expect("the lock was free")
        .expect("the body runs in a span");

    let spans = recorder.spans();
    let lock = only(&spans, "dlock.lock", Some("instrument:above"));
    assert_eq!(
        lock.parent, None,
        "the acquisition is outside the user's span"
    );
    let user = only(&spans, "user_span_inside", None);
    assert_eq!(
        user.parent,
        Some("dlock.lock"),
        "the user's span is created inside the locked body"
    );
    assert_eq!(body_span, user.id);
}
