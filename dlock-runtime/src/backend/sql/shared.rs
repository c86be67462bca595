//! Semaphores and read-write locks on the lease table of the server
//! databases, written once for every [dialect](super::engine::Dialect).
//!
//! **Rows.** A reader's share and a permit are *holder rows* in
//! `<table>_holders`, primary key `(key, slot)`: the slot (`0..permits` for
//! a permit, the lowest free number for a reader), the semaphore's `permits`
//! (0 for a reader), the owner, the expiry on the database's clock, the
//! fencing token, the holder record. The key's row in the lease table stays
//! the one place every grant of the key is decided: it is the writer (a
//! plain lock), and it carries `shared_until` (the latest expiry of the
//! key's holder rows) and the waiting-writer mark (`wwait_owner`,
//! `wwait_until`, and `wwait_token`: the key's token when it was marked, so
//! any grant since voids it).
//!
//! **Why this layout.** The plain lock's statements stay what they were
//! plus one predicate on the row they already lock (`shared_until` passed),
//! so plain locks keep their one-statement hot path and exclude readers and
//! permits. A reader or a permit is decided in one short transaction at
//! READ COMMITTED that first locks the key's lease-table row (`FOR UPDATE`):
//! every decision of a key is ordered by that row lock, and each later
//! statement of the transaction reads what the previous holder of the lock
//! committed — one statement could not see it (its snapshot predates the
//! lock wait), so the check of `N`, of the mode and of the free slots would
//! race. After the decision, the writes that need no fresh read are one
//! statement where the dialect can say it (PostgreSQL's data-modifying
//! `WITH`; two statements in one call to SQLite's connection thread): the
//! grant (the key's row and the slot row, [`SharedSql::grant`]) and the
//! release (the holder row freed, `shared_until` recomputed, the waiters
//! notified, [`SharedSql::release`]). These round trips are what a handoff
//! to a waiting reader, writer or permit seeker costs beyond a plain
//! lock's one statement: a grant is begin, the lock with the live holder
//! rows ([`SharedSql::lock_holders`]; PostgreSQL reads them again only when
//! the key's row changed while it waited for the lock), grant, commit; a
//! release begin, lock, release, commit. On PostgreSQL a release is one
//! statement ([`SharedSql::release_now`]: the key's row locked first, the
//! holder rows read in the statement's snapshot and written only when the
//! row did not change during the lock wait, the transaction otherwise).
//! On SQLite, whose `BEGIN IMMEDIATE` already orders every decision and
//! whose connection thread runs several statements in one call, the
//! transaction's ends travel with the statements beside them
//! ([`SharedSql::open`]): a grant is two calls (begin with the lock and
//! the read; grant with commit), a release one.
//!
//! **Semaphore.** Under the row lock: the key's live holder rows (an owner,
//! an unexpired lease); another `permits`, or readers, or a live plain
//! holder ⇒ [`HoldMode::mismatch`]; else the lowest slot not live (the
//! owner's own on a retry), busy when it is `≥ permits` (with the earliest
//! holder expiry). The slot row's token is the hybrid `max(token + 1, clock
//! µs)`, per (key, slot), kept in the row (rows are kept when freed and
//! collected after the retention like the lease table's).
//!
//! **Read-write.** A reader is busy while the plain lock is held or while
//! another owner's live writer mark stands; its token is the key's one
//! sequence (the lease-table row's hybrid token, bumped), so readers and
//! writers share it. A writer (a plain lock) that finds live readers leaves
//! the mark (refreshed by each of its attempts, for [`MARK_TTL_MIN`] or
//! three polls) and waits: writers are preferred. Its grant bumps the token
//! and so voids its mark; `abandon` and its owner-checked clean-up release
//! remove it.
//!
//! **Expiry, renewal, release.** Each holder row has its own expiry;
//! `shared_until` only grows while holders are granted or renewed, and is
//! recomputed from the live rows when one is released or revoked, so a
//! crashed reader or permit holder holds back writers only until its own
//! lease ends. A watchdog batch of shares is renewed in one transaction (the
//! keys' rows locked in key order). Releases wake this process's waiters
//! at once, and the others as a plain release does (PostgreSQL's `NOTIFY`
//! when the key is wanted; MySQL's polling).

// Public in the engine's `Dialect` (named by the public backends' docs);
// only SQLite's otherwise.
#![cfg_attr(
    not(any(feature = "postgres", feature = "mysql")),
    allow(unreachable_pub)
)]

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use std::future::Future;

use futures_util::future::BoxFuture;
use sqlx::Connection as _;

use super::ordered::Unanswered;
use super::upkeep::millis;
use crate::backend::{AcquireRequest, Attempt, HeldEntry, HoldMode, HolderRecord, Lease, Renewal};
use crate::error::BackendError;
use crate::token::FencingToken;

/// How often a release or a renewal of shares is tried again after a
/// transient failure (a deadlock the database broke, a lock wait timeout).
const DEADLOCK_RETRIES: usize = 3;

/// The shortest life of a waiting-writer mark (refreshed by each attempt).
pub(super) const MARK_TTL_MIN: Duration = Duration::from_secs(1);

/// An argument of a [`Stmt`].
#[derive(Debug, Clone)]
pub enum Arg {
    /// Text (a key, an owner, a holder record).
    Text(String),
    /// An integer.
    Int(i64),
}

/// The type of a column a [`Stmt`] returns.
#[derive(Debug, Clone, Copy)]
pub enum Col {
    /// An integer (or NULL).
    Int,
    /// Text (or NULL).
    Text,
}

