//! One SQL database under test (PostgreSQL, MySQL/MariaDB or SQLite) in one
//! mode: its URL, its backend, its harness, what it can do and the statements
//! a test runs behind the backend's back. The SQL suites
//! ([`crate::sql_lease_table`], [`crate::sql_session`]) are written once
//! against it.

use std::path::PathBuf;
use std::sync::Arc;

use dlock_runtime::{LockError, Registry};
use tokio::sync::OnceCell;

use crate::sql_support::SqlMode;
use crate::{Faults, Harness, servers_missing};

/// An SQL database: a test server's, or a SQLite file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SqlDb {
    /// PostgreSQL (`DLOCK_TEST_POSTGRES_URL`).
    #[cfg(feature = "postgres")]
    Postgres,
    /// MySQL/MariaDB (`DLOCK_TEST_MYSQL_URL`).
    #[cfg(feature = "mysql")]
    Mysql,
    /// SQLite, the database file at this path (lease mode only).
    #[cfg(feature = "sqlite")]
    Sqlite(&'static std::path::Path),
}

/// A backend of either database, on connections of its own.
#[derive(Debug, Clone)]
pub enum SqlBackend {
    /// A PostgreSQL backend.
    #[cfg(feature = "postgres")]
    Postgres(dlock_runtime::PostgresBackend),
    /// A MySQL/MariaDB backend.
    #[cfg(feature = "mysql")]
    Mysql(dlock_runtime::MysqlBackend),
    /// A SQLite backend.
    #[cfg(feature = "sqlite")]
    Sqlite(dlock_runtime::SqliteBackend),
}

impl SqlBackend {
    /// A registry whose default backend is this one.
    pub fn registry(&self) -> Registry {
        match self {
            #[cfg(feature = "postgres")]
            SqlBackend::Postgres(b) => Registry::builder().default_backend(b.clone()).build(),
            #[cfg(feature = "mysql")]
            SqlBackend::Mysql(b) => Registry::builder().default_backend(b.clone()).build(),
            #[cfg(feature = "sqlite")]
            SqlBackend::Sqlite(b) => Registry::builder().default_backend(b.clone()).build(),
        }
    }

    /// The rows of the backend's lease table.
    pub async fn row_count(&self) -> u64 {
        match self {
            #[cfg(feature = "postgres")]
            SqlBackend::Postgres(b) => b.row_count().await.expect("count"),
            #[cfg(feature = "mysql")]
            SqlBackend::Mysql(b) => b.row_count().await.expect("count"),
            #[cfg(feature = "sqlite")]
            SqlBackend::Sqlite(b) => b.row_count().await.expect("count"),
        }
    }

    /// The PostgreSQL backend; panics for another database.
    #[cfg(feature = "postgres")]
    pub fn postgres(&self) -> &dlock_runtime::PostgresBackend {
        match self {
            SqlBackend::Postgres(b) => b,
            #[cfg(any(feature = "mysql", feature = "sqlite"))]
            other => panic!("not PostgreSQL: {other:?}"),
        }
    }

    /// The MySQL/MariaDB backend; panics for another database.
    #[cfg(feature = "mysql")]
    pub fn mysql(&self) -> &dlock_runtime::MysqlBackend {
        match self {
            SqlBackend::Mysql(b) => b,
            #[cfg(any(feature = "postgres", feature = "sqlite"))]
            other => panic!("not MySQL: {other:?}"),
        }
    }
}

impl SqlDb {
    /// The server's URL, without dlock's options.
    pub fn url(self) -> String {
        match self {
            #[cfg(feature = "postgres")]
            SqlDb::Postgres => crate::server_url(
                "DLOCK_TEST_POSTGRES_URL",
                "postgres://dlock:dlock@127.0.0.1:45432/dlock",
            ),
            #[cfg(feature = "mysql")]
            SqlDb::Mysql => crate::server_url(
                "DLOCK_TEST_MYSQL_URL",
                "mysql://dlock:dlock@127.0.0.1:43306/dlock",
            ),
            #[cfg(feature = "sqlite")]
            SqlDb::Sqlite(path) => format!("sqlite://{}", path.display()),
        }
    }

