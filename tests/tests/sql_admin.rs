//! Holder records, `inspect`, `list` and `revoke` on the SQL backends beyond
//! the conformance suite: the holder's instance name (the builder's and
//! `DLOCK_HOLDER`), a grant by another process shown with its pid and taken
//! from it, session mode's revoke refused to a role that may not end the
//! holder's connection (leaving nothing that would later call a loss a
//! revocation), a session connection ended by something else not reported
//! as revoked, and a lease table created without the holder columns.
#![cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]

use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

#[cfg(any(feature = "postgres", feature = "mysql"))]
use dlock_runtime::LockGuard;
use dlock_runtime::{LockError, LossReason, Registry};
use dlock_tests::sql_db::SqlDb;
#[cfg(any(feature = "postgres", feature = "mysql"))]
use dlock_tests::sql_support::SqlMode;
use dlock_tests::unique_key;

const SECOND: Duration = Duration::from_secs(1);

#[cfg(feature = "sqlite")]
fn sqlite_path() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("sql-admin-{}.db", std::process::id()))
    })
}

/// Every SQL backend and mode under test, as URLs.
fn urls() -> Vec<String> {
    let mut urls = Vec::new();
    #[cfg(feature = "sqlite")]
    urls.push(SqlDb::Sqlite(sqlite_path()).url());
    #[cfg(feature = "postgres")]
    {
        urls.push(SqlDb::Postgres.url());
        urls.push(format!("{}?mode=session", SqlDb::Postgres.url()));
    }
    #[cfg(feature = "mysql")]
    {
        urls.push(SqlDb::Mysql.url());
        urls.push(format!("{}?mode=session", SqlDb::Mysql.url()));
    }
    urls
}

