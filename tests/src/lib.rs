//! dlock's shared test support: the conformance suite every backend's tests run.
//!
//! A backend's test file does:
//!
//! ```ignore
//! async fn harness() -> &'static dlock_tests::Harness { /* init once */ }
//! dlock_tests::conformance_suite!(harness);
//! ```
//!
//! and gets one `#[tokio::test]` per invariant of DESIGN.md §5 that a single
//! process can show. Every test runs on its own tokio runtime, so the suite
//! also shows that a registry keeps working across runtimes. The SQL
//! databases' test files also run the lease-table suite
//! (`dlock_tests::sql_lease_table_suite!(target)`) or the session suite
//! (`dlock_tests::sql_session_suite!(target)`). A backend that offers
//! semaphores runs `dlock_tests::semaphore_suite!(harness)`, one that offers
//! read-write locks `dlock_tests::rw_suite!(harness)`, with the same harness. Each suite's cases are
//! ordinary functions of its module, listed once at its end (see `suite!`);
//! a case left off the list fails the build.
//!
//! Beside the suites: the handoff measurement ([`handoff`]), support for the
//! in-process runtime tests ([`memory_support`]), SQLite's doorbells
//! (`doorbell_support`), Redis, ZooKeeper and the SQL servers.

/// Lists a suite's cases: `async fn`s of the calling module, private, each
/// taking the suite's one argument (`$arg`). Expands to a module `cases` with
/// one public function per listed case (calling it), and to an exported macro
/// `$suite!(setup)` with one `#[tokio::test]` per listed case, each calling
/// `setup().await` and handing the answer to the case.
///
/// A suite's module denies dead code (`#![deny(dead_code)]`): a case left off
/// the list is used nowhere, so it fails the build; a listed name that is not
/// a case of that signature fails it too.
macro_rules! suite {
    ($suite:ident, $module:ident, $arg:ty, $setup:literal; $($case:ident),+ $(,)?) => {
        $crate::suite!(@expand ($) $suite $module ($arg) $setup; $($case)+);
    };
    (@expand ($d:tt) $suite:ident $module:ident ($arg:ty) $setup:literal; $($case:ident)+) => {
        #[doc = concat!("The listed cases, for the tests `", stringify!($suite), "!` expands to.")]
        pub mod cases {
            $(
                #[doc = concat!("Runs the case `", stringify!($case), "`.")]
                pub async fn $case(arg: $arg) {
                    super::$case(arg).await;
                }
            )+
        }

        #[doc = concat!(
            "Expands to one `#[tokio::test]` per case of [`crate::", stringify!($module),
            "`], each calling ", $setup, " first."
        )]
        #[macro_export]
        macro_rules! $suite {
            ($d setup:path) => {
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $case() {
                        let setup = $d setup().await;
                        $d crate::$module::cases::$case(setup).await;
                    }
                )+
            };
        }
    };
}
use suite;

pub mod conformance;
#[cfg(feature = "sqlite")]
pub mod doorbell_support;
pub mod handoff;
pub mod memory_support;
pub mod rw_locks;
pub mod scenarios;
pub mod semaphores;
#[cfg(feature = "redis")]
pub mod sentinel_support;

use std::sync::Arc;

use futures_util::future::BoxFuture;

/// Server-side access a backend's tests give the suite, to cause and observe
/// what a lock holder cannot: an operator deleting the key, a check that the
/// key is really gone.
pub trait Faults: Send + Sync + 'static {
    /// Ends the lease on `stored_key` behind the holder's back (`DEL`, `DELETE`,
    /// expire now): the holder must learn that it lost the lock.
    fn revoke<'a>(&'a self, stored_key: &'a str) -> BoxFuture<'a, ()>;

    /// Whether `stored_key` is held (unexpired, with an owner) on the server now.
    fn is_held<'a>(&'a self, stored_key: &'a str) -> BoxFuture<'a, bool>;

    /// How many entries (keys, rows, nodes, counters) the server keeps for
    /// stored keys starting with `stored_prefix`, once the backend's
    /// retention for free keys has passed (an implementation may run the
    /// backend's collection first); `None` where it cannot tell.
    fn leftover<'a>(&'a self, stored_prefix: &'a str) -> BoxFuture<'a, Option<usize>> {
        let _ = stored_prefix;
        Box::pin(std::future::ready(None))
    }
}

