//! Taking a lock: the builder and the acquisition (a new lease, or a nested
//! hold of one this call chain holds).

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::Instrument;

use super::background::Releasing;
use super::context::{self, Found, Hold};
use super::guard::LockGuard;
use super::held::{HeldLease, NewLease};
use super::registry::{BackendEntry, Registry, global};
use super::shutdown::Leases;
use crate::backend::wait::{self, Acquired, AcquiredAll};
use crate::backend::{AcquireRequest, HoldMode, Lease, LockBackend, MAX_PERMITS};
use crate::error::{BackendError, LockError};
use crate::stats::{Site, WaitOutcome};
use crate::time::MIN_LEASE;
use crate::token::FencingToken;

/// The lease length when none is given.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// How a lock is taken: the same knobs as the attribute's arguments.
#[derive(Debug, Clone)]
pub(crate) struct LockOptions {
    pub(crate) wait: Duration,
    pub(crate) lease: Duration,
    pub(crate) watchdog: bool,
    pub(crate) fencing: bool,
    pub(crate) hold_at_least: Option<Duration>,
    pub(crate) backend: Option<Cow<'static, str>>,
    /// The ceiling on the hold (`max_hold`).
    pub(crate) max_hold: Option<Duration>,
    /// The `key` label of the metrics (the attribute's key template).
    pub(crate) key_label: Option<Cow<'static, str>>,
    /// What the hold takes of each key: the whole key, a reader's share, a permit.
    pub(crate) mode: HoldMode,
    /// The number of permits asked with [`LockBuilder::permits`], checked
    /// when the lock is acquired (`mode` is then its [`HoldMode`]).
    pub(crate) permits: Option<u32>,
}

impl Default for LockOptions {
    fn default() -> Self {
        LockOptions {
            wait: Duration::ZERO,
            lease: DEFAULT_LEASE,
            watchdog: true,
            fencing: true,
            hold_at_least: None,
            backend: None,
            max_hold: None,
            key_label: None,
            mode: HoldMode::Exclusive,
            permits: None,
        }
    }
}

/// Starts a lock on `key` through the registry installed with [`init`](crate::init).
///
/// ```no_run
/// # async fn f() -> Result<(), dlock_runtime::LockError> {
/// use std::time::Duration;
/// let guard = dlock_runtime::lock("order:42")
///     .wait(Duration::from_secs(3))
///     .lease(Duration::from_secs(10))
///     .acquire()
///     .await?;
/// let token = guard.fencing_token();
/// // … work, passing `token` to the storage …
/// # let _ = token;
/// guard.release().await?;
/// # Ok(()) }
/// ```
pub fn lock(key: impl Into<String>) -> LockBuilder {
    let registry = global().cloned().ok_or(LockError::NotInitialized);
    LockBuilder::new(registry, Keys::One(key.into()))
}

/// Starts one hold of several keys, all or nothing, through the registry
/// installed with [`init`](crate::init).
///
/// The keys (de-duplicated) are taken in one canonical order — sorted by
/// their bytes, without the registry's prefix — so two calls naming the same
/// keys in different orders never wait on each other for ever. One `wait`
/// budget covers every key; an acquisition that fails, runs out of time or is
/// cancelled releases what it took at once. The loss of any key is the loss
/// of the hold. Every key is checked like [`lock`](crate::lock())'s
/// ([`LockError::InvalidKey`] names the bad one); no key at all is
/// [`LockError::Config`].
///
/// ```no_run
/// # async fn f() -> Result<(), dlock_runtime::LockError> {
/// use std::time::Duration;
/// let guard = dlock_runtime::lock_all(["acct:7", "acct:3"])
///     .wait(Duration::from_secs(3))
///     .acquire()
///     .await?;
/// assert_eq!(guard.keys(), ["acct:3", "acct:7"]);
/// let token_of_7 = guard.fencing_token_of("acct:7");
/// # let _ = token_of_7;
/// guard.release().await?;
/// # Ok(()) }
/// ```
pub fn lock_all(keys: impl IntoIterator<Item = impl Into<String>>) -> LockBuilder {
    let registry = global().cloned().ok_or(LockError::NotInitialized);
    LockBuilder::new(registry, Keys::all(keys))
}

/// What a builder locks: one key, or several in one hold.
#[derive(Debug, Clone)]
pub(crate) enum Keys {
    One(String),
    All(Vec<String>),
}

impl Keys {
    pub(crate) fn all(keys: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Keys::All(keys.into_iter().map(Into::into).collect())
    }
}

/// Configures and takes a lock; made by [`lock`](crate::lock()),
/// [`lock_all`](crate::lock_all()), [`Registry::lock`] or [`Registry::lock_all`].
#[must_use = "a LockBuilder does nothing until `.acquire().await`"]
pub struct LockBuilder {
    registry: Result<Registry, LockError>,
    keys: Keys,
    options: LockOptions,
}

impl fmt::Debug for LockBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("LockBuilder");
        match &self.keys {
            Keys::One(key) => d.field("key", key),
            Keys::All(keys) => d.field("keys", keys),
        };
        d.field("options", &self.options).finish_non_exhaustive()
    }
}

