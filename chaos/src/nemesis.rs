//! The nemesis: a seeded schedule of faults, one at a time, each logged when it
//! starts and when it heals.
//!
//! The seed fixes the order of fault kinds, their durations, the leases of the
//! holders they aim at and the choices among candidates; which worker holds a
//! lock when a fault strikes depends on timing, so two runs with one seed are
//! alike, not identical.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use rand::seq::{IndexedRandom as _, SliceRandom as _};
use rand::{Rng as _, SeedableRng as _, rngs::StdRng};

use crate::history::{Phase, RevocationEvent, RevokedHolder, SessionKillEvent};
use crate::proxy::Fault;
use crate::run::{Backend, Cluster, SqlMode};
use crate::worker::{EXPIRE_REQUEST, LEASES, LONG_HOLD, LongRequest, Workload};
use tokio::io::AsyncWriteExt as _;

/// The faults the nemesis knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// SIGSTOP a worker in the middle of a long stay inside the lock for 1.5–3
    /// leases (odd and even workers in turn).
    PauseHolder,
    /// SIGKILL a worker inside the lock and start it again.
    KillWorker,
    /// SIGKILL the Redis server while a body runs; restart it with its data, then
    /// (next time) without. etcd: one member, picked at random (the leader
    /// or a follower), restarted with its data.
    KillServer,
    /// Delay one to three workers' traffic by 20–200 ms for 1–2 s.
    ProxyDelay,
    /// Black-hole the traffic of a worker inside the lock for 1.5–3 leases.
    ProxyBlackhole,
    /// Reset the connections of some workers.
    ProxyReset,
    /// Redlock: two of five nodes down for 1–2.5 s.
    RedlockMinority,
    /// Redlock: two nodes down, a holder acquires on the other three, one of those
    /// dies and comes back empty.
    RedlockHolderMajority,
    /// ZooKeeper: a worker inside the lock (in the middle of a long stay) has a
    /// second client take over its session and close it, which is what the
    /// server's expiry of the session does: its nodes go at once, and the worker
    /// hears `Expired` when it next talks to the server.
    SessionExpiry,
    /// PostgreSQL or MySQL in session mode: a connection holding a lock of
    /// the run (a key's own lock, or a permit's or reader's slot; in the
    /// semaphore workload a permit's slot) is ended by the server
    /// (`pg_terminate_backend`, `KILL CONNECTION`), the one of a worker in
    /// the middle of a long stay where it holds one: the lock goes at once,
    /// and the holder hears of it when its connection closes or at its next
    /// ping. The checker wants each such holder told within
    /// [`revocation_bound`].
    SessionKill,
    /// PostgreSQL or MySQL in lease mode: the row of a worker inside the lock
    /// (in the middle of a long stay) is deleted, then (next time) given
    /// another owner, behind its back; its next renewal finds it gone. A
    /// deleted row also makes the next holder's token come from the clock
    /// alone.
    RowStolen,
    /// Stall the side backend while a worker holds a side lock and a main lock
    /// across a long stay: a transaction holding SQLite's write lock for 1.5–3
    /// side leases, or a Lua busy loop that stalls the side Redis for 1–2 s. The
    /// main backend must go on renewing meanwhile.
    SideStall,
    /// An operator's `dlock revoke`: the nemesis opens a registry of its own
    /// on the run's backend (the server itself, not through a proxy) and
    /// revokes the key of a worker inside the lock (in the middle of a long
    /// stay), recording whom `revoke` reported; the fault lasts until those
    /// holders have left the lock, at most [`revocation_bound`] of the
    /// longest lease.
    Revoke,
}

fn kinds(backend: Backend, mode: SqlMode) -> &'static [Kind] {
    use Kind::*;
    match backend {
        Backend::Url => &[PauseHolder, KillWorker, Revoke],
        Backend::Sqlite => &[PauseHolder, KillWorker, SideStall, Revoke],
        Backend::Redis | Backend::Etcd => &[
            PauseHolder,
            KillWorker,
            KillServer,
            ProxyDelay,
            ProxyBlackhole,
            ProxyReset,
            SideStall,
            Revoke,
        ],
        Backend::Redlock => &[
            PauseHolder,
            KillWorker,
            RedlockMinority,
            RedlockHolderMajority,
            SideStall,
            Revoke,
        ],
        Backend::Zk => &[
            PauseHolder,
            KillWorker,
            KillServer,
            ProxyDelay,
            ProxyBlackhole,
            ProxyReset,
            SessionExpiry,
            SideStall,
            Revoke,
        ],
        Backend::Postgres | Backend::Mysql => match mode {
            SqlMode::Lease => &[
                PauseHolder,
                KillWorker,
                KillServer,
                ProxyDelay,
                ProxyBlackhole,
                ProxyReset,
                RowStolen,
                SideStall,
                Revoke,
            ],
            SqlMode::Session => &[
                PauseHolder,
                KillWorker,
                KillServer,
                ProxyDelay,
                ProxyBlackhole,
                ProxyReset,
                SessionKill,
                SideStall,
                Revoke,
            ],
        },
    }
}