    /// The URL scheme (`postgres`, `mysql`, `sqlite`).
    pub fn scheme(self) -> &'static str {
        match self {
            #[cfg(feature = "postgres")]
            SqlDb::Postgres => "postgres",
            #[cfg(feature = "mysql")]
            SqlDb::Mysql => "mysql",
            #[cfg(feature = "sqlite")]
            SqlDb::Sqlite(_) => "sqlite",
        }
    }

    /// Whether the database is a server reached over TCP (logins, a proxy
    /// between): not SQLite.
    pub fn has_server(self) -> bool {
        match self {
            #[cfg(feature = "postgres")]
            SqlDb::Postgres => true,
            #[cfg(feature = "mysql")]
            SqlDb::Mysql => true,
            #[cfg(feature = "sqlite")]
            SqlDb::Sqlite(_) => false,
        }
    }

    /// Whether the backend takes `?table=` and `?create=false` (one database,
    /// several lease tables): not SQLite (one lease table per file).
    pub fn names_its_table(self) -> bool {
        self.has_server()
    }

    /// Whether a release collects the free rows that are due before it
    /// returns (SQLite); the servers' backends collect in the background.
    pub fn collects_in_the_release(self) -> bool {
        !self.has_server()
    }

    /// The server's `host:port`.
    pub fn host_port(self) -> String {
        assert!(self.has_server(), "{self:?} has no server");
        crate::sql_support::host_port(&self.url())
    }

    /// A backend for `url` (any URL of this database, with options).
    pub async fn connect_url(self, url: &str) -> Result<SqlBackend, LockError> {
        match self {
            #[cfg(feature = "postgres")]
            SqlDb::Postgres => dlock_runtime::PostgresBackend::connect(url)
                .await
                .map(SqlBackend::Postgres),
            #[cfg(feature = "mysql")]
            SqlDb::Mysql => dlock_runtime::MysqlBackend::connect(url)
                .await
                .map(SqlBackend::Mysql),
            #[cfg(feature = "sqlite")]
            SqlDb::Sqlite(_) => dlock_runtime::SqliteBackend::connect(url)
                .await
                .map(SqlBackend::Sqlite),
        }
    }

    /// A backend on the server with `query` (`?…`, or empty) appended to its
    /// URL: what another process would have.
    pub async fn connect(self, query: &str) -> SqlBackend {
        let url = format!("{}{query}", self.url());
        self.connect_url(&url)
            .await
            .unwrap_or_else(|e| servers_missing(&url, e))
    }

    /// A registry over a backend on the server with `?options` appended to
    /// its URL.
    pub async fn registry(self, options: &str) -> Registry {
        self.connect(&format!("?{options}")).await.registry()
    }

    /// Server-side controls for a backend of this database in `mode`.
    pub fn faults(self, mode: SqlMode) -> Arc<dyn Faults> {
        match self {
            #[cfg(feature = "postgres")]
            SqlDb::Postgres => Arc::new(crate::sql_support::PgFaults {
                url: self.url(),
                mode,
            }),
            #[cfg(feature = "mysql")]
            SqlDb::Mysql => Arc::new(crate::sql_support::MyFaults {
                url: self.url(),
                mode,
            }),
            #[cfg(feature = "sqlite")]
            SqlDb::Sqlite(path) => {
                assert_eq!(mode, SqlMode::Lease, "SQLite has only the lease table");
                Arc::new(SqliteFaults {
                    path: path.to_owned(),
                })
            }
        }
    }

    /// Runs `sql` with its `{key}` column and `{param}` placeholder filled in
    /// for this database, binding `value` to the placeholder; answers the
    /// rows affected.
    pub async fn execute_with(self, sql: &str, value: &str) -> u64 {
        let sql = self.dialect(sql);
        match self {
            #[cfg(feature = "postgres")]
            SqlDb::Postgres => sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(value)
                .execute(&mut self.postgres_faults().connect().await)
                .await
                .expect("statement")
                .rows_affected(),
            #[cfg(feature = "mysql")]
            SqlDb::Mysql => sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(value)
                .execute(&mut self.mysql_faults().connect().await)
                .await
                .expect("statement")
                .rows_affected(),
            #[cfg(feature = "sqlite")]
            SqlDb::Sqlite(path) => sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(value)
                .execute(&mut SqliteFaults::connect_to(path).await)
                .await
                .expect("statement")
                .rows_affected(),
        }
    }

    /// Runs `sql` (no parameters) and answers its one integer.
    pub async fn fetch_count(self, sql: &str) -> i64 {
        let sql = self.dialect(sql);
        match self {
            #[cfg(feature = "postgres")]
            SqlDb::Postgres => sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .fetch_one(&mut self.postgres_faults().connect().await)
                .await
                .expect("count"),
            #[cfg(feature = "mysql")]
            SqlDb::Mysql => sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .fetch_one(&mut self.mysql_faults().connect().await)
                .await
                .expect("count"),
            #[cfg(feature = "sqlite")]
            SqlDb::Sqlite(path) => sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .fetch_one(&mut SqliteFaults::connect_to(path).await)
                .await
                .expect("count"),
        }
    }

    /// Runs `sql` (no parameters, no answer), e.g. `DROP TABLE`.
    pub async fn execute(self, sql: &str) {
        let sql = self.dialect(sql);
        match self {
            #[cfg(feature = "postgres")]
            SqlDb::Postgres => {
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                    .execute(&mut self.postgres_faults().connect().await)
                    .await
                    .expect("statement");
            }
            #[cfg(feature = "mysql")]
            SqlDb::Mysql => {
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                    .execute(&mut self.mysql_faults().connect().await)
                    .await
                    .expect("statement");
            }
            #[cfg(feature = "sqlite")]
            SqlDb::Sqlite(path) => {
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                    .execute(&mut SqliteFaults::connect_to(path).await)
                    .await
                    .expect("statement");
            }
        }
    }

    /// Deletes the session-mode fence row of `stored_key`; answers the rows
    /// deleted.
    pub async fn delete_fence_row(self, stored_key: &str) -> u64 {
        match self {
            #[cfg(feature = "postgres")]
            SqlDb::Postgres => sqlx::query(sqlx::AssertSqlSafe(format!(
                "DELETE FROM dlock_leases_fence WHERE k = {}",
                crate::sql_support::PG_SESSION_KEY
            )))
            .bind(stored_key)
            .execute(&mut self.postgres_faults().connect().await)
            .await
            .expect("delete")
            .rows_affected(),
            #[cfg(feature = "mysql")]
            SqlDb::Mysql => sqlx::query("DELETE FROM dlock_leases_fence WHERE k = ?")
                .bind(crate::sql_support::session_hash(stored_key) as i64)
                .execute(&mut self.mysql_faults().connect().await)
                .await
                .expect("delete")
                .rows_affected(),
            #[cfg(feature = "sqlite")]
            SqlDb::Sqlite(_) => panic!("SQLite has no session mode ({stored_key})"),
        }
    }

    /// The server connections holding the session lock of `stored_key`.
    pub async fn session_holder_count(self, stored_key: &str) -> usize {
        match self {
            #[cfg(feature = "postgres")]
            SqlDb::Postgres => self
                .postgres_faults()
                .session_holders(stored_key)
                .await
                .len(),
            #[cfg(feature = "mysql")]
            SqlDb::Mysql => usize::from(
                self.mysql_faults()
                    .session_holder(stored_key)
                    .await
                    .is_some(),
            ),
            #[cfg(feature = "sqlite")]
            SqlDb::Sqlite(_) => panic!("SQLite has no session mode ({stored_key})"),
        }
    }

    /// How soon a session-mode holder hears that the server dropped its
    /// connection, where the backend watches the idle connection
    /// (PostgreSQL; a ping is due every 500 ms); `None` where the next ping
    /// tells (MySQL).
    pub fn connection_loss_noticed_within(self) -> Option<std::time::Duration> {
        match self {
            #[cfg(feature = "postgres")]
            SqlDb::Postgres => Some(std::time::Duration::from_millis(300)),
            #[cfg(feature = "mysql")]
            SqlDb::Mysql => None,
            #[cfg(feature = "sqlite")]
            SqlDb::Sqlite(_) => panic!("SQLite has no session mode"),
        }
    }

    /// `{key}` → the lease table's key column, `{param}` → the placeholder.
    fn dialect(self, sql: &str) -> String {
        let (key, param) = match self {
            #[cfg(feature = "postgres")]
            SqlDb::Postgres => ("key", "$1"),
            #[cfg(feature = "mysql")]
            SqlDb::Mysql => ("k", "?"),
            #[cfg(feature = "sqlite")]
            SqlDb::Sqlite(_) => ("key", "?1"),
        };
        sql.replace("{key}", key).replace("{param}", param)
    }

    #[cfg(feature = "postgres")]
    fn postgres_faults(self) -> crate::sql_support::PgFaults {
        crate::sql_support::PgFaults {
            url: self.url(),
            mode: SqlMode::Lease,
        }
    }

    #[cfg(feature = "mysql")]
    fn mysql_faults(self) -> crate::sql_support::MyFaults {
        crate::sql_support::MyFaults {
            url: self.url(),
            mode: SqlMode::Lease,
        }
    }
}