impl LockBuilder {
    pub(crate) fn new(registry: Result<Registry, LockError>, keys: Keys) -> Self {
        LockBuilder {
            registry,
            keys,
            options: LockOptions::default(),
        }
    }

    /// How long to wait for a busy lock (default zero: try once).
    /// `Duration::MAX` waits for ever.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.options.wait = wait;
        self
    }

    /// The lease length (default 30 s), at least [`MIN_LEASE`] (else
    /// `acquire` answers [`LockError::Config`]). The watchdog renews it every
    /// third of it.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.options.lease = lease;
        self
    }

    /// `false`: never renew; the lease is a hard cap, and the lock counts as
    /// lost when it runs out.
    pub fn watchdog(mut self, renew: bool) -> Self {
        self.options.watchdog = renew;
        self
    }

    /// `false`: this hold needs no fencing token, and
    /// [`fencing_token`](LockGuard::fencing_token) (on the guard and on
    /// [`current`](crate::current())) is `None`. The lock excludes other
    /// holders of the key exactly as a fenced one does, fenced or not. On
    /// Redis (`redis://`, `rediss://`, `redis+cluster://`) the grant is then a
    /// plain `SET NX PX` instead of the script that issues the token (the
    /// fast path; `?fencing=off` on the URL makes it the backend's default).
    /// On every other backend the acquisition does the same work and the
    /// token is dropped (Redlock never has one). Default `true`. A nested call
    /// shares the outer hold and its token: `fencing(false)` inside a fenced
    /// hold sees the outer token; a call with `fencing(true)` inside a hold
    /// taken without one is [`LockError::Config`] at once.
    pub fn fencing(mut self, fencing: bool) -> Self {
        self.options.fencing = fencing;
        self
    }

    /// On release, keep the key held for this long (as a lease that expires)
    /// instead of freeing it at once.
    pub fn hold_at_least(mut self, hold: Duration) -> Self {
        self.options.hold_at_least = Some(hold);
        self
    }

    /// Takes the lock on the backend registered under `name` instead of the default.
    pub fn backend(mut self, name: impl Into<String>) -> Self {
        self.options.backend = Some(Cow::Owned(name.into()));
        self
    }

    /// A ceiling on the whole hold, counted from the grant: then the
    /// renewals stop, [`lost()`](LockGuard::lost) fires and
    /// [`loss_reason`](LockGuard::loss_reason) is
    /// [`MaxHold`](crate::LossReason::MaxHold); the lease runs out on the
    /// server within one lease (a release frees it at once). For several keys
    /// it caps the whole hold, from the first key's grant. A nested hold keeps
    /// the outer hold's ceiling. It needs the watchdog and must be at least the
    /// lease: else `acquire` answers [`LockError::Config`].
    pub fn max_hold(mut self, ceiling: Duration) -> Self {
        self.options.max_hold = Some(ceiling);
        self
    }

    /// A semaphore of `n` permits (1 ..= [`MAX_PERMITS`]): at most `n`
    /// holders of the key at once, each on its own slot
    /// ([`LockGuard::permit`]), with fencing tokens increasing per (key,
    /// slot). `permits(1)` is the plain lock. Every holder of a key must
    /// use the same `n` (a plain lock counts as 1): while the key has
    /// holders, another `n` is [`LockError::Config`] naming both. 0 or more
    /// than [`MAX_PERMITS`] is [`LockError::Config`] when acquired.
    pub fn permits(mut self, n: u32) -> Self {
        self.options.permits = Some(n);
        self.options.mode = if n == 1 {
            HoldMode::Exclusive
        } else {
            HoldMode::Permit { permits: n }
        };
        self
    }

    /// The read mode of a read-write lock: readers share the key, a writer
    /// ([`write`](Self::write), or a plain lock) excludes everyone, and a
    /// waiting writer holds new readers back.
    pub fn read(mut self) -> Self {
        self.options.permits = None;
        self.options.mode = HoldMode::Shared;
        self
    }

    /// The write mode of a read-write lock: the plain lock, excluding readers
    /// and other writers (the default).
    pub fn write(mut self) -> Self {
        self.options.permits = None;
        self.options.mode = HoldMode::Exclusive;
        self
    }

    /// The `key` label of this lock's [metrics](crate::metrics) (feature
    /// `metrics`); without it the builder's locks have none. Give a bounded
    /// pattern (`"order:{id}"`), not the formatted key, unless the keys are
    /// few: every distinct label value is a time series.
    pub fn key_label(mut self, label: impl Into<Cow<'static, str>>) -> Self {
        self.options.key_label = Some(label.into());
        self
    }

    /// Acquires the lock (every key of it), waiting up to the wait budget.
    ///
    /// Errors: [`LockError::Busy`] when the budget ran out (naming the key
    /// that was busy), [`LockError::NotInitialized`],
    /// [`LockError::UnknownBackend`], [`LockError::InvalidKey`],
    /// [`LockError::Config`], [`LockError::Backend`].
    pub async fn acquire(self) -> Result<LockGuard, LockError> {
        let registry = self.registry?;
        acquire_counted(&registry, &self.options, self.keys).await
    }
}

