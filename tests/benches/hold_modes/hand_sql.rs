//! The lease table's permit and reader transactions written by hand with
//! sqlx: the statements of `dlock-runtime/src/backend/sql/shared.rs`
//! (`try_shared` and `release_shared`) in each dialect's text
//! (`shared_sql` of `postgres/mod.rs`, `mysql/mod.rs`, `sqlite/mod.rs`),
//! run in the same order, in the same transactions: where a dialect says a
//! grant or a release in one statement (`grant`, `release`), that one.

/// An argument of a statement.
#[derive(Clone, Debug)]
pub(crate) enum Arg {
    Text(String),
    Int(i64),
}

/// A statement and, for each of its placeholders, the index of the argument
/// it takes (dlock's engine passes its arguments in a fixed order).
pub(crate) struct Stmt {
    sql: String,
    order: Vec<usize>,
}

impl Stmt {
    fn new(sql: String, order: &[usize]) -> Stmt {
        Stmt {
            sql,
            order: order.to_vec(),
        }
    }

    fn bound(&self, args: &[Arg]) -> Vec<Arg> {
        self.order.iter().map(|i| args[*i].clone()).collect()
    }
}

/// The statements one permit or reader pair runs.
pub(crate) struct HandSql {
    pub(crate) begin: &'static str,
    /// (key) → inserts the key's lease-table row, free, if missing.
    ensure: Stmt,
    /// (key, owner) → [ms left of a plain holder, ms left of another's
    /// writer mark], locking the row.
    lock: Stmt,
    /// (key) → [slot, permits, owner, ms left] of the live holder rows.
    holders: Stmt,
    /// `lock` and `holders` in one: (key, owner) → [`lock`'s two, 1 where
    /// the holder columns are current, `holders`' four], a row per holder.
    lock_holders: Option<Stmt>,
    /// (key, slot, permits, owner, lease ms, holder, token or -1) → [token]
    /// where `slot_token` is `None`.
    take: Stmt,
    /// (key, slot) → [token]; `None` where `take` returns it.
    slot_token: Option<Stmt>,
    /// (key, lease ms, 1 to bump the key's token) → [token] where
    /// `key_token` is `None`.
    share: Stmt,
    /// (key) → [token]; `None` where `share` returns it.
    key_token: Option<Stmt>,
    /// `share` and `take` in one statement: (key, slot, permits, owner,
    /// lease ms, holder, 1 for a reader) → [token].
    grant: Option<Stmt>,
    /// (key, slot or -1, owner).
    free_holder: Stmt,
    /// (key, owner).
    reshare: Stmt,
    /// (key): PostgreSQL's `NOTIFY` of a wanted key.
    notify: Option<Stmt>,
    /// `free_holder`, `reshare` and `notify` in one statement: (key, slot
    /// or -1, owner).
    release: Option<Stmt>,
    /// The release in one autocommitted statement when the key's row did
    /// not change while it waited for the row's lock: (key, slot or -1,
    /// owner) → [1 released, -1 no row, 0 changed: release in a transaction].
    release_now: Option<Stmt>,
    /// `begin` alone orders every decision: a release locks no row first.
    begin_orders: bool,
    /// SQLite's transaction ends folded into the statements beside them:
    /// `begin`, `ensure` and `lock_holders` in one call (key, owner); the
    /// grant with `COMMIT`; `release_now` the whole release.
    folded: Option<(Stmt, Stmt)>,
}

/// PostgreSQL's clock in µs.
const PG_NOW_US: &str = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint";