async fn registry(url: &str) -> Registry {
    Registry::from_url(url)
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

/// A `dlock-admin-holder` child holding `key` on `url`.
struct Holder {
    child: Child,
    stdout: Option<BufReader<ChildStdout>>,
    token: u64,
}

impl Holder {
    fn start(url: &str, key: &str, name: &str) -> Holder {
        let mut child = Command::new(env!("CARGO_BIN_EXE_dlock-admin-holder"))
            .args([url, key])
            .env("DLOCK_HOLDER", name)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the holder process");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        stdout
            .read_line(&mut line)
            .expect("the holder's first line");
        let token = line
            .trim()
            .strip_prefix("held ")
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("the holder said {line:?}"));
        Holder {
            child,
            stdout: Some(stdout),
            token,
        }
    }

    /// The holder's next line, within `within`.
    async fn next_line(&mut self, within: Duration) -> String {
        let mut stdout = self.stdout.take().expect("stdout");
        let read = tokio::task::spawn_blocking(move || {
            let mut line = String::new();
            stdout.read_line(&mut line).expect("a line");
            (stdout, line)
        });
        let (stdout, line) = tokio::time::timeout(within, read)
            .await
            .expect("the holder answers in time")
            .expect("task");
        self.stdout = Some(stdout);
        line.trim().to_owned()
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Ends the session connection holding `key` behind its holder's back, as
/// an operator's own `pg_terminate_backend` or `KILL` would, and answers the
/// reason its holder is told.
#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn reason_told_when_ended_by_another(
    db: SqlDb,
    registry: &Registry,
    key: &str,
    guard: &LockGuard,
) -> Option<LossReason> {
    db.faults(SqlMode::Session)
        .revoke(&format!("{}{key}", registry.key_prefix()))
        .await;
    tokio::time::timeout(10 * SECOND, guard.lost())
        .await
        .expect("the holder is told that its connection ended");
    guard.loss_reason()
}

/// A session connection ended by something other than dlock's revoke is
/// reported as an ended session (or a key gone), never as a revocation.
#[cfg(all(feature = "postgres", feature = "mysql"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_ended_by_another_is_not_reported_revoked() {
    for db in [SqlDb::Postgres, SqlDb::Mysql] {
        let url = format!("{}?mode=session", db.url());
        let registry = registry(&url).await;
        let key = unique_key("ended-otherwise");
        let guard = registry
            .lock(&key)
            .lease(2 * SECOND)
            .acquire()
            .await
            .expect("acquire");
        let reason = reason_told_when_ended_by_another(db, &registry, &key, &guard).await;
        assert!(
            matches!(reason, Some(LossReason::SessionEnded | LossReason::Gone)),
            "{url}: {reason:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_builders_holder_name_is_stored_with_the_grant() {
    for url in urls() {
        let registry = Registry::builder()
            .default_backend(dlock_runtime::connect(&url).await.expect("connect"))
            .holder_name("payments blue")
            .build();
        let key = unique_key("admin-name");
        let guard = registry.lock(&key).acquire().await.expect("acquire");
        let info = registry
            .inspect(&key)
            .await
            .expect("inspect")
            .unwrap_or_else(|| panic!("{url}: the held key is shown"));
        let holder = &info.holders()[0];
        assert_eq!(holder.name(), Some("payments blue"), "{url}: {holder:?}");
        assert_eq!(holder.pid(), Some(std::process::id()), "{url}");
        assert!(holder.granted_at().is_some(), "{url}: {holder:?}");
        guard.release().await.expect("release");
    }
}

/// Two registries of one process with different holder names, on one lock
/// table: each grant is shown with its own registry's record (MySQL keeps
/// the records apart from the rows, one per registry), side by side and on
/// one key handed from one to the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registries_with_different_holder_names_are_told_apart_on_one_table() {
    for url in urls() {
        let backend = dlock_runtime::connect(&url).await.expect("connect");
        let named = |name: &str| {
            Registry::builder()
                .default_backend(backend.clone())
                .holder_name(name)
                .build()
        };
        let (blue, green) = (named("payments blue"), named("payments green"));
        let prefix = unique_key("admin-two-names");
        let (kb, kg) = (format!("{prefix}:b"), format!("{prefix}:g"));
        let b = blue.lock(&kb).acquire().await.expect("acquire blue");
        let g = green.lock(&kg).acquire().await.expect("acquire green");
        let listed = blue.list(&prefix, 10).await.expect("list");
        let names: Vec<_> = listed
            .iter()
            .map(|k| (k.key().to_owned(), k.holders()[0].name().map(str::to_owned)))
            .collect();
        assert_eq!(
            names,
            [
                (kb.clone(), Some("payments blue".to_owned())),
                (kg.clone(), Some("payments green".to_owned()))
            ],
            "{url}: {listed:?}"
        );
        g.release().await.expect("release green");
        b.release().await.expect("release blue");
        let shared = format!("{prefix}:handed");
        for (registry, name) in [(&blue, "payments blue"), (&green, "payments green")] {
            let guard = registry.lock(&shared).acquire().await.expect("acquire");
            let info = green
                .inspect(&shared)
                .await
                .expect("inspect")
                .unwrap_or_else(|| panic!("{url}: the held key is shown"));
            let holder = &info.holders()[0];
            assert_eq!(holder.name(), Some(name), "{url}: {holder:?}");
            assert_eq!(holder.pid(), Some(std::process::id()), "{url}");
            assert!(holder.granted_at().is_some(), "{url}: {holder:?}");
            guard.release().await.expect("release");
        }
    }
}

/// MySQL lease mode keeps a registry's holder record in a row of
/// `<table>_procs`, not in each grant's row; the record's row stays while
/// its registry holds a lease (renewed past the retention) and is collected
/// once the registry has held nothing for longer than the retention.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_registrys_record_row_is_collected_once_it_holds_nothing_past_the_retention() {
    let db = SqlDb::Mysql;
    let table = format!("dlock_records_{}", std::process::id());
    let drop_tables =
        format!("DROP TABLE IF EXISTS {table}, {table}_holders, {table}_procs, {table}_fence");
    db.execute(&drop_tables).await;
    let url = format!("{}?table={table}&retention=1s&timeout=1s", db.url());
    let backend = dlock_runtime::connect(&url).await.expect("connect");
    let name = unique_key("records-collected");
    let holder = Registry::builder()
        .default_backend(backend.clone())
        .holder_name(&name)
        .build();
    let other = Registry::builder().default_backend(backend).build();
    let rows_of = format!("SELECT COUNT(*) FROM {table}_procs WHERE holder LIKE '%{name}'");
    let lease = Duration::from_millis(300);
    let guard = holder
        .lock("records:held")
        .lease(lease)
        .acquire()
        .await
        .expect("acquire");
    assert_eq!(db.fetch_count(&rows_of).await, 1, "the record's row");
    assert_eq!(
        db.fetch_count(&format!(
            "SELECT COUNT(*) FROM {table} WHERE holder IS NOT NULL"
        ))
        .await,
        0,
        "the grant's row carries no record of its own"
    );
    // Held (the watchdog renews it) well past the row's first cover and
    // the retention, while the other registry's releases collect.
    let held_until = tokio::time::Instant::now() + 6 * SECOND;
    while tokio::time::Instant::now() < held_until {
        let g = other
            .lock("records:other")
            .acquire()
            .await
            .expect("acquire");
        g.release().await.expect("release");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(!guard.is_lost(), "the holder kept its lease");
    assert_eq!(db.fetch_count(&rows_of).await, 1, "kept while held");
    let info = other
        .inspect("records:held")
        .await
        .expect("inspect")
        .expect("held");
    assert_eq!(info.holders()[0].name(), Some(name.as_str()));
    guard.release().await.expect("release");
    // Collected at most twice (lease + timeout) plus the retention after
    // the release; the bound here is liveness on a loaded machine.
    let deadline = tokio::time::Instant::now() + 60 * SECOND;
    loop {
        let g = other
            .lock("records:other")
            .acquire()
            .await
            .expect("acquire");
        g.release().await.expect("release");
        if db.fetch_count(&rows_of).await == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the record's row was not collected within 60 s of the release"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The other registry, still acquiring, keeps its own row.
    assert_eq!(
        db.fetch_count(&format!("SELECT COUNT(*) FROM {table}_procs"))
            .await,
        1
    );
    db.execute(&drop_tables).await;
}

/// A name longer than a PostgreSQL connection's `application_name` holds,
/// and one outside ASCII, are shown whole in every mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_or_non_ascii_holder_name_is_shown_whole() {
    let long = format!("payments {}", "x".repeat(80));
    for name in [long.as_str(), "entrepôt nord"] {
        for url in urls() {
            let registry = Registry::builder()
                .default_backend(dlock_runtime::connect(&url).await.expect("connect"))
                .holder_name(name)
                .build();
            let key = unique_key("admin-long-name");
            let guard = registry.lock(&key).acquire().await.expect("acquire");
            let info = registry
                .inspect(&key)
                .await
                .expect("inspect")
                .unwrap_or_else(|| panic!("{url}: the held key is shown"));
            let holder = &info.holders()[0];
            assert_eq!(holder.name(), Some(name), "{url}: {holder:?}");
            assert_eq!(holder.pid(), Some(std::process::id()), "{url}");
            guard.release().await.expect("release");
        }
    }
}

/// PostgreSQL session mode: the holder's connection carries the record in
/// its `application_name` (`dlock h1 <pid> …`) unless the URL names the
/// application, which is then kept, the record still shown.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_session_connection_names_carry_the_record_unless_the_url_names_one() {
    let db = SqlDb::Postgres;
    let pid = std::process::id();
    // The sessions holding an advisory lock whose connection's name is like
    // `pattern`.
    let holding = |pattern: &str| {
        format!(
            "SELECT count(*) FROM pg_stat_activity a JOIN pg_locks l \
               ON l.pid = a.pid AND l.locktype = 'advisory' AND l.granted \
             WHERE a.application_name LIKE '{pattern}'"
        )
    };
    for (query, shown) in [
        ("", format!("dlock h1 {pid} % replica 3")),
        ("&application_name=billing", "billing".to_owned()),
    ] {
        let url = format!("{}?mode=session{query}", db.url());
        let registry = Registry::builder()
            .default_backend(dlock_runtime::connect(&url).await.expect("connect"))
            .holder_name("replica 3")
            .build();
        let key = unique_key("admin-app-name");
        let guard = registry.lock(&key).acquire().await.expect("acquire");
        let named = db.fetch_count(&holding(&shown)).await;
        assert_eq!(
            named, 1,
            "{url}: the holder's connection is named like `{shown}`"
        );
        let info = registry
            .inspect(&key)
            .await
            .expect("inspect")
            .unwrap_or_else(|| panic!("{url}: the held key is shown"));
        let holder = &info.holders()[0];
        assert_eq!(holder.name(), Some("replica 3"), "{url}: {holder:?}");
        assert_eq!(holder.pid(), Some(pid), "{url}");
        assert!(holder.granted_at().is_some(), "{url}: {holder:?}");
        guard.release().await.expect("release");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_process_grant_is_shown_with_its_pid_and_revoked() {
    for url in urls() {
        let registry = registry(&url).await;
        let key = unique_key("admin-child");
        let mut holder = Holder::start(&url, &key, "replica 7");
        let info = registry
            .inspect(&key)
            .await
            .expect("inspect")
            .unwrap_or_else(|| panic!("{url}: the child's key is shown"));
        let shown = &info.holders()[0];
        assert_eq!(shown.pid(), Some(holder.child.id()), "{url}: {shown:?}");
        assert_eq!(shown.name(), Some("replica 7"), "{url}: {shown:?}");
        assert_eq!(shown.token().map(u64::from), Some(holder.token), "{url}");
        let listed = registry.list(&key, 10).await.expect("list");
        assert_eq!(listed.len(), 1, "{url}: {listed:?}");
        assert_eq!(listed[0].holders()[0].pid(), Some(holder.child.id()));

        let revoked = registry.revoke(&key).await.expect("revoke");
        assert_eq!(revoked.len(), 1, "{url}: {revoked:?}");
        assert_eq!(revoked[0].pid(), Some(holder.child.id()), "{url}");
        assert_eq!(holder.next_line(15 * SECOND).await, "lost", "{url}");
        let next = registry
            .lock(&key)
            .wait(10 * SECOND)
            .acquire()
            .await
            .expect("acquire after the revocation");
        assert!(
            next.fencing_token().map(u64::from) > Some(holder.token),
            "{url}: {:?} after the revoked {}",
            next.fencing_token(),
            holder.token
        );
        next.release().await.expect("release");
    }
}

/// A role that may read dlock's tables and write the counter table but not
/// end other sessions (`dlock_reader`, created by `scripts/servers.sh`): its
/// revoke in session mode says what it needs, and leaves no mark that would
/// later report another end of the holder's connection as a revocation.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_session_revoke_without_the_right_says_what_is_needed() {
    let db = SqlDb::Postgres;
    let role = "dlock_reader";
    let url = format!("{}?mode=session", db.url());
    let holder_registry = registry(&url).await;
    let key = unique_key("admin-denied");
    let guard = holder_registry
        .lock(&key)
        .lease(2 * SECOND)
        .acquire()
        .await
        .expect("acquire");
    // The tables exist now; their owner lets the reader read them, and
    // write the counter table (where a revocation marks the grant's end).
    db.execute(&format!(
        "GRANT SELECT ON dlock_leases, dlock_leases_fence TO {role}; \
         GRANT INSERT ON dlock_leases_fence TO {role}"
    ))
    .await;
    let base = db.url();
    let (_, rest) = base.split_once('@').expect("a URL with credentials");
    let denied = registry(&format!(
        "postgres://{role}:{role}@{rest}?mode=session&create=false"
    ))
    .await;
    let info = denied
        .inspect(&key)
        .await
        .expect("inspect as the other role");
    let holders = info.map(|info| info.holders().to_vec()).unwrap_or_default();
    assert_eq!(
        holders.first().and_then(|h| h.pid()),
        Some(std::process::id()),
        "the other role sees the holder and its record: {holders:?}"
    );
    let answer = denied.revoke(&key).await;
    let Err(err @ LockError::Backend { .. }) = &answer else {
        panic!("revoked without the right: {answer:?}")
    };
    assert!(
        err.to_string().contains("pg_signal_backend"),
        "the error says what is needed: {err}"
    );
    assert!(
        holder_registry
            .inspect(&key)
            .await
            .expect("inspect")
            .is_some(),
        "the holder keeps the key"
    );
    let reason = reason_told_when_ended_by_another(db, &holder_registry, &key, &guard).await;
    db.execute(&format!("REVOKE INSERT ON dlock_leases_fence FROM {role}"))
        .await;
    assert!(
        matches!(reason, Some(LossReason::SessionEnded | LossReason::Gone)),
        "a refused revocation marked the grant: {reason:?}"
    );
}

/// A user that may read dlock's tables but not kill other connections
/// (`dlock_reader`, created by `scripts/servers.sh`): its revoke in session
/// mode says what it needs, and leaves no mark that would later report
/// another end of the holder's connection as a revocation.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_session_revoke_without_the_right_says_what_is_needed() {
    let db = SqlDb::Mysql;
    let user = "dlock_reader";
    let base = db.url();
    let (_, rest) = base.split_once('@').expect("a URL with credentials");
    let url = format!("{base}?mode=session");
    let holder_registry = registry(&url).await;
    let key = unique_key("admin-denied");
    let guard = holder_registry
        .lock(&key)
        .lease(2 * SECOND)
        .acquire()
        .await
        .expect("acquire");
    let denied = registry(&format!(
        "mysql://{user}:{user}@{rest}?mode=session&create=false"
    ))
    .await;
    assert!(
        denied.inspect(&key).await.expect("inspect").is_some(),
        "the other user sees the holder"
    );
    let answer = denied.revoke(&key).await;
    let Err(err @ LockError::Backend { .. }) = &answer else {
        panic!("revoked without the right: {answer:?}")
    };
    assert!(
        err.to_string().contains("CONNECTION_ADMIN"),
        "the error says what is needed: {err}"
    );
    assert!(
        holder_registry
            .inspect(&key)
            .await
            .expect("inspect")
            .is_some(),
        "the holder keeps the key"
    );
    let reason = reason_told_when_ended_by_another(db, &holder_registry, &key, &guard).await;
    assert!(
        matches!(reason, Some(LossReason::SessionEnded | LossReason::Gone)),
        "a refused revocation marked the grant: {reason:?}"
    );
}