/// The counters and labels of an acquisition with these options.
fn site(registry: &Registry, options: &LockOptions) -> Site {
    let name = options.backend.as_deref();
    Site {
        counters: registry.inner.counters.clone(),
        backend: registry
            .backend(name)
            .map(|e| e.name.clone())
            .unwrap_or_else(|_| Arc::from(name.unwrap_or("default"))),
        key_label: options.key_label.clone(),
    }
}

/// An acquisition (one key or several) as the builder and the attribute
/// take it: counted in `waiting` while in progress, then by outcome.
pub(crate) async fn acquire_counted(
    registry: &Registry,
    options: &LockOptions,
    keys: Keys,
) -> Result<LockGuard, LockError> {
    let site = site(registry, options);
    let waiting = site.waiting();
    let started = Instant::now();
    let answer = match keys {
        Keys::One(key) => acquire(registry, options, key).await,
        Keys::All(keys) => acquire_all(registry, options, keys).await,
    };
    drop(waiting);
    let outcome = match &answer {
        Ok(_) => WaitOutcome::Acquired,
        Err(LockError::Busy { .. }) => WaitOutcome::Busy,
        Err(_) => WaitOutcome::Failed,
    };
    site.waited(outcome, started.elapsed());
    answer
}

/// Counts a body skipped under `on_busy = "skip"`.
pub(crate) fn count_skipped(registry: &Registry, options: &LockOptions) {
    site(registry, options).skipped();
}

static NEXT_LEASE_ID: AtomicU64 = AtomicU64::new(1);

/// An owner token: 32 hex digits, the registry's holder id (see
/// [`holder_id`](crate::backend::holder_id)) and 64 random bits.
fn owner_token(registry: &Registry) -> String {
    format!(
        "{:016x}{:016x}",
        registry.inner.holder_id,
        rand::random::<u64>()
    )
}

/// The `mode` field of the `dlock.lock` span.
fn mode_label(mode: HoldMode) -> &'static str {
    match mode {
        HoldMode::Shared => "read",
        HoldMode::Permit { .. } => "permit",
        _ => "write",
    }
}

/// The backend a lock is taken on, once the options and the registry allow it.
fn checked_backend(registry: &Registry, options: &LockOptions) -> Result<BackendEntry, LockError> {
    if options.lease < MIN_LEASE {
        return Err(LockError::config(format!(
            "the lease must be at least {MIN_LEASE:?} (dlock_runtime::MIN_LEASE), got {:?}",
            options.lease
        )));
    }
    if let Some(ceiling) = options.max_hold {
        if !options.watchdog {
            return Err(LockError::config(
                "max_hold needs the watchdog: with watchdog(false) the lease is already the cap",
            ));
        }
        if ceiling < options.lease {
            return Err(LockError::config(format!(
                "max_hold ({ceiling:?}) must be at least the lease ({:?}): a shorter cap needs \
                 no renewal; use the lease with watchdog(false) instead",
                options.lease
            )));
        }
    }
    if let Some(n) = options.permits
        && (n == 0 || n > MAX_PERMITS)
    {
        return Err(LockError::config(format!(
            "a semaphore has 1 to {MAX_PERMITS} permits, got {n}"
        )));
    }
    if registry.inner.leases.is_closing() {
        return Err(LockError::ShutDown);
    }
    let entry = registry.backend(options.backend.as_deref())?.clone();
    entry
        .backend
        .offers(options.mode)
        .map_err(LockError::config)?;
    Ok(entry)
}

/// The stored form of a user's key (with the registry's prefix), checked
/// by the runtime and by the backend.
fn stored_key(registry: &Registry, entry: &BackendEntry, key: &str) -> Result<String, LockError> {
    let prefix = registry.key_prefix();
    crate::key::check(key, prefix)?;
    let stored_key = format!("{prefix}{key}");
    entry
        .backend
        .check_key(&stored_key)
        .map_err(|reason| LockError::invalid_key(key, reason))?;
    Ok(stored_key)
}

/// The acquisition shared by the builder and the attribute.
pub(crate) async fn acquire(
    registry: &Registry,
    options: &LockOptions,
    key: String,
) -> Result<LockGuard, LockError> {
    let entry = checked_backend(registry, options)?;
    let stored_key = stored_key(registry, &entry, &key)?;

    if let Some(found) = context::find(registry.inner.id, &entry.name, &stored_key) {
        return enter_nested(found, options, key).await;
    }
    let lost = CancellationToken::new();
    acquire_new(
        registry,
        &entry,
        options,
        key,
        stored_key,
        lost.clone(),
        lost,
    )
    .await
}

/// A new lease on `key` (checked, and held nowhere up this call chain).
/// `lost` is cancelled when it is lost (shared by the keys of one hold);
/// the backend cancels `backend_lost` when it learns on its own that the
/// key is gone (`lost` itself for a single key).
async fn acquire_new(
    registry: &Registry,
    entry: &BackendEntry,
    options: &LockOptions,
    key: String,
    stored_key: String,
    lost: CancellationToken,
    backend_lost: CancellationToken,
) -> Result<LockGuard, LockError> {
    let request = new_request(
        registry,
        options,
        stored_key,
        owner_token(registry),
        backend_lost,
    );
    let mut held = new_leases(registry, entry, options, vec![key], vec![request], lost).await?;
    let guard = LockGuard::new(held.pop().expect("one lease per key"), None);
    // Checked after the lease is tracked: either shutdown saw it (and
    // releases it), or this sees the shutdown — a grant that arrives while
    // the registry shuts down (a waiter woken by shutdown's own release) is
    // never handed out.
    if registry.inner.leases.is_closing() {
        guard.waive_hold_at_least();
        let _ = guard.release().await;
        return Err(LockError::ShutDown);
    }
    Ok(guard)
}

