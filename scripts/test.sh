#!/usr/bin/env bash
# The whole dlock suite: start the test servers, then fmt, clippy, tests, docs.
#
#   scripts/test.sh [ARGS...]   ARGS go to `cargo test` (e.g. a test name filter,
#                               or `-- --nocapture`)
#
# Servers and their state: scripts/servers.sh (stop them with `scripts/servers.sh down`).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
STATE_DIR=${DLOCK_SERVERS_DIR:-$REPO/target/servers}

step() { printf '\n==> %s\n' "$*" >&2; }

step "scripts/servers.sh up"
scripts/servers.sh up
set -a
# shellcheck source=/dev/null
. "$STATE_DIR/urls.env"
set +a

missing=()
cargo fmt --version >/dev/null 2>&1 || missing+=(rustfmt)
cargo clippy --version >/dev/null 2>&1 || missing+=(clippy)
if ((${#missing[@]})); then
    step "rustup component add ${missing[*]}"
    rustup component add "${missing[@]}"
fi

step "cargo fmt --all --check"
cargo fmt --all --check

step "cargo clippy --workspace --all-targets --all-features -- -D warnings"
cargo clippy --workspace --all-targets --all-features -- -D warnings

step "cargo test --workspace --all-features --no-fail-fast $*"
cargo test --workspace --all-features --no-fail-fast "$@"

step "cargo doc --workspace --no-deps --all-features (RUSTDOCFLAGS=-Dwarnings)"
RUSTDOCFLAGS=-Dwarnings cargo doc --workspace --no-deps --all-features

step "all checks passed"
