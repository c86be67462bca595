//! The short chaos runs CI does: one per multi-process backend, and the
//! transfer workload (two accounts per hold) on Redis, PostgreSQL and
//! ZooKeeper, each failing on any violation the checker finds (stale write
//! accepted, lost update, key left behind on either backend, renewal after a
//! release request, loss signalled after the server's expiry, main lease lost
//! during a side stall, worker hung, targets not reached; for transfers, a
//! total not conserved or a transfer half-applied) and on a run that did not
//! exercise the faults it claims (no stale write refused, no lost-lease
//! signal, a caller that never gave up at the acquisition, the body or the
//! release, no side stall with the main backend renewing through it, a lease
//! length never used, no revoked holder told of its loss). Every run revokes
//! a held key through the admin API at least once: each revoked holder must
//! be told within a bound (with the reason `revoked` where the backend
//! tells it), and the next grant's token must be larger.
//!
//! The semaphore workload (a semaphore of 3 permits per key, through the
//! attribute's `permits = 3`) and the read-write workload (readers,
//! writers and plain locks of the same keys) run on SQLite, Redis,
//! PostgreSQL and MySQL in lease mode, PostgreSQL in session mode,
//! ZooKeeper and etcd (the semaphore also on MySQL in session mode, whose
//! read locks are refused) under one round of their backend's faults,
//! failing also on more holders of one key than its permits, two holders
//! of one (key, slot), a reader beside a writer (all on the store's order
//! of the operations it took), and on a run where permits or readers never
//! actually shared a key. In session mode the `session_kill` fault ends a
//! lock-holding connection (in the semaphore workload a permit's slot's):
//! each holder so ended must be told of its loss within its lease, a
//! renewal period and 2 s.
//!
//! `DLOCK_CHAOS_PORT_BASE` moves the servers the runs start (`--port-base`)
//! away from the default ports, for a machine where those are taken.
//!
//! They need `redis-server` on the PATH, for the etcd runs `etcd`, for the
//! ZooKeeper run `java` and Debian's ZooKeeper jars, for the PostgreSQL
//! runs Debian's PostgreSQL 15 (in
//! `/usr/lib/postgresql/15/bin`, and a `postgres` user) and for the MySQL runs
//! `mariadbd` and `mariadb-install-db` (`scripts/servers.sh up` installs them
//! all; the harness runs servers of its own, on its own ports); a missing
//! server fails the run, it is not skipped.

use std::path::Path;
use std::process::Command;
use std::sync::Mutex;

/// One run at a time: eight worker processes each already share two cores.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// One short run on `backend` with `faults` faults; its summary.
fn short_run(backend: &str, faults: u32) -> serde_json::Value {
    short_run_in(backend, None, faults)
}

/// One short run on `backend` (with `--mode`, if given) with `faults` faults;
/// its summary.
fn short_run_in(backend: &str, mode: Option<&str>, faults: u32) -> serde_json::Value {
    short_run_of(backend, mode, "counter", faults)
}

/// One short run of the transfer workload on `backend` with `faults` faults,
/// failing also when the total is not conserved, a transfer was
/// half-applied or none went through; its summary.
fn short_transfer_run(backend: &str, faults: u32) -> serde_json::Value {
    let summary = short_run_of(backend, None, "transfer", faults);
    assert_eq!(summary["workload"], "transfer", "{summary}");
    assert!(
        summary["total_initial"].as_u64().unwrap_or(0) > 0,
        "{summary}"
    );
    assert_eq!(
        summary["total_final"], summary["total_initial"],
        "the total was not conserved: {summary}"
    );
    assert_eq!(summary["half_applied_transfers"].as_u64(), Some(0));
    assert!(
        summary["transfers_taken"].as_u64().unwrap_or(0) >= 1,
        "no transfer went through: {summary}"
    );
    assert_eq!(summary["stale_writes_by_key"], serde_json::json!({}));
    assert_eq!(summary["lost_updates_by_key"], serde_json::json!({}));
    summary
}