/// A lease table as earlier versions created it, with a row one of them
/// granted: the columns are added, the old grant is shown (without a
/// holder record) and revoked, new grants carry records.
async fn an_old_lease_table_keeps_working(db: SqlDb, url: &str, table: &str, old_row: &str) {
    db.execute(old_row).await;
    let registry = registry(url).await;
    let old = registry
        .inspect("old-grant")
        .await
        .expect("inspect the old grant")
        .expect("the old grant is shown");
    assert_eq!(old.holders()[0].pid(), None, "{old:?}");
    assert_eq!(old.holders()[0].token().map(u64::from), Some(5), "{old:?}");
    assert_eq!(registry.revoke("old-grant").await.expect("revoke").len(), 1);
    let guard = registry
        .lock("old-grant")
        .acquire()
        .await
        .expect("the revoked key is free");
    assert!(guard.fencing_token().map(u64::from) > Some(5));
    let info = registry
        .inspect("old-grant")
        .await
        .expect("inspect")
        .expect("held");
    assert_eq!(info.holders()[0].pid(), Some(std::process::id()), "{table}");
    guard.release().await.expect("release");
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_sqlite_lease_table_keeps_working() {
    let path: &'static Path = Box::leak(
        Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("sql-admin-old-{}.db", std::process::id()))
            .into_boxed_path(),
    );
    // An empty file is an empty database.
    std::fs::write(path, b"").expect("create the database file");
    let db = SqlDb::Sqlite(path);
    let ddl = "CREATE TABLE dlock_leases (key TEXT PRIMARY KEY NOT NULL, owner TEXT, \
               token INTEGER NOT NULL, expires_at INTEGER NOT NULL) WITHOUT ROWID; \
               INSERT INTO dlock_leases VALUES ('dlock:old-grant', 'an-old-owner', 5, \
               CAST(unixepoch('subsec') * 1000 AS INTEGER) + 600000)";
    an_old_lease_table_keeps_working(db, &db.url(), "dlock_leases", ddl).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_postgres_lease_table_keeps_working() {
    let db = SqlDb::Postgres;
    let table = format!("dlock_old_{}", std::process::id());
    let ddl = format!(
        "DROP TABLE IF EXISTS {table}; \
         CREATE TABLE {table} (key text COLLATE \"C\" PRIMARY KEY, owner text, \
         token bigint NOT NULL, expires_at timestamptz NOT NULL, \
         wanted boolean NOT NULL DEFAULT false); \
         INSERT INTO {table} VALUES ('dlock:old-grant', 'an-old-owner', 5, \
         clock_timestamp() + interval '10 minutes')"
    );
    let url = format!("{}?table={table}", db.url());
    an_old_lease_table_keeps_working(db, &url, &table, &ddl).await;
    db.execute(&format!("DROP TABLE {table}")).await;
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_mysql_lease_table_keeps_working() {
    let db = SqlDb::Mysql;
    let table = format!("dlock_old_{}", std::process::id());
    let ddl = format!(
        "DROP TABLE IF EXISTS {table}; \
         CREATE TABLE {table} (k VARBINARY(1024) NOT NULL PRIMARY KEY, owner VARBINARY(255), \
         token BIGINT UNSIGNED NOT NULL, expires_us BIGINT NOT NULL) ENGINE = InnoDB; \
         INSERT INTO {table} VALUES ('dlock:old-grant', 'an-old-owner', 5, \
         TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) + 600000000)"
    );
    let url = format!("{}?table={table}", db.url());
    an_old_lease_table_keeps_working(db, &url, &table, &ddl).await;
    db.execute(&format!(
        "DROP TABLE IF EXISTS {table}, {table}_holders, {table}_procs"
    ))
    .await;
}

/// A MySQL lease table of its own (`dlock_<name>_<pid>`), dropped with its
/// companions before and after.
#[cfg(feature = "mysql")]
struct MyTable {
    name: String,
}

#[cfg(feature = "mysql")]
impl MyTable {
    async fn new(name: &str) -> MyTable {
        let table = MyTable {
            name: format!("dlock_{name}_{}", std::process::id()),
        };
        table.drop_all().await;
        table
    }

    async fn drop_all(&self) {
        let t = &self.name;
        SqlDb::Mysql
            .execute(&format!(
                "DROP TABLE IF EXISTS {t}, {t}_holders, {t}_procs, {t}_fence"
            ))
            .await;
    }

    fn url(&self, options: &str) -> String {
        format!("{}?table={}{options}", SqlDb::Mysql.url(), self.name)
    }
}

/// On MySQL, a grant whose registry's `<table>_procs` row is gone (deleted
/// by hand, or collected) is never shown with the record the key's row
/// kept from an earlier grant: here one made by a process of the earlier
/// owner format (32 random hex digits, the record in the row), which is
/// itself shown with its record and revoked, during a rolling deploy.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_grant_without_its_record_row_is_never_shown_with_an_earlier_record() {
    let db = SqlDb::Mysql;
    let table = MyTable::new("stale_record").await;
    let registry = Registry::builder()
        .default_backend(
            dlock_runtime::connect(&table.url(""))
                .await
                .expect("connect"),
        )
        .holder_name("payments blue")
        .build();
    // An earlier version's grant: its owner is 32 random hex digits and its
    // row keeps its record.
    let t = &table.name;
    db.execute(&format!(
        "INSERT INTO {t} (k, owner, token, expires_us, holder, granted_us) VALUES \
         ('dlock:handed', '0123456789abcdef0123456789abcdef', 7, \
          TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) + 600000000, \
          'h1 1 old-host', \
          TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)))"
    ))
    .await;
    let old = registry
        .inspect("handed")
        .await
        .expect("inspect")
        .expect("the earlier version's grant is shown");
    assert_eq!(old.holders()[0].host(), Some("old-host"), "{old:?}");
    assert_eq!(old.holders()[0].pid(), Some(1), "{old:?}");
    let revoked = registry.revoke("handed").await.expect("revoke");
    assert_eq!(revoked.len(), 1, "{revoked:?}");
    assert_eq!(revoked[0].pid(), Some(1), "{revoked:?}");
    let guard = registry
        .lock("handed")
        .acquire()
        .await
        .expect("the revoked key is free");
    assert!(guard.fencing_token().map(u64::from) > Some(7));
    let shown = registry
        .inspect("handed")
        .await
        .expect("inspect")
        .expect("held");
    assert_eq!(
        shown.holders()[0].name(),
        Some("payments blue"),
        "{shown:?}"
    );
    assert_eq!(shown.holders()[0].pid(), Some(std::process::id()));
    // The registry's record row deleted behind its back: the grant is shown
    // without a record, or with its own, never with the earlier one.
    assert_eq!(
        db.fetch_count(&format!("SELECT COUNT(*) FROM {t}_procs"))
            .await,
        1,
        "the registry's one record row"
    );
    db.execute(&format!("DELETE FROM {t}_procs")).await;
    let shown = registry
        .inspect("handed")
        .await
        .expect("inspect")
        .expect("held");
    let holder = &shown.holders()[0];
    assert!(
        holder.pid().is_none() || holder.pid() == Some(std::process::id()),
        "an earlier grant's record shown for the live one: {holder:?}"
    );
    assert_ne!(holder.host(), Some("old-host"), "{holder:?}");
    assert!(holder.granted_at().is_some(), "{holder:?}");
    let listed = registry.list("", 10).await.expect("list");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_ne!(
        listed[0].holders()[0].host(),
        Some("old-host"),
        "{listed:?}"
    );
    guard.release().await.expect("release");
    table.drop_all().await;
}