fn name(kind: Kind) -> &'static str {
    match kind {
        Kind::PauseHolder => "sigstop",
        Kind::KillWorker => "sigkill_worker",
        Kind::KillServer => "kill_server",
        Kind::ProxyDelay => "proxy_delay",
        Kind::ProxyBlackhole => "proxy_blackhole",
        Kind::ProxyReset => "proxy_reset",
        Kind::RedlockMinority => "redlock_minority_down",
        Kind::RedlockHolderMajority => "redlock_holder_majority_node",
        Kind::SessionExpiry => SESSION_EXPIRY,
        Kind::SessionKill => SESSION_KILL,
        Kind::RowStolen => "row_stolen",
        Kind::SideStall => SIDE_STALL,
        Kind::Revoke => REVOKE,
    }
}

/// `k` distinct indices below `n`.
fn pick(rng: &mut StdRng, n: usize, k: usize) -> Vec<usize> {
    let mut all: Vec<usize> = (0..n).collect();
    all.shuffle(rng);
    all.truncate(k);
    all
}

/// The name of the side backend's stall in histories (the checker looks for it).
pub(crate) const SIDE_STALL: &str = "side_stall";

/// The name of a forced session expiry in histories (the checker looks for it).
pub(crate) const SESSION_EXPIRY: &str = "session_expiry";

/// The name of a revocation in histories (the checker looks for it).
pub(crate) const REVOKE: &str = "revoke";

/// How long the `revoke` fault tries to connect before the run fails.
const REVOKE_CONNECT_FOR: Duration = Duration::from_secs(30);

/// How long after a revocation answered its holder of a lease of `lease`
/// must have been told of its loss: its next renewal (a third of the lease
/// later at most) finds the key revoked, and a renewal that fails for
/// another reason ends in a loss by the end of the lease; plus slack for a
/// loaded machine.
pub(crate) fn revocation_bound(lease: Duration) -> Duration {
    lease + lease / 3 + Duration::from_secs(2)
}

/// Between `lo` and `hi` times `lease`.
fn leases(rng: &mut StdRng, lease: Duration, lo: f64, hi: f64) -> Duration {
    lease.mul_f64(rng.random_range(lo..hi))
}

/// One of the workers' leases, for the holder a fault aims at.
fn any_lease(rng: &mut StdRng) -> Duration {
    LEASES[rng.random_range(0..LEASES.len())]
}

/// A long stay with the given lease and no side lock.
fn long(lease: Duration) -> LongRequest {
    LongRequest { lease, side: None }
}