/// One short run of the semaphore workload on `backend` with `faults`
/// faults, failing also when one key had more holders than its 3 permits
/// at once, a permit had no slot below them, two holders of one slot
/// overlapped, or no two permits of one key were ever held together.
fn short_semaphore_run(backend: &str, faults: u32) -> serde_json::Value {
    short_semaphore_run_in(backend, None, faults)
}

/// [`short_semaphore_run`] with `--mode`, if given.
fn short_semaphore_run_in(backend: &str, mode: Option<&str>, faults: u32) -> serde_json::Value {
    let summary = short_run_of(backend, mode, "semaphore", faults);
    assert_eq!(summary["workload"], "semaphore", "{summary}");
    assert_eq!(summary["permits"].as_u64(), Some(3), "{summary}");
    let most = summary["max_permit_holders"].as_u64().unwrap_or(0);
    assert!(
        (2..=3).contains(&most),
        "at most {most} permit holders at once: {summary}"
    );
    assert_eq!(summary["permit_slots_out_of_range"].as_u64(), Some(0));
    assert_eq!(summary["holders_at_once"].as_u64(), Some(0));
    assert_eq!(summary["stale_writes_by_key"], serde_json::json!({}));
    summary
}

/// One short run of the read-write workload on `backend` with `faults`
/// faults, failing also when a reader's hold overlapped a writer's, two
/// exclusive holds overlapped, or no two readers ever shared a key.
fn short_rw_run(backend: &str, faults: u32) -> serde_json::Value {
    short_rw_run_in(backend, None, faults)
}

/// [`short_rw_run`] with `--mode`, if given.
fn short_rw_run_in(backend: &str, mode: Option<&str>, faults: u32) -> serde_json::Value {
    let summary = short_run_of(backend, mode, "rw", faults);
    assert_eq!(summary["workload"], "rw", "{summary}");
    assert_eq!(summary["readers_beside_writers"].as_u64(), Some(0));
    assert_eq!(summary["holders_at_once"].as_u64(), Some(0));
    assert_eq!(summary["stale_reads_accepted"].as_u64(), Some(0));
    assert!(
        summary["max_readers_at_once"].as_u64().unwrap_or(0) >= 2,
        "readers never shared a key: {summary}"
    );
    assert!(
        summary["writes_accepted"].as_u64().unwrap_or(0) >= 1,
        "no writer wrote: {summary}"
    );
    summary
}