/// A value of a returned column.
#[derive(Debug, Clone)]
pub enum Val {
    /// NULL.
    Null,
    /// An integer.
    Int(i64),
    /// Text.
    Text(String),
}

impl Val {
    fn int(&self) -> Option<i64> {
        match self {
            Val::Int(n) => Some(*n),
            _ => None,
        }
    }

    fn text(&self) -> Option<String> {
        match self {
            Val::Text(t) => Some(t.clone()),
            _ => None,
        }
    }
}

/// One statement of a dialect, with the engine's arguments it binds, in
/// the order of its placeholders (`$n` may be bound once each; `?` as often
/// as it appears).
#[derive(Debug, Clone)]
pub struct Stmt {
    /// The SQL text.
    pub sql: Arc<str>,
    /// For each placeholder, the index of the engine's argument.
    pub order: Vec<usize>,
}

impl Stmt {
    /// A statement whose placeholders take the engine's arguments in `order`.
    pub fn new(sql: String, order: &[usize]) -> Self {
        Stmt {
            sql: sql.into(),
            order: order.to_vec(),
        }
    }

    /// The arguments in the order of the placeholders.
    pub fn bound(&self, args: &[Arg]) -> Vec<Arg> {
        self.order.iter().map(|i| args[*i].clone()).collect()
    }
}

/// A dialect's statements for semaphores and read-write locks. Arguments
/// are named in each field's doc, in the engine's order; `T` is the lease
/// table, `H` the holder rows.
#[derive(Debug, Clone)]
pub struct SharedSql {
    /// (key): `T`'s row of the key, inserted free if missing.
    pub ensure: Stmt,
    /// (key, owner) → [ms left of a live plain holder, ms left of another
    /// owner's live writer mark], locking `T`'s row.
    pub lock: Stmt,
    /// (key) → [slot, permits, owner, ms left] of the live holder rows, by slot.
    pub holders: Stmt,
    /// `lock` and `holders` in one statement, where the dialect can say
    /// it: (key, owner) → `lock`'s two columns, then 1 where the holder
    /// columns are the rows as the lock found them (else `holders` reads
    /// them again), then `holders`' four columns — a row per live holder
    /// row, or one with NULL holder columns.
    pub lock_holders: Option<Stmt>,
    /// (key, slot, permits, owner, lease ms, holder, token or -1 for the
    /// slot's hybrid token): takes the slot row; → [token] of the slot row
    /// where [`slot_token`](Self::slot_token) is `None` (`RETURNING`).
    pub take: Stmt,
    /// (key, slot) → [token] of the slot row, read after `take`; `None`
    /// where `take` returns it.
    pub slot_token: Option<Stmt>,
    /// (key, lease ms, 1 to bump the key's token): `shared_until` raised;
    /// → [token] of `T`'s row where [`key_token`](Self::key_token) is
    /// `None` (`RETURNING`).
    pub share: Stmt,
    /// (key) → [token] of `T`'s row, read after `share`; `None` where
    /// `share` returns it.
    pub key_token: Option<Stmt>,
    /// `share` and `take` in one statement, where the dialect can say it:
    /// (key, slot, permits, owner, lease ms, holder, 1 for a reader) →
    /// [token] of the grant (the key's bumped token for a reader, the slot
    /// row's for a permit). One round trip less between a wake-up and a
    /// grant.
    pub grant: Option<Stmt>,
    /// Where the dialect runs several statements in one call, the
    /// transaction's first statement folded into the next ones: (key,
    /// owner) → `BEGIN`, `ensure` and `lock_holders` (whose holder columns
    /// must then always be current) in one call. The transaction is then
    /// ended in the call that decides it: [`grant_commit`](Self::grant_commit),
    /// or `COMMIT` / `ROLLBACK`. The database's driver knows nothing of this
    /// transaction, so a backend whose dialect has it rolls it back itself,
    /// on the same connection before anyone else uses it, when an owner's
    /// [`call`](SharedStore::call) answers an error or is dropped. Two round
    /// trips less between a wake-up and a grant.
    pub open: Option<Stmt>,
    /// `grant` and then `COMMIT` in one call, where [`open`](Self::open) is:
    /// `grant`'s arguments and answer.
    pub grant_commit: Option<Stmt>,
    /// (key): marks the key as wanted, where releases notify.
    pub wanted: Option<Stmt>,
    /// (key, owner, ttl ms): the waiting-writer mark, unless another
    /// owner's live one stands.
    pub mark_writer: Stmt,
    /// (key, owner): removes `owner`'s writer mark.
    pub unmark_writer: Stmt,
    /// (key, slot or -1, owner, ttl ms): renews the owner's holder row.
    pub renew_holder: Stmt,
    /// (key, slot or -1, owner): frees the owner's holder row.
    pub free_holder: Stmt,
    /// (key, owner): `shared_until` recomputed from the live rows, the
    /// owner's writer mark removed.
    pub reshare: Stmt,
    /// (key): wakes the waiters of other processes, where the database
    /// pushes (only if the key is wanted).
    pub notify: Option<Stmt>,
    /// `free_holder`, `reshare` and `notify` in one statement, where the
    /// dialect can say it: (key, slot or -1, owner). Two round trips less
    /// between a release call and the waiter's wake-up.
    pub release: Option<Stmt>,
    /// The release in one call: one statement of its own, outside a
    /// transaction, where the dialect can tell that the key's row (so its
    /// holder rows) did not change while the statement waited for the row's
    /// lock; or, where the dialect runs several statements in one call, the
    /// whole transaction (ended as [`open`](Self::open) says). (key, slot or
    /// -1, owner) → [1 released, -1 no key row, 0 the row changed and
    /// nothing was written], or no row: released. On 0 the release is made
    /// in a transaction. Two or three round trips less.
    pub release_now: Option<Stmt>,
    /// (key, slot or -1, owner) → a row if the owner's holder row was revoked.
    pub was_revoked: Stmt,
    /// (key) → [key, owner, holder, token, granted, ms left, slot, permits]
    /// of the live holder rows, by slot.
    pub inspect: Stmt,
    /// (from, to) → the same of the keys in `from..=to`, by key and slot.
    pub inspect_range: Stmt,
    /// (from, to, limit) → [key] of the keys in `from..to` with live shares.
    pub list: Stmt,
    /// (from, limit) → [key] of the keys from `from` with live shares.
    pub list_to_end: Stmt,
    /// (key): revokes every live holder row of the key.
    pub revoke: Stmt,
}