/// Injects `--faults` faults, every kind of the backend in turn (shuffled per round).
pub(crate) async fn run(cluster: Arc<Cluster>) -> anyhow::Result<()> {
    let mut rng = StdRng::seed_from_u64(cluster.args.seed);
    let all = kinds(cluster.args.backend, cluster.args.mode);
    let mut round = Vec::new();
    let mut server_kills = 0u32;
    let mut steals = 0u32;
    let mut pauses = 0usize;
    for id in 1..=cluster.args.faults {
        if round.is_empty() {
            round = all.to_vec();
            round.shuffle(&mut rng);
        }
        let kind = round.pop().expect("refilled above");
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..800))).await;
        let fault = name(kind);
        match kind {
            Kind::PauseHolder => {
                // Odd workers (`on_lost = "continue"`) then send a stale write the
                // store must refuse; even ones get their body stopped.
                pauses += 1;
                let lease = any_lease(&mut rng);
                let w = long_holder(&cluster, &mut rng, Some(pauses % 2), long(lease)).await;
                let pause = leases(&mut rng, lease, 1.5, 3.0);
                let Some(pid) = pid(&cluster, w).await else {
                    continue;
                };
                let _ = kill(pid, Signal::SIGSTOP);
                cluster.fault(
                    id,
                    fault,
                    Phase::Start,
                    vec![w],
                    format!("for {pause:?} (lease {lease:?})"),
                );
                tokio::time::sleep(pause).await;
                cluster.fault(id, fault, Phase::Heal, vec![w], String::new());
                let _ = kill(pid, Signal::SIGCONT);
            }
            Kind::KillWorker => {
                let lease = any_lease(&mut rng);
                let w = long_holder(&cluster, &mut rng, None, long(lease)).await;
                let mut workers = cluster.workers.lock().await;
                let _ = workers[w].child.kill().await;
                // The killed process is inside nothing any more; a stale entry would
                // let the next fault aim at a worker that is not in the lock.
                cluster.tracker.lock().expect("tracker").inside.remove(&w);
                cluster.fault(id, fault, Phase::Start, vec![w], format!("lease {lease:?}"));
                tokio::time::sleep(Duration::from_millis(100)).await;
                let inc = workers[w].inc + 1;
                workers[w] = cluster.spawn_worker(w, inc)?;
                cluster.fault(
                    id,
                    fault,
                    Phase::Heal,
                    vec![w],
                    format!("restarted as incarnation {inc}"),
                );
            }
            Kind::KillServer => {
                server_kills += 1;
                // ZooKeeper always restarts from its snapshot and transaction
                // log, PostgreSQL and MariaDB from their write-ahead logs.
                let keep = server_kills % 2 == 1
                    || matches!(
                        cluster.args.backend,
                        Backend::Zk | Backend::Etcd | Backend::Postgres | Backend::Mysql
                    );
                let lease = any_lease(&mut rng);
                let w = long_holder(&cluster, &mut rng, Some(0), long(lease)).await;
                let mut servers = cluster.servers.lock().await;
                let victim = if cluster.args.backend == Backend::Etcd {
                    rng.random_range(0..servers.len())
                } else {
                    0
                };
                servers[victim].kill().await?;
                let what = if cluster.args.backend == Backend::Etcd {
                    format!(
                        "member {victim} (port {}); restart with its data",
                        servers[victim].port()
                    )
                } else if cluster.args.backend == Backend::Zk {
                    "restart with its data and sessions".to_owned()
                } else if matches!(cluster.args.backend, Backend::Postgres | Backend::Mysql) {
                    "restart with its data (crash recovery)".to_owned()
                } else if keep {
                    "restart from its append-only file".to_owned()
                } else {
                    "restart empty (no persistence)".to_owned()
                };
                cluster.fault(
                    id,
                    fault,
                    Phase::Start,
                    vec![],
                    format!("while worker {w} holds (lease {lease:?}); {what}"),
                );
                tokio::time::sleep(Duration::from_millis(rng.random_range(300..1500))).await;
                servers[victim].restart(keep).await?;
                cluster.fault(id, fault, Phase::Heal, vec![], String::new());
            }
            Kind::ProxyDelay => {
                let n = rng.random_range(1..=3.min(cluster.proxies.len()));
                let ws: Vec<usize> = pick(&mut rng, cluster.proxies.len(), n);
                let delay = Duration::from_millis(rng.random_range(20..200));
                for &w in &ws {
                    cluster.proxies[w].set(Fault::Delay(delay));
                }
                cluster.fault(
                    id,
                    fault,
                    Phase::Start,
                    ws.clone(),
                    format!("{delay:?} each way"),
                );
                tokio::time::sleep(Duration::from_millis(rng.random_range(1000..2000))).await;
                for &w in &ws {
                    cluster.proxies[w].set(Fault::Pass);
                }
                cluster.fault(id, fault, Phase::Heal, ws, String::new());
            }
            Kind::ProxyBlackhole => {
                let lease = any_lease(&mut rng);
                let w = long_holder(&cluster, &mut rng, Some(0), long(lease)).await;
                let span = leases(&mut rng, lease, 1.5, 3.0);
                cluster.proxies[w].set(Fault::Hold);
                cluster.fault(
                    id,
                    fault,
                    Phase::Start,
                    vec![w],
                    format!("for {span:?} (lease {lease:?})"),
                );
                tokio::time::sleep(span).await;
                cluster.proxies[w].set(Fault::Pass);
                cluster.fault(id, fault, Phase::Heal, vec![w], String::new());
            }
            Kind::ProxyReset => {
                let n = rng.random_range(1..=cluster.proxies.len());
                let ws: Vec<usize> = pick(&mut rng, cluster.proxies.len(), n);
                cluster.fault(id, fault, Phase::Start, ws.clone(), String::new());
                for &w in &ws {
                    cluster.proxies[w].reset_all();
                }
                cluster.fault(id, fault, Phase::Heal, ws, String::new());
            }
            Kind::RedlockMinority => {
                let mut servers = cluster.servers.lock().await;
                let down: Vec<usize> = pick(&mut rng, servers.len(), 2);
                for &i in &down {
                    servers[i].kill().await?;
                }
                let ports: Vec<u16> = down.iter().map(|&i| servers[i].port()).collect();
                cluster.fault(
                    id,
                    fault,
                    Phase::Start,
                    vec![],
                    format!("nodes {ports:?} down"),
                );
                tokio::time::sleep(Duration::from_millis(rng.random_range(1000..2500))).await;
                let mut how = Vec::new();
                for &i in &down {
                    let keep = rng.random_bool(0.5);
                    servers[i].restart(keep).await?;
                    how.push(format!(
                        "{} {}",
                        servers[i].port(),
                        if keep { "with its data" } else { "empty" }
                    ));
                }
                cluster.fault(id, fault, Phase::Heal, vec![], how.join(", "));
            }
            Kind::RedlockHolderMajority => {
                let mut servers = cluster.servers.lock().await;
                let mut order: Vec<usize> = (0..servers.len()).collect();
                order.shuffle(&mut rng);
                let (down, third) = ([order[0], order[1]], order[2]);
                for &i in &down {
                    servers[i].kill().await?;
                }
                // A holder that acquires on the three nodes left.
                let lease = any_lease(&mut rng);
                let w = long_holder(&cluster, &mut rng, Some(0), long(lease)).await;
                servers[third].kill().await?;
                cluster.fault(
                    id,
                    fault,
                    Phase::Start,
                    vec![],
                    format!(
                        "nodes {} {} down, then {} of worker {w}'s majority (lease {lease:?})",
                        servers[down[0]].port(),
                        servers[down[1]].port(),
                        servers[third].port()
                    ),
                );
                tokio::time::sleep(lease).await;
                servers[third].restart(false).await?;
                tokio::time::sleep(Duration::from_millis(rng.random_range(500..1500))).await;
                for &i in &down {
                    servers[i].restart(true).await?;
                }
                cluster.fault(
                    id,
                    fault,
                    Phase::Heal,
                    vec![],
                    format!("{} came back empty", servers[third].port()),
                );
            }
            Kind::SessionExpiry => {
                let lease = any_lease(&mut rng);
                let w = long_holder(&cluster, &mut rng, None, long(lease)).await;
                cluster.fault(id, fault, Phase::Start, vec![w], format!("lease {lease:?}"));
                if let Some(stdin) = cluster.workers.lock().await[w].stdin.as_mut() {
                    let _ = stdin.write_all(EXPIRE_REQUEST.as_bytes()).await;
                }
                // The worker connects a second client with its session and closes
                // it (see the worker's log for how long that took: a few hundred ms,
                // the server turning the second client away while the first one's
                // connection lasts).
                tokio::time::sleep(Duration::from_millis(1500)).await;
                cluster.fault(id, fault, Phase::Heal, vec![w], String::new());
            }
            Kind::SessionKill => {
                let lease = any_lease(&mut rng);
                let w = long_holder(&cluster, &mut rng, None, long(lease)).await;
                session_kill(&cluster, &mut rng, id, w, lease).await?;
            }
            Kind::RowStolen => {
                steals += 1;
                let lease = any_lease(&mut rng);
                let w = long_holder(&cluster, &mut rng, None, long(lease)).await;
                let key = cluster
                    .tracker
                    .lock()
                    .expect("tracker")
                    .keys
                    .get(&w)
                    .cloned();
                cluster.fault(id, fault, Phase::Start, vec![w], format!("lease {lease:?}"));
                let outcome = match key {
                    None => format!("worker {w} was not inside the lock"),
                    Some(key) => {
                        let stored = format!("dlock:chaos:{}:{key}", cluster.run_id);
                        let url = cluster.sql_admin_url().await.context("no SQL server")?;
                        steal_row(cluster.args.backend, &url, &stored, steals % 2 == 1).await?
                    }
                };
                tokio::time::sleep(Duration::from_millis(500)).await;
                cluster.fault(id, fault, Phase::Heal, vec![w], outcome);
            }
            Kind::Revoke => revoke(&cluster, &mut rng, id).await?,
            Kind::SideStall => {
                // The main lease is short enough to be renewed several times during
                // the stall; the side lease short enough to be lost in it.
                let main = LEASES[rng.random_range(0..2)];
                let side = LEASES[rng.random_range(0..2)];
                let request = LongRequest {
                    lease: main,
                    side: Some(side),
                };
                let w = long_holder(&cluster, &mut rng, None, request).await;
                let span = match cluster.args.backend {
                    Backend::Sqlite | Backend::Zk | Backend::Postgres | Backend::Mysql => {
                        leases(&mut rng, side, 1.5, 3.0)
                    }
                    _ => Duration::from_millis(rng.random_range(1000..2000)),
                };
                let what = format!(
                    "for {span:?} while worker {w} holds (main lease {main:?}, side lease {side:?})"
                );
                stall_side(&cluster, span, || {
                    cluster.fault(id, fault, Phase::Start, vec![], what.clone());
                })
                .await?;
                cluster.fault(id, fault, Phase::Heal, vec![], String::new());
            }
        }
    }
    Ok(())
}