/// The request for one key of a new acquisition.
fn new_request(
    registry: &Registry,
    options: &LockOptions,
    stored_key: String,
    owner: String,
    backend_lost: CancellationToken,
) -> AcquireRequest {
    AcquireRequest {
        key: stored_key,
        owner,
        lease: options.lease,
        wait: options.wait,
        lost: backend_lost,
        fencing: options.fencing,
        holder: registry.inner.holder.clone(),
        mode: options.mode,
    }
}

/// What the attempts of an acquisition came to.
enum Got {
    /// One lease per request, in their order.
    Held(Vec<Lease>),
    /// The key of this index stayed busy for the whole wait budget.
    Busy(usize),
}

/// The attempts of an acquisition: one key through the wait loop, several
/// in one step ([`LockBackend::try_acquire_all`]) through its own.
async fn attempts(
    backend: &dyn LockBackend,
    requests: &[AcquireRequest],
    on_the_wire: &AtomicBool,
) -> Result<Got, BackendError> {
    if let [request] = requests {
        return Ok(
            match wait::acquire_watched(backend, request, on_the_wire).await? {
                Acquired::Held(lease) => Got::Held(vec![lease]),
                Acquired::Busy => Got::Busy(0),
            },
        );
    }
    Ok(
        match wait::acquire_all_watched(backend, requests, on_the_wire).await? {
            AcquiredAll::Held(leases) => Got::Held(leases),
            AcquiredAll::Busy(key) => Got::Busy(key),
        },
    )
}

/// New leases for `requests` (one per key of `keys`, the user's keys): one
/// key, or several the backend takes in one step. `lost` is cancelled when
/// any of them is lost; each request's `lost` is the token the backend
/// cancels on its own. The leases are tracked and scheduled for renewal.
async fn new_leases(
    registry: &Registry,
    entry: &BackendEntry,
    options: &LockOptions,
    keys: Vec<String>,
    requests: Vec<AcquireRequest>,
    lost: CancellationToken,
) -> Result<Vec<Arc<HeldLease>>, LockError> {
    let leases = &registry.inner.leases;
    // Counted by shutdown until this returns: a grant on its way is either
    // tracked (and released by shutdown, or by the check at the end) or
    // released when the acquisition is abandoned — before shutdown stops
    // waiting. Counted first, checked after: shutdown either sees the count
    // or this sees the shutdown.
    let _in_flight = Releasing::new(leases);
    if leases.is_closing() {
        return Err(LockError::ShutDown);
    }

    let spans: Vec<tracing::Span> = keys
        .iter()
        .map(|key| {
            tracing::debug_span!(
                "dlock.lock",
                key = %key,
                backend = %entry.name,
                kind = entry.backend.kind(),
                mode = mode_label(options.mode),
                slot = tracing::field::Empty,
                waited_ms = tracing::field::Empty,
                held_ms = tracing::field::Empty,
                token = tracing::field::Empty,
            )
        })
        .collect();
    let span = spans[0].clone();
    let started = Instant::now();
    let backend = entry.backend.clone();
    // Shutdown stops a waiting acquisition: dropping it undoes whatever an
    // attempt on the wire may be granted.
    let answer = if backend.needs_io_runtime() {
        tokio::select! {
            biased;
            answer = acquire_on_io_runtime(backend.clone(), requests, leases.clone())
                .instrument(span.clone()) => answer,
            () = leases.closed() => return Err(LockError::ShutDown),
        }
    } else {
        let on_the_wire = AtomicBool::new(false);
        let abandoned = ReleaseIfAbandoned {
            backend: &backend,
            requests: &requests,
            leases,
            on_the_wire: &on_the_wire,
            armed: true,
        };
        let answer = tokio::select! {
            biased;
            answer = attempts(&*backend, &requests, &on_the_wire)
                .instrument(span.clone()) => answer,
            () = leases.closed() => return Err(LockError::ShutDown),
        };
        match answer {
            // A busy answer given while an attempt was still unanswered
            // (the wait's last look, see `wait`): the guard's drop undoes
            // that attempt.
            Ok(got) if on_the_wire.load(Ordering::SeqCst) => {
                drop(abandoned);
                Ok((got, requests))
            }
            Ok(got) => {
                abandoned.disarm();
                Ok((got, requests))
            }
            Err(err) => {
                // The guard's drop sends the owner-checked release: the
                // server may have run the attempt whose answer was lost.
                drop(abandoned);
                Err(err)
            }
        }
    };
    let waited = started.elapsed();
    for span in &spans {
        span.record("waited_ms", waited.as_secs_f64() * 1000.0);
    }
    let (got, requests) = answer.map_err(|e| {
        tracing::debug!(parent: &span, error = %e, "dlock acquisition failed");
        e.into_lock_error(backend.kind())
    })?;
    let granted = match got {
        Got::Held(granted) => granted,
        Got::Busy(i) => {
            tracing::debug!(parent: &span, waited_ms = waited.as_secs_f64() * 1000.0, "dlock busy");
            let key = keys.into_iter().nth(i).unwrap_or_default();
            return Err(LockError::Busy { key, waited });
        }
    };
    if granted.len() != requests.len() {
        for lease in &granted {
            let _ = backend.release(lease).await;
        }
        return Err(LockError::Backend {
            backend: backend.kind(),
            source: BackendError::permanent(format!(
                "{} leases granted for {} keys",
                granted.len(),
                requests.len()
            )),
        });
    }
    let mut held = Vec::with_capacity(granted.len());
    for (((mut lease, key), span), request) in
        granted.into_iter().zip(keys).zip(spans).zip(requests)
    {
        if !options.fencing {
            lease.token = None;
        }
        if let Some(token) = lease.token {
            span.record("token", token.get());
        }
        if let Some(slot) = lease.slot {
            span.record("slot", slot);
        }
        tracing::debug!(parent: &span, token = lease.token.map(FencingToken::get), "dlock acquired");
        let lease = HeldLease::new(NewLease {
            id: NEXT_LEASE_ID.fetch_add(1, Ordering::Relaxed),
            registry_id: registry.inner.id,
            backend_name: entry.name.clone(),
            backend: backend.clone(),
            user_key: key,
            lease,
            lease_len: options.lease,
            renew: options.watchdog,
            hold_at_least: options.hold_at_least,
            fenced: options.fencing,
            lost: lost.clone(),
            backend_lost: request.lost,
            span,
            watchdog: registry.inner.watchdog.clone(),
            leases: registry.inner.leases.clone(),
            site: Site {
                counters: registry.inner.counters.clone(),
                backend: entry.name.clone(),
                key_label: options.key_label.clone(),
            },
            max_hold: options.max_hold,
        });
        registry.inner.watchdog.reschedule(&lease);
        held.push(lease);
    }
    Ok(held)
}