/// The `rows` and `exec` of a database whose connection is `$conn` and
/// whose text columns read as `$text` (`String`, or `Vec<u8>` for binary
/// keys).
macro_rules! rows_and_exec {
    ($text:ty, $conn:ty) => {
        fn rows<'c>(
            conn: &'c mut $conn,
            stmt: &$crate::backend::sql::shared::Stmt,
            args: Vec<$crate::backend::sql::shared::Arg>,
            cols: &'static [$crate::backend::sql::shared::Col],
        ) -> futures_util::future::BoxFuture<
            'c,
            Result<Vec<Vec<$crate::backend::sql::shared::Val>>, sqlx::Error>,
        > {
            use sqlx::Row as _;
            use $crate::backend::sql::shared::{Arg, Col, Val};
            let sql = stmt.sql.clone();
            let args = stmt.bound(&args);
            Box::pin(async move {
                let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
                for arg in args {
                    query = match arg {
                        Arg::Text(t) => query.bind(t),
                        Arg::Int(n) => query.bind(n),
                    };
                }
                let rows = query.fetch_all(conn).await?;
                rows.iter()
                    .map(|row| {
                        cols.iter()
                            .enumerate()
                            .map(|(i, col)| {
                                Ok(match col {
                                    Col::Int => row
                                        .try_get::<Option<i64>, _>(i)?
                                        .map_or(Val::Null, Val::Int),
                                    Col::Text => {
                                        row.try_get::<Option<$text>, _>(i)?.map_or(Val::Null, |t| {
                                            Val::Text(
                                                String::from_utf8_lossy(AsRef::<[u8]>::as_ref(&t))
                                                    .into_owned(),
                                            )
                                        })
                                    }
                                })
                            })
                            .collect()
                    })
                    .collect()
            })
        }

        fn exec<'c>(
            conn: &'c mut $conn,
            stmt: &$crate::backend::sql::shared::Stmt,
            args: Vec<$crate::backend::sql::shared::Arg>,
        ) -> futures_util::future::BoxFuture<'c, Result<u64, sqlx::Error>> {
            use $crate::backend::sql::shared::Arg;
            let sql = stmt.sql.clone();
            let args = stmt.bound(&args);
            Box::pin(async move {
                let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
                for arg in args {
                    query = match arg {
                        Arg::Text(t) => query.bind(t),
                        Arg::Int(n) => query.bind(n),
                    };
                }
                Ok(query.execute(conn).await?.rows_affected())
            })
        }
    };
}
pub(super) use rows_and_exec;

/// The owners of a process whose waiting-writer marks may stand: a
/// release or a give-up removes a mark only for them, and a grant (which
/// voids the mark) forgets them, so plain locks that never met readers
/// cost no statement.
#[derive(Debug, Default)]
pub(super) struct Marks(std::sync::Mutex<std::collections::HashSet<String>>);

impl Marks {
    fn set(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `owner` marked a key.
    fn marked(&self, owner: &str) {
        self.set().insert(owner.to_owned());
    }

    /// Forgets `owner`: whether it had marked a key.
    pub(super) fn forget(&self, owner: &str) -> bool {
        self.set().remove(owner)
    }
}

/// The connection of a [`SharedStore`]'s database.
pub(super) type StoreConn<B> = <<B as SharedStore>::Db as sqlx::Database>::Connection;

/// A lease table that holds shares and permits: the engine's backends and
/// SQLite's. The algorithm is written once, over this.
pub(super) trait SharedStore: Clone + Send + Sync + 'static {
    /// The `sqlx` database.
    type Db: sqlx::Database;
    /// The length of one unit of the `granted_at` columns.
    const GRANTED_UNIT: Duration;
    /// The longest holder record stored, in bytes.
    const HOLDER_MAX: usize;
    /// The statement that begins a transaction that will write.
    const BEGIN: &'static str;
    /// Whether [`BEGIN`](Self::BEGIN) alone orders every decision (one
    /// writer at a time from the start), so that a release takes no row
    /// lock first.
    const BEGIN_ORDERS: bool;

    /// The statements.
    fn sql(&self) -> Arc<SharedSql>;

    /// How often waiters look again.
    fn poll(&self) -> Duration;

    /// The owners of this process whose waiting-writer marks may stand.
    fn marks(&self) -> &Marks;

    /// The owners' work the server may still be doing, which their later
    /// statements wait for (see `ordered`).
    fn unanswered(&self) -> &Unanswered;