/// The `revoke` fault (see [`Kind::Revoke`]).
async fn revoke(cluster: &Cluster, rng: &mut StdRng, id: u32) -> anyhow::Result<()> {
    // A worker in the middle of a long stay, so that its hold outlasts its
    // next renewal (a few tries: the key it picks may be busy for a while).
    let long_stay = LONG_HOLD.as_millis() as u64;
    let mut target = None;
    for _ in 0..3 {
        let lease = any_lease(rng);
        let w = long_holder(cluster, rng, None, long(lease)).await;
        let tracker = cluster.tracker.lock().expect("tracker");
        if matches!(tracker.inside.get(&w), Some(Some(ms)) if *ms >= long_stay)
            && let Some(key) = tracker.keys.get(&w)
        {
            target = Some((w, key.clone(), format!("lease {lease:?}")));
            break;
        }
    }
    // Otherwise any key held now.
    if target.is_none() {
        let tracker = cluster.tracker.lock().expect("tracker");
        let mut inside: Vec<(&usize, &String)> = tracker.keys.iter().collect();
        inside.sort();
        target = inside
            .first()
            .map(|&(&w, key)| (w, key.clone(), "a short stay".to_owned()));
    }
    let Some((w, key, what)) = target else {
        cluster.fault(id, REVOKE, Phase::Start, vec![], "no key held".to_owned());
        cluster.fault(id, REVOKE, Phase::Heal, vec![], String::new());
        return Ok(());
    };
    let lock_key = format!("chaos:{}:{key}", cluster.run_id);
    cluster.fault(
        id,
        REVOKE,
        Phase::Start,
        vec![w],
        format!("{key} held by worker {w} ({what})"),
    );
    let entries_before = cluster.tracker.lock().expect("tracker").entries.clone();
    let url = cluster.admin_url().await;
    // Connecting changes nothing on the server, so it is tried again while
    // the cluster recovers from an earlier fault (an etcd member restarted
    // just before, its cluster still electing a leader), as an operator
    // would; the revocation itself is sent once.
    let connect_until = tokio::time::Instant::now() + REVOKE_CONNECT_FOR;
    let backend = loop {
        match dlock_runtime::connect(&url).await {
            Ok(backend) => break backend,
            Err(e) if tokio::time::Instant::now() < connect_until => {
                tracing::info!(error = %e, "revoke: connect failed; trying again");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => {
                return Err(e).with_context(|| {
                    format!(
                        "revoke: connect to {} (tried for {REVOKE_CONNECT_FOR:?})",
                        dlock_runtime::admin::redact_url(&url)
                    )
                });
            }
        }
    };
    let registry = dlock_runtime::Registry::builder()
        .default_backend(backend)
        .build();
    let t = crate::clock::now_ns();
    let held = tokio::time::timeout(Duration::from_secs(10), registry.revoke(&lock_key))
        .await
        .context("revoke: no answer within 10 s")?
        .with_context(|| format!("revoke {lock_key}"))?;
    let answered = crate::clock::now_ns();
    drop(registry);
    let mut holders = Vec::new();
    {
        let workers = cluster.workers.lock().await;
        for info in &held {
            let slot = info.pid().and_then(|pid| {
                workers
                    .iter()
                    .position(|p| p.child.id() == Some(pid))
                    .map(|w| (w, workers[w].inc))
            });
            holders.push(RevokedHolder {
                pid: info.pid(),
                w: slot.map(|(w, _)| w),
                inc: slot.map(|(_, inc)| inc),
                token: info.token().map(|t| t.get()),
                slot: info.slot(),
            });
        }
    }
    cluster.revocation(RevocationEvent {
        t,
        answered,
        id,
        key: key.clone(),
        lock_key,
        holders: holders.clone(),
    });
    // Until every revoked worker has left that hold (it was told, or its
    // hold ended), at most the bound of the longest lease.
    let slots: Vec<usize> = holders.iter().filter_map(|h| h.w).collect();
    let until = tokio::time::Instant::now() + revocation_bound(crate::worker::MAX_LEASE);
    while tokio::time::Instant::now() < until {
        let left = {
            let tracker = cluster.tracker.lock().expect("tracker");
            slots.iter().all(|w| {
                !tracker.inside.contains_key(w) || tracker.entries.get(w) != entries_before.get(w)
            })
        };
        if left {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let tokens: Vec<String> = holders
        .iter()
        .map(|h| h.token.map_or("-".to_owned(), |t| t.to_string()))
        .collect();
    cluster.fault(
        id,
        REVOKE,
        Phase::Heal,
        slots,
        format!(
            "{} holders of {key} revoked (tokens {})",
            holders.len(),
            tokens.join(", ")
        ),
    );
    Ok(())
}

/// The name of a session kill in histories (the checker looks for it).
pub(crate) const SESSION_KILL: &str = "session_kill";

/// One server connection holding a session-mode lock of the run, from the
/// counter row of the lock it holds.
struct SessionHolder {
    /// The server's id of the connection (PostgreSQL's backend pid,
    /// MySQL's connection id).
    conn: u64,
    /// The key as the backend stores it (`dlock:chaos:<run>:<key>`).
    stored_key: String,
    /// The holder record's process id.
    pid: Option<u32>,
    /// The grant's fencing token.
    token: u64,
    /// A permit's or reader's slot (`None`: the key's own lock).
    slot: Option<u32>,
}

/// The `session_kill` fault (see [`Kind::SessionKill`]): among the
/// connections holding a lock of the run — a key's own lock, a permit's
/// slot, a reader's slot — and, in the semaphore workload, only those
/// holding a permit's slot, the one of worker `w` (in the middle of a long
/// stay) or else one picked at random; the server ends it, and the
/// history records whom (a [`SessionKillEvent`]).
async fn session_kill(
    cluster: &Cluster,
    rng: &mut StdRng,
    id: u32,
    w: usize,
    lease: Duration,
) -> anyhow::Result<()> {
    let url = cluster.sql_admin_url().await.context("no SQL server")?;
    let prefix = format!("dlock:chaos:{}:", cluster.run_id);
    let mut holders = session_holders(cluster.args.backend, &url, &prefix).await?;
    if cluster.args.workload == Workload::Semaphore {
        holders.retain(|h| h.slot.is_some());
    }
    let (pids, incs): (Vec<Option<u32>>, Vec<u32>) = {
        let workers = cluster.workers.lock().await;
        workers.iter().map(|p| (p.child.id(), p.inc)).unzip()
    };
    let of_w = holders
        .iter()
        .position(|h| h.pid.is_some() && h.pid == pids[w]);
    let picked = of_w.or_else(|| (!holders.is_empty()).then(|| rng.random_range(0..holders.len())));
    let Some(victim) = picked.map(|i| holders.swap_remove(i)) else {
        cluster.fault(
            id,
            SESSION_KILL,
            Phase::Start,
            vec![w],
            format!("lease {lease:?}; no connection held a lock"),
        );
        cluster.fault(id, SESSION_KILL, Phase::Heal, vec![w], String::new());
        return Ok(());
    };
    let slot_of = |pid: Option<u32>| {
        let pid = pid?;
        let w = pids.iter().position(|p| *p == Some(pid))?;
        Some((w, incs[w]))
    };
    let process = slot_of(victim.pid);
    let touched = vec![process.map_or(w, |(w, _)| w)];
    let what = match victim.slot {
        Some(slot) => format!("slot {slot} of {}", victim.stored_key),
        None => victim.stored_key.clone(),
    };
    cluster.fault(
        id,
        SESSION_KILL,
        Phase::Start,
        touched.clone(),
        format!(
            "connection {} holding {what} (token {}, pid {}; worker {w} asked to stay, lease {lease:?})",
            victim.conn,
            victim.token,
            victim.pid.map_or("-".to_owned(), |p| p.to_string())
        ),
    );
    let t = crate::clock::now_ns();
    let ended = end_connection(cluster.args.backend, &url, victim.conn).await?;
    let answered = crate::clock::now_ns();
    if ended {
        let lock_key = victim
            .stored_key
            .strip_prefix("dlock:")
            .unwrap_or(&victim.stored_key)
            .to_owned();
        let key = victim
            .stored_key
            .strip_prefix(&prefix)
            .unwrap_or(&victim.stored_key)
            .to_owned();
        cluster.session_kill(SessionKillEvent {
            t,
            answered,
            id,
            key,
            lock_key,
            holder: RevokedHolder {
                pid: victim.pid,
                w: process.map(|(w, _)| w),
                inc: process.map(|(_, inc)| inc),
                token: Some(victim.token),
                slot: victim.slot,
            },
        });
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    cluster.fault(
        id,
        SESSION_KILL,
        Phase::Heal,
        touched,
        if ended {
            format!("connection {} ended", victim.conn)
        } else {
            format!("connection {} was gone already", victim.conn)
        },
    );
    Ok(())
}

/// A row of [`session_holders`]' PostgreSQL query: the backend's pid, the
/// key, the holder record, the token, the slot.
type PgHolderRow = (i32, String, Option<String>, i64, Option<i32>);

/// A row of [`session_holders`]' MySQL query: the connection id, the key,
/// the holder record, the token, the slot.
type MyHolderRow = (u64, Vec<u8>, Option<Vec<u8>>, u64, Option<i32>);

/// The connections holding a session-mode lock of a key under `prefix`
/// (as the backend stores it), with their counter rows: on PostgreSQL the
/// exclusive advisory locks (`pg_locks`; a key's lock or a slot's — a
/// share's shared hold of its key is not one) joined with the rows of
/// their 64-bit names, the holder record from the row or the connection's
/// `application_name`; on MySQL the rows whose `GET_LOCK` name
/// (`dlock:` and the name in hex) is in use (`IS_USED_LOCK`).
async fn session_holders(
    backend: Backend,
    url: &str,
    prefix: &str,
) -> anyhow::Result<Vec<SessionHolder>> {
    use sqlx::Connection as _;
    let like = format!("{prefix}%");
    let pid_of = |holder: Option<&str>| {
        holder
            .and_then(dlock_runtime::backend::HolderRecord::decode)
            .map(|h| h.pid)
    };
    if backend == Backend::Postgres {
        let mut conn = sqlx::PgConnection::connect(url).await?;
        let rows: Vec<PgHolderRow> = sqlx::query_as(
            "SELECT l.pid, f.name,
                    COALESCE(f.holder,
                             (SELECT substr(a.application_name, 7) FROM pg_stat_activity a
                              WHERE a.pid = l.pid AND left(a.application_name, 6) = 'dlock ')),
                    f.token, f.slot
             FROM dlock_leases_fence f JOIN pg_locks l
               ON l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
              AND l.mode = 'ExclusiveLock'
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND ((l.classid::bigint << 32) | l.objid::bigint) = f.k
             WHERE f.name LIKE $1
             ORDER BY l.pid",
        )
        .bind(&like)
        .fetch_all(&mut conn)
        .await?;
        conn.close().await?;
        return Ok(rows
            .into_iter()
            .map(|(conn, stored_key, holder, token, slot)| SessionHolder {
                conn: u64::try_from(conn).unwrap_or_default(),
                stored_key,
                pid: pid_of(holder.as_deref()),
                token: u64::try_from(token).unwrap_or_default(),
                slot: slot.and_then(|s| u32::try_from(s).ok()),
            })
            .collect());
    }
    let mut conn = sqlx::MySqlConnection::connect(url).await?;
    let rows: Vec<MyHolderRow> = sqlx::query_as(
        "SELECT * FROM (SELECT CAST(IS_USED_LOCK(CONCAT('dlock:', LPAD(LOWER(HEX(k)), 16, '0')))
                                    AS UNSIGNED) AS id,
                               name, holder, token, slot
                        FROM dlock_leases_fence WHERE name LIKE ?) AS h
         WHERE id IS NOT NULL ORDER BY id",
    )
    .bind(like.into_bytes())
    .fetch_all(&mut conn)
    .await?;
    conn.close().await?;
    Ok(rows
        .into_iter()
        .map(|(conn, name, holder, token, slot)| SessionHolder {
            conn,
            stored_key: String::from_utf8_lossy(&name).into_owned(),
            pid: pid_of(holder.as_deref().and_then(|h| std::str::from_utf8(h).ok())),
            token,
            slot: slot.and_then(|s| u32::try_from(s).ok()),
        })
        .collect())
}

/// MySQL's error for a `KILL` of a connection that is no more.
const ER_NO_SUCH_THREAD: u16 = 1094;

/// Ends server connection `conn` (`pg_terminate_backend`, `KILL
/// CONNECTION`): answers whether it did (`false`: it was gone already).
async fn end_connection(backend: Backend, url: &str, conn: u64) -> anyhow::Result<bool> {
    use sqlx::Connection as _;
    if backend == Backend::Postgres {
        let mut admin = sqlx::PgConnection::connect(url).await?;
        let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(i32::try_from(conn)?)
            .fetch_one(&mut admin)
            .await?;
        admin.close().await?;
        return Ok(ended);
    }
    let mut admin = sqlx::MySqlConnection::connect(url).await?;
    let killed = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL CONNECTION {conn}")))
        .execute(&mut admin)
        .await;
    admin.close().await?;
    match killed {
        Ok(_) => Ok(true),
        Err(sqlx::Error::Database(e))
            if e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                .is_some_and(|e| e.number() == ER_NO_SUCH_THREAD) =>
        {
            Ok(false)
        }
        Err(e) => Err(e.into()),
    }
}

/// Deletes the lease row of `stored_key` (`delete`), or gives it another
/// owner, behind its holder's back, and so every live holder row of the key
/// (its permits or readers). Says what it did.
async fn steal_row(
    backend: Backend,
    url: &str,
    stored_key: &str,
    delete: bool,
) -> anyhow::Result<String> {
    use sqlx::Connection as _;
    let mut rows = 0;
    if backend == Backend::Postgres {
        let mut conn = sqlx::PgConnection::connect(url).await?;
        for table in ["dlock_leases", "dlock_leases_holders"] {
            let sql = if delete {
                format!("DELETE FROM {table} WHERE key = $1 AND owner IS NOT NULL")
            } else {
                format!(
                    "UPDATE {table} SET owner = 'chaos-nemesis' WHERE key = $1 AND owner IS NOT NULL"
                )
            };
            let done = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(stored_key)
                .execute(&mut conn)
                .await?;
            rows += done.rows_affected();
        }
        conn.close().await?;
    } else {
        let mut conn = sqlx::MySqlConnection::connect(url).await?;
        for table in ["dlock_leases", "dlock_leases_holders"] {
            let sql = if delete {
                format!("DELETE FROM {table} WHERE k = ? AND owner IS NOT NULL")
            } else {
                format!(
                    "UPDATE {table} SET owner = 'chaos-nemesis' WHERE k = ? AND owner IS NOT NULL"
                )
            };
            let done = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(stored_key.as_bytes())
                .execute(&mut conn)
                .await?;
            rows += done.rows_affected();
        }
        conn.close().await?;
    }
    Ok(format!(
        "{rows} rows {}",
        if delete {
            "deleted"
        } else {
            "given another owner"
        }
    ))
}

/// Stalls the side backend for `span`, calling `started` just before: holds
/// SQLite's write lock in a `BEGIN IMMEDIATE` transaction, or runs a Lua busy
/// loop on the side Redis (a script stalls the whole server; it ends by itself
/// well before `busy-reply-threshold`, 5 s, would make Redis answer `BUSY`).
async fn stall_side(
    cluster: &Cluster,
    span: Duration,
    started: impl FnOnce(),
) -> anyhow::Result<()> {
    use sqlx::Connection as _;
    let url = cluster.side_url().context("no side backend to stall")?;
    if url.starts_with("sqlite:") {
        let mut conn = sqlx::SqliteConnection::connect(&url).await?;
        started();
        sqlx::query("BEGIN IMMEDIATE").execute(&mut conn).await?;
        tokio::time::sleep(span).await;
        sqlx::query("ROLLBACK").execute(&mut conn).await?;
        conn.close().await?;
        return Ok(());
    }
    let port = cluster
        .side_server
        .lock()
        .await
        .as_ref()
        .map(|s| s.port())
        .context("no side Redis")?;
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?;
    let config = redis::AsyncConnectionConfig::new()
        .set_response_timeout(Some(span + Duration::from_secs(3)));
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&config)
        .await?;
    started();
    let busy: redis::RedisResult<u64> = redis::cmd("EVAL")
        .arg(BUSY_LOOP)
        .arg(0)
        .arg(span.as_micros() as u64)
        .query_async(&mut conn)
        .await;
    if busy.is_err() {
        end_side_stall(port).await;
    }
    busy.context("the side Redis' busy loop")?;
    Ok(())
}

/// A script that keeps Redis busy for `ARGV[1]` µs and returns its iterations.
const BUSY_LOOP: &str = "local t = redis.call('TIME')
local start = t[1] * 1000000 + t[2]
local n = 0
while true do
  n = n + 1
  local u = redis.call('TIME')
  if u[1] * 1000000 + u[2] - start >= tonumber(ARGV[1]) then return n end
end";

/// `SCRIPT KILL` on the side Redis (an error when no script runs is fine).
async fn end_side_stall(port: u16) {
    let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{port}/")) else {
        return;
    };
    if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
        let _: redis::RedisResult<()> = redis::cmd("SCRIPT")
            .arg("KILL")
            .query_async(&mut conn)
            .await;
    }
}