/// A nested acquisition of a key held further up this call chain: it
/// shares the outer lease, passing the frame's gate one holder at a time
/// (siblings take turns, each within its own `wait`).
/// A call that asks for a fencing token, inside a hold of the same key taken
/// without one: the nested call would run without the token it counts on.
fn unfenced_outer(key: &str) -> LockError {
    LockError::config(format!(
        "`{key}` is already held in this call chain without a fencing token \
         (`fencing = false`); a nested call that needs one cannot enter it: \
         take the outer hold with a token, or pass `fencing = false` here too"
    ))
}

/// Whether a nested call asking for `asked` may share an outer hold of the
/// same key in `held`: the same mode, or a read inside a write. A write
/// inside a read would wait for itself; any other pair is a mismatch.
fn nested_mode(key: &str, held: HoldMode, asked: HoldMode) -> Result<(), LockError> {
    match (held, asked) {
        _ if held == asked => Ok(()),
        (HoldMode::Exclusive, HoldMode::Shared) => Ok(()),
        (HoldMode::Shared, HoldMode::Exclusive) => Err(LockError::config(format!(
            "`{key}` is held for reading in this call chain, and this call asks to write it: \
             a write inside a read of the same key would wait for itself; take the outer \
             hold in write mode (a read inside a write enters)"
        ))),
        _ => Err(LockError::config(HoldMode::mismatch(key, held, asked))),
    }
}

async fn enter_nested(
    frame: Found,
    options: &LockOptions,
    key: String,
) -> Result<LockGuard, LockError> {
    let held = frame.lease;
    nested_mode(&key, held.lease.mode, options.mode)?;
    if held.is_lost() {
        return Err(LockError::Lost { key });
    }
    if options.fencing && !held.fenced {
        return Err(unfenced_outer(&key));
    }
    let started = Instant::now();
    let permit = match frame.gate.clone().try_acquire_owned() {
        Ok(permit) => permit,
        Err(_) if options.wait.is_zero() => {
            return Err(LockError::Busy {
                key,
                waited: Duration::ZERO,
            });
        }
        Err(_) => {
            let until = crate::time::saturating_add(started, options.wait);
            let lost = held.lost.clone();
            tokio::select! {
                permit = tokio::time::timeout_at(until.into(), frame.gate.clone().acquire_owned()) => match permit {
                    Ok(Ok(permit)) => permit,
                    _ => return Err(LockError::Busy { key, waited: started.elapsed() }),
                },
                () = lost.cancelled() => return Err(LockError::Lost { key }),
            }
        }
    };
    if !held.add_nested_hold() {
        return Err(LockError::Lost { key });
    }
    if options.lease != held.lease_len
        || options.watchdog != held.renew
        || options.hold_at_least != held.hold_at_least
        || options.fencing != held.fenced
    {
        tracing::debug!(
            parent: &held.span,
            key = %key,
            lease_ms = options.lease.as_secs_f64() * 1000.0,
            outer_lease_ms = held.lease_len.as_secs_f64() * 1000.0,
            watchdog = options.watchdog,
            outer_watchdog = held.renew,
            fencing = options.fencing,
            outer_fencing = held.fenced,
            "dlock nested hold: the outer lease's lease, watchdog, hold_at_least and fencing apply, not this call's"
        );
    }
    tracing::trace!(parent: &held.span, key = %key, "dlock reentrant hold");
    Ok(LockGuard::new(held, Some(permit)))
}