/// One short run of `workload` on `backend` (with `--mode`, if given) with
/// `faults` faults; its summary.
fn short_run_of(
    backend: &str,
    mode: Option<&str>,
    workload: &str,
    faults: u32,
) -> serde_json::Value {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let out = tempfile::tempdir().unwrap();
    let status = Command::new(env!("CARGO_BIN_EXE_dlock-chaos"))
        .args([
            "run",
            "--backend",
            backend,
            "--acquisitions",
            "1000",
            "--seed",
            "1",
        ])
        .args(["--faults", &faults.to_string(), "--max-duration", "4m"])
        .args(mode.map(|mode| ["--mode", mode]).into_iter().flatten())
        .args(["--workload", workload])
        .args(
            std::env::var("DLOCK_CHAOS_PORT_BASE")
                .ok()
                .map(|base| ["--port-base".to_owned(), base])
                .into_iter()
                .flatten(),
        )
        .arg("--out")
        .arg(out.path())
        .status()
        .unwrap();
    let summary = read_summary(out.path());
    assert!(
        status.success(),
        "the chaos run on {backend} failed: {summary}"
    );
    let field = |name: &str| {
        summary[name]
            .as_u64()
            .unwrap_or_else(|| panic!("{name} in {summary}"))
    };
    let faults_seen: u64 = summary["faults"]
        .as_object()
        .unwrap()
        .values()
        .filter_map(|v| v.as_u64())
        .sum();
    assert_eq!(faults_seen, u64::from(faults), "{summary}");
    assert!(field("acquisitions") >= 1000, "{summary}");
    assert!(
        field("stale_refused") >= 1,
        "no paused holder's stale write reached the store: {summary}"
    );
    assert!(
        field("lost_signals") >= 1,
        "no lost-lease signal: {summary}"
    );
    for at in ["acquire", "body", "release"] {
        assert!(
            summary["gave_up"][at].as_u64().unwrap_or(0) >= 1,
            "no caller gave up during the {at}: {summary}"
        );
    }
    for lease_ms in ["400", "1000", "2500"] {
        assert!(
            summary["acquisitions_by_lease_ms"][lease_ms]
                .as_u64()
                .unwrap_or(0)
                >= 1,
            "no entry with a {lease_ms} ms lease: {summary}"
        );
    }
    assert!(
        summary["faults"]["side_stall"].as_u64().unwrap_or(0) >= 1,
        "the side backend was never stalled: {summary}"
    );
    assert!(field("side_acquired") >= 1, "no side lock: {summary}");
    assert!(
        field("side_stall_main_renewals") >= 1,
        "no main-backend renewal during a side stall: {summary}"
    );
    assert!(
        field("renewals_sent") >= 1 && field("releases_requested") >= 1,
        "the runtime's lease events were not recorded: {summary}"
    );
    assert_eq!(field("renewals_after_release"), 0);
    assert_eq!(field("losses_after_expiry"), 0);
    assert_eq!(field("main_lost_in_side_stall"), 0);
    assert!(
        summary["faults"]["revoke"].as_u64().unwrap_or(0) >= 1,
        "no key was revoked: {summary}"
    );
    assert!(
        field("holders_revoked") >= 1 && field("revoked_signalled") >= 1,
        "no revoked holder was told of its loss: {summary}"
    );
    if backend != "redlock" {
        assert!(
            field("tokens_after_revoke") >= 1,
            "no grant after a revocation to compare tokens with: {summary}"
        );
    }
    assert_eq!(field("revoked_unsignalled"), 0);
    assert_eq!(field("revoked_misreported"), 0);
    assert_eq!(field("revoked_unexplained"), 0);
    assert_eq!(field("tokens_not_above_revoked"), 0);
    assert_eq!(field("stale_writes_accepted"), 0);
    assert_eq!(field("lost_updates"), 0);
    assert_eq!(summary["keys_left"].as_u64(), Some(0));
    assert_eq!(summary["side_keys_left"].as_u64(), Some(0));
    summary
}

/// Fails unless every fault of `kinds` struck at least once.
fn assert_faults(summary: &serde_json::Value, kinds: &[&str]) {
    for kind in kinds {
        assert!(
            summary["faults"][kind].as_u64().unwrap_or(0) >= 1,
            "no {kind} fault: {summary}"
        );
    }
}

fn read_summary(dir: &Path) -> serde_json::Value {
    std::fs::read(dir.join("summary.json"))
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .unwrap_or(serde_json::Value::Null)
}

// Every fault kind of a backend comes once per round of the nemesis' schedule,
// so each run below (with at least as many faults as its backend has kinds:
// 4, 8, 6, 9, and 9 for each SQL run) stalls the side backend and revokes a
// held key at least once.

#[test]
fn sqlite_under_pauses_kills_and_side_stalls() {
    short_run("sqlite", 6);
}

#[test]
fn redis_under_server_kills_partitions_pauses_kills_and_side_stalls() {
    short_run("redis", 12);
}

#[test]
fn redlock_under_node_outages_pauses_kills_and_side_stalls() {
    short_run("redlock", 8);
}

#[test]
fn zookeeper_under_server_kills_partitions_session_expiries_pauses_kills_and_side_stalls() {
    let summary = short_run("zk", 9);
    assert_faults(
        &summary,
        &[
            "sigstop",
            "sigkill_worker",
            "kill_server",
            "proxy_delay",
            "proxy_blackhole",
            "proxy_reset",
            "session_expiry",
            "side_stall",
            "revoke",
        ],
    );
}

/// The faults of a SQL run besides its mode's own (`row_stolen`, `session_kill`).
const SQL_FAULTS: [&str; 8] = [
    "sigstop",
    "sigkill_worker",
    "kill_server",
    "proxy_delay",
    "proxy_blackhole",
    "proxy_reset",
    "side_stall",
    "revoke",
];