/// PostgreSQL's statements on `dlock_leases`, `NOTIFY` on channel `dlock`.
pub(crate) fn postgres() -> HandSql {
    let (table, h) = ("dlock_leases", "dlock_leases_holders");
    let left = |at: &str| {
        format!("GREATEST(0, ceil(extract(epoch FROM {at} - clock_timestamp()) * 1000))::bigint")
    };
    let live = "owner IS NOT NULL AND expires_at > clock_timestamp()";
    let until = |arg: &str| format!("clock_timestamp() + {arg} * interval '1 millisecond'");
    HandSql {
        begin: "BEGIN",
        ensure: Stmt::new(
            format!(
                "INSERT INTO {table} (key, owner, token, expires_at) \
                 VALUES ($1, NULL, 0, clock_timestamp()) ON CONFLICT (key) DO NOTHING"
            ),
            &[0],
        ),
        lock: Stmt::new(
            format!(
                "SELECT CASE WHEN owner IS NOT NULL AND expires_at > clock_timestamp() \
                             THEN {} END, \
                        CASE WHEN wwait_owner IS NOT NULL AND wwait_owner <> $2 \
                                  AND wwait_until > clock_timestamp() AND wwait_token = token \
                             THEN {} END \
                 FROM {table} WHERE key = $1 FOR UPDATE",
                left("expires_at"),
                left("wwait_until")
            ),
            &[0, 1],
        ),
        holders: Stmt::new(
            format!(
                "SELECT slot, permits, owner, {} FROM {h} WHERE key = $1 AND {live} \
                 ORDER BY slot",
                left("expires_at")
            ),
            &[0],
        ),
        lock_holders: Some(Stmt::new(
            format!(
                "SELECT CASE WHEN t.owner IS NOT NULL AND t.expires_at > clock_timestamp() \
                             THEN {} END, \
                        CASE WHEN t.wwait_owner IS NOT NULL AND t.wwait_owner <> $2 \
                                  AND t.wwait_until > clock_timestamp() \
                                  AND t.wwait_token = t.token \
                             THEN {} END, \
                        (CASE WHEN t.xmin = (SELECT s.xmin FROM {table} s WHERE s.key = $1) \
                              THEN 1 ELSE 0 END)::bigint, \
                        h.slot, h.permits, h.owner, {} \
                 FROM {table} t LEFT JOIN {h} h ON h.key = t.key \
                      AND h.owner IS NOT NULL AND h.expires_at > clock_timestamp() \
                 WHERE t.key = $1 ORDER BY h.slot FOR UPDATE OF t",
                left("t.expires_at"),
                left("t.wwait_until"),
                left("h.expires_at")
            ),
            &[0, 1],
        )),
        take: Stmt::new(
            format!(
                "INSERT INTO {h} AS h (key, slot, permits, owner, token, expires_at, holder, granted_at) \
                 VALUES ($1, $2, $3, $4, CASE WHEN $7 >= 0 THEN $7 ELSE {PG_NOW_US} END, {}, $6, \
                         clock_timestamp()) \
                 ON CONFLICT (key, slot) DO UPDATE SET permits = excluded.permits, \
                     owner = excluded.owner, \
                     token = CASE WHEN $7 >= 0 THEN $7 ELSE GREATEST(h.token + 1, excluded.token) END, \
                     expires_at = excluded.expires_at, holder = excluded.holder, \
                     granted_at = CASE WHEN h.owner = excluded.owner THEN h.granted_at \
                                       ELSE excluded.granted_at END \
                 RETURNING token",
                until("$5")
            ),
            &[0, 1, 2, 3, 4, 5, 6],
        ),
        slot_token: None,
        share: Stmt::new(
            format!(
                "UPDATE {table} SET shared_until = GREATEST(shared_until, {}), \
                 token = CASE WHEN $3 = 1 THEN GREATEST(token + 1, {PG_NOW_US}) ELSE token END \
                 WHERE key = $1 RETURNING token",
                until("$2")
            ),
            &[0, 1, 2],
        ),
        key_token: None,
        grant: Some(Stmt::new(
            format!(
                "WITH s AS (UPDATE {table} SET shared_until = GREATEST(shared_until, {}), \
                     token = CASE WHEN $7 = 1 THEN GREATEST(token + 1, {PG_NOW_US}) ELSE token END \
                     WHERE key = $1 RETURNING token, shared_until) \
                 INSERT INTO {h} AS h (key, slot, permits, owner, token, expires_at, holder, granted_at) \
                 SELECT $1, $2, $3, $4, CASE WHEN $7 = 1 THEN s.token ELSE {PG_NOW_US} END, \
                        LEAST({}, s.shared_until), $6, clock_timestamp() FROM s \
                 ON CONFLICT (key, slot) DO UPDATE SET permits = excluded.permits, \
                     owner = excluded.owner, \
                     token = CASE WHEN $7 = 1 THEN excluded.token \
                                  ELSE GREATEST(h.token + 1, excluded.token) END, \
                     expires_at = excluded.expires_at, holder = excluded.holder, \
                     granted_at = CASE WHEN h.owner = excluded.owner THEN h.granted_at \
                                       ELSE excluded.granted_at END \
                 RETURNING token",
                until("$5"),
                until("$5")
            ),
            &[0, 1, 2, 3, 4, 5, 6],
        )),
        free_holder: Stmt::new(
            format!(
                "UPDATE {h} SET owner = NULL, expires_at = clock_timestamp() \
                 WHERE key = $1 AND owner = $3 AND ($2 < 0 OR slot = $2)"
            ),
            &[0, 1, 2],
        ),
        reshare: Stmt::new(
            format!(
                "UPDATE {table} SET shared_until = \
                   (SELECT max(h.expires_at) FROM {h} h WHERE h.key = $1 \
                    AND h.owner IS NOT NULL AND h.expires_at > clock_timestamp()), \
                 wwait_owner = NULLIF(wwait_owner, $2) \
                 WHERE key = $1"
            ),
            &[0, 1],
        ),
        notify: Some(Stmt::new(
            format!("SELECT pg_notify('dlock', key)::text FROM {table} WHERE key = $1 AND wanted"),
            &[0],
        )),
        release: Some(Stmt::new(
            format!(
                "WITH f AS (UPDATE {h} SET owner = NULL, expires_at = clock_timestamp() \
                     WHERE key = $1 AND owner = $3 AND ($2 < 0 OR slot = $2)), \
                 r AS (UPDATE {table} SET shared_until = \
                       (SELECT max(h.expires_at) FROM {h} h WHERE h.key = $1 \
                        AND h.owner IS NOT NULL AND h.expires_at > clock_timestamp() \
                        AND NOT (h.owner = $3 AND ($2 < 0 OR h.slot = $2))), \
                     wwait_owner = NULLIF(wwait_owner, $3) \
                     WHERE key = $1 RETURNING key, wanted) \
                 SELECT pg_notify('dlock', key)::text FROM r WHERE wanted"
            ),
            &[0, 1, 2],
        )),
        release_now: Some(Stmt::new(
            format!(
                "WITH t AS (SELECT t.key, \
                     t.xmin = (SELECT s.xmin FROM {table} s WHERE s.key = $1) AS fresh \
                     FROM {table} t WHERE t.key = $1 FOR UPDATE), \
                 f AS (UPDATE {h} SET owner = NULL, expires_at = clock_timestamp() \
                     WHERE key = $1 AND owner = $3 AND ($2 < 0 OR slot = $2) \
                     AND (SELECT fresh FROM t)), \
                 r AS (UPDATE {table} SET shared_until = \
                       (SELECT max(h.expires_at) FROM {h} h WHERE h.key = $1 \
                        AND h.owner IS NOT NULL AND h.expires_at > clock_timestamp() \
                        AND NOT (h.owner = $3 AND ($2 < 0 OR h.slot = $2))), \
                     wwait_owner = NULLIF(wwait_owner, $3) \
                     WHERE key = $1 AND (SELECT fresh FROM t) RETURNING key, wanted) \
                 SELECT (CASE WHEN (SELECT fresh FROM t) THEN 1 \
                              WHEN EXISTS (SELECT 1 FROM t) THEN 0 ELSE -1 END)::bigint, \
                        (SELECT count(pg_notify('dlock', key)) FROM r WHERE wanted)"
            ),
            &[0, 1, 2],
        )),
        begin_orders: false,
        folded: None,
    }
}

