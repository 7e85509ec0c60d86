#!/usr/bin/env bash
# Bring up a Docker engine with BuildKit/buildx on a Debian bookworm machine (run as root).
#
# Usage: scripts/docker-up.sh
#   env DOCKER_UP_TIMEOUT  seconds to wait for the daemon (default 60)
#   env DOCKERD_LOG        daemon log file (default /var/log/dockerd.log)
#
# Idempotent: installs only what is missing, starts dockerd only when it does not answer.
#
# Why trixie: bookworm's docker.io is 20.10, whose BuildKit lacks SOURCE_DATE_EPOCH and
# rewrite-timestamp. trixie's docker.io 26 + docker-buildx 0.13 install on bookworm without
# a libc upgrade. The pin (priority 100) keeps every other package on bookworm.
# Why no iptables/bridge: the sandbox has neither; builds and containers use --network host.
set -euo pipefail

TIMEOUT="${DOCKER_UP_TIMEOUT:-60}"
LOG="${DOCKERD_LOG:-/var/log/dockerd.log}"

die() { echo "docker-up: ERROR: $*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "must run as root (installs packages, starts dockerd)"

# Write a file only when its content differs, so reruns leave apt state untouched.
write_if_changed() {
  local path="$1" content="$2"
  if [[ ! -f "$path" ]] || [[ "$(cat "$path")" != "$content" ]]; then
    printf '%s\n' "$content" >"$path"
    return 0
  fi
  return 1
}

missing=()
for pkg in docker.io docker-cli docker-buildx containerd runc docker-registry debootstrap curl; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
done

if ((${#missing[@]})); then
  echo "docker-up: installing missing packages: ${missing[*]}"
  changed=0
  write_if_changed /etc/apt/sources.list.d/trixie-docker.sources "Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" && changed=1
  # Low priority: trixie is used only when asked for with -t trixie (or as a dependency of it).
  write_if_changed /etc/apt/preferences.d/trixie-docker "Package: *
Pin: release n=trixie
Pin-Priority: 100" && changed=1
  # Refresh lists when we just added trixie or the lists were never fetched (fresh machine).
  if ((changed)) || ! compgen -G '/var/lib/apt/lists/*trixie*Packages*' >/dev/null; then
    apt-get update -qq || die "apt-get update failed"
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq -t trixie docker.io docker-cli docker-buildx >/dev/null \
    || die "installing docker.io/docker-cli/docker-buildx from trixie failed"
  # docker-registry and debootstrap come from bookworm (no -t): they need no newer libs.
  apt-get install -y -qq docker-registry debootstrap curl >/dev/null \
    || die "installing docker-registry/debootstrap/curl failed"
fi

# Debian's docker-registry package enables a service; without systemd it never runs, and we
# start our own per-port registries (scripts/registry.sh), so nothing to do here.

if ! docker info >/dev/null 2>&1; then
  # A dockerd pidfile left by a killed daemon makes the new one refuse to start.
  if [[ -f /var/run/docker.pid ]] && ! kill -0 "$(cat /var/run/docker.pid)" 2>/dev/null; then
    rm -f /var/run/docker.pid
  fi
  if pidof dockerd >/dev/null && [[ -S /var/run/docker.sock ]]; then
    echo "docker-up: a dockerd process exists but does not answer yet; waiting for it"
  else
    echo "docker-up: starting dockerd (log: $LOG)"
    # setsid: detach from this shell so the daemon survives the script (no systemd here).
    setsid dockerd --iptables=false --ip6tables=false --bridge=none >>"$LOG" 2>&1 </dev/null &
  fi
  deadline=$((SECONDS + TIMEOUT))
  until docker info >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      echo "docker-up: last lines of $LOG:" >&2
      tail -n 20 "$LOG" >&2 || true
      die "dockerd did not answer within ${TIMEOUT}s"
    fi
    sleep 1
  done
fi

docker buildx version >/dev/null 2>&1 || die "docker buildx plugin not found (package docker-buildx)"

echo "docker-up: client $(docker version --format '{{.Client.Version}}') ($(command -v docker))," \
  "engine $(docker version --format '{{.Server.Version}}')," \
  "buildx $(docker buildx version | cut -d' ' -f2)," \
  "containerd $(docker info --format '{{.ContainerdCommit.ID}}')"
echo "docker-up: docker-registry $(dpkg-query -W -f='${Version}' docker-registry)," \
  "debootstrap $(dpkg-query -W -f='${Version}' debootstrap)"
