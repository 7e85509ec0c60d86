#!/usr/bin/env bash
# A local, throw-away image registry on loopback (Debian's docker-registry, no container needed).
#
# Usage: scripts/registry.sh start|stop|status [PORT]     (default PORT 5000, on 127.0.0.1)
#   env SPARKFORGE_STATE     state root (default /tmp/sparkforge); everything for one registry
#                            lives in $SPARKFORGE_STATE/registry-PORT/ (config.yml, data/,
#                            registry.pid, registry.log)
#   env REGISTRY_TIMEOUT     seconds to wait for /v2/ to answer on start (default 30)
#
# dockerd treats 127.0.0.0/8 as an insecure registry by default, so plain HTTP push/pull to
# 127.0.0.1:PORT works with no daemon.json change.
set -euo pipefail

CMD="${1:-}"
PORT="${2:-5000}"
STATE="${SPARKFORGE_STATE:-/tmp/sparkforge}/registry-$PORT"
PIDFILE="$STATE/registry.pid"
URL="http://127.0.0.1:$PORT/v2/"
TIMEOUT="${REGISTRY_TIMEOUT:-30}"

die() { echo "registry: ERROR: $*" >&2; exit 1; }
usage() { echo "usage: $0 start|stop|status [PORT]" >&2; exit 2; }

[[ "$PORT" =~ ^[0-9]+$ ]] || usage

running_pid() {
  # Print the pid only if the pidfile names a live docker-registry (pids get reused).
  [[ -f "$PIDFILE" ]] || return 1
  local pid
  pid="$(cat "$PIDFILE")"
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 1
  grep -q docker-registry "/proc/$pid/cmdline" 2>/dev/null || return 1
  echo "$pid"
}

answers() { curl -fsS -o /dev/null --max-time 2 "$URL" 2>/dev/null; }

case "$CMD" in
start)
  command -v docker-registry >/dev/null || die "docker-registry not found (run scripts/docker-up.sh)"
  if pid="$(running_pid)"; then
    echo "registry: already running on 127.0.0.1:$PORT (pid $pid)"
    exit 0
  fi
  # Something else on the port would make our start look fine while pushes go elsewhere.
  if answers; then
    die "127.0.0.1:$PORT already answers /v2/ but is not ours (no live pid in $PIDFILE)"
  fi
  mkdir -p "$STATE/data"
  # Our own config: loopback only, no auth, deletes allowed (tests clean up after themselves).
  cat >"$STATE/config.yml" <<EOF
version: 0.1
log:
  level: info
  fields:
    service: registry
storage:
  filesystem:
    rootdirectory: $STATE/data
  delete:
    enabled: true
  cache:
    blobdescriptor: inmemory
http:
  addr: 127.0.0.1:$PORT
  headers:
    X-Content-Type-Options: [nosniff]
EOF
  # setsid: the registry must outlive this script and not get the caller's Ctrl-C.
  setsid docker-registry serve "$STATE/config.yml" >>"$STATE/registry.log" 2>&1 </dev/null &
  started=$!
  echo "$started" >"$PIDFILE"
  deadline=$((SECONDS + TIMEOUT))
  until answers; do
    # Liveness only: right after the fork the child may not have exec'd docker-registry yet, so
    # its command line (which running_pid checks) can still be this script's.
    if ! kill -0 "$started" 2>/dev/null; then
      tail -n 20 "$STATE/registry.log" >&2 || true
      rm -f "$PIDFILE"
      die "docker-registry exited during start-up (log: $STATE/registry.log)"
    fi
    if ((SECONDS >= deadline)); then
      tail -n 20 "$STATE/registry.log" >&2 || true
      die "registry did not answer $URL within ${TIMEOUT}s (pid $(cat "$PIDFILE") left running)"
    fi
    sleep 0.2
  done
  echo "registry: running on 127.0.0.1:$PORT (pid $(cat "$PIDFILE"), data $STATE/data)"
  echo "registry: push with: docker tag IMAGE 127.0.0.1:$PORT/NAME:TAG && docker push 127.0.0.1:$PORT/NAME:TAG"
  echo "registry: stop with: $0 stop $PORT"
  ;;
stop)
  if ! pid="$(running_pid)"; then
    rm -f "$PIDFILE"
    echo "registry: not running on port $PORT"
    exit 0
  fi
  kill -TERM "$pid"
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  # Still there after 5 s: it is hung, a graceful shutdown is no longer worth waiting for.
  kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  rm -f "$PIDFILE"
  echo "registry: stopped (pid $pid); data kept in $STATE/data"
  ;;
status)
  if pid="$(running_pid)"; then
    if answers; then
      echo "registry: running on 127.0.0.1:$PORT (pid $pid)"
    else
      echo "registry: pid $pid alive but $URL does not answer"
      exit 1
    fi
  else
    echo "registry: not running on port $PORT"
    exit 3
  fi
  ;;
*) usage ;;
esac