/// On MySQL, a registry whose record row could not be extended for longer
/// than the row's cover (its row locked by another transaction, so each
/// extension failed while the renewals went on) writes it again once it
/// can, even after the row was collected: a grant held for long is shown
/// with its record.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_record_row_that_could_not_be_extended_is_written_again() {
    use sqlx::Connection as _;
    let db = SqlDb::Mysql;
    let table = MyTable::new("record_rewritten").await;
    let t = &table.name;
    let backend = dlock_runtime::connect(&table.url("&retention=1s&timeout=1s"))
        .await
        .expect("connect");
    let name = unique_key("record-rewritten");
    let holder = Registry::builder()
        .default_backend(backend.clone())
        .holder_name(&name)
        .build();
    let other = Registry::builder().default_backend(backend.clone()).build();
    let lease = 4 * SECOND;
    let guard = holder
        .lock("held")
        .lease(lease)
        .acquire()
        .await
        .expect("acquire");
    let id: String = {
        let mut conn = sqlx::MySqlConnection::connect(&db.url())
            .await
            .expect("connect");
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT CAST(id AS CHAR) FROM {t}_procs WHERE holder LIKE '%{name}'"
        )))
        .fetch_one(&mut conn)
        .await
        .expect("the registry's record row")
    };
    // Another transaction locks the row past its cover, twice (lease +
    // timeout) from its last extension, so every extension fails meanwhile.
    let mut locker = sqlx::MySqlConnection::connect(&db.url())
        .await
        .expect("connect");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SET SESSION innodb_lock_wait_timeout = 1; BEGIN; \
         SELECT * FROM {t}_procs WHERE id = '{id}' FOR UPDATE"
    )))
    .execute(&mut locker)
    .await
    .expect("lock the record row");
    let locked_until = tokio::time::Instant::now() + 2 * (lease + SECOND) + 2 * SECOND;
    while tokio::time::Instant::now() < locked_until {
        // Other registries' records and releases go on meanwhile, each a
        // new registry, so a new record row.
        let fresh = Registry::builder().default_backend(backend.clone()).build();
        let g = fresh.lock("other").acquire().await.expect("acquire other");
        g.release().await.expect("release other");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut locker)
        .await
        .expect("unlock");
    assert!(!guard.is_lost(), "the renewals went on");
    // The row's cover ended while locked (the collection may delete it):
    // the holder's renewals write it again.
    let deadline = tokio::time::Instant::now() + 60 * SECOND;
    loop {
        let g = other.lock("other").acquire().await.expect("acquire other");
        g.release().await.expect("release other");
        let rows = db
            .fetch_count(&format!(
                "SELECT COUNT(*) FROM {t}_procs WHERE id = '{id}' AND until_us > \
                 TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))"
            ))
            .await;
        if rows == 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the record row was not written again within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(!guard.is_lost(), "the renewals went on");
    let info = other.inspect("held").await.expect("inspect").expect("held");
    assert_eq!(info.holders()[0].name(), Some(name.as_str()), "{info:?}");
    guard.release().await.expect("release");
    table.drop_all().await;
}

