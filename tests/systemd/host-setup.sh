#!/usr/bin/env bash
# Install the host tools tests/system/test_systemd.py needs (Debian/Ubuntu, root). Idempotent and
# quiet when everything is there; does nothing (exit 0) when not root or without apt-get,
# so that `make test` still runs elsewhere and the systemd tests skip with a reason.
set -euo pipefail
[ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || exit 0
need=()
command -v systemd-nspawn >/dev/null || need+=(systemd-container)
command -v systemd-analyze >/dev/null || need+=(systemd)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v dpkg-buildpackage >/dev/null || need+=(dpkg-dev)
command -v dh >/dev/null || need+=(debhelper)
command -v dh_python3 >/dev/null || need+=(dh-python)
command -v lintian >/dev/null || need+=(lintian)
command -v nsenter >/dev/null || need+=(util-linux)
command -v ip >/dev/null || need+=(iproute2)  # tests/system/test_systemd_slurm.py: an address for slurmd
command -v apparmor_parser >/dev/null || need+=(apparmor)  # tests/integration/test_contrib_kubernetes.py: the profiles parse
command -v promtool >/dev/null || need+=(prometheus)  # tests/integration/test_metrics.py checks the alert rules
command -v faketime >/dev/null || need+=(faketime)  # tests/system/test_e2e_clock_step.py steps the daemon's wall clock
dpkg -s pybuild-plugin-pyproject python3-all python3-setuptools python3-shtab python3-wheel >/dev/null 2>&1 \
    || need+=(pybuild-plugin-pyproject python3-all python3-setuptools python3-shtab python3-wheel)
# tests/integration/test_contrib_kubernetes.py runs the node-problem-detector plugin as nobody
# with Debian's python3, as in the image.
dpkg -s python3-prometheus-client >/dev/null 2>&1 || need+=(python3-prometheus-client)
[ ${#need[@]} -eq 0 ] && exit 0
export DEBIAN_FRONTEND=noninteractive
echo "host-setup: installing ${need[*]}"
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
