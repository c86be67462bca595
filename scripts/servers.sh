#!/usr/bin/env bash
# Start, stop and inspect the local servers dlock's integration tests run against.
#
#   scripts/servers.sh [up]            install what is missing (apt), start everything, print URLs
#   scripts/servers.sh down            stop everything (data is kept)
#   scripts/servers.sh status          say which servers are up
#   scripts/servers.sh urls            print the DLOCK_TEST_* lines
#   scripts/servers.sh stop-redis PORT stop one Redis instance (for failure tests)
#   scripts/servers.sh start-redis PORT (a Sentinel data node rejoins as a replica)
#   scripts/servers.sh stop-postgres [kill]   stop PostgreSQL (`kill`: SIGKILL, a crash)
#   scripts/servers.sh start-postgres
#   scripts/servers.sh stop-mysql [kill]      stop MariaDB (`kill`: SIGKILL, a crash)
#   scripts/servers.sh start-mysql
#   scripts/servers.sh start-pgbouncer        (PostgreSQL must be up)
#   scripts/servers.sh stop-pgbouncer
#   scripts/servers.sh stop-etcd N [kill]     stop etcd member N (0-2; `kill`: SIGKILL)
#   scripts/servers.sh start-etcd N
#
# Every server listens on 127.0.0.1 on the project's own ports, and all state
# (data dirs, logs, pid files, urls.env) lives under one directory:
# ${DLOCK_SERVERS_DIR:-<repo>/target/servers}. `up` is idempotent: servers that
# are already running are left alone. Meant for Debian 12 (root for installs).
#
# Redis: five standalone instances (46379-46383; 46379 is also the one with
# the ACL user), a primary with one replica (46384 -> 46385, for
# `?replicas=N`), a three-master Redis Cluster (47001-47003, bus ports
# 57001-57003) and a TLS-only instance (46390, throwaway CA in <state>/tls).
# The ACL user `dlock` (see ACL_RULES) is set on 46379, the cluster nodes and
# the TLS instance at every `up`/`start-redis`: Redis keeps no ACL on disk here.
#
# Redis Sentinel: a primary (46401) with one replica (46402), watched by
# three sentinels (46411-46413, `redis-server --sentinel`, quorum 2, primary
# name `dlock`) that fail over 1 s after the primary stops answering. After a
# failover the roles stay swapped; a data node started again joins the
# primary the sentinels name.
#
# etcd (Debian's etcd-server): a three-member cluster, clients on
# 42379/42389/42399, peers on 42380/42390/42400, data under <state>/etcd.
#
# PgBouncer (Debian's): two instances in front of the PostgreSQL server, one
# in session pooling (46432) and one in transaction pooling (46433).
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$SCRIPT_DIR/.." && pwd)
STATE_DIR=${DLOCK_SERVERS_DIR:-$REPO/target/servers}
[[ $STATE_DIR == /* ]] || STATE_DIR=$PWD/$STATE_DIR   # urls.env holds paths under it
START_TIMEOUT=${DLOCK_SERVERS_TIMEOUT:-60}   # seconds to wait for a server to answer

HOST=127.0.0.1
REDIS_PORTS=(46379 46380 46381 46382 46383)
PRIMARY_PORT=46384   # has one replica:
REPLICA_PORT=46385
CLUSTER_PORTS=(47001 47002 47003)   # cluster bus: port + 10000
TLS_PORT=46390
SENTINEL_DATA_PORTS=(46401 46402)   # the first starts as the primary
SENTINEL_PORTS=(46411 46412 46413)
SENTINEL_NAME=dlock
ZK_PORT=42181
PG_PORT=45432
MYSQL_PORT=43306
PGB_SESSION_PORT=46432       # PgBouncer, pool_mode = session
PGB_TRANSACTION_PORT=46433   # PgBouncer, pool_mode = transaction
ETCD_CLIENT_PORTS=(42379 42389 42399)   # member i: client port, peer port + 1

PG_BIN=/usr/lib/postgresql/15/bin   # Debian's own; /usr/local/bin/postgres may not exist on CI
ZK_JARS=(/usr/share/java/zookeeper.jar /usr/share/java/slf4j-simple.jar)

# The least-privileged user the Redis backend's tests log in as. The backend
# keeps a lock at `{<prefix><key>}` (default prefix `dlock:`), the shared fence
# counters at `dlock-fence` (one server) and `dlock-fence:{<tag>}` (one per
# hash slot on a cluster), and wakes waiters over pub/sub channels under the
# lock's name (sharded channels on a cluster).
ACL_USER=dlock
ACL_PASS=dlock-secret
ACL_RULES=(
    '~{dlock:*' '~dlock-fence' '~dlock-fence:*' '&{dlock:*' -@all
    +eval +evalsha '+script|load' '+script|exists' +publish +subscribe +unsubscribe
    # Sharded pub/sub: the release messages on Redis Cluster (Redis >= 7).
    +spublish +ssubscribe +sunsubscribe
    +ping +hello +auth '+client|setname' +select +pttl +info
    # Redis checks every redis.call() of a script against the caller's ACL
    # too, so the commands the backend's Lua scripts run must be allowed as
    # well (dlock-runtime/src/backend/redis/*.lua; PTTL and PUBLISH are above).
    +get +set +del +pexpire +time
    # Topology discovery, which a cluster client does on connect.
    '+cluster|slots' '+cluster|shards'
)
# Allowed only where the server knows them (CLIENT SETINFO is Redis >= 7.2;
# ACL SETUSER rejects a command it does not know).
ACL_OPTIONAL=('client|setinfo')

log() { printf '[servers] %s\n' "$*" >&2; }
die() { printf '[servers] error: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------- helpers ---

# pid_alive PIDFILE: the pid file names a live process that is the server it
# belongs to (a stale pid file whose pid was reused by some other program does
# not count, so we never wait on or kill a stranger).
pid_alive() {
    local pid cmdline want
    [[ -s $1 ]] || return 1
    pid=$(head -n1 "$1" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
    case ${1##*/} in
        redis.pid | sentinel.pid) want=redis-server ;;
        zookeeper.pid) want=ZooKeeperServerMain ;;
        postmaster.pid) want=postgres ;;
        mariadb.pid) want=mariadbd ;;
        pgbouncer.pid) want=pgbouncer ;;
        etcd.pid) want=etcd ;;
        *) return 0 ;;
    esac
    cmdline=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
    [[ $cmdline == *"$want"* ]]
}

# port_open PORT: something accepts TCP connections on HOST:PORT.
port_open() {
    # shellcheck disable=SC2016  # $0/$1 expand in the inner bash
    timeout 2 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$HOST" "$1" 2>/dev/null
}

# wait_for NAME LOGFILE PIDFILE CMD...: run CMD until it succeeds; after
# START_TIMEOUT seconds (or as soon as the process in PIDFILE has died, once
# it exists) print the log tail and exit non-zero.
wait_for() {
    local name=$1 logfile=$2 pidfile=$3
    shift 3
    local deadline=$((SECONDS + START_TIMEOUT))
    until "$@" >/dev/null 2>&1; do
        local why=""
        if ((SECONDS >= deadline)); then
            why="did not answer within ${START_TIMEOUT}s"
        elif [[ -n $pidfile && -s $pidfile ]] && ! kill -0 "$(head -n1 "$pidfile")" 2>/dev/null; then
            why="exited during startup"
        fi
        if [[ -n $why ]]; then
            log "$name $why; last lines of $logfile:"
            tail -n 40 "$logfile" >&2 2>/dev/null || true
            exit 1
        fi
        sleep 0.2
    done
}

