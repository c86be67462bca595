//! The `metrics` feature: every event reaches the installed recorder under
//! the names of `dlock_runtime::metrics`, labelled with the backend, the
//! outcome or reason, and the attribute's key *template* — never the
//! formatted key.
#![cfg(feature = "metrics")]

use std::collections::BTreeMap;
use std::time::Duration;

use dlock_runtime::metrics::*;
use dlock_runtime::{LockError, MemoryBackend, Registry, distributed_lock, lock};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

const TEMPLATE: &str = "metered:{id}";

#[distributed_lock(key = "metered:{id}", lease = "300ms")]
async fn metered(id: u32) -> Result<(), LockError> {
    tokio::time::sleep(Duration::from_millis(150)).await;
    Ok(())
}

#[distributed_lock(key = "metered:{id}", on_busy = "skip")]
async fn metered_or_skipped(id: u32) -> Result<(), LockError> {
    Ok(())
}

/// `(name, sorted labels)` → value.
type Seen = BTreeMap<(String, Vec<(String, String)>), DebugValue>;

fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v: Vec<_> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    v.sort();
    v
}

fn counter(seen: &Seen, name: &str, pairs: &[(&str, &str)]) -> u64 {
    match seen.get(&(name.to_owned(), labels(pairs))) {
        Some(DebugValue::Counter(n)) => *n,
        other => panic!("{name} {pairs:?}: {other:?}\nseen: {seen:#?}"),
    }
}

fn gauge(seen: &Seen, name: &str, pairs: &[(&str, &str)]) -> f64 {
    match seen.get(&(name.to_owned(), labels(pairs))) {
        Some(DebugValue::Gauge(g)) => g.into_inner(),
        other => panic!("{name} {pairs:?}: {other:?}"),
    }
}

fn samples(seen: &Seen, name: &str, pairs: &[(&str, &str)]) -> Vec<f64> {
    match seen.get(&(name.to_owned(), labels(pairs))) {
        Some(DebugValue::Histogram(h)) => h.iter().map(|v| v.into_inner()).collect(),
        other => panic!("{name} {pairs:?}: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_is_recorded_with_the_key_template_as_its_label() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this test binary");
    let mem = MemoryBackend::new();
    dlock_runtime::init(Registry::builder().default_backend(mem.clone()).build()).expect("init");

    // Two holds through the attribute (renewed once or more), one busy
    // call skipped while the first runs.
    let first = tokio::spawn(metered(7));
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert_eq!(metered_or_skipped(7).await.ok(), Some(()));
    first.await.expect("task").expect("first hold");
    metered(8).await.expect("second hold");
    // A builder lock without a label, lost on the server.
    let lost = lock("unlabelled")
        .lease(Duration::from_millis(300))
        .acquire()
        .await
        .expect("acquire");
    assert!(mem.expire_now("dlock:unlabelled"));
    tokio::time::timeout(Duration::from_secs(1), lost.lost())
        .await
        .expect("lost");
    drop(lost);
    // And one with a label of its own.
    let labelled = lock("job:1")
        .key_label("job:{n}")
        .acquire()
        .await
        .expect("acquire");
    labelled.release().await.expect("release");
    tokio::time::sleep(Duration::from_millis(50)).await;

    let seen: Seen = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let key = key.key();
            let pairs = key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()));
            let mut pairs: Vec<_> = pairs.collect();
            pairs.sort();
            ((key.name().to_owned(), pairs), value)
        })
        .collect();

    let templated = [(LABEL_BACKEND, "default"), (LABEL_KEY, TEMPLATE)];
    assert_eq!(counter(&seen, ACQUIRED_TOTAL, &templated), 2);
    assert_eq!(counter(&seen, RELEASED_TOTAL, &templated), 2);
    assert_eq!(counter(&seen, BUSY_TOTAL, &templated), 1);
    assert_eq!(counter(&seen, SKIPPED_TOTAL, &templated), 1);
    assert!(
        counter(
            &seen,
            RENEWALS_TOTAL,
            &[templated[0], templated[1], (LABEL_OUTCOME, "renewed")]
        ) >= 2
    );
    assert_eq!(gauge(&seen, HELD, &templated), 0.0);
    assert_eq!(gauge(&seen, WAITING, &templated), 0.0);
    let acquired = [templated[0], templated[1], (LABEL_OUTCOME, "acquired")];
    assert_eq!(samples(&seen, WAIT_SECONDS, &acquired).len(), 2);
    let busy = [templated[0], templated[1], (LABEL_OUTCOME, "busy")];
    assert_eq!(samples(&seen, WAIT_SECONDS, &busy).len(), 1);
    let released = [templated[0], templated[1], (LABEL_OUTCOME, "released")];
    let holds = samples(&seen, HOLD_SECONDS, &released);
    assert_eq!(holds.len(), 2);
    assert!(holds.iter().all(|s| *s >= 0.15), "{holds:?}");

    let unlabelled = [(LABEL_BACKEND, "default")];
    assert_eq!(counter(&seen, ACQUIRED_TOTAL, &unlabelled), 1);
    let gone = [(LABEL_BACKEND, "default"), (LABEL_REASON, "gone")];
    assert_eq!(counter(&seen, LOST_TOTAL, &gone), 1);
    let lateness = samples(&seen, LOSS_LATENESS_SECONDS, &gone);
    assert_eq!(
        lateness,
        [0.0],
        "the server reported it before the give-up instant"
    );
    let lost = [(LABEL_BACKEND, "default"), (LABEL_OUTCOME, "lost")];
    assert_eq!(samples(&seen, HOLD_SECONDS, &lost).len(), 1);
    assert_eq!(gauge(&seen, HELD, &unlabelled), 0.0);

    let own = [(LABEL_BACKEND, "default"), (LABEL_KEY, "job:{n}")];
    assert_eq!(counter(&seen, ACQUIRED_TOTAL, &own), 1);

    // The formatted keys never appear.
    for (_, pairs) in seen.keys() {
        for (_, value) in pairs {
            assert!(
                !value.contains("metered:7") && !value.contains("metered:8"),
                "{value}"
            );
            assert!(!value.contains("unlabelled") && value != "job:1", "{value}");
        }
    }
}