/// MariaDB's clock in µs.
const MY_N: &str = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))";

/// MariaDB's (and MySQL's) statements on `dlock_leases`.
pub(crate) fn mariadb() -> HandSql {
    let (table, h, n) = ("dlock_leases", "dlock_leases_holders", MY_N);
    let left = |at: &str| format!("CAST(CEIL(GREATEST({at} - {n}, 0) / 1000) AS SIGNED)");
    let live = format!("owner IS NOT NULL AND expires_us > {n}");
    HandSql {
        begin: "BEGIN",
        ensure: Stmt::new(
            format!(
                "INSERT INTO {table} (k, owner, token, expires_us) \
                 VALUES (?, NULL, 0, {n}) ON DUPLICATE KEY UPDATE token = token"
            ),
            &[0],
        ),
        lock: Stmt::new(
            format!(
                "SELECT CASE WHEN owner IS NOT NULL AND expires_us > {n} THEN {} END, \
                        CASE WHEN wwait_owner IS NOT NULL AND wwait_owner <> ? \
                                  AND wwait_us > {n} AND wwait_token = token THEN {} END \
                 FROM {table} WHERE k = ? FOR UPDATE",
                left("expires_us"),
                left("wwait_us")
            ),
            &[1, 0],
        ),
        holders: Stmt::new(
            format!(
                "SELECT slot, permits, owner, {} FROM {h} WHERE k = ? AND {live} ORDER BY slot",
                left("expires_us")
            ),
            &[0],
        ),
        lock_holders: None,
        take: Stmt::new(
            format!(
                "INSERT INTO {h} (k, slot, permits, owner, token, expires_us, holder, granted_us) \
                 VALUES (?, ?, ?, ?, IF(? >= 0, ?, {n}), \
                         LEAST({n} + ? * 1000, (SELECT shared_us FROM {table} WHERE k = ?)), ?, {n}) \
                 ON DUPLICATE KEY UPDATE \
                 token = IF(? >= 0, ?, GREATEST(token + 1, {n})), \
                 granted_us = IF(owner <=> ?, granted_us, {n}), \
                 permits = VALUES(permits), owner = VALUES(owner), \
                 expires_us = VALUES(expires_us), holder = VALUES(holder)"
            ),
            &[0, 1, 2, 3, 6, 6, 4, 0, 5, 6, 6, 3],
        ),
        slot_token: Some(Stmt::new(
            format!("SELECT token FROM {h} WHERE k = ? AND slot = ?"),
            &[0, 1],
        )),
        share: Stmt::new(
            format!(
                "UPDATE {table} SET shared_us = GREATEST(shared_us, {n} + ? * 1000), \
                 token = IF(? = 1, GREATEST(token + 1, {n}), token) WHERE k = ?"
            ),
            &[1, 2, 0],
        ),
        key_token: Some(Stmt::new(
            format!("SELECT CAST(token AS SIGNED) FROM {table} WHERE k = ?"),
            &[0],
        )),
        grant: None,
        free_holder: Stmt::new(
            format!(
                "UPDATE {h} SET owner = NULL, expires_us = {n} \
                 WHERE k = ? AND owner = ? AND (? < 0 OR slot = ?)"
            ),
            &[0, 2, 1, 1],
        ),
        reshare: Stmt::new(
            format!(
                "UPDATE {table} SET shared_us = COALESCE((SELECT MAX(h.expires_us) FROM {h} h \
                   WHERE h.k = ? AND h.owner IS NOT NULL AND h.expires_us > {n}), 0), \
                 wwait_owner = IF(wwait_owner <=> ?, NULL, wwait_owner) WHERE k = ?"
            ),
            &[0, 1, 0],
        ),
        notify: None,
        release: None,
        release_now: None,
        begin_orders: false,
        folded: None,
    }
}

