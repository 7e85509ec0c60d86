#!/usr/bin/env bash
# A throw-away image registry (Debian's docker-registry, no container needed), on loopback or on
# a LAN address of the head, over plain HTTP or TLS.
#
# Usage: scripts/registry.sh start|stop|status [PORT | ADDR:PORT] [--cert FILE --key FILE] [--ca FILE]
#                                               [--address HOST:PORT]
#   PORT              listen on 127.0.0.1:PORT (default 5000)
#   ADDR:PORT         listen on ADDR:PORT, e.g. 0.0.0.0:5000 (every address of the head) or 10.0.0.1:5000
#   --cert/--key      serve TLS with this certificate (it must name the address nodes pull from) and key
#   --ca              the CA that signed --cert, used to check the registry answers after start
#   --address         the address nodes use (HOST:PORT), used for that check (default: the listen
#                     address; 127.0.0.1 when listening on 0.0.0.0)
#   env SPARKFORGE_STATE     state root (default /tmp/sparkforge); everything for one registry
#                            lives in $SPARKFORGE_STATE/registry-PORT/ (config.yml, data/,
#                            registry.pid, registry.log)
#   env REGISTRY_TIMEOUT     seconds to wait for /v2/ to answer on start (default 30)
#
# dockerd treats 127.0.0.0/8 as an insecure registry by default, so plain HTTP on 127.0.0.1:PORT
# works with no daemon.json change. On a LAN address every node needs either the CA in
# /etc/docker/certs.d/HOST:PORT/ca.crt (TLS) or HOST:PORT in "insecure-registries" (plain HTTP).
set -euo pipefail

CMD="${1:-}"
shift || true
LISTEN="127.0.0.1:5000"
CERT="" KEY="" CA="" ADDRESS=""
usage() { echo "usage: $0 start|stop|status [PORT | ADDR:PORT] [--cert FILE --key FILE] [--ca FILE] [--address HOST:PORT]" >&2; exit 2; }
if [[ $# -gt 0 && "$1" != --* ]]; then
  if [[ "$1" == *:* ]]; then LISTEN="$1"; else LISTEN="127.0.0.1:$1"; fi
  shift
fi
while [[ $# -gt 0 ]]; do
  case "$1" in
  --cert) CERT="${2:-}"; shift 2 || usage ;;
  --key) KEY="${2:-}"; shift 2 || usage ;;
  --ca) CA="${2:-}"; shift 2 || usage ;;
  --address) ADDRESS="${2:-}"; shift 2 || usage ;;
  *) usage ;;
  esac
done
PORT="${LISTEN##*:}"
HOST="${LISTEN%:*}"
[[ "$PORT" =~ ^[0-9]+$ && "$HOST" =~ ^[0-9.]+$ ]] || usage
[[ -z "$CERT" && -z "$KEY" ]] || [[ -n "$CERT" && -n "$KEY" ]] || { echo "registry: ERROR: --cert and --key go together" >&2; exit 2; }
for f in "$CERT" "$KEY" "$CA"; do
  [[ -z "$f" || -r "$f" ]] || { echo "registry: ERROR: cannot read $f" >&2; exit 2; }
done
if [[ -z "$ADDRESS" ]]; then
  if [[ "$HOST" == 0.0.0.0 ]]; then ADDRESS="127.0.0.1:$PORT"; else ADDRESS="$LISTEN"; fi
fi
STATE="${SPARKFORGE_STATE:-/tmp/sparkforge}/registry-$PORT"
PIDFILE="$STATE/registry.pid"
SCHEME=http
[[ -n "$CERT" ]] && SCHEME=https
URL="$SCHEME://$ADDRESS/v2/"
TIMEOUT="${REGISTRY_TIMEOUT:-30}"

die() { echo "registry: ERROR: $*" >&2; exit 1; }

running_pid() {
  # Print the pid only if the pidfile names a live docker-registry (pids get reused).
  [[ -f "$PIDFILE" ]] || return 1
  local pid
  pid="$(cat "$PIDFILE")"
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 1
  grep -q docker-registry "/proc/$pid/cmdline" 2>/dev/null || return 1
  echo "$pid"
}

answers() {
  local trust=()
  [[ -n "$CA" ]] && trust=(--cacert "$CA")
  curl -fsS -o /dev/null --max-time 2 "${trust[@]}" "$URL" 2>/dev/null
}

case "$CMD" in
start)
  command -v docker-registry >/dev/null || die "docker-registry not found (Debian package docker-registry)"
  if pid="$(running_pid)"; then
    echo "registry: already running on $LISTEN (pid $pid)"
    exit 0
  fi
  # Something else on the port would make our start look fine while pushes go elsewhere.
  if answers; then
    die "$ADDRESS already answers /v2/ but is not ours (no live pid in $PIDFILE)"
  fi
  mkdir -p "$STATE/data"
  # Our own config: the given address only, no auth, deletes allowed (tests clean up after themselves).
  TLS=""
  if [[ -n "$CERT" ]]; then
    TLS=$'\n  tls:\n    certificate: '"$(realpath "$CERT")"$'\n    key: '"$(realpath "$KEY")"
  fi
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
  addr: $LISTEN$TLS
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
  echo "registry: running on $LISTEN over $SCHEME (pid $(cat "$PIDFILE"), data $STATE/data)"
  echo "registry: push with: docker tag IMAGE $ADDRESS/NAME:TAG && docker push $ADDRESS/NAME:TAG"
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
      echo "registry: running on $LISTEN (pid $pid)"
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