/// What a test binary of one SQL database in one mode runs on: the database,
/// the mode, and the [`Harness`] (the global registry over a backend of both).
#[derive(Clone, Copy)]
pub struct SqlTarget {
    /// The database.
    pub db: SqlDb,
    /// The backend's mode.
    pub mode: SqlMode,
    /// The conformance harness; its registry is the global one.
    pub h: &'static Harness,
}

impl SqlTarget {
    /// Installs a backend of `db` in `mode` as the global registry's default
    /// backend, once per process (a test binary runs one database in one mode).
    pub async fn get(db: SqlDb, mode: SqlMode) -> SqlTarget {
        static HARNESS: OnceCell<(SqlDb, SqlMode, Harness)> = OnceCell::const_new();
        let (db_in, mode_in, h) = HARNESS
            .get_or_init(|| async {
                let backend = db.connect(mode.query()).await;
                #[cfg(feature = "postgres")]
                if let (SqlBackend::Postgres(b), SqlMode::Lease) = (&backend, mode) {
                    assert!(b.is_listening(), "{b:?}");
                }
                dlock_runtime::init(backend.registry()).expect("first init");
                let h = Harness {
                    faults: db.faults(mode),
                    fences: true,
                };
                (db, mode, h)
            })
            .await;
        assert_eq!(
            (*db_in, *mode_in),
            (db, mode),
            "one database and mode per binary"
        );
        SqlTarget { db, mode, h }
    }

