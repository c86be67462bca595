//! The registry: the backends an application locks through, set once at startup.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::backend::{self, LockBackend};
use crate::error::LockError;
use crate::key::DEFAULT_PREFIX;
use crate::lock::LockBuilder;
use crate::lock::held::HeldLease;
use crate::watchdog::Watchdog;

static GLOBAL: OnceLock<Registry> = OnceLock::new();

/// Installs the process-wide registry that `#[distributed_lock]` functions and
/// [`lock`](crate::lock()) use. A second call is an error: it never replaces the
/// registry that locks may already be held through.
pub fn init(registry: Registry) -> Result<(), LockError> {
    GLOBAL.set(registry).map_err(|_| {
        LockError::config(
            "dlock_runtime::init was called twice; the registry can be set only once per process",
        )
    })
}

/// The registry [`init`] installed, if any.
pub fn global() -> Option<&'static Registry> {
    GLOBAL.get()
}

/// Shuts the global registry down for a graceful restart: see
/// [`Registry::shutdown`]. Without a registry there is nothing to release.
pub async fn shutdown(deadline: Duration) -> ShutdownReport {
    match GLOBAL.get() {
        Some(registry) => registry.shutdown(deadline).await,
        None => ShutdownReport::default(),
    }
}

/// What [`Registry::shutdown`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// Held leases whose release shutdown asked for.
    pub released: usize,
    /// Releases still unfinished when the deadline passed (their keys expire
    /// with their leases).
    pub unfinished: usize,
}

/// Every live lease of a registry and its releases in progress: what
/// shutdown releases and waits for.
#[derive(Debug, Default)]
pub(crate) struct Leases {
    live: Mutex<HashMap<u64, Weak<HeldLease>>>,
    /// Releases asked for and not yet finished.
    releasing: AtomicUsize,
    settled: Notify,
    closing: AtomicBool,
}

impl Leases {
    fn live_map(&self) -> MutexGuard<'_, HashMap<u64, Weak<HeldLease>>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn track(&self, lease: &Arc<HeldLease>) {
        self.live_map().insert(lease.id, Arc::downgrade(lease));
    }

    pub(crate) fn release_started(&self) {
        self.releasing.fetch_add(1, Ordering::SeqCst);
    }

    pub(crate) fn release_finished(&self, id: u64) {
        self.live_map().remove(&id);
        self.releasing.fetch_sub(1, Ordering::SeqCst);
        if self.is_closing() {
            // Only shutdown waits on it.
            self.settled.notify_waiters();
        }
    }

    pub(crate) fn is_closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }

    fn live(&self) -> usize {
        let mut live = self.live_map();
        live.retain(|_, l| l.strong_count() > 0);
        live.len()
    }
}

/// A set of named backends, a default one, a key prefix, and one watchdog.
///
/// Cheap to clone. Usually installed once with [`init`]; a registry can also
/// be used directly with [`Registry::lock`].
#[derive(Clone)]
pub struct Registry {
    pub(crate) inner: Arc<RegistryInner>,
}

pub(crate) struct RegistryInner {
    pub(crate) id: u64,
    pub(crate) default: Option<BackendEntry>,
    pub(crate) named: BTreeMap<String, BackendEntry>,
    pub(crate) prefix: String,
    pub(crate) watchdog: Watchdog,
    pub(crate) leases: Arc<Leases>,
}

#[derive(Clone)]
pub(crate) struct BackendEntry {
    pub(crate) name: Arc<str>,
    pub(crate) backend: Arc<dyn LockBackend>,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Backends' own Debug redacts their secrets.
        f.debug_struct("Registry")
            .field("default", &self.inner.default.as_ref().map(|e| &e.backend))
            .field(
                "named",
                &self
                    .inner
                    .named
                    .iter()
                    .map(|(k, v)| (k, &v.backend))
                    .collect::<BTreeMap<_, _>>(),
            )
            .field("prefix", &self.inner.prefix)
            .field("held", &self.held_leases())
            .finish()
    }
}

impl Registry {
    /// Starts a builder.
    pub fn builder() -> RegistryBuilder {
        RegistryBuilder::default()
    }

    /// A registry whose default backend is the one `url` names
    /// (`memory://`, `sqlite://path`, …; see [`backend::connect`]).
    pub async fn from_url(url: &str) -> Result<Registry, LockError> {
        Ok(Registry::builder()
            .default_backend(backend::connect(url).await?)
            .build())
    }

    /// Starts a lock on `key` through this registry (see [`crate::lock()`]).
    pub fn lock(&self, key: impl Into<String>) -> LockBuilder {
        LockBuilder::new(Ok(self.clone()), key.into())
    }

    /// The prefix put before every key in the backends.
    pub fn key_prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// How many leases this registry currently holds (including those whose
    /// release is on its way).
    pub fn held_leases(&self) -> usize {
        self.inner.leases.live()
    }