#[test]
fn postgres_lease_under_server_kills_partitions_stolen_rows_pauses_kills_and_side_stalls() {
    let summary = short_run("postgres", 9);
    assert_faults(&summary, &SQL_FAULTS);
    assert_faults(&summary, &["row_stolen"]);
}

#[test]
fn postgres_session_under_server_kills_partitions_terminated_backends_pauses_kills_and_side_stalls()
{
    let summary = short_run_in("postgres", Some("session"), 9);
    assert_faults(&summary, &SQL_FAULTS);
    assert_faults(&summary, &["session_kill"]);
}

#[test]
fn mysql_lease_under_server_kills_partitions_stolen_rows_pauses_kills_and_side_stalls() {
    let summary = short_run("mysql", 9);
    assert_faults(&summary, &SQL_FAULTS);
    assert_faults(&summary, &["row_stolen"]);
}

#[test]
fn mysql_session_under_server_kills_partitions_killed_connections_pauses_kills_and_side_stalls() {
    let summary = short_run_in("mysql", Some("session"), 9);
    assert_faults(&summary, &SQL_FAULTS);
    assert_faults(&summary, &["session_kill"]);
}

// The transfer workload: two accounts out of 16 in one hold per iteration,
// one round of the backend's faults each.

#[test]
fn transfers_on_redis_conserve_the_total_under_one_round_of_faults() {
    short_transfer_run("redis", 8);
}

#[test]
fn transfers_on_postgres_conserve_the_total_under_one_round_of_faults() {
    let summary = short_transfer_run("postgres", 9);
    assert_faults(&summary, &SQL_FAULTS);
    assert_faults(&summary, &["row_stolen"]);
}

#[test]
fn transfers_on_zookeeper_conserve_the_total_under_one_round_of_faults() {
    let summary = short_transfer_run("zk", 9);
    assert_faults(
        &summary,
        &["session_expiry", "kill_server", "proxy_blackhole", "revoke"],
    );
}

// The semaphore and read-write workloads: one round of the backend's faults
// each.

#[test]
fn semaphore_on_sqlite_keeps_its_permits_under_pauses_kills_and_side_stalls() {
    short_semaphore_run("sqlite", 4);
}

#[test]
fn rw_on_sqlite_keeps_readers_from_writers_under_pauses_kills_and_side_stalls() {
    short_rw_run("sqlite", 4);
}

#[test]
fn semaphore_on_redis_keeps_its_permits_under_one_round_of_faults() {
    short_semaphore_run("redis", 8);
}

#[test]
fn rw_on_redis_keeps_readers_from_writers_under_one_round_of_faults() {
    short_rw_run("redis", 8);
}

#[test]
fn semaphore_on_postgres_lease_keeps_its_permits_under_one_round_of_faults() {
    let summary = short_semaphore_run("postgres", 9);
    assert_faults(&summary, &["row_stolen", "kill_server", "revoke"]);
}

#[test]
fn rw_on_postgres_lease_keeps_readers_from_writers_under_one_round_of_faults() {
    let summary = short_rw_run("postgres", 9);
    assert_faults(&summary, &["row_stolen", "kill_server", "revoke"]);
}

#[test]
fn semaphore_on_mysql_lease_keeps_its_permits_under_one_round_of_faults() {
    let summary = short_semaphore_run("mysql", 9);
    assert_faults(&summary, &["row_stolen", "kill_server", "revoke"]);
}

#[test]
fn rw_on_mysql_lease_keeps_readers_from_writers_under_one_round_of_faults() {
    let summary = short_rw_run("mysql", 9);
    assert_faults(&summary, &["row_stolen", "kill_server", "revoke"]);
}

#[test]
fn semaphore_on_zookeeper_keeps_its_permits_under_one_round_of_faults() {
    let summary = short_semaphore_run("zk", 9);
    assert_faults(&summary, &["session_expiry", "kill_server", "revoke"]);
}

