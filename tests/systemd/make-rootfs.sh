#!/usr/bin/env bash
# Print the path of a cached minimal Debian 12 root file system with systemd and gpuwatchd's
# runtime dependencies, building it first when the cache has none for this package list:
#   make-rootfs.sh [CACHE_DIR]      (default /var/cache/gpuwatchd-test-rootfs)
# GPUWATCHD_ROOTFS_EXTRA (a comma list) adds packages: tests/system/test_systemd_slurm.py asks for
# munge, slurmctld, slurmd, slurm-client and prometheus-node-exporter, in a tree of its own, so
# the other container tests keep their small one.
# The cache key is a hash of suite + package list, so changing the list builds a new one.
# Callers must not modify the cached tree: copy it (tests/system/test_systemd.py does).
set -euo pipefail
CACHE=${1:-${GPUWATCHD_ROOTFS_CACHE:-/var/cache/gpuwatchd-test-rootfs}}
SUITE=bookworm
PACKAGES=systemd,systemd-sysv,dbus,procps,python3,python3-yaml,python3-structlog,python3-sdnotify,python3-prometheus-client
PACKAGES=$PACKAGES${GPUWATCHD_ROOTFS_EXTRA:+,$GPUWATCHD_ROOTFS_EXTRA}
KEY=$(printf '%s\n%s\n' "$SUITE" "$PACKAGES" | sha256sum | cut -c1-16)
ROOT=$CACHE/$KEY
if [ -e "$ROOT/.complete" ]; then echo "$ROOT"; exit 0; fi

MIRROR=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
MIRROR=${MIRROR:-http://deb.debian.org/debian}
mkdir -p "$CACHE"
TMP=$(mktemp -d "$CACHE/.build.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
if command -v mmdebstrap >/dev/null; then
    mmdebstrap --quiet --variant=minbase --include="$PACKAGES" "$SUITE" "$TMP/root" "$MIRROR" >&2
else
    debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$TMP/root" "$MIRROR" >&2
fi
# The journal must persist so the host can read it; apt must not try the network inside.
mkdir -p "$TMP/root/var/log/journal"
rm -f "$TMP/root/etc/machine-id"; : > "$TMP/root/etc/machine-id"
touch "$TMP/root/.complete"
rm -rf "$ROOT"; mv "$TMP/root" "$ROOT"
echo "$ROOT"