/// The acquisition of several keys in one hold, shared by the builder and the attribute.
pub(crate) async fn acquire_all(
    registry: &Registry,
    options: &LockOptions,
    mut keys: Vec<String>,
) -> Result<LockGuard, LockError> {
    // The canonical order: the user's keys, by their bytes, each once.
    keys.sort_unstable();
    keys.dedup();
    if keys.is_empty() {
        return Err(LockError::config("lock_all needs at least one key"));
    }
    if keys.len() == 1 {
        let key = keys.pop().expect("one key");
        return acquire(registry, options, key).await;
    }
    let entry = checked_backend(registry, options)?;
    let stored = keys
        .iter()
        .map(|key| stored_key(registry, &entry, key))
        .collect::<Result<Vec<_>, _>>()?;

    let found: Vec<Option<Found>> = stored
        .iter()
        .map(|k| context::find(registry.inner.id, &entry.name, k))
        .collect();
    if found.iter().all(Option::is_some) {
        let found = found.into_iter().flatten().collect();
        return enter_nested_all(found, options, keys).await;
    }
    if let Some(held) = keys.iter().zip(&found).find(|(_, f)| f.is_some()) {
        return Err(LockError::config(format!(
            "this call chain already holds `{}` but not every key of {keys:?}: a hold of \
             several keys inside a hold of some of them could wait on itself; take them all \
             in the outer hold",
            held.0
        )));
    }

    let started = Instant::now();
    let until = crate::time::saturating_add(started, options.wait);
    let lost = CancellationToken::new();
    // Each key's own token, for a backend that learns of a loss on its own;
    // any of them cancelled is the loss of the hold.
    let backend_lost: Vec<CancellationToken> =
        keys.iter().map(|_| CancellationToken::new()).collect();
    let joined_loss = join_losses(&backend_lost, &lost);
    // One step where the backend can take these keys so (one owner for all).
    let owner = owner_token(registry);
    let requests: Vec<AcquireRequest> = stored
        .iter()
        .zip(&backend_lost)
        .map(|(k, own)| new_request(registry, options, k.clone(), owner.clone(), own.clone()))
        .collect();
    // Semaphores and readers take their keys one by one, through the wait
    // loop each mode's waiting rules live in.
    if options.mode == HoldMode::Exclusive && entry.backend.try_acquire_all(&requests).is_some() {
        let leases = new_leases(registry, &entry, options, keys, requests, lost.clone()).await?;
        return complete_hold(registry, leases, lost, joined_loss).await;
    }
    drop(requests);
    // Dropped (an error, a cancelled acquisition): what was taken is released
    // at once, in the background.
    let mut taken = Taken(Vec::with_capacity(keys.len()));
    for ((key, stored_key), own) in keys.into_iter().zip(stored).zip(backend_lost) {
        let mut one = options.clone();
        if options.wait != Duration::MAX {
            one.wait = until.saturating_duration_since(Instant::now());
        }
        let next = acquire_new(registry, &entry, &one, key, stored_key, lost.clone(), own);
        let answer = tokio::select! {
            biased;
            // A key taken first was lost while this one was awaited.
            () = lost.cancelled() => None,
            answer = next => Some(answer),
        };
        let Some(answer) = answer else {
            if registry.inner.leases.is_closing() {
                // Shutdown ends the keys taken so far: that is not a loss.
                release_taken(taken).await;
                return Err(LockError::ShutDown);
            }
            let key = taken
                .0
                .iter()
                .find(|g| g.lost_itself())
                .or_else(|| taken.0.iter().find(|g| g.is_lost()))
                .unwrap_or(&taken.0[0])
                .key()
                .to_owned();
            release_taken(taken).await;
            return Err(LockError::Lost { key });
        };
        match answer {
            Ok(guard) => taken.0.push(guard),
            Err(LockError::Busy { key, .. }) => {
                release_taken(taken).await;
                return Err(LockError::Busy {
                    key,
                    waited: started.elapsed(),
                });
            }
            Err(err) => {
                release_taken(taken).await;
                return Err(err);
            }
        }
    }
    let leases: Vec<Arc<HeldLease>> = std::mem::take(&mut taken.0)
        .into_iter()
        .map(LockGuard::into_lease)
        .collect();
    complete_hold(registry, leases, lost, joined_loss).await
}

/// The keys a hold of several keys has taken so far. Dropped unfinished (an
/// error, a cancelled acquisition), they are released at once: no body ran
/// under them, so `hold_at_least` does not apply.
struct Taken(Vec<LockGuard>);

impl Drop for Taken {
    fn drop(&mut self) {
        for guard in &self.0 {
            guard.waive_hold_at_least();
        }
    }
}

