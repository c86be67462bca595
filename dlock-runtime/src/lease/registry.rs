//! The registry: the backends an application locks through, set once at startup.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use super::lock::{Keys, LockBuilder};
use super::shutdown::Leases;
use super::watchdog::Watchdog;
use crate::backend::{self, HolderRecord, LockBackend};
use crate::error::LockError;
use crate::key::DEFAULT_PREFIX;

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
    /// Stamped on every grant (see [`RegistryBuilder::holder_name`]).
    pub(crate) holder: Arc<HolderRecord>,
    /// What its owner tokens start with (see [`backend::holder_id`]): drawn
    /// at random, so registries with different records have different ids.
    pub(crate) holder_id: u64,
    pub(crate) watchdog: Watchdog,
    pub(crate) leases: Arc<Leases>,
    /// What [`Registry::stats`] reads.
    pub(crate) counters: Arc<crate::stats::Counters>,
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
        LockBuilder::new(Ok(self.clone()), Keys::One(key.into()))
    }

    /// Starts one hold of several keys, all or nothing, through this registry
    /// (see [`crate::lock_all()`]).
    pub fn lock_all(&self, keys: impl IntoIterator<Item = impl Into<String>>) -> LockBuilder {
        LockBuilder::new(Ok(self.clone()), Keys::all(keys))
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
    holder_name: Option<String>,
}

impl fmt::Debug for RegistryBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistryBuilder")
            .field("default", &self.default)
            .field("named", &self.named)
            .field("prefix", &self.prefix)
            .field("holder_name", &self.holder_name)
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

    /// The instance name stored with every grant this registry gets, beside
    /// the host name and process id, so that `Registry::inspect` and the
    /// `dlock` command say which replica holds a key. Default: the
    /// `DLOCK_HOLDER` environment variable, else none. An empty name is none.
    pub fn holder_name(mut self, name: impl Into<String>) -> Self {
        self.holder_name = Some(name.into());
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
                holder: holder_record(self.holder_name),
                holder_id: rand::random(),
                watchdog: Watchdog::start(),
                leases: Arc::default(),
                counters: Arc::default(),
            }),
        }
    }
}

/// This process's holder record with the instance name given to the builder,
/// else `DLOCK_HOLDER`; control characters in the name become `_`.
fn holder_record(name: Option<String>) -> Arc<HolderRecord> {
    let name = name
        .or_else(|| std::env::var("DLOCK_HOLDER").ok())
        .map(|n| {
            n.chars()
                .map(|c| if c.is_control() { '_' } else { c })
                .collect::<String>()
        })
        .filter(|n| !n.is_empty());
    let this = HolderRecord::this_process();
    match name {
        None => this,
        Some(name) => Arc::new(HolderRecord::new(this.host.clone(), this.pid, Some(name))),
    }
}