/// Asks a worker (of the given parity: 1 = `on_lost = "continue"`, 0 = `"cancel"`)
/// to stay [`LONG_HOLD`] inside the lock next time, with the lease (and side
/// lock) of `request`, and waits up to 5 s for it to be there, so that the fault
/// strikes while its body runs.
async fn long_holder(
    cluster: &Cluster,
    rng: &mut StdRng,
    parity: Option<usize>,
    request: LongRequest,
) -> usize {
    let candidates: Vec<usize> = (0..cluster.args.workers)
        .filter(|w| parity.is_none_or(|p| w % 2 == p))
        .collect();
    let w = candidates.choose(rng).copied().unwrap_or(0);
    if let Some(stdin) = cluster.workers.lock().await[w].stdin.as_mut() {
        let _ = stdin.write_all(request.line().as_bytes()).await;
    }
    let long = LONG_HOLD.as_millis() as u64;
    for _ in 0..500 {
        if matches!(cluster.tracker.lock().expect("tracker").inside.get(&w), Some(Some(ms)) if *ms >= long)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    w
}

async fn pid(cluster: &Cluster, w: usize) -> Option<Pid> {
    let workers = cluster.workers.lock().await;
    workers[w]
        .child
        .id()
        .and_then(|id| i32::try_from(id).ok())
        .map(Pid::from_raw)
}

/// Ends whatever fault an aborted nemesis left: continues every worker, brings
/// every server back, ends a busy script on the side Redis, lets every proxy
/// pass. (An aborted SQLite stall ended when its connection was dropped.)
pub(crate) async fn heal_all(cluster: &Cluster) -> anyhow::Result<()> {
    for w in 0..cluster.args.workers {
        if let Some(pid) = pid(cluster, w).await {
            let _ = kill(pid, Signal::SIGCONT);
        }
    }
    for server in cluster.servers.lock().await.iter_mut() {
        if !server.is_up() {
            server.restart(true).await?;
        }
    }
    if let Some(port) = cluster.side_server.lock().await.as_ref().map(|s| s.port()) {
        end_side_stall(port).await;
    }
    for proxy in &cluster.proxies {
        proxy.set(Fault::Pass);
    }
    Ok(())
}
