#!/usr/bin/env bash
# Hunts flaky tests: the whole suite several times back to back, each on fresh
# servers, then every timing-sensitive test binary many times under a CPU hog.
# Reports every failure; exits non-zero if there was one.
#
#   scripts/flake-hunt.sh [--full N] [--each M] [--hog K] [BINARY...]
#
#   --full N   whole-suite runs (`cargo test --workspace --all-features`), each
#              after `scripts/servers.sh down`, its state wiped and `up` again
#              (default 3; 0 skips them)
#   --each M   runs of each timing-sensitive binary under the hog (default 10)
#   --hog K    busy processes competing for the CPU during those runs
#              (default: the number of cores)
#   BINARY     test binaries (file names under tests/tests or chaos/tests,
#              without `.rs`) to run under the hog; default: every one whose
#              source measures time (`Instant::now()` or `.elapsed()`)
#
# Logs and the report go to target/flake-hunt/ (report.txt). A failing run's
# whole output is kept as its own log. Nothing is retried: a failure counts.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
STATE_DIR=${DLOCK_SERVERS_DIR:-$REPO/target/servers}
OUT=$REPO/target/flake-hunt

FULL=3
EACH=10
HOG=$(nproc)
BINARIES=()
while (($#)); do
    case $1 in
        --full) FULL=$2; shift 2 ;;
        --each) EACH=$2; shift 2 ;;
        --hog) HOG=$2; shift 2 ;;
        -h | --help) sed -n '2,21p' "$0"; exit 0 ;;
        -*) echo "flake-hunt: unknown option $1" >&2; exit 2 ;;
        *) BINARIES+=("$1"); shift ;;
    esac
done

rm -rf "$OUT"
mkdir -p "$OUT"
REPORT=$OUT/report.txt
: >"$REPORT"
failures=0
runs=0

say() { printf '%s\n' "$*" | tee -a "$REPORT" >&2; }

hog_pids=()
stop_hog() {
    if ((${#hog_pids[@]})); then
        kill "${hog_pids[@]}" 2>/dev/null || true
        wait "${hog_pids[@]}" 2>/dev/null || true
    fi
    hog_pids=()
}
trap stop_hog EXIT

load_urls() {
    set -a
    # shellcheck source=/dev/null
    . "$STATE_DIR/urls.env"
    set +a
}

# Runs one command, logging to $1; counts and reports a failure with the
# names of the failed tests.
run_logged() {
    local log=$1
    shift
    runs=$((runs + 1))
    if "$@" >"$log" 2>&1; then
        rm -f "$log"
        return 0
    fi
    failures=$((failures + 1))
    local failed
    failed=$(grep -E '^test .* FAILED$|^    [A-Za-z0-9_:]+$|panicked at' "$log" | sort -u | head -n 40 || true)
    say "FAILED: $* (log: ${log#"$REPO"/})"
    [[ -n $failed ]] && say "$(sed 's/^/    /' <<<"$failed")"
    return 0
}

fresh_servers() {
    scripts/servers.sh down >/dev/null 2>&1 || true
    # Keep the installs' log, drop every server's data and the URLs.
    rm -rf "$STATE_DIR"
    scripts/servers.sh up >"$OUT/servers.log" 2>&1 || {
        say "FAILED: scripts/servers.sh up (log: ${OUT#"$REPO"/}/servers.log)"
        exit 1
    }
    load_urls
}

say "== flake hunt $(date -u +%FT%TZ): $FULL full runs; $EACH runs of each timing-sensitive binary under $HOG busy processes ($(nproc) cores)"
cargo test --workspace --all-features --no-run >"$OUT/build.log" 2>&1 || {
    say "FAILED: the build (log: ${OUT#"$REPO"/}/build.log)"
    exit 1
}

for ((i = 1; i <= FULL; i++)); do
    fresh_servers
    start=$SECONDS
    run_logged "$OUT/full-$i.log" cargo test --workspace --all-features --no-fail-fast
    say "full run $i/$FULL: $((SECONDS - start)) s"
done

if ((EACH > 0)); then
    if ((${#BINARIES[@]} == 0)); then
        while IFS= read -r file; do
            BINARIES+=("$(basename "$file" .rs)")
        done < <(grep -lE 'Instant::now\(\)|\.elapsed\(\)' tests/tests/*.rs chaos/tests/*.rs | sort)
    fi
    if ((FULL == 0)); then
        scripts/servers.sh up >"$OUT/servers.log" 2>&1
        load_urls
    fi
    for ((h = 0; h < HOG; h++)); do
        (while :; do :; done) &
        hog_pids+=($!)
    done
    say "under the hog: ${BINARIES[*]}"
    for bin in "${BINARIES[@]}"; do
        before=$failures
        start=$SECONDS
        for ((i = 1; i <= EACH; i++)); do
            # --workspace: the features of the build above, so nothing is rebuilt.
            run_logged "$OUT/$bin-$i.log" cargo test --workspace --all-features --test "$bin"
        done
        say "$bin: $((failures - before)) of $EACH runs failed ($((SECONDS - start)) s)"
    done
    stop_hog
fi

say "== $runs runs, $failures failed"
((failures == 0))
