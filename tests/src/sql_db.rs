//! One SQL database under test (PostgreSQL or MySQL/MariaDB) in one mode: its
//! URL, its backend, its harness and the statements a test runs behind the
//! backend's back. The SQL suites ([`crate::sql_lease_table`],
//! [`crate::sql_session`]) are written once against it.

use std::sync::Arc;

use dlock_runtime::{LockError, Registry};
use tokio::sync::OnceCell;

use crate::sql_support::SqlMode;
use crate::{Faults, Harness, server_url, servers_missing};

/// An SQL database of the test servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SqlDb {
    /// PostgreSQL (`DLOCK_TEST_POSTGRES_URL`).
    #[cfg(feature = "postgres")]
    Postgres,
    /// MySQL/MariaDB (`DLOCK_TEST_MYSQL_URL`).
    #[cfg(feature = "mysql")]
    Mysql,
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
}

impl SqlBackend {
    /// A registry whose default backend is this one.
    pub fn registry(&self) -> Registry {
        match self {
            #[cfg(feature = "postgres")]
            SqlBackend::Postgres(b) => Registry::builder().default_backend(b.clone()).build(),
            #[cfg(feature = "mysql")]
            SqlBackend::Mysql(b) => Registry::builder().default_backend(b.clone()).build(),
        }
    }

    /// The rows of the backend's lease table.
    pub async fn row_count(&self) -> u64 {
        match self {
            #[cfg(feature = "postgres")]
            SqlBackend::Postgres(b) => b.row_count().await.expect("count"),
            #[cfg(feature = "mysql")]
            SqlBackend::Mysql(b) => b.row_count().await.expect("count"),
        }
    }

    /// The PostgreSQL backend; panics for another database.
    #[cfg(feature = "postgres")]
    pub fn postgres(&self) -> &dlock_runtime::PostgresBackend {
        match self {
            SqlBackend::Postgres(b) => b,
            #[cfg(feature = "mysql")]
            other => panic!("not PostgreSQL: {other:?}"),
        }
    }

    /// The MySQL/MariaDB backend; panics for another database.
    #[cfg(feature = "mysql")]
    pub fn mysql(&self) -> &dlock_runtime::MysqlBackend {
        match self {
            SqlBackend::Mysql(b) => b,
            #[cfg(feature = "postgres")]
            other => panic!("not MySQL: {other:?}"),
        }
    }
}

impl SqlDb {
    /// The server's URL, without dlock's options.
    pub fn url(self) -> String {
        match self {
            #[cfg(feature = "postgres")]
            SqlDb::Postgres => server_url(
                "DLOCK_TEST_POSTGRES_URL",
                "postgres://dlock:dlock@127.0.0.1:45432/dlock",
            ),
            #[cfg(feature = "mysql")]
            SqlDb::Mysql => server_url(
                "DLOCK_TEST_MYSQL_URL",
                "mysql://dlock:dlock@127.0.0.1:43306/dlock",
            ),
        }
    }

    /// The URL scheme (`postgres`, `mysql`).
    pub fn scheme(self) -> &'static str {
        match self {
            #[cfg(feature = "postgres")]
            SqlDb::Postgres => "postgres",
            #[cfg(feature = "mysql")]
            SqlDb::Mysql => "mysql",
        }
    }

    /// The server's `host:port`.
    pub fn host_port(self) -> String {
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
        }
    }

    /// `{key}` → the lease table's key column, `{param}` → the placeholder.
    fn dialect(self, sql: &str) -> String {
        let (key, param) = match self {
            #[cfg(feature = "postgres")]
            SqlDb::Postgres => ("key", "$1"),
            #[cfg(feature = "mysql")]
            SqlDb::Mysql => ("k", "?"),
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