#[test]
fn rw_on_zookeeper_keeps_readers_from_writers_under_one_round_of_faults() {
    let summary = short_rw_run("zk", 9);
    assert_faults(&summary, &["session_expiry", "kill_server", "revoke"]);
}

/// The faults of a session-mode run: [`SQL_FAULTS`] and `session_kill`.
fn assert_session_faults(summary: &serde_json::Value) {
    assert_faults(summary, &SQL_FAULTS);
    assert_faults(summary, &["session_kill"]);
    assert!(
        summary["session_killed_holders"].as_u64().unwrap_or(0) >= 1,
        "no holder's connection was ended: {summary}"
    );
    assert_eq!(
        summary["session_killed_unsignalled"].as_u64(),
        Some(0),
        "{summary}"
    );
}

#[test]
fn semaphore_on_postgres_session_keeps_its_permits_under_one_round_of_faults() {
    let summary = short_semaphore_run_in("postgres", Some("session"), 9);
    assert_session_faults(&summary);
    assert!(
        summary["session_killed_slot_holders"].as_u64().unwrap_or(0) >= 1,
        "no permit holder's connection was ended: {summary}"
    );
}

#[test]
fn rw_on_postgres_session_keeps_readers_from_writers_under_one_round_of_faults() {
    let summary = short_rw_run_in("postgres", Some("session"), 9);
    assert_session_faults(&summary);
}

#[test]
fn semaphore_on_mysql_session_keeps_its_permits_under_one_round_of_faults() {
    let summary = short_semaphore_run_in("mysql", Some("session"), 9);
    assert_session_faults(&summary);
    assert!(
        summary["session_killed_slot_holders"].as_u64().unwrap_or(0) >= 1,
        "no permit holder's connection was ended: {summary}"
    );
}

/// etcd's faults: a member killed, the proxies' faults, a side stall, a
/// revocation (besides the workers' pauses and kills).
const ETCD_FAULTS: [&str; 8] = [
    "sigstop",
    "sigkill_worker",
    "kill_server",
    "proxy_delay",
    "proxy_blackhole",
    "proxy_reset",
    "side_stall",
    "revoke",
];

#[test]
fn semaphore_on_etcd_keeps_its_permits_under_one_round_of_faults() {
    let summary = short_semaphore_run("etcd", 8);
    assert_faults(&summary, &ETCD_FAULTS);
}

#[test]
fn rw_on_etcd_keeps_readers_from_writers_under_one_round_of_faults() {
    let summary = short_rw_run("etcd", 8);
    assert_faults(&summary, &ETCD_FAULTS);
}

/// Redlock offers neither permits nor readers; MySQL's session mode offers
/// no readers (`GET_LOCK` has no shared mode), and says to use lease mode.
#[test]
fn a_backend_that_does_not_offer_the_workloads_mode_fails_the_run() {
    let cases = [
        (["redlock", "lease"], "semaphore", "Redlock"),
        (["redlock", "lease"], "rw", "Redlock"),
        (["mysql", "session"], "rw", "lease mode"),
    ];
    for ([backend, mode], workload, named) in cases {
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        let out = tempfile::tempdir().unwrap();
        let run = Command::new(env!("CARGO_BIN_EXE_dlock-chaos"))
            .args(["run", "--backend", backend, "--mode", mode])
            .args(["--workload", workload])
            .args(["--acquisitions", "10", "--faults", "1"])
            .args(
                std::env::var("DLOCK_CHAOS_PORT_BASE")
                    .ok()
                    .map(|base| ["--port-base".to_owned(), base])
                    .into_iter()
                    .flatten(),
            )
            .arg("--out")
            .arg(out.path())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&run.stderr);
        let case = format!("{workload} on {backend} ({mode})");
        assert!(!run.status.success(), "{case} passed");
        assert!(
            stderr.contains("does not offer") && stderr.contains(named),
            "{case}: {stderr}"
        );
        assert!(read_summary(out.path()).is_null(), "{case}: a summary");
    }
}