/// On MySQL lease mode, permits and readers of registries with different
/// names are shown each with its own record, beside a plain lock of one of
/// them (its record in `<table>_procs`) under one prefix; a revocation
/// takes every permit, and a writer after the readers is shown as itself.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_permits_readers_and_a_plain_lock_are_shown_with_their_own_records() {
    let table = MyTable::new("shared_records").await;
    let backend = dlock_runtime::connect(&table.url(""))
        .await
        .expect("connect");
    let named = |name: &str| {
        Registry::builder()
            .default_backend(backend.clone())
            .holder_name(name)
            .build()
    };
    let (blue, green) = (named("payments blue"), named("payments green"));
    let names = |info: &dlock_runtime::LockInfo| -> Vec<(Option<String>, Option<u32>, bool)> {
        info.holders()
            .iter()
            .map(|h| (h.name().map(str::to_owned), h.slot(), h.is_reader()))
            .collect()
    };
    let b1 = blue
        .lock("s:sem")
        .permits(2)
        .acquire()
        .await
        .expect("permit");
    let g1 = green
        .lock("s:sem")
        .permits(2)
        .acquire()
        .await
        .expect("permit");
    let plain = green.lock("s:plain").acquire().await.expect("plain");
    let br = blue.lock("s:rw").read().acquire().await.expect("read");
    let gr = green.lock("s:rw").read().acquire().await.expect("read");
    let listed = green.list("s:", 10).await.expect("list");
    let shown: Vec<_> = listed
        .iter()
        .map(|k| (k.key().to_owned(), names(k)))
        .collect();
    let blue_name = Some("payments blue".to_owned());
    let green_name = Some("payments green".to_owned());
    assert_eq!(
        shown,
        [
            (
                "s:plain".to_owned(),
                vec![(green_name.clone(), None, false)]
            ),
            (
                "s:rw".to_owned(),
                vec![
                    (blue_name.clone(), None, true),
                    (green_name.clone(), None, true)
                ]
            ),
            (
                "s:sem".to_owned(),
                vec![
                    (blue_name.clone(), Some(0), false),
                    (green_name.clone(), Some(1), false)
                ]
            ),
        ],
        "{listed:?}"
    );
    for info in &listed {
        for h in info.holders() {
            assert_eq!(h.pid(), Some(std::process::id()), "{info:?}");
            assert!(h.granted_at().is_some(), "{info:?}");
        }
    }
    let revoked = blue.revoke("s:sem").await.expect("revoke");
    assert_eq!(revoked.len(), 2, "{revoked:?}");
    for guard in [&b1, &g1] {
        tokio::time::timeout(20 * SECOND, guard.lost())
            .await
            .expect("a revoked permit is told");
    }
    br.release().await.expect("release");
    gr.release().await.expect("release");
    let writer = blue.lock("s:rw").write().acquire().await.expect("write");
    let info = green.inspect("s:rw").await.expect("inspect").expect("held");
    assert_eq!(names(&info), [(blue_name, None, false)], "{info:?}");
    writer.release().await.expect("release");
    plain.release().await.expect("release");
    assert!(green.list("s:", 10).await.expect("list").is_empty());
    table.drop_all().await;
}

