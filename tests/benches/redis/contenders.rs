//! The contenders: dlock (fenced, and unfenced: `fencing(false)`), the floor
//! (the same job by hand on one connection), dlock's own scripts by hand, and
//! `rslock`; one acquire+release pair of each.

use super::*;

/// The compare-and-delete every careful hand-written Redis lock uses.
pub(super) fn unlock_script() -> Script {
    Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
    )
}

/// The hand-written acquire: `SET key owner NX PX 30000`; whether it took the key.
pub(super) async fn floor_try(conn: &mut MultiplexedConnection, key: &str, owner: &str) -> bool {
    let set: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg(owner)
        .arg("NX")
        .arg("PX")
        .arg(30_000)
        .query_async(conn)
        .await
        .unwrap_or_else(|e| panic!("hand-written floor: SET NX PX failed: {e}"));
    set.is_some()
}

/// The hand-written release: the compare-and-delete script; whether it deleted.
pub(super) async fn floor_unlock(
    c: &Contenders,
    conn: &mut MultiplexedConnection,
    key: &str,
    owner: &str,
) -> bool {
    let deleted: i64 = c
        .unlock
        .key(key)
        .arg(owner)
        .invoke_async(conn)
        .await
        .unwrap_or_else(|e| panic!("hand-written floor: the unlock script failed: {e}"));
    deleted == 1
}

pub(super) fn owner() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// dlock's own Redis scripts, for the "same protocol by hand" baseline.
pub(super) const ACQUIRE_LUA: &str =
    include_str!("../../../dlock-runtime/src/backend/redis/acquire.lua");
pub(super) const RELEASE_LUA: &str =
    include_str!("../../../dlock-runtime/src/backend/redis/release.lua");

/// The contenders of one benchmark process, all on one server.
pub(super) struct Contenders {
    pub(super) dlock: Registry,
    pub(super) floor: MultiplexedConnection,
    /// For `INFO` and `CONFIG RESETSTAT`, apart from the contenders.
    pub(super) admin: MultiplexedConnection,
    pub(super) unlock: Script,
    pub(super) acquire_lua: Script,
    /// The holder record dlock stores with each grant (this process's),
    /// which the acquire script takes as its third argument.
    pub(super) record: String,
    pub(super) release_lua: Script,
    pub(super) rslock: rslock::LockManager,
    pub(super) run: u64,
    /// The server's process id (for its threads' run-queue waits).
    pub(super) server_pid: u32,
}

impl Contenders {
    pub(super) async fn connect(
        url: &str,
        run: u64,
        server_pid: u32,
    ) -> anyhow::Result<Arc<Contenders>> {
        let client = redis::Client::open(url)?;
        Ok(Arc::new(Contenders {
            dlock: Registry::builder()
                .default_backend(
                    RedisBackend::connect(url)
                        .await
                        .map_err(|e| anyhow::anyhow!("dlock cannot connect to {url}: {e}"))?,
                )
                .build(),
            floor: client.get_multiplexed_async_connection().await?,
            admin: client.get_multiplexed_async_connection().await?,
            unlock: unlock_script(),
            acquire_lua: Script::new(ACQUIRE_LUA),
            record: dlock_runtime::backend::HolderRecord::this_process().encode(),
            release_lua: Script::new(RELEASE_LUA),
            rslock: rslock::LockManager::new(vec![url.to_owned()]),
            run,
            server_pid,
        }))
    }
}

/// The throughput contenders.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(super) enum Who {
    Floor,
    Same,
    Rslock,
    Dlock,
    Unfenced,
}

impl Who {
    pub(super) const ALL: [Who; 5] = [
        Who::Floor,
        Who::Same,
        Who::Rslock,
        Who::Dlock,
        Who::Unfenced,
    ];

    pub(super) fn name(self) -> &'static str {
        match self {
            Who::Floor => "hand-written floor",
            Who::Same => "dlock's scripts by hand",
            Who::Rslock => "rslock",
            Who::Dlock => "dlock",
            Who::Unfenced => "dlock unfenced",
        }
    }

    /// The name on the pinned child's output lines.
    pub(super) fn id(self) -> &'static str {
        match self {
            Who::Floor => "floor",
            Who::Same => "same",
            Who::Rslock => "rslock",
            Who::Dlock => "dlock",
            Who::Unfenced => "unfenced",
        }
    }

    pub(super) fn from_id(id: &str) -> anyhow::Result<Who> {
        Who::ALL
            .into_iter()
            .find(|w| w.id() == id)
            .ok_or_else(|| anyhow::anyhow!("unknown contender {id:?}"))
    }

    /// The commands it sends itself besides scripts (a script's own commands
    /// are counted in `INFO commandstats` too, inside the script's time).
    pub(super) fn direct(self) -> &'static [&'static str] {
        match self {
            Who::Floor | Who::Rslock => &["set"],
            Who::Unfenced => &["set", "pttl"],
            Who::Same | Who::Dlock => &[],
        }
    }
}

/// One acquire+release of `who` on a key of its own (`tag`, `i`). Panics, with
/// the contender's name, if anything fails: the run aborts.
pub(super) async fn pair(c: &Contenders, who: Who, tag: &str, i: u64) {
    match who {
        Who::Floor => {
            let key = format!("bench:floor:{}:{tag}:{i}", c.run);
            let mut conn = c.floor.clone();
            let owner = owner();
            assert!(
                floor_try(&mut conn, &key, &owner).await,
                "hand-written floor: SET NX found {key} taken"
            );
            assert!(
                floor_unlock(c, &mut conn, &key, &owner).await,
                "hand-written floor: the unlock script did not delete {key}"
            );
        }
        Who::Same => {
            let key = format!("{{bench:same:{}:{tag}:{i}}}", c.run);
            let mut conn = c.floor.clone();
            let owner = owner();
            let (taken, _token): (i64, i64) = c
                .acquire_lua
                .key(&key)
                .key(FENCE_KEY)
                .arg(&owner)
                .arg(30_000)
                .arg(&c.record)
                .invoke_async(&mut conn)
                .await
                .unwrap_or_else(|e| panic!("dlock's scripts by hand: acquire failed: {e}"));
            assert_eq!(taken, 1, "dlock's scripts by hand: {key} was taken");
            let released: i64 = c
                .release_lua
                .key(&key)
                .arg(&owner)
                .arg(format!("{key}:released"))
                .invoke_async(&mut conn)
                .await
                .unwrap_or_else(|e| panic!("dlock's scripts by hand: release failed: {e}"));
            assert_eq!(released, 1, "dlock's scripts by hand: {key} not deleted");
        }
        Who::Rslock => {
            let key = format!("bench:rslock:{}:{tag}:{i}", c.run);
            let lock = c
                .rslock
                .lock(key.as_bytes(), Duration::from_secs(30))
                .await
                .unwrap_or_else(|e| panic!("rslock: lock failed: {e}"));
            c.rslock.unlock(&lock).await;
        }
        Who::Dlock | Who::Unfenced => {
            let key = format!("throughput:{}:{tag}:{i}", c.run);
            let guard = c
                .dlock
                .lock(key)
                .lease(Duration::from_secs(30))
                .fencing(who == Who::Dlock)
                .acquire()
                .await
                .unwrap_or_else(|e| panic!("dlock: acquire failed: {e}"));
            guard
                .release()
                .await
                .unwrap_or_else(|e| panic!("dlock: release failed: {e}"));
        }
    }
}