/// The guard of a hold of several keys, once each is held: their renewals
/// joined, and the hold given up at once if a key ran out meanwhile or the
/// registry is shutting down.
async fn complete_hold(
    registry: &Registry,
    leases: Vec<Arc<HeldLease>>,
    lost: CancellationToken,
    joined_loss: DropGuard,
) -> Result<LockGuard, LockError> {
    // The keys of the hold are renewed together, from the first one due on.
    if let Some(first_due) = leases
        .iter()
        .map(|l| l.sched().machine.next_renewal())
        .min()
    {
        // One ceiling for the hold: the first key's.
        let ceiling = leases
            .iter()
            .filter_map(|l| l.sched().machine.ceiling())
            .min();
        for lease in &leases {
            let mut sched = lease.sched();
            sched.machine.renew_no_later_than(first_due);
            if let Some(ceiling) = ceiling {
                sched.machine.cap_at(ceiling);
            }
            drop(sched);
            registry.inner.watchdog.reschedule(lease);
        }
    }
    let guard = LockGuard::of_hold(
        Hold {
            leases: leases.into(),
            lost,
        },
        None,
        Some(joined_loss),
    );
    if guard.is_lost() {
        // A key taken first ran out while a later one was awaited.
        let key = guard.key().to_owned();
        guard.waive_hold_at_least();
        let _ = guard.release().await;
        return Err(LockError::Lost { key });
    }
    if registry.inner.leases.is_closing() {
        guard.waive_hold_at_least();
        let _ = guard.release().await;
        return Err(LockError::ShutDown);
    }
    Ok(guard)
}

/// Releases the keys of a hold that could not be completed, at once.
async fn release_taken(mut taken: Taken) {
    let guards = std::mem::take(&mut taken.0);
    for guard in &guards {
        guard.waive_hold_at_least();
    }
    // Cancel-safe: the guards not yet released release on drop.
    let _ = futures_util::future::join_all(guards.into_iter().map(LockGuard::release)).await;
}

/// A nested hold of several keys, every one held further up this call
/// chain: it passes the gate of each scope they were found in (outermost
/// first: siblings take them in the same order), within its `wait`.
async fn enter_nested_all(
    found: Vec<Found>,
    options: &LockOptions,
    keys: Vec<String>,
) -> Result<LockGuard, LockError> {
    let started = Instant::now();
    let until = crate::time::saturating_add(started, options.wait);
    let busy = |keys: &[String]| LockError::Busy {
        key: keys[0].clone(),
        waited: started.elapsed(),
    };
    let lost_key = |found: &[Found], keys: &[String]| {
        let i = found.iter().position(|f| f.lease.is_lost()).unwrap_or(0);
        LockError::Lost {
            key: keys[i].clone(),
        }
    };
    for (f, key) in found.iter().zip(&keys) {
        nested_mode(key, f.lease.lease.mode, options.mode)?;
    }
    if found.iter().any(|f| f.lease.is_lost()) {
        return Err(lost_key(&found, &keys));
    }
    if let Some(i) = found
        .iter()
        .position(|f| options.fencing && !f.lease.fenced)
    {
        return Err(unfenced_outer(&keys[i]));
    }
    let mut gates: Vec<(usize, Arc<tokio::sync::Semaphore>)> = Vec::new();
    for f in &found {
        if !gates.iter().any(|(_, g)| Arc::ptr_eq(g, &f.gate)) {
            gates.push((f.depth, f.gate.clone()));
        }
    }
    gates.sort_by_key(|(depth, _)| *depth);
    let mut any_lost = futures_util::future::select_all(
        found
            .iter()
            .map(|f| Box::pin(f.lease.lost.clone().cancelled_owned())),
    );
    let mut permits = Vec::with_capacity(gates.len());
    for (_, gate) in gates {
        let permit = match gate.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) if options.wait.is_zero() => return Err(busy(&keys)),
            Err(_) => tokio::select! {
                permit = tokio::time::timeout_at(until.into(), gate.acquire_owned()) => match permit {
                    Ok(Ok(permit)) => permit,
                    _ => return Err(busy(&keys)),
                },
                _ = &mut any_lost => return Err(lost_key(&found, &keys)),
            },
        };
        permits.push(permit);
    }
    let mut added = Vec::with_capacity(found.len());
    for f in &found {
        if !f.lease.add_nested_hold() {
            for lease in added {
                HeldLease::drop_nested_hold(lease);
            }
            return Err(lost_key(&found, &keys));
        }
        added.push(&*f.lease);
    }
    // One loss signal for the hold: any of its leases lost.
    drop(any_lost);
    let lost = CancellationToken::new();
    let leases_lost: Vec<CancellationToken> = found.iter().map(|f| f.lease.lost.clone()).collect();
    let joined_loss = join_losses(&leases_lost, &lost);
    tracing::trace!(parent: &found[0].lease.span, keys = ?keys, "dlock reentrant hold of several keys");
    let leases: Vec<Arc<HeldLease>> = found.into_iter().map(|f| f.lease).collect();
    Ok(LockGuard::of_hold(
        Hold {
            leases: leases.into(),
            lost,
        },
        Some(permits),
        Some(joined_loss),
    ))
}

/// Cancels `hold` as soon as any of `parts` is cancelled, until the guard
/// returned is dropped.
fn join_losses(parts: &[CancellationToken], hold: &CancellationToken) -> DropGuard {
    let stop = CancellationToken::new();
    let any = futures_util::future::select_all(
        parts.iter().map(|t| Box::pin(t.clone().cancelled_owned())),
    );
    let (hold, stopped) = (hold.clone(), stop.clone());
    // On dlock's own runtime: it outlives the caller's.
    crate::driver::handle().spawn(async move {
        tokio::select! {
            _ = any => hold.cancel(),
            () = stopped.cancelled() => {}
            () = hold.cancelled() => {}
        }
    });
    stop.drop_guard()
}