/// On MySQL, a process that connected (`create=false`) while the schema had
/// no `<table>_procs` keeps records in the lease rows, and one that
/// connected after a DBA added it keeps them in `_procs`, on one table:
/// each shows the other's grants without taking the record an earlier
/// grant left in a key's row for the live grant's.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_processes_before_and_after_the_record_table_show_each_others_grants() {
    let db = SqlDb::Mysql;
    let table = MyTable::new("late_records").await;
    let t = &table.name;
    let ddl: Vec<String> = dlock_runtime::MysqlBackend::DDL
        .split_inclusive(';')
        .map(|s| s.replace("dlock_leases", t))
        .collect();
    let (procs, others): (Vec<String>, Vec<String>) = ddl
        .into_iter()
        .partition(|s| s.contains(&format!("{t}_procs")));
    db.execute(&others.concat()).await;
    let named = |url: String, name: &'static str| async move {
        Registry::builder()
            .default_backend(dlock_runtime::connect(&url).await.expect("connect"))
            .holder_name(name)
            .build()
    };
    let before = named(table.url("&create=false"), "alpha").await;
    let a = before.lock("a").acquire().await.expect("acquire");
    db.execute(&procs.concat()).await;
    let after = named(table.url("&create=false"), "beta").await;
    let b = after.lock("b").acquire().await.expect("acquire");
    assert_eq!(
        db.fetch_count(&format!("SELECT COUNT(*) FROM {t}_procs"))
            .await,
        1,
        "only the later process writes a record row"
    );
    let shown = |listed: Vec<dlock_runtime::LockInfo>| -> Vec<(String, Option<String>)> {
        listed
            .iter()
            .map(|k| (k.key().to_owned(), k.holders()[0].name().map(str::to_owned)))
            .collect()
    };
    let both = [
        ("a".to_owned(), Some("alpha".to_owned())),
        ("b".to_owned(), Some("beta".to_owned())),
    ];
    assert_eq!(shown(after.list("", 10).await.expect("list")), both);
    let seen_before = shown(before.list("", 10).await.expect("list"));
    assert_eq!(seen_before[0], both[0]);
    assert_ne!(
        seen_before[1].1.as_deref(),
        Some("alpha"),
        "{seen_before:?}"
    );
    // The key handed from the earlier process to the later one: its row
    // still holds the earlier grant's record, never shown for the new one.
    a.release().await.expect("release");
    let a = after.lock("a").acquire().await.expect("acquire");
    let info = after.inspect("a").await.expect("inspect").expect("held");
    assert_eq!(info.holders()[0].name(), Some("beta"), "{info:?}");
    let info = before.inspect("a").await.expect("inspect").expect("held");
    assert_ne!(info.holders()[0].name(), Some("alpha"), "{info:?}");
    assert!(info.holders()[0].granted_at().is_some(), "{info:?}");
    // And back: the earlier process's grant carries its own record.
    a.release().await.expect("release");
    let a = before.lock("a").acquire().await.expect("acquire");
    let info = after.inspect("a").await.expect("inspect").expect("held");
    assert_eq!(info.holders()[0].name(), Some("alpha"), "{info:?}");
    a.release().await.expect("release");
    b.release().await.expect("release");
    table.drop_all().await;
}