# stop_pid NAME PIDFILE [GRACE [SIGNAL]]: send SIGNAL (default TERM, each
# server's graceful shutdown), wait up to GRACE seconds, then SIGKILL.
stop_pid() {
    local name=$1 pidfile=$2 grace=${3:-30} sig=${4:-TERM} pid
    if ! pid_alive "$pidfile"; then
        rm -f "$pidfile"
        return 0
    fi
    pid=$(head -n1 "$pidfile")
    kill -"$sig" "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + grace))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
        log "$name (pid $pid) still running ${grace}s after SIG$sig; killing it"
        kill -KILL "$pid" 2>/dev/null || true
        while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    fi
    rm -f "$pidfile"
    log "$name stopped"
}

# mark_log FILE: append a separator so a log tail shows where this start begins.
mark_log() { printf '\n===== %s: started by scripts/servers.sh =====\n' "$(date '+%F %T')" >>"$1"; }

# A port that answers without our pid file belongs to someone else: refuse.
check_port_free() {
    local name=$1 port=$2
    if port_open "$port"; then
        die "$name: port $port is already in use by a process not started from $STATE_DIR"
    fi
}

as_postgres() { (cd / && runuser -u postgres -- "$@"); }

# Unix socket paths are limited to ~107 bytes; keep ours short even when the
# state dir is deep (and reachable by the postgres user, see pg_dir).
socket_dir() {
    local d=$STATE_DIR/run
    if ((${#d} > 80)) || ! as_postgres test -x "$STATE_DIR"; then
        d=/tmp/dlock-servers-$(printf '%s' "$STATE_DIR" | cksum | cut -d' ' -f1)
    fi
    mkdir -p "$d"
    chmod 755 "$d"
    printf '%s' "$d"
}

# Take an exclusive lock so that concurrent `up`/`down` calls don't race.
# Servers are started with `9>&-` so they don't inherit (and hold) it.
take_lock() {
    mkdir -p "$STATE_DIR"
    STATE_DIR=$(cd "$STATE_DIR" && pwd)
    exec 9>"$STATE_DIR/.lock"
    flock 9
}

# --------------------------------------------------------------- install ---

zk_installed() {
    local j
    command -v java >/dev/null || return 1
    for j in "${ZK_JARS[@]}"; do [[ -f $j ]] || return 1; done
}

# Install, with apt, only the packages whose programs/jars are missing.
install_missing() {
    local pkgs=()
    command -v redis-server >/dev/null && command -v redis-cli >/dev/null || pkgs+=(redis-server)
    command -v openssl >/dev/null || pkgs+=(openssl)
    zk_installed || pkgs+=(zookeeper)
    # The ZooKeeper tests compile Java programs: Curator beside dlock, and a
    # server whose sequence counters start near their end.
    command -v javac >/dev/null || pkgs+=(default-jdk-headless)
    [[ -f /usr/share/java/curator-recipes.jar ]] || pkgs+=(libcurator-recipes-java)
    for b in postgres pg_ctl initdb pg_isready psql; do
        [[ -x $PG_BIN/$b ]] || { pkgs+=(postgresql-15 postgresql-client-15); break; }
    done
    for b in mariadbd mariadb-install-db mariadb; do
        command -v "$b" >/dev/null || { pkgs+=(mariadb-server mariadb-client); break; }
    done
    command -v pgbouncer >/dev/null || pkgs+=(pgbouncer)
    command -v etcd >/dev/null || pkgs+=(etcd-server)
    # etcd-client (the etcd backend's gRPC client) runs protoc at build time.
    command -v protoc >/dev/null || pkgs+=(protobuf-compiler)
    # … and needs protobuf's well-known types (a recommendation of
    # protobuf-compiler, which this script installs without them).
    [[ -f /usr/include/google/protobuf/descriptor.proto ]] || pkgs+=(libprotobuf-dev)
    # The `dlock` command's tests drive `dlock watch` in a terminal.
    command -v tmux >/dev/null || pkgs+=(tmux)
    ((${#pkgs[@]})) || return 0

    [[ $(id -u) -eq 0 ]] || die "missing packages (${pkgs[*]}); run this script as root or install them"
    log "installing: ${pkgs[*]} (log: $STATE_DIR/apt.log)"
    # Don't let the packages' init scripts start their own copies on default ports.
    local own_policy=""
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod +x /usr/sbin/policy-rc.d
        own_policy=1
    fi
    local apt=(env DEBIAN_FRONTEND=noninteractive apt-get -q -y --no-install-recommends install "${pkgs[@]}")
    # Try with the current package lists first; refresh them only if that fails.
    if ! "${apt[@]}" >"$STATE_DIR/apt.log" 2>&1; then
        log "install failed with the current package lists; running apt-get update"
        if ! { apt-get -q update && "${apt[@]}"; } >>"$STATE_DIR/apt.log" 2>&1; then
            [[ -z $own_policy ]] || rm -f /usr/sbin/policy-rc.d
            tail -n 30 "$STATE_DIR/apt.log" >&2
            die "apt-get install ${pkgs[*]} failed"
        fi
    fi
    [[ -z $own_policy ]] || rm -f /usr/sbin/policy-rc.d
}

# ----------------------------------------------------------------- Redis ---

redis_dir() { printf '%s/redis/%s' "$STATE_DIR" "$1"; }
tls_dir() { printf '%s/tls' "$STATE_DIR"; }

is_cluster_port() {
    local p
    for p in "${CLUSTER_PORTS[@]}"; do [[ $1 == "$p" ]] && return 0; done
    return 1
}

# The instances the ACL user is set on.
wants_acl() { [[ $1 == "${REDIS_PORTS[0]}" || $1 == "$TLS_PORT" ]] || is_cluster_port "$1"; }

# rcli PORT ARGS...: redis-cli to our instance on PORT (over TLS for the TLS one).
rcli() {
    local port=$1 tls=()
    shift
    [[ $port != "$TLS_PORT" ]] || tls=(--tls --cacert "$(tls_dir)/ca.crt")
    redis-cli -h "$HOST" -p "$port" "${tls[@]}" "$@"
}

redis_ping() { [[ $(rcli "$1" ping 2>/dev/null) == PONG ]]; }

# Both the server and the client must have been built with TLS (Debian's are).
# A client built without it rejects --tls; a server's binary then has no
# tls-* settings at all.
redis_has_tls() {
    redis-cli --tls --version >/dev/null 2>&1 && grep -q tls-cert-file "$(command -v redis-server)"
}

# cluster_conf_check PORT CONF: a nodes.conf that Redis would refuse to load ("corrupted cluster config
# file", and it exits before writing its pid file) is moved aside, so that the
# node starts as a new one and ensure_cluster re-creates the cluster. An empty
# or missing file is fine: Redis starts a new node from it.
cluster_conf_check() {
    local port=$1 conf=$2
    [[ -s $conf ]] || return 0
    awk '$1 == "vars" { next }
         NF < 8 { bad = 1 }
         $3 ~ /(^|,)myself(,|$)/ { me++ }
         END { exit (bad || me != 1) }' "$conf" && return 0
    mv "$conf" "$conf.broken-$(date +%s)"
    log "redis:$port: unreadable cluster config moved aside to $conf.broken-*"
}

start_redis() {
    local port=$1 dir
    dir=$(redis_dir "$port")
    if ! { pid_alive "$dir/redis.pid" && redis_ping "$port"; }; then
        if ! pid_alive "$dir/redis.pid"; then
            rm -f "$dir/redis.pid"
            check_port_free "redis:$port" "$port"
            mkdir -p "$dir"
            local mode=(--port "$port")
            if is_cluster_port "$port"; then
                check_port_free "redis:$port (cluster bus)" $((port + 10000))
                cluster_conf_check "$port" "$dir/nodes-$port.conf"
                mode+=(--cluster-enabled yes --cluster-config-file "$dir/nodes-$port.conf"
                    --cluster-node-timeout 2000)
            elif [[ $port == "$REPLICA_PORT" ]]; then
                mode+=(--replicaof "$HOST" "$PRIMARY_PORT")
            elif is_sentinel_data_port "$port"; then
                local primary
                primary=$(sentinel_primary_port "$port")
                [[ $primary == "$port" ]] || mode+=(--replicaof "$HOST" "$primary")
            elif [[ $port == "$TLS_PORT" ]]; then
                local tls
                tls=$(tls_dir)
                mode=(--port 0 --tls-port "$port" --tls-cert-file "$tls/server.crt"
                    --tls-key-file "$tls/server.key" --tls-ca-cert-file "$tls/ca.crt"
                    --tls-auth-clients no)
            fi
            mark_log "$dir/redis.log"
            # shellcheck disable=SC2094  # redis only appends to its log
            redis-server "${mode[@]}" --bind "$HOST" --dir "$dir" \
                --save '' --appendonly no \
                --daemonize yes --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" \
                --enable-debug-command local \
                </dev/null >>"$dir/redis.log" 2>&1 9>&-
            log "redis:$port started"
        fi
        wait_for "redis:$port" "$dir/redis.log" "$dir/redis.pid" redis_ping "$port"
    fi
    if [[ $port == "$REPLICA_PORT" ]] \
        || { is_sentinel_data_port "$port" && [[ $(redis_role "$port") == slave ]]; }; then
        wait_for "redis:$port (replication link)" "$dir/redis.log" "$dir/redis.pid" \
            redis_replica_linked "$port"
    fi
    ! wants_acl "$port" || redis_set_acl "$port"
}

# redis_replica_linked PORT: the replica on PORT is in sync with its primary.
redis_replica_linked() { rcli "$1" info replication 2>/dev/null | grep -q '^master_link_status:up'; }

# SIGTERM makes Redis shut down cleanly (nothing to save: no persistence).
stop_redis() { stop_pid "redis:$1" "$(redis_dir "$1")/redis.pid" 10; }

check_redis_port() {
    local p
    for p in "${REDIS_PORTS[@]}" "$PRIMARY_PORT" "$REPLICA_PORT" "${CLUSTER_PORTS[@]}" "$TLS_PORT" \
        "${SENTINEL_DATA_PORTS[@]}"; do
        [[ $1 == "$p" ]] && return 0
    done
    die "not one of the project's Redis ports (${REDIS_PORTS[*]} $PRIMARY_PORT $REPLICA_PORT ${CLUSTER_PORTS[*]} $TLS_PORT ${SENTINEL_DATA_PORTS[*]}): ${1:-<none>}"
}

# --------------------------------------------------------- Redis: ACL user ---

ACL_EXTRA=()
ACL_EXTRA_DONE=""

# redis_set_acl PORT: (re)define the ACL user from scratch (`reset`), so the
# result is the same however often it runs and whatever was there before.
redis_set_acl() {
    local port=$1 c out
    if [[ -z $ACL_EXTRA_DONE ]]; then   # every instance runs the same binary
        for c in "${ACL_OPTIONAL[@]}"; do
            out=$(rcli "$port" command info "$c" 2>/dev/null | tr -d '\r\n')
            [[ -z $out ]] || ACL_EXTRA+=("+$c")
        done
        ACL_EXTRA_DONE=1
    fi
    out=$(rcli "$port" acl setuser "$ACL_USER" reset on ">$ACL_PASS" \
        "${ACL_RULES[@]}" "${ACL_EXTRA[@]}" 2>&1) || true
    [[ $out == OK ]] || die "redis:$port: ACL SETUSER $ACL_USER failed: $out"
}

# redis_acl_check PORT [REDIS-CLI-OPTION...]: as the ACL user, a script may
# write a key under the prefix and may not touch any other key. redis-cli
# exits 0 on an error reply, so the replies themselves are compared.
redis_acl_check() {
    local port=$1 ok bad
    shift
    local script="return redis.call('SET', KEYS[1], 'x', 'PX', 1000)"
    ok=$(REDISCLI_AUTH=$ACL_PASS rcli "$port" --user "$ACL_USER" "$@" \
        eval "$script" 1 '{dlock:acl-check}' 2>&1) || true
    bad=$(REDISCLI_AUTH=$ACL_PASS rcli "$port" --user "$ACL_USER" "$@" \
        eval "$script" 1 other 2>&1) || true
    [[ $ok == OK && $bad == NOPERM* ]] \
        || die "redis:$port: ACL user $ACL_USER: SET {dlock:acl-check} gave '$ok' (want OK), SET other gave '$bad' (want NOPERM)"
}

# ---------------------------------------------------------- Redis: cluster ---

cluster_info() { rcli "$1" cluster info 2>/dev/null | tr -d '\r'; }

# cluster_ok: every node serves all slots and sees the same three masters.
cluster_ok() {
    local p info
    for p in "${CLUSTER_PORTS[@]}"; do
        info=$(cluster_info "$p") || return 1
        grep -qx cluster_state:ok <<<"$info" \
            && grep -qx cluster_slots_ok:16384 <<<"$info" \
            && grep -qx cluster_known_nodes:3 <<<"$info" \
            && grep -qx cluster_size:3 <<<"$info" || return 1
    done
}

# cluster_shape: "formed" if every node knows exactly the three running nodes
# (by their current IDs and ports) and has all slots assigned (as after a
# restart from intact nodes-*.conf: it only has to settle); "new" if every
# node knows only itself and no slots; "broken" for anything else (a node that
# lost its conf came back with a new ID, a half-done create, ...).
cluster_shape() {
    local p id ids=() want info seen is_new=1 is_formed=1
    for p in "${CLUSTER_PORTS[@]}"; do
        id=$(rcli "$p" cluster myid 2>/dev/null | tr -d '\r') || id=""
        [[ -n $id ]] || die "redis:$p: CLUSTER MYID failed"
        ids+=("$id $p")
    done
    want=$(printf '%s\n' "${ids[@]}" | sort)
    for p in "${CLUSTER_PORTS[@]}"; do
        info=$(cluster_info "$p")
        seen=$(rcli "$p" cluster nodes 2>/dev/null | tr -d '\r' \
            | awk 'NF { a = $2; sub(/@.*/, "", a); sub(/.*:/, "", a); print $1, a }' | sort)
        [[ $seen == "$want" ]] && grep -qx cluster_slots_assigned:16384 <<<"$info" || is_formed=0
        grep -qx cluster_known_nodes:1 <<<"$info" \
            && grep -qx cluster_slots_assigned:0 <<<"$info" || is_new=0
    done
    if ((is_formed)); then echo formed; elif ((is_new)); then echo new; else echo broken; fi
}

# wait_cluster_ok: like wait_for, with every node's view on a timeout.
wait_cluster_ok() {
    local deadline=$((SECONDS + START_TIMEOUT)) p
    until cluster_ok; do
        if ((SECONDS >= deadline)); then
            log "redis-cluster not ok within ${START_TIMEOUT}s; what each node says:"
            for p in "${CLUSTER_PORTS[@]}"; do
                printf -- '--- %s: %s\n' "$p" "$(cluster_info "$p" \
                    | grep -E '^cluster_(state|slots_ok|known_nodes|size):' | paste -sd' ')" >&2
                rcli "$p" cluster nodes >&2 2>/dev/null || true
                tail -n 10 "$(redis_dir "$p")/redis.log" >&2 2>/dev/null || true
            done
            log "to start the cluster afresh: $0 down; rm $STATE_DIR/redis/4700?/nodes-*.conf; $0 up"
            exit 1
        fi
        sleep 0.2
    done
}

# ensure_cluster: with all three nodes running, make them one cluster that is
# ok: create it on new nodes, wait for one re-forming from its nodes-*.conf,
# and reset and re-create one whose configs don't agree (test data is lost).
ensure_cluster() {
    cluster_ok && return 0
    local shape p out nodes=() logfile=$STATE_DIR/redis/cluster-create.log
    shape=$(cluster_shape)
    case $shape in
        formed) log "redis-cluster: waiting for the cluster to settle" ;;
        new | broken)
            if [[ $shape == broken ]]; then
                log "redis-cluster: node configs don't agree; resetting the cluster"
                for p in "${CLUSTER_PORTS[@]}"; do
                    out=$(rcli "$p" flushall 2>&1 && rcli "$p" cluster reset hard 2>&1) || true
                    [[ $out == $'OK\nOK' ]] || die "redis:$p: FLUSHALL/CLUSTER RESET HARD failed: $out"
                done
            fi
            for p in "${CLUSTER_PORTS[@]}"; do nodes+=("$HOST:$p"); done
            redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes \
                </dev/null >"$logfile" 2>&1 \
                || { tail -n 30 "$logfile" >&2; die "redis-cli --cluster create failed (log: $logfile)"; }
            log "redis-cluster created (${nodes[*]})"
            ;;
    esac
    wait_cluster_ok
}

# start_cluster_node PORT (start-redis): the cluster has to be ok again only
# if all of its nodes are running; a failure test may have stopped others.
start_cluster_node() {
    local p
    start_redis "$1"
    for p in "${CLUSTER_PORTS[@]}"; do
        if ! pid_alive "$(redis_dir "$p")/redis.pid"; then
            log "redis-cluster: redis:$p is down; not waiting for cluster_state:ok"
            return 0
        fi
    done
    ensure_cluster
}

# -------------------------------------------------------------- Redis: TLS ---

# ensure_tls_certs: a throwaway CA and a server certificate for 127.0.0.1
# (IP SAN) and localhost (DNS SAN), EC P-256, valid for 10 years, made once.
# A missing server certificate is re-issued by the existing CA; a missing CA
# means a new CA and a new server certificate. Returns 1 if it made nothing.
ensure_tls_certs() {
    local dir new have_ca=1
    dir=$(tls_dir)
    mkdir -p "$dir"
    [[ -s $dir/ca.crt && -s $dir/ca.key ]] || have_ca=0
    [[ $have_ca == 1 && -s $dir/server.crt && -s $dir/server.key ]] && return 1
    new=$(mktemp -d "$dir/.new.XXXXXX")
    (
        umask 077
        cd "$new"
        if [[ $have_ca == 0 ]]; then
            cat >ca.cnf <<'EOF'
[req]
distinguished_name = dn
x509_extensions = ca_ext
prompt = no
[dn]
CN = dlock test CA (throwaway)
[ca_ext]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
EOF
            openssl req -x509 -new -config ca.cnf -newkey ec -pkeyopt ec_paramgen_curve:P-256 \
                -nodes -keyout ca.key -out ca.crt -days 3650
        else
            cp "$dir/ca.crt" "$dir/ca.key" .
        fi
        cat >server.cnf <<'EOF'
[req]
distinguished_name = dn
prompt = no
[dn]
CN = 127.0.0.1
[server_ext]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
EOF
        openssl req -new -config server.cnf -newkey ec -pkeyopt ec_paramgen_curve:P-256 \
            -nodes -keyout server.key -out server.csr
        openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key \
            -set_serial "0x$(openssl rand -hex 15)" -days 3650 \
            -extfile server.cnf -extensions server_ext -out server.crt
        openssl verify -CAfile ca.crt server.crt
        chmod 644 ca.crt server.crt
    ) >"$new/openssl.log" 2>&1 \
        || { tail -n 20 "$new/openssl.log" >&2; die "openssl failed making the test certificates (in $new)"; }
    mv "$new/server.key" "$new/server.crt" "$dir/"
    [[ $have_ca == 1 ]] || mv "$new/ca.key" "$new/ca.crt" "$dir/"
    rm -rf "$new"
    log "redis-tls: made $([[ $have_ca == 1 ]] || printf 'a CA and ')a server certificate in $dir"
}

# start_tls_redis [strict]: without TLS support, skip (or, if strict, fail).
start_tls_redis() {
    if ! redis_has_tls; then
        [[ -z ${1:-} ]] || die "redis-server/redis-cli here were built without TLS"
        log "redis-tls: redis-server/redis-cli here were built without TLS; skipping redis:$TLS_PORT"
        return 0
    fi
    # A running server still has the old certificate loaded.
    if ensure_tls_certs; then stop_redis "$TLS_PORT"; fi
    start_redis "$TLS_PORT"
    redis_acl_check "$TLS_PORT"
}

# --------------------------------------------------------- Redis: Sentinel ---

is_sentinel_data_port() { [[ $1 == "${SENTINEL_DATA_PORTS[0]}" || $1 == "${SENTINEL_DATA_PORTS[1]}" ]]; }

sentinel_dir() { printf '%s/sentinel/%s' "$STATE_DIR" "$1"; }

# redis_role PORT: `master`, `slave`, or nothing if it does not answer.
redis_role() { rcli "$1" role 2>/dev/null | head -n1 | tr -d '\r'; }

# sentinel_master_addr PORT: "IP PORT" of the primary the sentinel on PORT names.
sentinel_master_addr() {
    rcli "$1" sentinel get-master-addr-by-name "$SENTINEL_NAME" 2>/dev/null | tr -d '\r' | paste -sd' '
}

# sentinel_primary_port [STARTING]: the port of the current primary: the one
# a running sentinel names, else a data node (other than STARTING, which is
# about to start) that says it is a master, else the first data node.
sentinel_primary_port() {
    local p addr
    for p in "${SENTINEL_PORTS[@]}"; do
        addr=$(sentinel_master_addr "$p")
        if [[ $addr == "$HOST "* ]]; then
            printf '%s' "${addr#"$HOST "}"
            return 0
        fi
    done
    for p in "${SENTINEL_DATA_PORTS[@]}"; do
        if [[ $p != "${1:-}" && $(redis_role "$p") == master ]]; then
            printf '%s' "$p"
            return 0
        fi
    done
    printf '%s' "${SENTINEL_DATA_PORTS[0]}"
}

# sentinel_healthy: every sentinel names the same primary, which says it is a
# master with its replica linked, and each sees the other two sentinels.
sentinel_healthy() {
    local p addr first="" primary replica
    for p in "${SENTINEL_PORTS[@]}"; do
        addr=$(sentinel_master_addr "$p")
        [[ -n $addr ]] || return 1
        [[ -z $first || $addr == "$first" ]] || return 1
        first=$addr
        rcli "$p" sentinel master "$SENTINEL_NAME" 2>/dev/null | tr -d '\r' \
            | grep -A1 -x num-other-sentinels | tail -n1 | grep -qx 2 || return 1
    done
    primary=${first#"$HOST "}
    [[ $(redis_role "$primary") == master ]] || return 1
    for replica in "${SENTINEL_DATA_PORTS[@]}"; do
        [[ $replica == "$primary" ]] || redis_replica_linked "$replica" || return 1
    done
}

sentinel_ping() { [[ $(rcli "$1" ping 2>/dev/null) == PONG ]]; }

# start_sentinel PORT: a fresh config file at every start (sentinels rewrite
# theirs), with a fixed ID per port, so that a restarted sentinel is not
# counted twice by the others.
start_sentinel() {
    local port=$1 dir primary id
    dir=$(sentinel_dir "$port")
    if pid_alive "$dir/sentinel.pid" && sentinel_ping "$port"; then return 0; fi
    if ! pid_alive "$dir/sentinel.pid"; then
        rm -f "$dir/sentinel.pid"
        check_port_free "sentinel:$port" "$port"
        mkdir -p "$dir"
        primary=$(sentinel_primary_port)
        id=$(printf 'dlock-sentinel-%s' "$port" | sha1sum | cut -c1-40)
        cat >"$dir/sentinel.conf" <<EOF
port $port
bind $HOST
daemonize yes
pidfile $dir/sentinel.pid
logfile $dir/sentinel.log
dir $dir
sentinel myid $id
sentinel announce-ip $HOST
sentinel monitor $SENTINEL_NAME $HOST $primary 2
sentinel down-after-milliseconds $SENTINEL_NAME 1000
sentinel failover-timeout $SENTINEL_NAME 5000
sentinel parallel-syncs $SENTINEL_NAME 1
EOF
        mark_log "$dir/sentinel.log"
        redis-server "$dir/sentinel.conf" --sentinel </dev/null >>"$dir/sentinel.log" 2>&1 9>&-
        log "sentinel:$port started (primary: $primary)"
    fi
    wait_for "sentinel:$port" "$dir/sentinel.log" "$dir/sentinel.pid" sentinel_ping "$port"
}

stop_sentinel() { stop_pid "sentinel:$1" "$(sentinel_dir "$1")/sentinel.pid" 10; }

# start_sentinels: the data nodes (the primary first), then the sentinels,
# then wait until they agree and the replica is linked.
start_sentinels() {
    local p primary
    primary=$(sentinel_primary_port)
    start_redis "$primary"
    for p in "${SENTINEL_DATA_PORTS[@]}"; do [[ $p == "$primary" ]] || start_redis "$p"; done
    for p in "${SENTINEL_PORTS[@]}"; do start_sentinel "$p"; done
    wait_for redis-sentinel "$(sentinel_dir "${SENTINEL_PORTS[0]}")/sentinel.log" "" sentinel_healthy
}

stop_sentinels() {
    local p
    for p in "${SENTINEL_PORTS[@]}"; do stop_sentinel "$p"; done
    for p in "${SENTINEL_DATA_PORTS[@]}"; do stop_redis "$p"; done
}

# ------------------------------------------------------------- ZooKeeper ---

zk_ruok() {
    # shellcheck disable=SC2016  # $0/$1 expand in the inner bash
    [[ $(timeout 3 bash -c 'exec 3<>"/dev/tcp/$0/$1" && printf ruok >&3 && cat <&3' \
        "$HOST" "$ZK_PORT" 2>/dev/null) == imok ]]
}

start_zookeeper() {
    local dir=$STATE_DIR/zookeeper
    local pidfile=$dir/zookeeper.pid logfile=$dir/zookeeper.log
    if pid_alive "$pidfile" && zk_ruok; then return 0; fi
    if ! pid_alive "$pidfile"; then
        rm -f "$pidfile"
        check_port_free zookeeper "$ZK_PORT"
        mkdir -p "$dir/data"
        cat >"$dir/zoo.cfg" <<EOF
tickTime=2000
minSessionTimeout=1000
maxSessionTimeout=60000
dataDir=$dir/data
clientPort=$ZK_PORT
clientPortAddress=$HOST
maxClientCnxns=0
forceSync=no
admin.enableServer=false
4lw.commands.whitelist=ruok,srvr,stat,mntr
EOF
        # zookeeper.jar's manifest Class-Path names its other Debian jars;
        # slf4j-simple is the logging backend (it logs to stderr).
        mark_log "$logfile"
        local cp
        cp=$(IFS=:; printf '%s' "${ZK_JARS[*]}")
        setsid java -Xmx256m -XX:+UseSerialGC -Dorg.slf4j.simpleLogger.showDateTime=true \
            -cp "$cp" org.apache.zookeeper.server.ZooKeeperServerMain "$dir/zoo.cfg" \
            </dev/null >>"$logfile" 2>&1 9>&- &
        echo $! >"$pidfile"
        log "zookeeper:$ZK_PORT started"
    fi
    wait_for zookeeper "$logfile" "$pidfile" zk_ruok
}

stop_zookeeper() { stop_pid zookeeper "$STATE_DIR/zookeeper/zookeeper.pid" 20; }

# ------------------------------------------------------------ PostgreSQL ---

PG_URL="postgres://dlock:dlock@$HOST:$PG_PORT/dlock"

# Postgres refuses to run as root, so its files must be reachable by the
# `postgres` user. If the state dir isn't (say, a repo under /root), keep the
# cluster under /tmp and leave a symlink to it in the state dir.
pg_dir() { postgres_owned_dir postgres; }

# postgres_owned_dir NAME: <state>/NAME, owned by and reachable for the
# `postgres` user (or a symlink to such a directory under /tmp).
postgres_owned_dir() {
    local d=$STATE_DIR/$1
    if [[ -L $d ]]; then
        mkdir -p "$(readlink "$d")"   # /tmp may have been cleaned
    elif [[ ! -e $d ]] && ! as_postgres test -x "$STATE_DIR"; then
        local real
        real=/tmp/dlock-servers-$(printf '%s' "$STATE_DIR" | cksum | cut -d' ' -f1)-$1
        mkdir -p "$real"
        ln -s "$real" "$d"
    fi
    mkdir -p "$d"
    d=$(readlink -f "$d")   # postgres must not have to traverse the symlink's dir
    chown postgres:postgres "$d"
    printf '%s' "$d"
}

pg_ready() { "$PG_BIN/pg_isready" -q -h "$HOST" -p "$PG_PORT"; }
pg_pidfile() { printf '%s/data/postmaster.pid' "$1"; }

start_postgres() {
    local dir
    dir=$(pg_dir)
    local data=$dir/data logfile=$dir/postgres.log
    if pid_alive "$(pg_pidfile "$dir")" && pg_ready; then
        pg_ensure_db
        return 0
    fi
    if ! pid_alive "$(pg_pidfile "$dir")"; then
        check_port_free postgres "$PG_PORT"
        rm -f "$(pg_pidfile "$dir")"   # stale: its pid is gone or is not postgres
        if [[ ! -f $data/PG_VERSION ]]; then
            rm -rf "$data"
            as_postgres "$PG_BIN/initdb" -D "$data" --auth=trust --username=postgres \
                --encoding=UTF8 --locale=C --no-sync >"$dir/initdb.log" 2>&1 \
                || { tail -n 20 "$dir/initdb.log" >&2; die "postgres initdb failed"; }
            # Test-only tuning: durability is not wanted here, speed is.
            cat >>"$data/postgresql.conf" <<EOF

# --- dlock test server ---
fsync = off
full_page_writes = off
max_connections = 300
include_if_exists = 'dlock-runtime.conf'
EOF
        fi
        # Rewritten on each start so that a moved state dir still works.
        local sock
        sock=$(socket_dir)/postgres
        mkdir -p "$sock"
        chown postgres:postgres "$sock"
        cat >"$data/dlock-runtime.conf" <<EOF
listen_addresses = '$HOST'
port = $PG_PORT
unix_socket_directories = '$sock'
# Commits reach the OS before they are acknowledged (no fsync: fsync = off),
# so a SIGKILL of the server (the restart tests) loses nothing committed.
# With synchronous_commit = off the last ~0.6 s of commits -- a table created
# at the start of a test -- would vanish with the process.
synchronous_commit = on
EOF
        chown postgres:postgres "$data/dlock-runtime.conf"
        mark_log "$logfile"
        chown postgres:postgres "$logfile"
        as_postgres "$PG_BIN/pg_ctl" start -D "$data" -l "$logfile" -W \
            </dev/null >/dev/null 2>&1 9>&- \
            || { tail -n 20 "$logfile" >&2; die "pg_ctl start failed"; }
        log "postgres:$PG_PORT started"
    fi
    wait_for postgres "$logfile" "$(pg_pidfile "$dir")" pg_ready
    pg_ensure_db
}

# Create role and database `dlock` (password `dlock`) unless they already work,
# and the role `dlock_reader` (password `dlock_reader`): a login without
# rights beyond what a test grants it (an operator who may not end sessions).
pg_ensure_db() {
    "$PG_BIN/psql" -h "$HOST" -p "$PG_PORT" -U postgres -d postgres -qAt -v ON_ERROR_STOP=1 >/dev/null <<'SQL' \
        || die "postgres: cannot create the role dlock_reader"
DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'dlock_reader') THEN
    CREATE ROLE dlock_reader LOGIN PASSWORD 'dlock_reader';
  END IF;
END $$;
SQL
    "$PG_BIN/psql" "$PG_URL" -qAtc 'select 1' >/dev/null 2>&1 && return 0
    "$PG_BIN/psql" -h "$HOST" -p "$PG_PORT" -U postgres -d postgres -qAt -v ON_ERROR_STOP=1 >/dev/null <<'SQL'
DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'dlock') THEN
    CREATE ROLE dlock LOGIN PASSWORD 'dlock';
  END IF;
END $$;
ALTER ROLE dlock LOGIN PASSWORD 'dlock';
SELECT 'CREATE DATABASE dlock OWNER dlock' WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'dlock')\gexec
SQL
    "$PG_BIN/psql" "$PG_URL" -qAtc 'select 1' >/dev/null || die "postgres: cannot connect as dlock"
    log "postgres: role and database dlock ready"
}

# SIGINT is PostgreSQL's "fast" shutdown (what `pg_ctl stop -m fast` sends).
stop_postgres() { stop_pid postgres "$STATE_DIR/postgres/data/postmaster.pid" 30 INT; }

# kill_postgres: a crash. SIGKILL to the postmaster and, at once, to its
# children (backends killed with their postmaster would otherwise linger and
# keep the shared memory that a restart needs). The next start recovers.
kill_postgres() {
    local pidfile=$STATE_DIR/postgres/data/postmaster.pid pid children p
    pid_alive "$pidfile" || return 0
    pid=$(head -n1 "$pidfile")
    children=$(ps -o pid= --ppid "$pid" 2>/dev/null | tr -s ' \n' ' ') || children=""
    # shellcheck disable=SC2086  # a list of pids
    kill -KILL "$pid" $children 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    for p in $children; do
        while kill -0 "$p" 2>/dev/null; do sleep 0.1; done
    done
    log "postgres (pid $pid) killed"
}

# ------------------------------------------------------------- PgBouncer ---

# Two PgBouncer instances in front of the PostgreSQL server above, for the
# tests of dlock behind a pooler: pool_mode = session on PGB_SESSION_PORT,
# pool_mode = transaction on PGB_TRANSACTION_PORT. Clients log in as
# dlock/dlock (SCRAM, checked by PgBouncer against its users file); PgBouncer
# logs in to PostgreSQL as dlock (trust). sqlx sends `extra_float_digits` and
# dlock sends `options` at startup, which PgBouncer refuses unless told to
# ignore them (ignored `options` never reach PostgreSQL). PgBouncer refuses to
# run as root: it runs as `postgres`, its files under <state>/pgbouncer.

pgb_url() { printf 'postgres://dlock:dlock@%s:%s/dlock' "$HOST" "$1"; }
pgb_ready() { "$PG_BIN/psql" "$(pgb_url "$1")" -qAtc 'select 1' >/dev/null 2>&1; }

# start_pgbouncer_instance POOL_MODE PORT POOL_SIZE
start_pgbouncer_instance() {
    local pool_mode=$1 port=$2 pool_size=$3 base
    base=$(postgres_owned_dir pgbouncer)
    local dir=$base/$pool_mode
    local pidfile=$dir/pgbouncer.pid logfile=$dir/pgbouncer.log
    if pid_alive "$pidfile" && pgb_ready "$port"; then return 0; fi
    if ! pid_alive "$pidfile"; then
        rm -f "$pidfile"
        check_port_free "pgbouncer-$pool_mode" "$port"
        mkdir -p "$dir"
        printf '"dlock" "dlock"\n' >"$base/userlist.txt"
        cat >"$dir/pgbouncer.ini" <<EOF
[databases]
dlock = host=$HOST port=$PG_PORT dbname=dlock user=dlock

[pgbouncer]
listen_addr = $HOST
listen_port = $port
unix_socket_dir =
auth_type = scram-sha-256
auth_file = $base/userlist.txt
pool_mode = $pool_mode
default_pool_size = $pool_size
max_client_conn = 1000
ignore_startup_parameters = extra_float_digits,options
logfile = $logfile
pidfile = $pidfile
EOF
        chown -R postgres:postgres "$base"
        chmod 600 "$base/userlist.txt"
        mark_log "$logfile"
        chown postgres:postgres "$logfile"
        as_postgres pgbouncer -d "$dir/pgbouncer.ini" </dev/null >>"$logfile" 2>&1 9>&- \
            || { tail -n 20 "$logfile" >&2; die "pgbouncer-$pool_mode failed to start"; }
        log "pgbouncer-$pool_mode:$port started"
    fi
    wait_for "pgbouncer-$pool_mode" "$logfile" "$pidfile" pgb_ready "$port"
}

# Needs PostgreSQL up (PgBouncer answers only once it reaches the server).
start_pgbouncer() {
    pg_ready || die "pgbouncer: PostgreSQL is not up on $HOST:$PG_PORT"
    # Session pooling pins a server connection per client connection: room
    # for the tests' pools. Transaction pooling shares a few.
    start_pgbouncer_instance session "$PGB_SESSION_PORT" 64
    start_pgbouncer_instance transaction "$PGB_TRANSACTION_PORT" 4
}

# SIGTERM: PgBouncer 1.18's immediate shutdown (clients are disconnected).
stop_pgbouncer() {
    local pool_mode
    for pool_mode in session transaction; do
        stop_pid "pgbouncer-$pool_mode" "$STATE_DIR/pgbouncer/$pool_mode/pgbouncer.pid" 10
    done
}

# --------------------------------------------------------------- MariaDB ---

mysql_dlock() {
    mariadb --protocol=tcp -h "$HOST" -P "$MYSQL_PORT" -u dlock --password=dlock dlock "$@"
}
mysql_ready() { mysql_dlock -Nse 'select 1'; }

start_mariadb() {
    local dir=$STATE_DIR/mariadb
    local data=$dir/data pidfile=$dir/mariadb.pid logfile=$dir/mariadb.log
    if pid_alive "$pidfile" && mysql_ready >/dev/null 2>&1; then return 0; fi
    if ! pid_alive "$pidfile"; then
        rm -f "$pidfile"
        check_port_free mariadb "$MYSQL_PORT"
        mkdir -p "$dir"
        if [[ ! -d $data/mysql ]]; then
            rm -rf "$data"
            mariadb-install-db --no-defaults --datadir="$data" --user=root \
                --auth-root-authentication-method=socket --skip-test-db \
                >"$dir/install-db.log" 2>&1 \
                || { tail -n 20 "$dir/install-db.log" >&2; die "mariadb-install-db failed"; }
        fi
        # Run at every start (idempotent): root only has unix-socket auth, so
        # this is where the TCP user for the tests comes from. GET_LOCK and
        # friends need no privilege.
        cat >"$dir/init.sql" <<'SQL'
CREATE DATABASE IF NOT EXISTS dlock;
CREATE USER IF NOT EXISTS 'dlock'@'%' IDENTIFIED BY 'dlock';
CREATE USER IF NOT EXISTS 'dlock'@'localhost' IDENTIFIED BY 'dlock';
ALTER USER 'dlock'@'%' IDENTIFIED BY 'dlock';
ALTER USER 'dlock'@'localhost' IDENTIFIED BY 'dlock';
GRANT ALL PRIVILEGES ON dlock.* TO 'dlock'@'%';
GRANT ALL PRIVILEGES ON dlock.* TO 'dlock'@'localhost';
GRANT PROCESS ON *.* TO 'dlock'@'%';
GRANT PROCESS ON *.* TO 'dlock'@'localhost';
CREATE USER IF NOT EXISTS 'dlock_reader'@'%' IDENTIFIED BY 'dlock_reader';
GRANT SELECT ON dlock.* TO 'dlock_reader'@'%';
SQL
        mark_log "$logfile"
        setsid mariadbd --no-defaults --datadir="$data" --user=root \
            --port="$MYSQL_PORT" --bind-address="$HOST" --socket="$(socket_dir)/mariadb.sock" \
            --pid-file="$pidfile" --log-error="$logfile" --init-file="$dir/init.sql" \
            --skip-name-resolve --skip-log-bin --max-connections=300 \
            --innodb-buffer-pool-size=64M --innodb-flush-log-at-trx-commit=2 \
            </dev/null >>"$logfile" 2>&1 9>&- &
        # mariadbd writes its pid file itself, but only once it is up.
        echo $! >"$pidfile"
        log "mariadb:$MYSQL_PORT started"
    fi
    wait_for mariadb "$logfile" "$pidfile" mysql_ready
}

stop_mariadb() { stop_pid mariadb "$STATE_DIR/mariadb/mariadb.pid" 60; }

# kill_mariadb: a crash (SIGKILL); InnoDB recovers at the next start.
kill_mariadb() {
    local pidfile=$STATE_DIR/mariadb/mariadb.pid pid
    pid_alive "$pidfile" || { rm -f "$pidfile"; return 0; }
    pid=$(head -n1 "$pidfile")
    kill -KILL "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    rm -f "$pidfile"
    log "mariadb (pid $pid) killed"
}

# ------------------------------------------------------------------ URLs ---

print_urls() {
    local nodes=() p
    for p in "${REDIS_PORTS[@]}"; do nodes+=("$HOST:$p"); done
    printf 'DLOCK_TEST_REDIS_URL=redis://%s:%s/\n' "$HOST" "${REDIS_PORTS[0]}"
    printf 'DLOCK_TEST_REDLOCK_URL=redlock://%s\n' "$(IFS=,; printf '%s' "${nodes[*]}")"
    printf 'DLOCK_TEST_ZK_URL=zk://%s:%s/dlock-test\n' "$HOST" "$ZK_PORT"
    printf 'DLOCK_TEST_ETCD_URL=%s\n' "$(etcd_url)"
    printf 'DLOCK_TEST_POSTGRES_URL=%s\n' "$PG_URL"
    printf 'DLOCK_TEST_PGBOUNCER_SESSION_URL=%s\n' "$(pgb_url "$PGB_SESSION_PORT")"
    printf 'DLOCK_TEST_PGBOUNCER_TRANSACTION_URL=%s\n' "$(pgb_url "$PGB_TRANSACTION_PORT")"
    printf 'DLOCK_TEST_MYSQL_URL=mysql://dlock:dlock@%s:%s/dlock\n' "$HOST" "$MYSQL_PORT"
    nodes=()
    for p in "${CLUSTER_PORTS[@]}"; do nodes+=("$HOST:$p"); done
    printf 'DLOCK_TEST_REDIS_CLUSTER_URL=redis+cluster://%s\n' "$(IFS=,; printf '%s' "${nodes[*]}")"
    printf 'DLOCK_TEST_REDIS_ACL_URL=redis://%s:%s@%s:%s/\n' "$ACL_USER" "$ACL_PASS" "$HOST" "${REDIS_PORTS[0]}"
    printf 'DLOCK_TEST_REDIS_PRIMARY_URL=redis://%s:%s/\n' "$HOST" "$PRIMARY_PORT"
    printf 'DLOCK_TEST_REDIS_REPLICA_URL=redis://%s:%s/\n' "$HOST" "$REPLICA_PORT"
    nodes=()
    for p in "${SENTINEL_PORTS[@]}"; do nodes+=("$HOST:$p"); done
    printf 'DLOCK_TEST_REDIS_SENTINEL_URL=redis+sentinel://%s/%s\n' "$(IFS=,; printf '%s' "${nodes[*]}")" "$SENTINEL_NAME"
    if redis_has_tls; then
        printf 'DLOCK_TEST_REDIS_TLS_URL=rediss://%s:%s/\n' "$HOST" "$TLS_PORT"
        printf 'DLOCK_TEST_REDIS_TLS_CA=%s/ca.crt\n' "$(tls_dir)"
    fi
}

# ------------------------------------------------------------------ etcd ---

etcd_dir() { printf '%s/etcd/m%s' "$STATE_DIR" "$1"; }
etcd_client_port() { printf '%s' "${ETCD_CLIENT_PORTS[$1]}"; }
etcd_peer_port() { printf '%s' $((${ETCD_CLIENT_PORTS[$1]} + 1)); }

check_etcd_member() {
    [[ ${1:-} =~ ^[0-2]$ ]] || die "expected an etcd member index (0, 1 or 2), got '${1:-}'"
}

# etcd_healthy I: member I answers and sees a leader.
etcd_healthy() {
    curl -fsS --max-time 2 "http://$HOST:$(etcd_client_port "$1")/health" 2>/dev/null \
        | grep -q '"health":"true"'
}

# etcd_answers I: member I's client port answers HTTP (a member alone, with
# no quorum, answers but is not healthy).
etcd_answers() { curl -sS --max-time 2 -o /dev/null "http://$HOST:$(etcd_client_port "$1")/version"; }

# start_etcd_member I: starts member I (joining the cluster the first time,
# rejoining with its data dir after). Does not wait for a quorum.
start_etcd_member() {
    local i=$1 dir cluster="" j
    dir=$(etcd_dir "$i")
    local pidfile=$dir/etcd.pid logfile=$dir/etcd.log
    if pid_alive "$pidfile"; then return 0; fi
    rm -f "$pidfile"
    check_port_free "etcd:$(etcd_client_port "$i")" "$(etcd_client_port "$i")"
    mkdir -p "$dir"
    for j in 0 1 2; do
        cluster+="${cluster:+,}m$j=http://$HOST:$(etcd_peer_port "$j")"
    done
    mark_log "$logfile"
    setsid etcd --name "m$i" --data-dir "$dir/data" \
        --listen-client-urls "http://$HOST:$(etcd_client_port "$i")" \
        --advertise-client-urls "http://$HOST:$(etcd_client_port "$i")" \
        --listen-peer-urls "http://$HOST:$(etcd_peer_port "$i")" \
        --initial-advertise-peer-urls "http://$HOST:$(etcd_peer_port "$i")" \
        --initial-cluster "$cluster" --initial-cluster-token dlock-test \
        --initial-cluster-state new --unsafe-no-fsync \
        </dev/null >>"$logfile" 2>&1 9>&- &
    echo $! >"$pidfile"
    log "etcd:$(etcd_client_port "$i") started"
}

start_etcd() {
    local i
    for i in 0 1 2; do start_etcd_member "$i"; done
    for i in 0 1 2; do
        wait_for "etcd:$(etcd_client_port "$i")" "$(etcd_dir "$i")/etcd.log" \
            "$(etcd_dir "$i")/etcd.pid" etcd_healthy "$i"
    done
}

# stop_etcd_member I [kill]
stop_etcd_member() {
    local sig=TERM
    [[ ${2:-} == kill ]] && sig=KILL
    stop_pid "etcd:$(etcd_client_port "$1")" "$(etcd_dir "$1")/etcd.pid" 20 "$sig"
}

stop_etcd() {
    local i
    for i in 0 1 2; do stop_etcd_member "$i"; done
}

etcd_url() {
    local eps=() i
    for i in 0 1 2; do eps+=("$HOST:$(etcd_client_port "$i")"); done
    printf 'etcd://%s/dlock-test' "$(IFS=,; printf '%s' "${eps[*]}")"
}

# ------------------------------------------------------------- commands ---

# The project's ports (42000-48999: the servers here and the ones tests start
# on ports of their own; 57000-57999: the cluster bus) lie inside Linux's
# ephemeral range (32768-60999), so an outgoing connection could take one as
# its source port just when a server starts on it ("Address already in use").
# Reserve them (never handed out as source ports; needs root, else a warning).
reserve_ports() {
    local want=42000-48999,57000-57999 file=/proc/sys/net/ipv4/ip_local_reserved_ports
    [[ -r $file && $(cat "$file") == *"$want"* ]] && return 0
    if ! { [[ -w $file ]] && printf '%s\n' "$want" >"$file"; } 2>/dev/null; then
        log "warning: could not reserve ports $want (not root?): a test server may find its port taken"
    fi
}

cmd_up() {
    take_lock
    install_missing
    reserve_ports
    local p
    for p in "${REDIS_PORTS[@]}"; do start_redis "$p"; done
    redis_acl_check "${REDIS_PORTS[0]}"
    start_redis "$PRIMARY_PORT"
    start_redis "$REPLICA_PORT"
    for p in "${CLUSTER_PORTS[@]}"; do start_redis "$p"; done
    ensure_cluster
    redis_acl_check "${CLUSTER_PORTS[0]}" -c
    start_tls_redis
    start_sentinels
    start_zookeeper
    start_postgres
    start_pgbouncer
    start_mariadb
    start_etcd
    print_urls >"$STATE_DIR/urls.env.tmp"
    mv "$STATE_DIR/urls.env.tmp" "$STATE_DIR/urls.env"
    cat "$STATE_DIR/urls.env"
}

cmd_down() {
    take_lock
    local p
    for p in "${REDIS_PORTS[@]}" "$REPLICA_PORT" "$PRIMARY_PORT" "${CLUSTER_PORTS[@]}" "$TLS_PORT"; do
        stop_redis "$p"
    done
    stop_sentinels
    stop_zookeeper
    stop_pgbouncer
    stop_postgres
    stop_mariadb
    stop_etcd
}

cmd_status() {
    local all_up=0 p
    report() { # NAME PIDFILE CHECK...
        local name=$1 pidfile=$2
        shift 2
        if pid_alive "$pidfile" && "$@" >/dev/null 2>&1; then
            printf '%-16s up   (pid %s)\n' "$name" "$(head -n1 "$pidfile")"
        else
            printf '%-16s down\n' "$name"
            all_up=1
        fi
    }
    for p in "${REDIS_PORTS[@]}" "$PRIMARY_PORT"; do
        report "redis:$p" "$(redis_dir "$p")/redis.pid" redis_ping "$p"
    done
    report "redis:$REPLICA_PORT" "$(redis_dir "$REPLICA_PORT")/redis.pid" \
        redis_replica_linked "$REPLICA_PORT"

    for p in "${CLUSTER_PORTS[@]}"; do
        report "redis:$p" "$(redis_dir "$p")/redis.pid" redis_ping "$p"
    done
    if cluster_ok; then
        printf '%-16s ok\n' redis-cluster
    else
        printf '%-16s not ok\n' redis-cluster
        all_up=1
    fi
    if redis_has_tls; then
        report "redis-tls:$TLS_PORT" "$(redis_dir "$TLS_PORT")/redis.pid" redis_ping "$TLS_PORT"
    else
        printf '%-16s skipped (no TLS in this Redis build)\n' "redis-tls:$TLS_PORT"
    fi
    for p in "${SENTINEL_DATA_PORTS[@]}"; do
        report "redis:$p" "$(redis_dir "$p")/redis.pid" redis_ping "$p"
    done
    for p in "${SENTINEL_PORTS[@]}"; do
        report "sentinel:$p" "$(sentinel_dir "$p")/sentinel.pid" sentinel_ping "$p"
    done
    if sentinel_healthy; then
        printf '%-16s ok (primary %s)\n' redis-sentinel "$(sentinel_master_addr "${SENTINEL_PORTS[0]}")"
    else
        printf '%-16s not ok\n' redis-sentinel
        all_up=1
    fi
    report "zookeeper:$ZK_PORT" "$STATE_DIR/zookeeper/zookeeper.pid" zk_ruok
    report "postgres:$PG_PORT" "$STATE_DIR/postgres/data/postmaster.pid" pg_ready
    report "pgbouncer:$PGB_SESSION_PORT" "$STATE_DIR/pgbouncer/session/pgbouncer.pid" \
        pgb_ready "$PGB_SESSION_PORT"
    report "pgbouncer:$PGB_TRANSACTION_PORT" "$STATE_DIR/pgbouncer/transaction/pgbouncer.pid" \
        pgb_ready "$PGB_TRANSACTION_PORT"
    report "mariadb:$MYSQL_PORT" "$STATE_DIR/mariadb/mariadb.pid" mysql_ready
    for p in 0 1 2; do
        report "etcd:$(etcd_client_port "$p")" "$(etcd_dir "$p")/etcd.pid" etcd_answers "$p"
    done
    return "$all_up"
}

usage() {
    sed -n '2,17s/^# \{0,1\}//p' "${BASH_SOURCE[0]}" >&2
    exit 2
}

case ${1:-up} in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    urls) print_urls ;;
    start-redis)
        check_redis_port "${2:-}"
        take_lock
        if is_cluster_port "$2"; then
            start_cluster_node "$2"
        elif [[ $2 == "$TLS_PORT" ]]; then
            start_tls_redis strict
        else
            start_redis "$2"
        fi
        ;;
    stop-redis)
        check_redis_port "${2:-}"
        take_lock
        stop_redis "$2"
        ;;
    stop-postgres | stop-mysql)
        [[ -z ${2:-} || $2 == kill ]] || die "$1: the only option is \`kill\` (SIGKILL)"
        take_lock
        case $1:${2:-} in
            stop-postgres:) stop_postgres ;;
            stop-postgres:kill) kill_postgres ;;
            stop-mysql:) stop_mariadb ;;
            stop-mysql:kill) kill_mariadb ;;
        esac
        ;;
    start-postgres)
        take_lock
        start_postgres
        ;;
    start-mysql)
        take_lock
        start_mariadb
        ;;
    start-pgbouncer)
        take_lock
        start_pgbouncer
        ;;
    stop-pgbouncer)
        take_lock
        stop_pgbouncer
        ;;
    stop-etcd)
        check_etcd_member "${2:-}"
        [[ -z ${3:-} || $3 == kill ]] || die "$1: the only option is \`kill\` (SIGKILL)"
        take_lock
        stop_etcd_member "$2" "${3:-}"
        ;;
    start-etcd)
        check_etcd_member "${2:-}"
        take_lock
        start_etcd_member "$2"
        wait_for "etcd:$(etcd_client_port "$2")" "$(etcd_dir "$2")/etcd.log" \
            "$(etcd_dir "$2")/etcd.pid" etcd_answers "$2"
        ;;
    -h | --help | help) usage ;;
    *) usage ;;
esac
