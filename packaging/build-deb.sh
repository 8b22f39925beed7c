#!/usr/bin/env bash
# Build the gpuwatchd .deb from this repository into OUTDIR, without touching the tree:
#   packaging/build-deb.sh OUTDIR
# Copies the tracked-or-unignored files to a scratch dir, puts packaging/debian at debian/,
# fetches the nvidia-ml-py wheel (Debian main lacks it) into vendor/, and runs
# dpkg-buildpackage -us -uc -b. Then lintian, failing on errors.
# Env: NVML_PY_WHEEL=path/to/nvidia_ml_py-*.whl to use a wheel already on disk (offline);
#      NVML_PY_VERSION (default 13.615.71); LINTIAN=0 to skip lintian.
set -euo pipefail
OUT=${1:?usage: build-deb.sh OUTDIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
NVML_PY_VERSION=${NVML_PY_VERSION:-13.615.71}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d /tmp/gpuwatchd-deb.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
SRC=$WORK/gpuwatchd

# 1. The source: what git would ship (tracked + untracked-not-ignored), never .venv or builds.
mkdir -p "$SRC"
if git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1; then
    git -C "$REPO" ls-files -z --cached --others --exclude-standard \
        | (cd "$REPO" && xargs -0 cp --parents -t "$SRC" 2>/dev/null || true)
else
    tar -C "$REPO" --exclude=.venv --exclude=.git --exclude='*/build' -cf - . | tar -C "$SRC" -xf -
fi
rm -rf "$SRC/debian"; cp -a "$REPO/packaging/debian" "$SRC/debian"
for f in config/gpuwatchd.yaml docs/man/gpuwatchd.8 docs/man/gpuwatchd.yaml.5 systemd/gpuwatchd.service; do
    [ -f "$SRC/$f" ] || { echo "build-deb: $f is missing from the tree" >&2; exit 1; }
done

# The build dependencies (debian/control): installed when root, else named (with the command).
"$REPO/packaging/check-build-deps.sh" "$SRC"

# 2. nvidia-ml-py: fetched now, bundled in the package, never committed.
mkdir -p "$WORK/wheel" "$SRC/vendor"
if [ -n "${NVML_PY_WHEEL:-}" ]; then
    cp "$NVML_PY_WHEEL" "$WORK/wheel/"
else
    PY=python3; [ -x "$REPO/.venv/bin/python" ] && PY=$REPO/.venv/bin/python
    "$PY" -m pip --version >/dev/null 2>&1 || {
        echo "build-deb: pip is needed to fetch nvidia-ml-py (apt-get install python3-pip," \
            "or run make venv; offline: NVML_PY_WHEEL=path/to/nvidia_ml_py-*.whl)" >&2
        exit 1
    }
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: \
        -d "$WORK/wheel" "nvidia-ml-py==$NVML_PY_VERSION"
fi
/usr/bin/python3 - "$WORK"/wheel/nvidia_ml_py-*.whl "$SRC/vendor" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extract("pynvml.py", sys.argv[2])
PY

# 3. Build. Debian's tools must not see a pyenv/venv python3 first on PATH.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin DEB_BUILD_OPTIONS=${DEB_BUILD_OPTIONS:-nocheck}
unset PYTHONPATH VIRTUAL_ENV
(cd "$SRC" && dpkg-buildpackage -us -uc -b) >"$OUT/build.log" 2>&1 || {
    tail -40 "$OUT/build.log" >&2; echo "build-deb: dpkg-buildpackage failed, see $OUT/build.log" >&2; exit 1; }
DEB=$(ls "$WORK"/gpuwatchd_*_all.deb)
cp "$DEB" "$OUT/"
echo "built $OUT/$(basename "$DEB")"

# 4. lintian: errors fail the build; warnings are fixed or overridden with a reason.
if [ "${LINTIAN:-1}" != 0 ] && ! command -v lintian >/dev/null; then
    echo "build-deb: lintian is not installed: the package is not checked (apt-get install lintian)" >&2
elif [ "${LINTIAN:-1}" != 0 ]; then
    rc=0
    lintian --fail-on error,warning --info "$OUT/$(basename "$DEB")" >"$OUT/lintian.txt" 2>&1 || rc=$?
    grep -v 'running with root privileges' "$OUT/lintian.txt" || true
    [ "$rc" -eq 0 ] || { echo "build-deb: lintian failed" >&2; exit 1; }
fi