/// On MySQL, the first grants of new registries, many at once, all write
/// the same record row (the registry's) at once: a free key is still taken
/// by one try each (no deadlock or lock wait surfaces as an error).
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_many_first_grants_of_a_registry_at_once_each_take_their_free_key() {
    let table = MyTable::new("first_grants").await;
    let backend = dlock_runtime::connect(&table.url(""))
        .await
        .expect("connect");
    for round in 0..8 {
        let registry = Registry::builder()
            .default_backend(backend.clone())
            .holder_name(format!("round {round}"))
            .build();
        let grants = futures_util::future::join_all((0..24).map(|i| {
            let registry = registry.clone();
            async move {
                registry
                    .lock(format!("first:{round}:{i}"))
                    .wait(Duration::ZERO)
                    .acquire()
                    .await
            }
        }))
        .await;
        let mut guards = Vec::new();
        for grant in grants {
            guards.push(grant.unwrap_or_else(|e| panic!("round {round}: {e}")));
        }
        let listed = registry
            .list(&format!("first:{round}:"), 100)
            .await
            .expect("list");
        assert_eq!(listed.len(), 24);
        let name = format!("round {round}");
        for info in &listed {
            assert_eq!(info.holders()[0].name(), Some(name.as_str()), "{info:?}");
        }
        for guard in guards {
            guard.release().await.expect("release");
        }
    }
    table.drop_all().await;
}