    /// [`crate::sql_support::black_hole_then_reset`] on a backend of the
    /// target's database and mode with a 500 ms `timeout`.
    pub async fn black_hole_then_reset(self) {
        crate::sql_support::black_hole_then_reset(
            &self.db.url(),
            &self.mode.query_with("&timeout=500ms"),
            |url| async move { self.db.connect_url(&url).await.expect("connect").registry() },
        )
        .await;
    }

    /// A backend of the target's database and mode on connections of its
    /// own (what another process would have), with `options` (`&a=b…`, or
    /// empty) added to its URL.
    pub async fn other_process(&self, options: &str) -> SqlBackend {
        self.db.connect(&self.mode.query_with(options)).await
    }

    /// A backend of the target's database and mode, with `options` (`&a=b…`,
    /// or empty) added to its URL, on a lease table of its own (a table
    /// `name_<random>` where the database takes `?table=`, else a database
    /// file of its own); and that table, to drop when done.
    pub async fn with_own_table(&self, name: &str, options: &str) -> (SqlBackend, OwnTable) {
        let table = format!("{name}_{:08x}", rand::random::<u32>());
        match self.db {
            #[cfg(feature = "sqlite")]
            SqlDb::Sqlite(path) => {
                let file = path.with_file_name(format!("{table}.db"));
                let url = format!(
                    "sqlite://{}{}",
                    file.display(),
                    self.mode.query_with(options)
                );
                let backend = self
                    .db
                    .connect_url(&url)
                    .await
                    .unwrap_or_else(|e| panic!("open {url}: {e}"));
                (backend, OwnTable::File(file))
            }
            #[allow(unreachable_patterns)]
            db => {
                let backend = self
                    .other_process(&format!("&table={table}{options}"))
                    .await;
                (backend, OwnTable::Table(db, table))
            }
        }
    }
}