/// What the suite needs: the backend under test installed as the default
/// backend of the global registry (so `#[distributed_lock]` functions use it),
/// and its server-side controls.
pub struct Harness {
    /// Server-side controls of the backend under test.
    pub faults: Arc<dyn Faults>,
    /// Whether the backend hands out fencing tokens (all but Redlock).
    pub fences: bool,
}

impl Harness {
    /// The registry installed with `dlock_runtime::init`.
    pub fn registry(&self) -> &'static dlock_runtime::Registry {
        dlock_runtime::global().expect("the harness installs the global registry")
    }

    /// The stored form of a user key (with the registry's prefix).
    pub fn stored(&self, key: &str) -> String {
        format!("{}{key}", self.registry().key_prefix())
    }
}

/// [`Faults`] of a [`MemoryBackend`](dlock_runtime::MemoryBackend): `revoke`
/// is `expire_now`, `is_held` looks at its held keys.
pub struct MemoryFaults(pub dlock_runtime::MemoryBackend);

impl Faults for MemoryFaults {
    fn revoke<'a>(&'a self, stored_key: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            self.0.expire_now(stored_key);
        })
    }

    fn is_held<'a>(&'a self, stored_key: &'a str) -> BoxFuture<'a, bool> {
        Box::pin(async move { self.0.held_keys().iter().any(|k| k == stored_key) })
    }

    fn leftover<'a>(&'a self, stored_prefix: &'a str) -> BoxFuture<'a, Option<usize>> {
        Box::pin(async move { Some(self.0.entries_under(stored_prefix)) })
    }
}

/// A key unique to this test run, so that runs against a persistent server
/// never see each other's leases.
pub fn unique_key(case: &str) -> String {
    static RUN: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let run = RUN.get_or_init(rand::random::<u64>);
    format!("conformance:{case}:{run:016x}")
}

#[cfg(feature = "etcd")]
pub mod etcd_support;
#[cfg(any(
    feature = "postgres",
    feature = "mysql",
    feature = "sqlite",
    feature = "redis"
))]
pub mod fence_support;
#[cfg(feature = "redis")]
pub mod redis_support;
#[cfg(feature = "zookeeper")]
pub mod zk_support;

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub mod sql_db;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub mod sql_lease_table;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub mod sql_server_lease_table;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub mod sql_session;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql")),
    allow(unused_imports)
)]
pub mod sql_support;

/// The URL of a test server from `scripts/servers.sh` (`urls.env`), or its
/// default. Test servers are never optional: a test that cannot reach its
/// server fails with a message saying how to start it.
pub fn server_url(var: &str, default: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| default.to_owned())
}

/// Panics with the way to start the test servers.
pub fn servers_missing(url: &str, err: impl std::fmt::Display) -> ! {
    panic!(
        "cannot reach the test server at {url}: {err}\n\
         start the test servers first: scripts/servers.sh up (scripts/test.sh does it)"
    )
}

/// Takes `key` on `registry` with a 30 s lease.
pub async fn hold(registry: &dlock_runtime::Registry, key: &str) -> dlock_runtime::LockGuard {
    registry
        .lock(key)
        .lease(std::time::Duration::from_secs(30))
        .acquire()
        .await
        .expect("hold")
}

/// Acquires `key` on `registry` and releases it at once.
pub async fn acquire_and_release(registry: &dlock_runtime::Registry, key: &str) {
    registry
        .lock(key)
        .acquire()
        .await
        .expect("acquire")
        .release()
        .await
        .expect("release");
}

/// Acquires `key` on `registry`, trying again every 200 ms for up to 15 s (a
/// restarted server coming back), and answers the guard.
pub async fn acquire_eventually(
    registry: &dlock_runtime::Registry,
    key: &str,
) -> dlock_runtime::LockGuard {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        match registry.lock(key).acquire().await {
            Ok(guard) => return guard,
            Err(e) if std::time::Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            Err(e) => panic!("no acquisition of {key} after the restart: {e}"),
        }
    }
}