/// A key revoked from one registry and taken by another of other name on
/// one table: the revocation answers the first's record, the new grant is
/// shown with the second's, and the first is told it was revoked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_revoked_and_taken_by_another_registry_is_shown_with_the_new_record() {
    for url in urls() {
        let backend = dlock_runtime::connect(&url).await.expect("connect");
        let named = |name: &str| {
            Registry::builder()
                .default_backend(backend.clone())
                .holder_name(name)
                .build()
        };
        let (blue, green) = (named("payments blue"), named("payments green"));
        let key = unique_key("admin-revoked-taken");
        let first = blue
            .lock(&key)
            .lease(5 * SECOND)
            .acquire()
            .await
            .expect("acquire");
        let revoked = green.revoke(&key).await.expect("revoke");
        let names: Vec<_> = revoked.iter().map(|h| h.name()).collect();
        assert_eq!(names, [Some("payments blue")], "{url}: {revoked:?}");
        let second = green.lock(&key).acquire().await.expect("acquire");
        assert!(second.fencing_token() > first.fencing_token(), "{url}");
        for registry in [&blue, &green] {
            let info = registry
                .inspect(&key)
                .await
                .expect("inspect")
                .unwrap_or_else(|| panic!("{url}: held"));
            assert_eq!(info.holders().len(), 1, "{url}: {info:?}");
            assert_eq!(info.holders()[0].name(), Some("payments green"), "{url}");
        }
        tokio::time::timeout(20 * SECOND, first.lost())
            .await
            .unwrap_or_else(|_| panic!("{url}: the revoked holder is told"));
        assert_eq!(first.loss_reason(), Some(LossReason::Revoked), "{url}");
        second.release().await.expect("release");
    }
}

/// On MySQL, a registry's record row locked by another transaction (so
/// that extending it waits up to the URL's `timeout`) costs its holder no
/// lease, even one as short as the `timeout`: the renewals do not wait for
/// the record.
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_locked_record_row_does_not_hold_up_the_renewals() {
    use sqlx::Connection as _;
    let db = SqlDb::Mysql;
    let table = MyTable::new("record_locked").await;
    let t = &table.name;
    let backend = dlock_runtime::connect(&table.url("&timeout=3s"))
        .await
        .expect("connect");
    let name = unique_key("record-locked");
    let holder = Registry::builder()
        .default_backend(backend)
        .holder_name(&name)
        .build();
    let guard = holder
        .lock("held")
        .lease(3 * SECOND)
        .acquire()
        .await
        .expect("acquire");
    let mut locker = sqlx::MySqlConnection::connect(&db.url())
        .await
        .expect("connect");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "BEGIN; SELECT * FROM {t}_procs WHERE holder LIKE '%{name}' FOR UPDATE"
    )))
    .execute(&mut locker)
    .await
    .expect("lock the record row");
    // Past the row's first cover, twice (lease + timeout): several
    // extensions wait for the lock meanwhile.
    tokio::time::sleep(16 * SECOND).await;
    assert!(
        !guard.is_lost(),
        "the holder lost its lease: {:?}",
        guard.loss_reason()
    );
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut locker)
        .await
        .expect("unlock");
    let deadline = tokio::time::Instant::now() + 30 * SECOND;
    while db
        .fetch_count(&format!(
            "SELECT COUNT(*) FROM {t}_procs WHERE holder LIKE '%{name}' AND until_us > \
             TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) + 3000000"
        ))
        .await
        == 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the record row was not extended once unlocked"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(!guard.is_lost());
    guard.release().await.expect("release");
    table.drop_all().await;
}