/// SQLite's clock in ms.
const SQ_NOW: &str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";

/// SQLite's statements on `dlock_leases` (one writer at a time: `BEGIN IMMEDIATE`).
pub(crate) fn sqlite() -> HandSql {
    let (h, now) = ("dlock_leases_holders", SQ_NOW);
    let live = format!("owner IS NOT NULL AND expires_at > {now}");
    let now_us = "CAST(unixepoch('subsec') * 1000000 AS INTEGER)";
    let ids = |n: usize| (0..n).collect::<Vec<_>>();
    let ensure = format!(
        "INSERT INTO dlock_leases (key, owner, token, expires_at) \
             VALUES (?1, NULL, 0, {now}) ON CONFLICT (key) DO NOTHING"
    );
    let lock_holders = format!(
        "SELECT CASE WHEN t.owner IS NOT NULL AND t.expires_at > {now} \
                         THEN t.expires_at - {now} END, \
                    CASE WHEN t.wwait_owner IS NOT NULL AND t.wwait_owner <> ?2 \
                              AND t.wwait_until > {now} AND t.wwait_token = t.token \
                         THEN t.wwait_until - {now} END, \
                    1, h.slot, h.permits, h.owner, h.expires_at - {now} \
             FROM dlock_leases t LEFT JOIN {h} h ON h.key = t.key \
                  AND h.owner IS NOT NULL AND h.expires_at > {now} \
             WHERE t.key = ?1 ORDER BY h.slot"
    );
    let grant = format!(
        "UPDATE dlock_leases SET shared_until = MAX(shared_until, {now} + ?5), \
             token = CASE WHEN ?7 = 1 THEN MAX(token + 1, {now_us}) ELSE token END \
             WHERE key = ?1; \
             INSERT INTO {h} (key, slot, permits, owner, token, expires_at, holder, granted_at) \
             VALUES (?1, ?2, ?3, ?4, \
                     CASE WHEN ?7 = 1 THEN (SELECT token FROM dlock_leases WHERE key = ?1) \
                          ELSE {now_us} END, \
                     MIN({now} + ?5, (SELECT shared_until FROM dlock_leases WHERE key = ?1)), \
                     ?6, {now}) \
             ON CONFLICT (key, slot) DO UPDATE SET \
                 granted_at = CASE WHEN {h}.owner IS excluded.owner THEN {h}.granted_at \
                                   ELSE excluded.granted_at END, \
                 permits = excluded.permits, owner = excluded.owner, \
                 token = CASE WHEN ?7 = 1 THEN excluded.token \
                              ELSE MAX({h}.token + 1, excluded.token) END, \
                 expires_at = excluded.expires_at, holder = excluded.holder \
             RETURNING token"
    );
    let release = format!(
        "UPDATE {h} SET owner = NULL, expires_at = {now} \
             WHERE key = ?1 AND owner = ?3 AND (?2 < 0 OR slot = ?2); \
             UPDATE dlock_leases SET shared_until = COALESCE((SELECT MAX(h.expires_at) \
               FROM {h} h WHERE h.key = ?1 AND h.owner IS NOT NULL \
               AND h.expires_at > {now}), 0), \
             wwait_owner = NULLIF(wwait_owner, ?3) WHERE key = ?1"
    );
    HandSql {
        begin: "BEGIN IMMEDIATE",
        ensure: Stmt::new(ensure.clone(), &ids(1)),
        lock: Stmt::new(
            format!(
                "SELECT CASE WHEN owner IS NOT NULL AND expires_at > {now} \
                             THEN expires_at - {now} END, \
                        CASE WHEN wwait_owner IS NOT NULL AND wwait_owner <> ?2 \
                                  AND wwait_until > {now} AND wwait_token = token \
                             THEN wwait_until - {now} END \
                 FROM dlock_leases WHERE key = ?1"
            ),
            &ids(2),
        ),
        holders: Stmt::new(
            format!(
                "SELECT slot, permits, owner, expires_at - {now} FROM {h} \
                 WHERE key = ?1 AND {live} ORDER BY slot"
            ),
            &ids(1),
        ),
        lock_holders: Some(Stmt::new(lock_holders.clone(), &ids(2))),
        take: Stmt::new(
            format!(
                "INSERT INTO {h} (key, slot, permits, owner, token, expires_at, holder, granted_at) \
                 VALUES (?1, ?2, ?3, ?4, CASE WHEN ?7 >= 0 THEN ?7 ELSE {now_us} END, \
                         {now} + ?5, ?6, {now}) \
                 ON CONFLICT (key, slot) DO UPDATE SET \
                     granted_at = CASE WHEN {h}.owner IS excluded.owner THEN {h}.granted_at \
                                       ELSE excluded.granted_at END, \
                     permits = excluded.permits, owner = excluded.owner, \
                     token = CASE WHEN ?7 >= 0 THEN ?7 ELSE MAX({h}.token + 1, excluded.token) END, \
                     expires_at = excluded.expires_at, holder = excluded.holder \
                 RETURNING token"
            ),
            &ids(7),
        ),
        slot_token: None,
        share: Stmt::new(
            format!(
                "UPDATE dlock_leases SET shared_until = MAX(shared_until, {now} + ?2), \
                 token = CASE WHEN ?3 = 1 THEN MAX(token + 1, {now_us}) ELSE token END \
                 WHERE key = ?1 RETURNING token"
            ),
            &ids(3),
        ),
        key_token: None,
        grant: Some(Stmt::new(grant.clone(), &ids(7))),
        free_holder: Stmt::new(
            format!(
                "UPDATE {h} SET owner = NULL, expires_at = {now} \
                 WHERE key = ?1 AND owner = ?3 AND (?2 < 0 OR slot = ?2)"
            ),
            &ids(3),
        ),
        reshare: Stmt::new(
            format!(
                "UPDATE dlock_leases SET shared_until = COALESCE((SELECT MAX(h.expires_at) \
                   FROM {h} h WHERE h.key = ?1 AND h.owner IS NOT NULL \
                   AND h.expires_at > {now}), 0), \
                 wwait_owner = NULLIF(wwait_owner, ?2) WHERE key = ?1"
            ),
            &ids(2),
        ),
        notify: None,
        release: Some(Stmt::new(release.clone(), &ids(3))),
        release_now: Some(Stmt::new(
            format!("BEGIN IMMEDIATE; {release}; COMMIT"),
            &ids(3),
        )),
        begin_orders: true,
        folded: Some((
            Stmt::new(
                format!("BEGIN IMMEDIATE; {ensure}; {lock_holders}"),
                &ids(2),
            ),
            Stmt::new(format!("{grant}; COMMIT"), &ids(7)),
        )),
    }
}

