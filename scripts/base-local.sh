#!/usr/bin/env bash
# Make a local Python base image without pulling anything (no container registry is reachable):
# debootstrap a minimal Debian rootfs and `docker import` it.
#
# Usage: scripts/base-local.sh [NAME:TAG]      (default sparkforge/base-local:bookworm)
#   env BASE_SUITE         the Debian release (default bookworm)
#   env BASE_ARCH          its architecture, as dpkg names it (default this machine's). Another one is
#                          made with mmdebstrap, whose package scripts run under QEMU (binfmt_misc must
#                          run that architecture's programs: .ci/provision registers arm64), and is
#                          imported as linux/BASE_ARCH
#   env SPARKFORGE_CACHE   cache root (default $HOME/.cache/sparkforge); the rootfs tarball
#                          is kept in $SPARKFORGE_CACHE/base/ so a later run only re-imports
#   env DEBIAN_MIRROR      debootstrap mirror (default http://deb.debian.org/debian)
#   env BASE_FORCE=1       re-import even if the image exists (tarball cache still used)
#
# Levels of cache: image present -> nothing to do; tarball present -> import only (seconds);
# neither -> debootstrap (minutes) + import.
set -euo pipefail

IMAGE="${1:-sparkforge/base-local:bookworm}"
SUITE="${BASE_SUITE:-bookworm}"
VARIANT=minbase
INCLUDE=python3,python3-pip,python3-venv,git,patch,ca-certificates
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
CACHE_DIR="${SPARKFORGE_CACHE:-$HOME/.cache/sparkforge}/base"
# Fixed mtime for every file in the tarball: the rootfs otherwise carries the build time,
# and the same tarball content then gives the same layer digest on every machine.
EPOCH=1704067200 # 2024-01-01T00:00:00Z

die() { echo "base-local: ERROR: $*" >&2; exit 1; }
log() { echo "base-local: $*" >&2; }

command -v docker >/dev/null || die "docker not found"
docker info >/dev/null 2>&1 || die "the Docker engine does not answer"

if [[ "${BASE_FORCE:-0}" != 1 ]] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
  log "$IMAGE already present ($(docker image inspect -f '{{.Id}}' "$IMAGE")); nothing to do"
  exit 0
fi

HOST_ARCH="$(dpkg --print-architecture)"
ARCH="${BASE_ARCH:-$HOST_ARCH}"
# The cache key covers everything that changes the rootfs content.
KEY="$(printf '%s\n' "$SUITE" "$VARIANT" "$INCLUDE" "$MIRROR" "$ARCH" "$EPOCH" | sha256sum | cut -c1-12)"
TARBALL="$CACHE_DIR/rootfs-$SUITE-$ARCH-$KEY.tar"
mkdir -p "$CACHE_DIR"

# One builder at a time per cache dir: a second concurrent run waits and then reuses the tarball.
exec 9>"$CACHE_DIR/.lock-$SUITE-$ARCH"
flock 9

if [[ ! -s "$TARBALL" ]]; then
  command -v debootstrap >/dev/null || die "debootstrap not found (on Debian: apt-get install debootstrap)"
  [[ $(id -u) -eq 0 ]] || die "debootstrap needs root"
  ROOTFS="$(mktemp -d "$CACHE_DIR/rootfs.XXXXXX")"
  cleanup() {
    # debootstrap mounts proc/sys inside the target; never let rm cross into them.
    for m in proc sys dev/pts dev; do umount -l "$ROOTFS/$m" 2>/dev/null || true; done
    rm -rf --one-file-system "$ROOTFS" "$TARBALL.tmp"
  }
  trap cleanup EXIT
  log "debootstrap $SUITE $ARCH ($VARIANT, $INCLUDE) from $MIRROR; log: $CACHE_DIR/debootstrap-$SUITE-$ARCH.log"
  t0=$SECONDS
  if [[ $ARCH == "$HOST_ARCH" ]]; then
    make_root=(debootstrap --variant="$VARIANT" --include="$INCLUDE" "$SUITE" "$ROOTFS" "$MIRROR")
  else
    # mmdebstrap runs the package scripts of a foreign root through QEMU in a third of debootstrap's
    # second stage (measured here: 6 min against 15 for trixie arm64, most of it byte-compiling Python).
    command -v mmdebstrap >/dev/null || die "mmdebstrap not found (on Debian: apt-get install mmdebstrap arch-test)"
    make_root=(mmdebstrap --mode=root --arch="$ARCH" --variant="$VARIANT" --include="$INCLUDE" "$SUITE" "$ROOTFS" "$MIRROR")
  fi
  if ! "${make_root[@]}" >"$CACHE_DIR/debootstrap-$SUITE-$ARCH.log" 2>&1; then
    tail -n 20 "$CACHE_DIR/debootstrap-$SUITE-$ARCH.log" >&2
    die "debootstrap failed (full log: $CACHE_DIR/debootstrap-$SUITE-$ARCH.log)"
  fi
  log "debootstrap took $((SECONDS - t0))s"
  # Drop downloaded .debs, logs and host-specific leftovers: size, and less run-to-run noise.
  rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/cache/apt/*.bin \
    "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/log/* "$ROOTFS"/tmp/* "$ROOTFS"/var/tmp/* \
    "$ROOTFS"/var/cache/ldconfig/aux-cache "$ROOTFS"/debootstrap
  : >"$ROOTFS/etc/machine-id"
  # Sorted names, fixed mtime, numeric owners, no atime/ctime: a deterministic tar stream.
  tar -C "$ROOTFS" --sort=name --mtime="@$EPOCH" --numeric-owner \
    --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
    --one-file-system -cf "$TARBALL.tmp" .
  mv "$TARBALL.tmp" "$TARBALL"
  sha256sum "$TARBALL" | cut -d' ' -f1 >"$TARBALL.sha256"
  log "cached rootfs: $TARBALL ($(du -h "$TARBALL" | cut -f1))"
else
  log "using cached rootfs $TARBALL"
fi

SHA="$(cat "$TARBALL.sha256" 2>/dev/null || sha256sum "$TARBALL" | cut -d' ' -f1)"
t0=$SECONDS
# Fixed config so the image looks the same wherever it is imported (only `created` differs).
docker import --platform "linux/$ARCH" \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  --change "LABEL io.sparkforge.base.rootfs-sha256=$SHA io.sparkforge.base.suite=$SUITE" \
  - "$IMAGE" <"$TARBALL" >/dev/null
log "imported $IMAGE in $((SECONDS - t0))s: $(docker image inspect -f '{{.Id}} layer {{index .RootFS.Layers 0}}' "$IMAGE")"