    /// Releases every lease for a graceful restart (a rolling deploy), so the
    /// next replica need not wait for them to expire: new acquisitions fail
    /// with [`LockError::ShutDown`] from now on, every held lease is marked
    /// lost (bodies with `on_lost = "cancel"` stop at their next `.await`)
    /// and released, and the releases in flight — also those handed to the
    /// background by guards' `Drop` — are waited for, up to `deadline`.
    ///
    /// ```no_run
    /// # async fn f() {
    /// // after the HTTP server has drained its requests:
    /// let report = dlock_runtime::shutdown(std::time::Duration::from_secs(5)).await;
    /// assert_eq!(report.unfinished, 0);
    /// # }
    /// ```
    pub async fn shutdown(&self, deadline: Duration) -> ShutdownReport {
        let leases = &self.inner.leases;
        leases.closing.store(true, Ordering::SeqCst);
        let held: Vec<Arc<HeldLease>> = leases
            .live_map()
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        let released = held.len();
        for lease in held {
            lease.signal_lost("the registry is shutting down");
            lease.release_in_background();
        }
        let until = crate::time::saturating_add(Instant::now(), deadline);
        loop {
            let settled = leases.settled.notified();
            tokio::pin!(settled);
            settled.as_mut().enable();
            let unfinished = leases.releasing.load(Ordering::SeqCst);
            if unfinished == 0 || Instant::now() >= until {
                tracing::info!(released, unfinished, "dlock registry shut down");
                return ShutdownReport {
                    released,
                    unfinished,
                };
            }
            let _ = tokio::time::timeout_at(until.into(), settled).await;
        }
    }

    pub(crate) fn backend(&self, name: Option<&str>) -> Result<&BackendEntry, LockError> {
        match name {
            None => self.inner.default.as_ref().ok_or_else(|| {
                LockError::config(
                    "the registry has no default backend; call RegistryBuilder::default_backend \
                     or name a backend",
                )
            }),
            Some(name) => self
                .inner
                .named
                .get(name)
                .ok_or_else(|| LockError::UnknownBackend {
                    name: name.to_owned(),
                    known: self
                        .inner
                        .named
                        .keys()
                        .map(String::as_str)
                        .collect::<Vec<_>>()
                        .join(", "),
                }),
        }
    }
}

/// Anything that can be registered as a backend: a backend value, or an
/// `Arc<dyn LockBackend>` (what [`backend::connect`] returns).
pub trait IntoBackend {
    /// Converts into the shared trait object.
    fn into_backend(self) -> Arc<dyn LockBackend>;
}

impl<B: LockBackend> IntoBackend for B {
    fn into_backend(self) -> Arc<dyn LockBackend> {
        Arc::new(self)
    }
}

impl IntoBackend for Arc<dyn LockBackend> {
    fn into_backend(self) -> Arc<dyn LockBackend> {
        self
    }
}

/// Builds a [`Registry`].
#[derive(Default)]
pub struct RegistryBuilder {
    default: Option<Arc<dyn LockBackend>>,
    named: BTreeMap<String, Arc<dyn LockBackend>>,
    prefix: Option<String>,
}

impl fmt::Debug for RegistryBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistryBuilder")
            .field("default", &self.default)
            .field("named", &self.named)
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl RegistryBuilder {
    /// The backend used when a lock names none.
    pub fn default_backend(mut self, backend: impl IntoBackend) -> Self {
        self.default = Some(backend.into_backend());
        self
    }

    /// Registers a backend under `name`, for `#[distributed_lock(backend = "name")]`
    /// and [`LockBuilder::backend`]. A later call with the same name replaces it.
    pub fn backend(mut self, name: impl Into<String>, backend: impl IntoBackend) -> Self {
        self.named.insert(name.into(), backend.into_backend());
        self
    }

    /// The prefix put before every key in the backends (default `dlock:`), so
    /// that lock keys do not collide with an application's own keys or tables.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = Some(prefix.into());
        self
    }

    /// Builds the registry and starts its watchdog.
    pub fn build(self) -> Registry {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let entry = |name: &str, backend: Arc<dyn LockBackend>| BackendEntry {
            name: Arc::from(name),
            backend,
        };
        Registry {
            inner: Arc::new(RegistryInner {
                id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                default: self.default.map(|b| entry("default", b)),
                named: self
                    .named
                    .into_iter()
                    .map(|(name, b)| {
                        let e = entry(&name, b);
                        (name, e)
                    })
                    .collect(),
                prefix: self.prefix.unwrap_or_else(|| DEFAULT_PREFIX.to_owned()),
                watchdog: Watchdog::start(),
                leases: Arc::default(),
            }),
        }
    }
}