/// The acquire and release of one permit (`permits` > 0) or one reader
/// (`permits` = 0) on a database whose text columns read as `$text`; what
/// dlock's `try_shared` and `release_shared` run, in the same transactions.
macro_rules! shared_pair {
    ($name:ident, $db:ty, $text:ty) => {
        pub(crate) mod $name {
            use super::{Arg, HandSql, Stmt};
            use sqlx::Connection as _;
            use sqlx::Row as _;

            type Conn = <$db as sqlx::Database>::Connection;

            /// A row: integers, or the owner text (`None` for NULL).
            type Row = Vec<(Option<i64>, Option<String>)>;

            async fn rows(
                conn: &mut Conn,
                stmt: &Stmt,
                args: &[Arg],
                texts: &[bool],
            ) -> Result<Vec<Row>, sqlx::Error> {
                let mut query = sqlx::query(sqlx::AssertSqlSafe(stmt.sql.as_str()));
                for arg in stmt.bound(args) {
                    query = match arg {
                        Arg::Text(t) => query.bind(t),
                        Arg::Int(n) => query.bind(n),
                    };
                }
                let found = query.fetch_all(conn).await?;
                found
                    .iter()
                    .map(|row| {
                        texts
                            .iter()
                            .enumerate()
                            .map(|(i, text)| {
                                Ok(if *text {
                                    let t: Option<$text> = row.try_get(i)?;
                                    (
                                        None,
                                        t.map(|t| {
                                            String::from_utf8_lossy(AsRef::<[u8]>::as_ref(&t))
                                                .into_owned()
                                        }),
                                    )
                                } else {
                                    (row.try_get::<Option<i64>, _>(i)?, None)
                                })
                            })
                            .collect()
                    })
                    .collect()
            }

            async fn exec(conn: &mut Conn, stmt: &Stmt, args: &[Arg]) -> Result<u64, sqlx::Error> {
                let mut query = sqlx::query(sqlx::AssertSqlSafe(stmt.sql.as_str()));
                for arg in stmt.bound(args) {
                    query = match arg {
                        Arg::Text(t) => query.bind(t),
                        Arg::Int(n) => query.bind(n),
                    };
                }
                Ok(query.execute(conn).await?.rows_affected())
            }

            /// The slot `owner` takes of `key` (its own, else the lowest
            /// free), where the state lets it take one.
            fn choose(
                key: &str,
                owner: &str,
                permits: i64,
                (plain, mark): (Option<i64>, Option<i64>),
                live: &[Row],
            ) -> anyhow::Result<i64> {
                anyhow::ensure!(plain.is_none(), "{key} is held whole");
                anyhow::ensure!(
                    live.iter().all(|l| l[1].0 == Some(permits)),
                    "{key} is held in another mode"
                );
                let mine = live.iter().find(|l| l[2].1.as_deref() == Some(owner));
                anyhow::ensure!(
                    permits > 0 || mark.is_none() || mine.is_some(),
                    "a writer waits for {key}"
                );
                let slot = match mine {
                    Some(own) => own[0].0.unwrap_or(0),
                    None => {
                        let taken: Vec<i64> = live.iter().filter_map(|l| l[0].0).collect();
                        (0..).find(|s| !taken.contains(s)).unwrap_or(0)
                    }
                };
                anyhow::ensure!(permits == 0 || slot < permits, "{key} has no free permit");
                Ok(slot)
            }

            /// The columns of `lock_holders`.
            const LOCK_HOLDERS: [bool; 7] = [false, false, false, false, false, true, false];

            /// The live holder rows in `lock_holders`' answer.
            fn live_of(state: Vec<Row>) -> Vec<Row> {
                state
                    .into_iter()
                    .filter(|r| r[3].0.is_some())
                    .map(|r| r[3..].to_vec())
                    .collect()
            }

            fn first(rows: Vec<Row>) -> Option<i64> {
                rows.first().and_then(|r| r[0].0)
            }

            /// Takes a permit of `permits` (0: a reader's share) of `key` for
            /// `owner`; answers its slot (-1 for a reader) and token.
            pub(crate) async fn acquire(
                pool: &sqlx::Pool<$db>,
                sql: &HandSql,
                key: &str,
                owner: &str,
                holder: &str,
                lease_ms: i64,
                permits: i64,
            ) -> anyhow::Result<(i64, i64)> {
                let mut conn = pool.acquire().await?;
                let k = Arg::Text(key.to_owned());
                let lock_args = [k.clone(), Arg::Text(owner.to_owned())];
                let reader = permits == 0;
                let grant_args = |slot| {
                    [
                        k.clone(),
                        Arg::Int(slot),
                        Arg::Int(permits),
                        Arg::Text(owner.to_owned()),
                        Arg::Int(lease_ms),
                        Arg::Text(holder.to_owned()),
                        Arg::Int(i64::from(reader)),
                    ]
                };
                if let Some((open, grant_commit)) = &sql.folded {
                    let folded = async {
                        let state = rows(&mut conn, open, &lock_args, &LOCK_HOLDERS).await?;
                        let plain_and_mark =
                            state.first().map_or((None, None), |r| (r[0].0, r[1].0));
                        let slot = choose(key, owner, permits, plain_and_mark, &live_of(state))?;
                        let args = grant_args(slot);
                        let token = first(rows(&mut conn, grant_commit, &args, &[false]).await?);
                        let token = token.unwrap_or(if reader { -1 } else { 0 });
                        Ok((if reader { -1 } else { slot }, token))
                    }
                    .await;
                    if folded.is_err() {
                        // The transaction the driver knows nothing of.
                        let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
                    }
                    return folded;
                }
                let mut tx = conn.begin_with(sql.begin).await?;
                let (stmt, texts) = match &sql.lock_holders {
                    Some(both) => (both, &LOCK_HOLDERS[..]),
                    None => (&sql.lock, &LOCK_HOLDERS[..2]),
                };
                let mut state = rows(&mut tx, stmt, &lock_args, texts).await?;
                if state.is_empty() {
                    exec(&mut tx, &sql.ensure, std::slice::from_ref(&k)).await?;
                    state = rows(&mut tx, stmt, &lock_args, texts).await?;
                }
                let plain_and_mark = state.first().map_or((None, None), |r| (r[0].0, r[1].0));
                let current =
                    sql.lock_holders.is_some() && state.first().and_then(|r| r[2].0) == Some(1);
                let live: Vec<Row> = if plain_and_mark.0.is_some() {
                    Vec::new()
                } else if current {
                    live_of(state)
                } else {
                    rows(
                        &mut tx,
                        &sql.holders,
                        std::slice::from_ref(&k),
                        &[false, false, true, false],
                    )
                    .await?
                };
                let slot = choose(key, owner, permits, plain_and_mark, &live)?;
                if let Some(grant) = &sql.grant {
                    let token = first(rows(&mut tx, grant, &grant_args(slot), &[false]).await?);
                    let token = token.unwrap_or(if reader { -1 } else { 0 });
                    tx.commit().await?;
                    return Ok((if reader { -1 } else { slot }, token));
                }
                let share_args = [k.clone(), Arg::Int(lease_ms), Arg::Int(i64::from(reader))];
                let key_token = match &sql.key_token {
                    None => first(rows(&mut tx, &sql.share, &share_args, &[false]).await?),
                    Some(read) => {
                        exec(&mut tx, &sql.share, &share_args).await?;
                        if reader {
                            first(rows(&mut tx, read, std::slice::from_ref(&k), &[false]).await?)
                        } else {
                            None
                        }
                    }
                };
                let key_token = if reader { key_token.unwrap_or(-1) } else { -1 };
                let take_args = [
                    k.clone(),
                    Arg::Int(slot),
                    Arg::Int(permits),
                    Arg::Text(owner.to_owned()),
                    Arg::Int(lease_ms),
                    Arg::Text(holder.to_owned()),
                    Arg::Int(key_token),
                ];
                let slot_token = match &sql.slot_token {
                    None => first(rows(&mut tx, &sql.take, &take_args, &[false]).await?),
                    Some(read) => {
                        exec(&mut tx, &sql.take, &take_args).await?;
                        if reader {
                            None
                        } else {
                            first(rows(&mut tx, read, &[k, Arg::Int(slot)], &[false]).await?)
                        }
                    }
                };
                let token = if reader {
                    key_token
                } else {
                    slot_token.unwrap_or(0)
                };
                tx.commit().await?;
                Ok((if reader { -1 } else { slot }, token))
            }

            /// Frees `owner`'s permit on `slot` (-1: its reader's share).
            pub(crate) async fn release(
                pool: &sqlx::Pool<$db>,
                sql: &HandSql,
                key: &str,
                owner: &str,
                slot: i64,
            ) -> anyhow::Result<()> {
                let mut conn = pool.acquire().await?;
                let (k, o) = (Arg::Text(key.to_owned()), Arg::Text(owner.to_owned()));
                if let Some(now) = &sql.release_now {
                    let args = [k.clone(), Arg::Int(slot), o.clone()];
                    let done = match rows(&mut conn, now, &args, &[false]).await {
                        Ok(done) => done,
                        Err(err) => {
                            if sql.folded.is_some() {
                                let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
                            }
                            return Err(err.into());
                        }
                    };
                    let state = done
                        .first()
                        .and_then(|row| row.first())
                        .and_then(|(n, _)| *n);
                    anyhow::ensure!(state != Some(-1), "{key} has no row");
                    if state != Some(0) {
                        return Ok(());
                    }
                }
                let mut tx = conn.begin_with(sql.begin).await?;
                if !sql.begin_orders {
                    let locked =
                        rows(&mut tx, &sql.lock, &[k.clone(), o.clone()], &[false, false]).await?;
                    anyhow::ensure!(!locked.is_empty(), "{key} has no row");
                }
                if let Some(release) = &sql.release {
                    exec(&mut tx, release, &[k, Arg::Int(slot), o]).await?;
                    tx.commit().await?;
                    return Ok(());
                }
                let freed = exec(
                    &mut tx,
                    &sql.free_holder,
                    &[k.clone(), Arg::Int(slot), o.clone()],
                )
                .await?;
                anyhow::ensure!(freed == 1, "{key}: the holder row was not freed");
                exec(&mut tx, &sql.reshare, &[k.clone(), o]).await?;
                if let Some(notify) = &sql.notify {
                    exec(&mut tx, notify, &[k]).await?;
                }
                tx.commit().await?;
                Ok(())
            }
        }
    };
}

shared_pair!(pg, sqlx::Postgres, String);
shared_pair!(my, sqlx::MySql, Vec<u8>);
shared_pair!(sq, sqlx::Sqlite, String);
