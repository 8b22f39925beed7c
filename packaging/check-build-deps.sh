#!/usr/bin/env bash
# Check that the build dependencies of the package in SRC (its debian/control) are installed:
#   packaging/check-build-deps.sh SRC
# Missing ones are installed when run as root with apt-get; otherwise the script names them,
# with the command that installs them, and exits 1 (instead of dpkg's bare "Unmet build
# dependencies"). packaging/build-deb.sh runs it before building.
set -euo pipefail
SRC=${1:?usage: check-build-deps.sh SRC}
say() { echo "build-deb: $*" >&2; }

if ! command -v dpkg-checkbuilddeps >/dev/null; then
    say "dpkg-dev is not installed (it has dpkg-buildpackage): apt-get install dpkg-dev"
    exit 1
fi
out=$(cd "$SRC" && dpkg-checkbuilddeps 2>&1) && exit 0
unmet=$(printf '%s\n' "$out" | sed -n 's/.*Unmet build dependencies: //p')
if [ -z "$unmet" ]; then
    say "cannot check the build dependencies: $out"
    exit 1
fi
# "debhelper-compat (= 13) dh-python (>= 5)" -> apt package names; debhelper provides -compat.
packages=$(printf '%s\n' "$unmet" | sed -e 's/([^)]*)//g' -e 's/|[^ ]*//g' -e 's/\bdebhelper-compat\b/debhelper/' | tr -s ' ' | sed 's/^ //; s/ $//')
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing the build dependencies: $packages"
    export DEBIAN_FRONTEND=noninteractive
    # shellcheck disable=SC2086 # one word per package
    if apt-get install -y -q --no-install-recommends $packages >&2 ||
        { apt-get update -q >&2 && apt-get install -y -q --no-install-recommends $packages >&2; }; then
        exit 0
    fi
    say "apt-get could not install them: $packages"
    exit 1
fi
say "missing build dependencies: $unmet"
say "install them (as root): apt-get install --no-install-recommends $packages"
exit 1