    /// Runs `statement` on a connection, bounded like every call; one of
    /// `owner`'s (an attempt, a release) after its unanswered ones.
    fn call<T, F>(
        &self,
        owner: Option<&str>,
        what: &str,
        statement: F,
    ) -> impl Future<Output = Result<T, BackendError>> + Send
    where
        T: Send,
        F: for<'c> FnMut(&'c mut StoreConn<Self>) -> BoxFuture<'c, Result<T, sqlx::Error>> + Send;

    /// Runs `stmt` with `args`: its rows, each column read as `cols` says.
    fn rows<'c>(
        conn: &'c mut StoreConn<Self>,
        stmt: &Stmt,
        args: Vec<Arg>,
        cols: &'static [Col],
    ) -> BoxFuture<'c, Result<Vec<Vec<Val>>, sqlx::Error>>;

    /// Runs `stmt` with `args`: the rows it matched.
    fn exec<'c>(
        conn: &'c mut StoreConn<Self>,
        stmt: &Stmt,
        args: Vec<Arg>,
    ) -> BoxFuture<'c, Result<u64, sqlx::Error>>;
}

/// `holder`'s one-line form, cut to `max` bytes at a character boundary.
pub(super) fn holder_text(holder: &HolderRecord, max: usize) -> String {
    let mut text = holder.encode();
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

/// The columns of [`SharedSql::lock_holders`]; the first two are
/// [`SharedSql::lock`]'s.
const LOCK_HOLDERS_COLS: [Col; 7] = [
    Col::Int,
    Col::Int,
    Col::Int,
    Col::Int,
    Col::Int,
    Col::Text,
    Col::Int,
];

/// What an attempt found, decided inside its transaction.
enum Found {
    Held { token: i64, slot: Option<u32> },
    Busy(Option<Duration>),
    Mismatch(HoldMode),
}

/// The held mode a live holder row stands for.
fn row_mode(permits: i64) -> HoldMode {
    match u32::try_from(permits) {
        Ok(0) | Err(_) => HoldMode::Shared,
        Ok(permits) => HoldMode::Permit { permits },
    }
}

fn ms(n: i64) -> Duration {
    Duration::from_millis(n.max(0) as u64)
}

/// A live holder row: slot, permits, owner, ms left.
type Live = (i64, i64, String, i64);

fn live_rows(rows: Vec<Vec<Val>>) -> Vec<Live> {
    rows.into_iter()
        .map(|r| {
            (
                r[0].int().unwrap_or(0),
                r[1].int().unwrap_or(0),
                r[2].text().unwrap_or_default(),
                r[3].int().unwrap_or(0),
            )
        })
        .collect()
}

/// The first column of the first row, if an integer.
fn first_int(rows: Vec<Vec<Val>>) -> Option<i64> {
    rows.first().and_then(|r| r.first()).and_then(Val::int)
}

/// The slot argument of a lease: its permit's slot, or -1 (any of the owner's).
fn slot_arg(lease: &Lease) -> i64 {
    lease.slot.map_or(-1, i64::from)
}

/// How long a waiting-writer mark stands unless its writer tries again.
fn mark_ttl<B: SharedStore>(b: &B) -> Duration {
    (b.poll() * 3).max(MARK_TTL_MIN)
}

/// What the key's state decides for an attempt.
enum Decision {
    /// Busy, with the ms left of what holds the key back, if known.
    Busy(Option<i64>),
    Mismatch(HoldMode),
    /// The slot (a reader's or a permit's) and the permits (0: a reader).
    Grant {
        slot: i64,
        permits: i64,
    },
}

/// The decision of an attempt at `asked` by `owner` (see the module docs):
/// `plain_ms` and `mark_ms` as [`SharedSql::lock`] reads them, `live` the
/// key's live holder rows, read only when no live plain holder decides.
async fn decide<F>(
    asked: HoldMode,
    owner: &str,
    (plain_ms, mark_ms): (Option<i64>, Option<i64>),
    live: F,
) -> Result<Decision, sqlx::Error>
where
    F: Future<Output = Result<Vec<Live>, sqlx::Error>>,
{
    if let Some(left) = plain_ms {
        return Ok(if asked == HoldMode::Shared {
            Decision::Busy(Some(left))
        } else {
            Decision::Mismatch(HoldMode::Exclusive)
        });
    }
    let live = live.await?;
    if let Some((_, permits, _, _)) = live.iter().find(|l| row_mode(l.1) != asked) {
        return Ok(Decision::Mismatch(row_mode(*permits)));
    }
    if asked == HoldMode::Shared
        && let Some(left) = mark_ms
        && !live.iter().any(|l| l.2 == owner)
    {
        return Ok(Decision::Busy(Some(left)));
    }
    let slot = match live.iter().find(|l| l.2 == owner) {
        Some(own) => own.0,
        None => {
            let taken: BTreeSet<i64> = live.iter().map(|l| l.0).collect();
            (0..).find(|s| !taken.contains(s)).unwrap_or(0)
        }
    };
    let permits = match asked {
        HoldMode::Permit { permits } => i64::from(permits),
        _ => 0,
    };
    if permits > 0 && slot >= permits {
        return Ok(Decision::Busy(live.iter().map(|l| l.3).min()));
    }
    Ok(Decision::Grant { slot, permits })
}

/// The first two columns of [`SharedSql::lock`] (or `lock_holders`).
fn lock_state(state: &[Vec<Val>]) -> (Option<i64>, Option<i64>) {
    state
        .first()
        .map(|r| (r[0].int(), r[1].int()))
        .unwrap_or((None, None))
}

/// The live holder rows in [`SharedSql::lock_holders`]'s answer.
fn state_live(state: Vec<Vec<Val>>) -> Vec<Live> {
    live_rows(
        state
            .into_iter()
            .filter(|r| r[3].int().is_some())
            .map(|r| r[3..].to_vec())
            .collect(),
    )
}

/// The token a grant's statement answered: the key's for a reader (-1 if
/// none came back), the slot row's for a permit.
fn grant_token(rows: Vec<Vec<Val>>, reader: bool) -> i64 {
    first_int(rows).unwrap_or(if reader { -1 } else { 0 })
}

/// What a decision found, once its transaction ended.
fn found(decision: Decision, token: i64) -> Found {
    match decision {
        Decision::Busy(left) => Found::Busy(left.map(ms)),
        Decision::Mismatch(held) => Found::Mismatch(held),
        Decision::Grant { slot, permits } => Found::Held {
            token,
            slot: (permits > 0).then_some(slot as u32),
        },
    }
}

/// One attempt at a reader's share or a permit (see the module docs).
pub(super) async fn try_shared<B: SharedStore>(
    b: &B,
    request: &AcquireRequest,
) -> Result<Attempt, BackendError> {
    let sql = b.sql();
    let asked = request.mode;
    let lease_ms = millis(request.lease);
    let holder = holder_text(&request.holder, B::HOLDER_MAX);
    let found = b
        .call(Some(&request.owner), "acquire", |c| {
            let sql = sql.clone();
            let key = Arg::Text(request.key.clone());
            let owner = request.owner.clone();
            let holder = holder.clone();
            Box::pin(async move {
                let lock_args = vec![key.clone(), Arg::Text(owner.clone())];
                let grant_args = |slot, permits| {
                    let reader = i64::from(permits == 0);
                    slot_args(&key, slot, permits, &owner, lease_ms, &holder, reader)
                };
                if let (Some(open), Some(grant_commit)) = (&sql.open, &sql.grant_commit) {
                    // The transaction's ends travel with the statements
                    // beside them (see `SharedSql::open`).
                    let state = B::rows(c, open, lock_args, &LOCK_HOLDERS_COLS).await?;
                    if state.is_empty() {
                        // `ensure` made the row: nothing to decide on.
                        B::exec(c, &end_stmt("ROLLBACK"), Vec::new()).await?;
                        return Err(sqlx::Error::RowNotFound);
                    }
                    let plain_and_mark = lock_state(&state);
                    let live = async { Ok(state_live(state)) };
                    let decision = decide(asked, &owner, plain_and_mark, live).await?;
                    let token = match decision {
                        Decision::Mismatch(_) => {
                            B::exec(c, &end_stmt("ROLLBACK"), Vec::new()).await?;
                            0
                        }
                        Decision::Busy(_) => {
                            if let Some(w) = &sql.wanted {
                                B::exec(c, w, vec![key.clone()]).await?;
                            }
                            B::exec(c, &end_stmt("COMMIT"), Vec::new()).await?;
                            0
                        }
                        Decision::Grant { slot, permits } => {
                            let args = grant_args(slot, permits);
                            let rows = B::rows(c, grant_commit, args, &[Col::Int]).await?;
                            grant_token(rows, permits == 0)
                        }
                    };
                    return Ok(found(decision, token));
                }
                let mut tx = c.begin_with(B::BEGIN).await?;
                // The key's row locked, and its state: with the live holder
                // rows where the dialect reads them in the same statement.
                let (stmt, cols) = match &sql.lock_holders {
                    Some(both) => (both, &LOCK_HOLDERS_COLS[..]),
                    None => (&sql.lock, &LOCK_HOLDERS_COLS[..2]),
                };
                let mut state = B::rows(&mut tx, stmt, lock_args.clone(), cols).await?;
                if state.is_empty() {
                    B::exec(&mut tx, &sql.ensure, vec![key.clone()]).await?;
                    state = B::rows(&mut tx, stmt, lock_args, cols).await?;
                }
                let current =
                    sql.lock_holders.is_some() && state.first().and_then(|r| r[2].int()) == Some(1);
                let plain_and_mark = lock_state(&state);
                let live = async {
                    if current {
                        return Ok(state_live(state));
                    }
                    let cols = &[Col::Int, Col::Int, Col::Text, Col::Int];
                    Ok(live_rows(
                        B::rows(&mut tx, &sql.holders, vec![key.clone()], cols).await?,
                    ))
                };
                let decision = decide(asked, &owner, plain_and_mark, live).await?;
                let token = match decision {
                    // Nothing written: rolled back as the transaction drops.
                    Decision::Mismatch(_) => return Ok(found(decision, 0)),
                    Decision::Busy(_) => {
                        if let Some(w) = &sql.wanted {
                            B::exec(&mut tx, w, vec![key.clone()]).await?;
                        }
                        0
                    }
                    Decision::Grant { slot, permits } => match &sql.grant {
                        Some(grant) => {
                            let args = grant_args(slot, permits);
                            grant_token(
                                B::rows(&mut tx, grant, args, &[Col::Int]).await?,
                                permits == 0,
                            )
                        }
                        None => {
                            split_grant::<B>(
                                &mut tx, &sql, &key, slot, permits, &owner, lease_ms, &holder,
                            )
                            .await?
                        }
                    },
                };
                tx.commit().await?;
                Ok(found(decision, token))
            })
        })
        .await?;
    match found {
        Found::Held { token, slot } => {
            let lease = Lease::new(request, Some(FencingToken::new(token as u64)));
            Ok(Attempt::Held(match slot {
                Some(slot) => lease.with_slot(slot),
                None => lease,
            }))
        }
        Found::Busy(left) => Ok(Attempt::Busy {
            retry_in: Some(left.unwrap_or(b.poll()).min(b.poll())),
        }),
        Found::Mismatch(held) => Err(BackendError::config(HoldMode::mismatch(
            &request.key,
            held,
            asked,
        ))),
    }
}

/// A statement without arguments that ends a transaction begun by
/// [`SharedSql::open`].
fn end_stmt(sql: &str) -> Stmt {
    Stmt::new(sql.to_owned(), &[])
}

/// The arguments of `take` and `grant`: (key, slot, permits, owner, lease
/// ms, holder, `last`: `take`'s token or -1, `grant`'s 1 for a reader).
fn slot_args(
    key: &Arg,
    slot: i64,
    permits: i64,
    owner: &str,
    lease_ms: i64,
    holder: &str,
    last: i64,
) -> Vec<Arg> {
    vec![
        key.clone(),
        Arg::Int(slot),
        Arg::Int(permits),
        Arg::Text(owner.to_owned()),
        Arg::Int(lease_ms),
        Arg::Text(holder.to_owned()),
        Arg::Int(last),
    ]
}

/// `share`, then `take`, each token read from its statement or right
/// after it: the grant's token (the key's for a reader, the slot row's for
/// a permit).
#[allow(clippy::too_many_arguments)]
async fn split_grant<B: SharedStore>(
    tx: &mut StoreConn<B>,
    sql: &SharedSql,
    key: &Arg,
    slot: i64,
    permits: i64,
    owner: &str,
    lease_ms: i64,
    holder: &str,
) -> Result<i64, sqlx::Error> {
    let reader = permits == 0;
    let share_args = vec![key.clone(), Arg::Int(lease_ms), Arg::Int(i64::from(reader))];
    // The key's token (a reader's), by the statement that bumps it where
    // it returns it, else read right after it.
    let key_token = match &sql.key_token {
        None => first_int(B::rows(tx, &sql.share, share_args, &[Col::Int]).await?),
        Some(read) => {
            B::exec(tx, &sql.share, share_args).await?;
            if reader {
                first_int(B::rows(tx, read, vec![key.clone()], &[Col::Int]).await?)
            } else {
                None
            }
        }
    };
    let key_token = if reader { key_token.unwrap_or(-1) } else { -1 };
    let take_args = slot_args(key, slot, permits, owner, lease_ms, holder, key_token);
    // The slot row's token (a permit's), likewise.
    let slot_token = match &sql.slot_token {
        None => first_int(B::rows(tx, &sql.take, take_args, &[Col::Int]).await?),
        Some(read) => {
            B::exec(tx, &sql.take, take_args).await?;
            if reader {
                None
            } else {
                let args = vec![key.clone(), Arg::Int(slot)];
                first_int(B::rows(tx, read, args, &[Col::Int]).await?)
            }
        }
    };
    Ok(if reader {
        key_token
    } else {
        slot_token.unwrap_or(0)
    })
}

/// A plain lock (the write mode) found busy: when readers hold the key,
/// the waiting-writer mark (for a waiting request) and an answer no
/// later than their earliest expiry; permits there are a mismatch.
pub(super) async fn exclusive_busy<B: SharedStore>(
    b: &B,
    request: &AcquireRequest,
    busy: Attempt,
) -> Result<Attempt, BackendError> {
    let Attempt::Busy { retry_in } = busy else {
        return Ok(busy);
    };
    let sql = b.sql();
    let live = live_rows(
        b.call(None, "holders", |c| {
            let sql = sql.clone();
            let key = Arg::Text(request.key.clone());
            Box::pin(async move {
                B::rows(
                    c,
                    &sql.holders,
                    vec![key],
                    &[Col::Int, Col::Int, Col::Text, Col::Int],
                )
                .await
            })
        })
        .await?,
    );
    let Some(first) = live.first() else {
        return Ok(Attempt::Busy { retry_in });
    };
    let held = row_mode(first.1);
    if held != HoldMode::Shared {
        return Err(BackendError::config(HoldMode::mismatch(
            &request.key,
            held,
            HoldMode::Exclusive,
        )));
    }
    let ttl = mark_ttl(b);
    if !request.wait.is_zero() {
        // Known before it is sent, so the undo (`abandon`, the owner-checked
        // release) removes it. It is sent from a task on dlock's I/O runtime
        // that runs to its end whether or not this caller stays, and the
        // owner's statements — the undo's removal among them — go out only
        // once that task has ended (see `ordered`): the removal reaches the
        // server after the mark, never before.
        b.marks().marked(&request.owner);
        let (this, owner) = (b.clone(), request.owner.clone());
        let args = vec![
            Arg::Text(request.key.clone()),
            Arg::Text(request.owner.clone()),
            Arg::Int(millis(ttl)),
        ];
        b.unanswered()
            .detached(&request.owner, async move {
                this.call(Some(&owner), "mark", |c| {
                    let (sql, args) = (sql.clone(), args.clone());
                    Box::pin(async move { B::exec(c, &sql.mark_writer, args).await })
                })
                .await
            })
            .await?;
    }
    let earliest = live.iter().map(|l| ms(l.3)).min().unwrap_or_default();
    let cap = earliest.min(ttl / 3);
    Ok(Attempt::Busy {
        retry_in: Some(retry_in.map_or(cap, |r| r.min(cap))),
    })
}

/// Removes `owner`'s waiting-writer mark from `key`, if it left one: once
/// the owner's work that may still leave one has ended (an attempt on
/// dlock's I/O runtime whose caller left, a mark on its way).
pub(super) async fn unmark_writer<B: SharedStore>(
    b: &B,
    key: &str,
    owner: &str,
) -> Result<(), BackendError> {
    b.unanswered().wait_for(owner).await;
    if !b.marks().forget(owner) {
        return Ok(());
    }
    let sql = b.sql();
    b.call(Some(owner), "unmark", |c| {
        let sql = sql.clone();
        let args = vec![Arg::Text(key.to_owned()), Arg::Text(owner.to_owned())];
        Box::pin(async move { B::exec(c, &sql.unmark_writer, args).await })
    })
    .await
    .map(|_| ())
}

/// Renews a batch of shares in one transaction, the keys' rows locked
/// in key order; the lost ones told revoked where they were.
pub(super) async fn renew_shared<B: SharedStore>(
    b: &B,
    batch: &[(&Lease, Duration)],
) -> Result<Vec<Renewal>, BackendError> {
    let mut tries = 0;
    loop {
        match renew_shared_once(b, batch).await {
            Err(err) if err.is_retryable() && tries < DEADLOCK_RETRIES => tries += 1,
            done => return done,
        }
    }
}

async fn renew_shared_once<B: SharedStore>(
    b: &B,
    batch: &[(&Lease, Duration)],
) -> Result<Vec<Renewal>, BackendError> {
    let sql = b.sql();
    let mut order: Vec<usize> = (0..batch.len()).collect();
    order.sort_by(|a, b| batch[*a].0.key.cmp(&batch[*b].0.key));
    let entries: Vec<(String, String, i64, i64)> = order
        .iter()
        .map(|i| {
            let (lease, ttl) = batch[*i];
            (
                lease.key.clone(),
                lease.owner.clone(),
                slot_arg(lease),
                millis(ttl),
            )
        })
        .collect();
    let sorted: Vec<Renewal> = b
        .call(None, "renew", |c| {
            let (sql, entries) = (sql.clone(), entries.clone());
            Box::pin(async move {
                let mut tx = c.begin_with(B::BEGIN).await?;
                let mut answers = Vec::with_capacity(entries.len());
                for (key, owner, slot, ttl) in entries {
                    let key = Arg::Text(key);
                    let owner = Arg::Text(owner);
                    B::rows(
                        &mut tx,
                        &sql.lock,
                        vec![key.clone(), owner.clone()],
                        &[Col::Int, Col::Int],
                    )
                    .await?;
                    let renewed = B::exec(
                        &mut tx,
                        &sql.renew_holder,
                        vec![key.clone(), Arg::Int(slot), owner.clone(), Arg::Int(ttl)],
                    )
                    .await?;
                    if renewed == 0 {
                        let revoked = B::rows(
                            &mut tx,
                            &sql.was_revoked,
                            vec![key, Arg::Int(slot), owner],
                            &[Col::Int],
                        )
                        .await?;
                        answers.push(if revoked.is_empty() {
                            Renewal::Lost
                        } else {
                            Renewal::Revoked
                        });
                        continue;
                    }
                    B::exec(&mut tx, &sql.share, vec![key, Arg::Int(ttl), Arg::Int(0)]).await?;
                    answers.push(Renewal::Renewed);
                }
                tx.commit().await?;
                Ok(answers)
            })
        })
        .await?;
    let mut answers = vec![Renewal::Lost; batch.len()];
    for (i, answer) in order.into_iter().zip(sorted) {
        answers[i] = answer;
    }
    Ok(answers)
}

/// Frees the owner's share (its slot, or any of the owner's with no
/// slot), recomputes `shared_until`, removes the owner's writer mark,
/// and wakes the other processes' waiters where the database pushes.
pub(super) async fn release_shared<B: SharedStore>(
    b: &B,
    lease: &Lease,
) -> Result<(), BackendError> {
    let mut tries = 0;
    loop {
        match release_shared_once(b, lease).await {
            Err(err) if err.is_retryable() && tries < DEADLOCK_RETRIES => tries += 1,
            done => return done,
        }
    }
}

async fn release_shared_once<B: SharedStore>(b: &B, lease: &Lease) -> Result<(), BackendError> {
    let sql = b.sql();
    b.call(Some(&lease.owner), "release", |c| {
        let sql = sql.clone();
        let key = Arg::Text(lease.key.clone());
        let owner = Arg::Text(lease.owner.clone());
        let slot = Arg::Int(slot_arg(lease));
        Box::pin(async move {
            if let Some(now) = &sql.release_now {
                let done = B::rows(
                    c,
                    now,
                    vec![key.clone(), slot.clone(), owner.clone()],
                    &[Col::Int],
                )
                .await?;
                if first_int(done) != Some(0) {
                    return Ok(());
                }
            }
            let mut tx = c.begin_with(B::BEGIN).await?;
            if !B::BEGIN_ORDERS {
                let locked = B::rows(
                    &mut tx,
                    &sql.lock,
                    vec![key.clone(), owner.clone()],
                    &[Col::Int, Col::Int],
                )
                .await?;
                if locked.is_empty() {
                    return Ok(());
                }
            }
            if let Some(release) = &sql.release {
                B::exec(&mut tx, release, vec![key, slot, owner]).await?;
                return tx.commit().await;
            }
            B::exec(
                &mut tx,
                &sql.free_holder,
                vec![key.clone(), slot, owner.clone()],
            )
            .await?;
            B::exec(&mut tx, &sql.reshare, vec![key.clone(), owner]).await?;
            if let Some(notify) = &sql.notify {
                B::exec(&mut tx, notify, vec![key]).await?;
            }
            tx.commit().await
        })
    })
    .await
}

/// The live holder rows of `key`, as holder entries.
pub(super) async fn shared_entries<B: SharedStore>(
    b: &B,
    key: &str,
) -> Result<Vec<HeldEntry>, BackendError> {
    let sql = b.sql();
    let rows = b
        .call(None, "inspect", |c| {
            let sql = sql.clone();
            let key = Arg::Text(key.to_owned());
            Box::pin(async move { B::rows(c, &sql.inspect, vec![key], &ENTRY_COLS).await })
        })
        .await?;
    Ok(rows.iter().map(|r| entry(r, B::GRANTED_UNIT).1).collect())
}

/// The keys in `from..to` (no end: `None`) with live shares, at most
/// `limit`, each with its holder entries.
pub(super) async fn shared_keys<B: SharedStore>(
    b: &B,
    from: &str,
    to: Option<&str>,
    limit: i64,
) -> Result<Vec<(String, Vec<HeldEntry>)>, BackendError> {
    let sql = b.sql();
    let keys = b
        .call(None, "list", |c| {
            let sql = sql.clone();
            let (stmt, args) = match to {
                Some(to) => (
                    sql.list.clone(),
                    vec![
                        Arg::Text(from.to_owned()),
                        Arg::Text(to.to_owned()),
                        Arg::Int(limit),
                    ],
                ),
                None => (
                    sql.list_to_end.clone(),
                    vec![Arg::Text(from.to_owned()), Arg::Int(limit)],
                ),
            };
            Box::pin(async move { B::rows(c, &stmt, args, &[Col::Text]).await })
        })
        .await?;
    let keys: Vec<String> = keys.iter().filter_map(|r| r[0].text()).collect();
    let (Some(first), Some(last)) = (keys.first(), keys.last()) else {
        return Ok(Vec::new());
    };
    let rows = b
        .call(None, "list", |c| {
            let sql = sql.clone();
            let args = vec![Arg::Text(first.clone()), Arg::Text(last.clone())];
            Box::pin(async move { B::rows(c, &sql.inspect_range, args, &ENTRY_COLS).await })
        })
        .await?;
    let mut out: Vec<(String, Vec<HeldEntry>)> =
        keys.iter().map(|k| (k.clone(), Vec::new())).collect();
    for row in &rows {
        let (key, entry) = entry(row, B::GRANTED_UNIT);
        if let Some((_, entries)) = out.iter_mut().find(|(k, _)| *k == key) {
            entries.push(entry);
        }
    }
    out.retain(|(_, entries)| !entries.is_empty());
    Ok(out)
}

/// Revokes every share of `key`: the entries it removed.
pub(super) async fn revoke_shared<B: SharedStore>(
    b: &B,
    key: &str,
) -> Result<Vec<HeldEntry>, BackendError> {
    let sql = b.sql();
    let rows = b
        .call(None, "revoke", |c| {
            let sql = sql.clone();
            let key = Arg::Text(key.to_owned());
            Box::pin(async move {
                let mut tx = c.begin_with(B::BEGIN).await?;
                let locked = B::rows(
                    &mut tx,
                    &sql.lock,
                    vec![key.clone(), Arg::Text(String::new())],
                    &[Col::Int, Col::Int],
                )
                .await?;
                if locked.is_empty() {
                    return Ok(Vec::new());
                }
                let rows = B::rows(&mut tx, &sql.inspect, vec![key.clone()], &ENTRY_COLS).await?;
                if rows.is_empty() {
                    return Ok(rows);
                }
                B::exec(&mut tx, &sql.revoke, vec![key.clone()]).await?;
                B::exec(
                    &mut tx,
                    &sql.reshare,
                    vec![key.clone(), Arg::Text(String::new())],
                )
                .await?;
                if let Some(notify) = &sql.notify {
                    B::exec(&mut tx, notify, vec![key]).await?;
                }
                tx.commit().await?;
                Ok(rows)
            })
        })
        .await?;
    Ok(rows.iter().map(|r| entry(r, B::GRANTED_UNIT).1).collect())
}

/// The columns of an inspected holder row.
const ENTRY_COLS: [Col; 8] = [
    Col::Text,
    Col::Text,
    Col::Text,
    Col::Int,
    Col::Int,
    Col::Int,
    Col::Int,
    Col::Int,
];

/// An inspected holder row as its key and holder entry.
fn entry(r: &[Val], granted_unit: Duration) -> (String, HeldEntry) {
    let row = super::admin::Row {
        key: r[0].text().unwrap_or_default(),
        owner: r[1].text().unwrap_or_default(),
        holder: r[2].text(),
        token: r[3].int().unwrap_or(0),
        granted_at: r[4].int(),
        expires_in_ms: r[5].int().unwrap_or(0),
    };
    let mut entry = row.entry(granted_unit);
    entry.mode = row_mode(r[7].int().unwrap_or(0));
    if entry.mode != HoldMode::Shared {
        entry.slot = r[6].int().and_then(|s| u32::try_from(s).ok());
    }
    (row.key, entry)
}