/// Runs the acquisition on the I/O runtime. A caller that stops waiting (its
/// future is dropped) stops the acquisition; whatever the task may have been
/// granted on the wire, or was granted for a caller that is gone, is released
/// at once with an owner-checked release — and, for an attempt that may still
/// be on the wire, again after the backstop, since the first release can reach
/// the server before the attempt it undoes.
async fn acquire_on_io_runtime(
    backend: Arc<dyn LockBackend>,
    requests: Vec<AcquireRequest>,
    leases: Arc<Leases>,
) -> Result<(Got, Vec<AcquireRequest>), BackendError> {
    let caller_gone = CancellationToken::new();
    let _stop_when_dropped = caller_gone.clone().drop_guard();
    // Counted until the task has handed what it may have been granted on:
    // to the caller, or to a release of its own.
    let task_in_flight = Releasing::new(&leases);
    let (tx, rx) = tokio::sync::oneshot::channel::<Result<Granted, BackendError>>();
    crate::driver::handle().spawn(
        async move {
            let on_the_wire = AtomicBool::new(false);
            let answer = tokio::select! {
                biased;
                () = caller_gone.cancelled() => None,
                answer = attempts(&*backend, &requests, &on_the_wire) => Some(answer),
            };
            match answer {
                Some(Ok(got)) => {
                    // A busy answer given while an attempt was still
                    // unanswered (the wait's last look): undo that attempt.
                    if on_the_wire.load(Ordering::SeqCst) {
                        release_abandoned(&leases, &backend, &requests, false);
                    }
                    // If the caller is gone — now, or before it takes the
                    // answer out of the channel — `Granted`'s drop releases it.
                    let _ = tx.send(Ok(Granted {
                        answer: Some((got, requests)),
                        backend,
                        leases,
                    }));
                }
                Some(Err(err)) => {
                    let _ = tx.send(Err(err));
                    // The server may have run the attempt whose answer was
                    // lost: release now, and again once that attempt has
                    // surely been answered or timed out (the first release
                    // may reach the server before the attempt does).
                    release_abandoned(&leases, &backend, &requests, false);
                }
                None => {
                    // The caller went away mid-wait (or shutdown stopped it):
                    // undo whatever an attempt on the wire may be granted, now
                    // and after the backstop — which shutdown waits for when
                    // it stopped an attempt on the wire.
                    let wait_for_backstop =
                        leases.is_closing() && on_the_wire.load(Ordering::SeqCst);
                    release_abandoned(&leases, &backend, &requests, wait_for_backstop);
                }
            }
            drop(task_in_flight);
        }
        .in_current_span(),
    );
    match rx.await {
        Ok(answer) => answer.map(|mut granted| granted.answer.take().expect("taken once")),
        Err(_) => Err(BackendError::permanent(
            "the acquisition task on dlock's I/O runtime ended without an answer",
        )),
    }
}

/// The owner-checked release of every key of an abandoned acquisition (see
/// [`Releasing::spawn_after_abandoned`]).
fn release_abandoned(
    leases: &Arc<Leases>,
    backend: &Arc<dyn LockBackend>,
    requests: &[AcquireRequest],
    wait_for_backstop: bool,
) {
    for request in requests {
        Releasing::new(leases).spawn_after_abandoned(
            backend.clone(),
            Lease::new(request, None),
            wait_for_backstop,
        );
    }
}

/// An answer from the I/O runtime on its way to the caller. Leases in it that
/// the caller never takes out (its future was dropped, before or after the
/// send) are released in the background.
struct Granted {
    answer: Option<(Got, Vec<AcquireRequest>)>,
    backend: Arc<dyn LockBackend>,
    leases: Arc<Leases>,
}

impl Drop for Granted {
    fn drop(&mut self) {
        if let Some((Got::Held(granted), _)) = self.answer.take() {
            let backend = self.backend.clone();
            Releasing::new(&self.leases).spawn(async move {
                for lease in &granted {
                    let _ = backend.release(lease).await;
                }
            });
        }
    }
}

/// For backends called inline: if the caller drops the acquisition while a
/// request may be on the wire, an owner-checked release of every key is
/// sent after it (see [`Releasing::spawn_after_abandoned`]); shutdown waits
/// for its backstop too when it stopped an attempt on the wire.
struct ReleaseIfAbandoned<'a> {
    backend: &'a Arc<dyn LockBackend>,
    requests: &'a [AcquireRequest],
    leases: &'a Arc<Leases>,
    on_the_wire: &'a AtomicBool,
    armed: bool,
}

impl ReleaseIfAbandoned<'_> {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for ReleaseIfAbandoned<'_> {
    fn drop(&mut self) {
        if self.armed {
            let wait_for_backstop =
                self.leases.is_closing() && self.on_the_wire.load(Ordering::SeqCst);
            release_abandoned(self.leases, self.backend, self.requests, wait_for_backstop);
        }
    }
}