/// A lease table of a test's own ([`SqlTarget::with_own_table`]).
#[derive(Debug)]
pub enum OwnTable {
    /// A table of this name in the database.
    Table(SqlDb, String),
    /// A SQLite database file of its own.
    File(PathBuf),
}

impl OwnTable {
    /// Drops the table (removes the database file with its journal files).
    pub async fn drop_table(self) {
        match self {
            OwnTable::Table(db, table) => db.execute(&format!("DROP TABLE {table}")).await,
            OwnTable::File(file) => {
                for suffix in ["", "-wal", "-shm"] {
                    let mut path = file.clone().into_os_string();
                    path.push(suffix);
                    let _ = std::fs::remove_file(path);
                }
            }
        }
    }
}

/// Reads and changes a SQLite lease table directly, as an operator would,
/// over a connection of its own (opened per call, on the caller's runtime).
#[cfg(feature = "sqlite")]
pub struct SqliteFaults {
    /// The database file.
    pub path: PathBuf,
}

#[cfg(feature = "sqlite")]
impl SqliteFaults {
    /// A connection of its own to the database file at `path` (waiting up
    /// to 5 s for a lock).
    pub async fn connect_to(path: &std::path::Path) -> sqlx::SqliteConnection {
        use sqlx::ConnectOptions;
        sqlx::sqlite::SqliteConnectOptions::new()
            .filename(path)
            .busy_timeout(std::time::Duration::from_secs(5))
            .connect()
            .await
            .expect("a connection to the database file")
    }

    /// Panics unless a connection of its own takes the database's write
    /// lock (`BEGIN IMMEDIATE`, within its 5 s busy timeout): no transaction
    /// stays open elsewhere. `after` names what came before, for the message.
    pub async fn assert_writable(path: &std::path::Path, after: &str) {
        let mut conn = Self::connect_to(path).await;
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("after {after}, the write lock is still taken: {e}"));
        sqlx::query("ROLLBACK")
            .execute(&mut conn)
            .await
            .expect("rollback");
    }
}

#[cfg(feature = "sqlite")]
impl Faults for SqliteFaults {
    fn revoke<'a>(&'a self, stored_key: &'a str) -> futures_util::future::BoxFuture<'a, ()> {
        Box::pin(async move {
            let mut conn = Self::connect_to(&self.path).await;
            // Readers and permits are rows of the holder table.
            for sql in [
                "DELETE FROM dlock_leases_holders WHERE key = ?1",
                "DELETE FROM dlock_leases WHERE key = ?1",
            ] {
                sqlx::query(sql)
                    .bind(stored_key)
                    .execute(&mut conn)
                    .await
                    .expect("delete the rows");
            }
        })
    }

    fn is_held<'a>(&'a self, stored_key: &'a str) -> futures_util::future::BoxFuture<'a, bool> {
        Box::pin(async move {
            let held: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM dlock_leases WHERE key = ?1 \
                 AND MAX(CASE WHEN owner IS NULL THEN 0 ELSE expires_at END, shared_until) \
                     > CAST(unixepoch('subsec') * 1000 AS INTEGER)",
            )
            .bind(stored_key)
            .fetch_one(&mut Self::connect_to(&self.path).await)
            .await
            .expect("read the row");
            held > 0
        })
    }
}

impl SqlMode {
    /// The URL query selecting this mode (`""` or `"?mode=session"`).
    pub fn query(self) -> &'static str {
        match self {
            SqlMode::Lease => "",
            SqlMode::Session => "?mode=session",
        }
    }

    /// [`Self::query`] with `options` (`&a=b…`, or empty) added.
    pub fn query_with(self, options: &str) -> String {
        match (self.query(), options) {
            (q, "") => q.to_owned(),
            ("", o) => format!("?{}", o.trim_start_matches('&')),
            (q, o) => format!("{q}{o}"),
        }
    }
}
