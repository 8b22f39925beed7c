"""contrib/kubernetes: the manifests validate, ask for no more than the unit does, carry a policy
that ``check-config`` accepts, and the node-problem-detector plugin keeps NPD's protocol.

Not tested here (no cluster in CI): that the pods schedule and start, the NVIDIA runtime's
device injection, the ``nsenter`` into the host cgroup namespace under a real runtime's
seccomp/AppArmor, and NPD actually setting the node condition. The schema check uses the
offline Kubernetes JSON schemas bundled by the ``kubernetes-validate`` package ([test] extra).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuwatchd.config.files import read_only_everywhere
from gpuwatchd.core.vocabulary import EventName
from tests.support.daemonrun import Run, orphan_host
from tests.support.fakenvml import GiB, MiB, gpu, process
from tests.support.simhost import SimHost, pid_namespace_command, run_in_pid_namespace

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "contrib" / "kubernetes"
MANIFEST = K8S / "gpuwatchd.yaml"
NPD_CONFIG = K8S / "gpuwatchd-npd.json"
NPD_COMMAND = K8S / "gpuwatchd-npd"
KUBERNETES_VERSION = "1.30.0"  # the oldest release with securityContext.appArmorProfile
NPD_COMMAND_INSTALLED = "/usr/lib/gpuwatchd/kubernetes/gpuwatchd-npd"


def documents() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]


def find(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def pod_spec(daemonset: str = "gpuwatchd") -> dict[str, Any]:
    spec: dict[str, Any] = find("DaemonSet", daemonset)["spec"]["template"]["spec"]
    return spec


NPD = "gpuwatchd-npd"  # node-problem-detector's DaemonSet


def container(name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [
        c for ds in ("gpuwatchd", NPD) for c in pod_spec(ds)["containers"] if c["name"] == name
    ]
    assert len(found) == 1, name
    return found[0]


# --- the manifests ---------------------------------------------------------------------------


@pytest.mark.parametrize("index", range(len(documents())))
def test_each_manifest_validates_against_the_kubernetes_schema(index: int) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate (the [test] extra)"
    )
    doc = documents()[index]
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_schema_check_would_catch_a_misspelt_field() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    daemonset = find("DaemonSet", "gpuwatchd")
    daemonset["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, KUBERNETES_VERSION, strict=True)


def unit_capabilities() -> set[str]:
    unit = (REPO / "systemd" / "gpuwatchd.service").read_text()
    found = re.search(r"^CapabilityBoundingSet=(.*)$", unit, re.M)
    assert found
    return {cap.removeprefix("CAP_") for cap in found.group(1).split()}


def test_the_daemon_gets_the_units_capabilities_and_nothing_more() -> None:
    spec = pod_spec()
    assert spec["hostPID"] is True
    assert not spec.get("hostNetwork")
    assert not spec.get("hostIPC")
    daemon = container("gpuwatchd")["securityContext"]
    assert daemon["privileged"] is False
    assert daemon["allowPrivilegeEscalation"] is False
    assert daemon["capabilities"]["drop"] == ["ALL"]
    assert set(daemon["capabilities"]["add"]) == unit_capabilities()
    assert [c["name"] for c in spec["containers"]] == ["gpuwatchd"]  # no sidecar


def test_node_problem_detector_runs_unprivileged_in_a_pod_of_its_own() -> None:
    """It reads the daemon's metrics file: no capability, not root, not in the host's PID
    namespace, no /tmp shared with the daemon, no host path but the metrics folder, read-only."""
    spec = pod_spec(NPD)
    assert not spec.get("hostPID")
    assert not spec.get("hostNetwork")
    assert not spec.get("hostIPC")
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    (npd,) = spec["containers"]
    context = npd["securityContext"]
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert "runAsUser" not in context  # the pod's non-root user
    mounts = {m["mountPath"]: m for m in npd["volumeMounts"]}
    assert all(m["readOnly"] is True for m in mounts.values())
    assert "/tmp" not in mounts
    assert "/var/lib/gpuwatchd" not in mounts  # not the daemon's state
    host_paths = [v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v]
    assert host_paths == ["/var/lib/gpuwatchd-metrics"]
    env = {e["name"]: e.get("value") for e in npd["env"]}
    assert env["GPUWATCHD_METRICS_FILE"].startswith("/var/lib/gpuwatchd-metrics/")


def test_the_host_paths_are_the_state_and_the_metrics_folder() -> None:
    volumes = pod_spec()["volumes"]
    host_paths = [v["hostPath"]["path"] for v in volumes if "hostPath" in v]
    assert host_paths == ["/var/lib/gpuwatchd", "/var/lib/gpuwatchd-metrics"]
    daemon = {m["mountPath"] for m in container("gpuwatchd")["volumeMounts"]}
    assert daemon == {
        "/etc/gpuwatchd/conf.d",
        "/var/lib/gpuwatchd",
        "/var/lib/gpuwatchd-metrics",
        "/tmp",
    }


def test_the_metrics_file_is_written_to_the_metrics_host_path() -> None:
    """A textfile for the node's node_exporter, not a port (docs/operations.md says why)."""
    policy = yaml.safe_load(find("ConfigMap", "gpuwatchd-policy")["data"]["50-kubernetes.yaml"])
    textfile = Path(policy["metrics"]["textfile"])
    assert textfile.suffix == ".prom"
    assert str(textfile.parent) == "/var/lib/gpuwatchd-metrics"
    assert not any("ports" in c for c in pod_spec()["containers"])


def test_the_namespace_allows_the_privileged_pod_security_level() -> None:
    labels = find("Namespace", "gpuwatchd")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


def test_only_the_npd_container_gets_an_api_token() -> None:
    for account in ("gpuwatchd", NPD):
        assert find("ServiceAccount", account)["automountServiceAccountToken"] is False
    assert pod_spec()["automountServiceAccountToken"] is False
    assert pod_spec(NPD)["automountServiceAccountToken"] is False
    assert pod_spec()["serviceAccountName"] == "gpuwatchd"
    assert pod_spec(NPD)["serviceAccountName"] == NPD
    mounted_at = "/var/run/secrets/kubernetes.io/" + "serviceaccount"
    daemon = [m["mountPath"] for m in container("gpuwatchd")["volumeMounts"]]
    assert mounted_at not in daemon
    npd = {m["mountPath"]: m for m in container("node-problem-detector")["volumeMounts"]}
    assert npd[mounted_at]["readOnly"] is True
    (volume,) = [v for v in pod_spec(NPD)["volumes"] if v["name"] == npd[mounted_at]["name"]]
    sources = volume["projected"]["sources"]
    (token,) = [
        source["serviceAccountToken"] for source in sources if "serviceAccountToken" in source
    ]
    assert token["expirationSeconds"] <= 3600


def test_the_daemons_account_has_no_rights() -> None:
    """Every binding names node-problem-detector's account, none the daemon's."""
    bindings = [d for d in documents() if d["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert bindings
    for binding in bindings:
        assert [s["name"] for s in binding["subjects"]] == [NPD]


def test_npd_may_change_the_status_of_its_own_node_only() -> None:
    """RBAC grants node status patches (it cannot name "its own node"); the admission policy
    lets the pod's service account change only the node its token was issued on. Events only
    in "default", where node events go."""
    role = find("ClusterRole", "gpuwatchd-npd")
    granted = {(r["resources"][0], v) for r in role["rules"] for v in r["verbs"]}
    assert granted == {("nodes", "get"), ("nodes/status", "patch")}
    events = find("Role", "gpuwatchd-npd-events")
    assert events["metadata"]["namespace"] == "default"
    account = f"system:serviceaccount:gpuwatchd:{pod_spec(NPD)['serviceAccountName']}"
    policy = find("ValidatingAdmissionPolicy", "gpuwatchd-npd-own-node")["spec"]
    assert policy["failurePolicy"] == "Fail"
    (rule,) = policy["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["nodes/status"]
    assert rule["operations"] == ["UPDATE"]  # a PATCH is admitted as an UPDATE
    (condition,) = policy["matchConditions"]
    assert f"'{account}'" in condition["expression"]
    (check,) = policy["validations"]
    assert "authentication.kubernetes.io/node-name" in check["expression"]
    assert "object.metadata.name" in check["expression"]
    binding = find("ValidatingAdmissionPolicyBinding", "gpuwatchd-npd-own-node")["spec"]
    assert binding == {"policyName": "gpuwatchd-npd-own-node", "validationActions": ["Deny"]}


def test_reload_is_the_command_that_finds_the_daemon_never_pid_1() -> None:
    text = MANIFEST.read_text()
    assert "gpuwatchd reload" in text
    assert re.search(r"--\s+kill\s+-HUP", text) is None


APPARMOR = K8S / "apparmor"


@pytest.mark.parametrize("name", ["gpuwatchd", "node-problem-detector"])
def test_each_container_has_an_apparmor_profile_with_its_capabilities(name: str) -> None:
    """The profile the manifest names is shipped, declares that name, allows exactly the
    container's capabilities, and parses (apparmor_parser, without loading it)."""
    context = container(name)["securityContext"]
    assert context["appArmorProfile"]["type"] == "Localhost"
    profile = context["appArmorProfile"]["localhostProfile"]
    text = (APPARMOR / profile).read_text()
    assert re.search(rf"^profile {re.escape(profile)} ", text, re.M)
    allowed = {c.upper() for c in re.findall(r"^\s*capability (\w+),", text, re.M)}
    assert allowed == set(context["capabilities"].get("add", []))
    assert re.search(r"^\s*deny mount,", text, re.M)
    parser = shutil.which("apparmor_parser")
    if parser is None:
        pytest.skip("apparmor_parser not installed (run tests/systemd/host-setup.sh)")
    proc = subprocess.run(
        [parser, "--skip-kernel-load", "--skip-cache", "--stdout", str(APPARMOR / profile)],
        capture_output=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")


def test_the_daemon_enters_the_host_cgroup_namespace() -> None:
    """Without it namespace_check keeps the daemon report-only (docs/operations.md)."""
    command = container("gpuwatchd")["command"]
    assert command[:2] == ["nsenter", "--cgroup=/proc/1/ns/cgroup"]
    assert command[-2:] == ["/usr/bin/gpuwatchd", "run"]


def configmap_tree(root: Path, data: dict[str, str]) -> Path:
    """Lay ``data`` out as the kubelet does: the volume's folder mode 0777 (an emptyDir), the
    files (0644, the default ``defaultMode``) in a timestamped folder (0755), ``..data`` linking
    to it, and each key a link through ``..data``."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o777)
    stamp = root / "..2026_12_03_08_00_00.000000001"
    stamp.mkdir()
    stamp.chmod(0o755)
    for key, text in data.items():
        (stamp / key).write_text(text)
        (stamp / key).chmod(0o644)
    (root / "..data").symlink_to(stamp.name)
    for key in data:
        (root / key).symlink_to(f"..data/{key}")
    return root


def test_the_configmap_policy_passes_check_config(tmp_path: Path) -> None:
    etc = tmp_path / "etc" / "gpuwatchd"
    etc.mkdir(parents=True)
    (etc / "gpuwatchd.yaml").write_text((REPO / "config" / "gpuwatchd.yaml").read_text())
    data = find("ConfigMap", "gpuwatchd-policy")["data"]
    assert data, "the policy ConfigMap has no drop-ins"
    # The content and the merge order here; the 0777 folder on its read-only mount, as root:
    # test_the_daemon_accepts_the_configmap_mounted_as_the_kubelet_mounts_it.
    configmap_tree(etc / "conf.d", data).chmod(0o755)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwatchd",
            "check-config",
            "--config",
            str(etc / "gpuwatchd.yaml"),
        ],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    merged_from = [line for line in proc.stdout.splitlines() if line.startswith("#   ")]
    assert [Path(line[4:]).name for line in merged_from] == ["gpuwatchd.yaml", *sorted(data)]
    assert "log: {format: json}" in proc.stdout.splitlines()  # the drop-in is in force


# The kubelet's ConfigMap volume as a container sees it: the node's file system (8:1) shows the
# volume's folder through one read-only bind; the same device is also mounted read-write for a
# hostPath volume and /etc/hosts, whose folders do not contain it.
KUBELET = "/var/lib/kubelet/pods/7f3c/volumes/kubernetes.io~configmap/policy"
CONTAINER_MOUNTS = f"""\
1020 990 0:312 / / rw,relatime - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w
1021 1020 0:315 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
1030 1020 8:1 /var/lib/gpuwatchd /var/lib/gpuwatchd rw,relatime - ext4 /dev/sda1 rw
1031 1020 8:1 /var/lib/kubelet/pods/7f3c/etc-hosts /etc/hosts rw,relatime - ext4 /dev/sda1 rw
1032 1020 8:1 {KUBELET} /etc/gpuwatchd/conf.d ro,relatime - ext4 /dev/sda1 rw
"""


@pytest.mark.parametrize(
    ("mounts", "path", "read_only"),
    [
        (CONTAINER_MOUNTS, "/etc/gpuwatchd/conf.d", True),
        (CONTAINER_MOUNTS, "/etc/gpuwatchd/conf.d/..2026_12_03/50-site.yaml", True),
        (CONTAINER_MOUNTS, "/etc/gpuwatchd", False),  # the overlay: writable
        (CONTAINER_MOUNTS, "/var/lib/gpuwatchd", False),
        # The same bind on a host whose root file system (the same device) is mounted
        # read-write: the folder can be written through / — refused.
        (
            "1 0 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
            + CONTAINER_MOUNTS.splitlines()[-1]
            + "\n",
            "/etc/gpuwatchd/conf.d",
            False,
        ),
        # A writable mount showing a folder above the volume's, elsewhere: refused.
        (
            CONTAINER_MOUNTS + "1040 1020 8:1 /var/lib/kubelet /mnt rw - ext4 /dev/sda1 rw\n",
            "/etc/gpuwatchd/conf.d",
            False,
        ),
        # Read-only mounted over a writable one at the same point: the last one is on top.
        (
            "1 0 0:40 / /cfg rw - tmpfs tmpfs rw\n2 1 0:41 / /cfg ro - tmpfs tmpfs rw\n",
            "/cfg",
            True,
        ),
        (
            "1 0 0:41 / /cfg ro - tmpfs tmpfs rw\n2 1 0:40 / /cfg rw - tmpfs tmpfs rw\n",
            "/cfg",
            False,
        ),
        # Escaped names (\\040 is a space), and nothing parsable.
        ("1 0 0:42 / /my\\040cfg ro - tmpfs tmpfs rw\n", "/my cfg/a.yaml", True),
        ("garbage\n", "/etc/gpuwatchd/conf.d", False),
    ],
)
def test_read_only_everywhere_tells_a_configmap_mount_from_a_writable_folder(
    mounts: str, path: str, read_only: bool
) -> None:
    assert read_only_everywhere(mounts, path) is read_only


def _in_mount_namespace(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (sh) as root in a private mount namespace of its own."""
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-euc", script],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        timeout=60,
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: mounts a read-only file system")
def test_the_daemon_accepts_the_configmap_mounted_as_the_kubelet_mounts_it(tmp_path: Path) -> None:
    """The policy ConfigMap laid out as the kubelet does (0777 folder, ``..data``) on a
    read-only mount that only it shows: check-config accepts it (as root, with the permission
    check on), and the daemon starts with it and polls (``run --once`` on the fake NVML). The
    same folder writable, or read-only but writable elsewhere (a bind of a folder / shows), is
    refused with exit 78 naming it."""
    fakenvml = pytest.importorskip("tests.support.fakenvml")
    library = fakenvml.ensure_built()
    etc = tmp_path / "etc" / "gpuwatchd"
    conf_d = etc / "conf.d"
    conf_d.mkdir(parents=True)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    data = dict(find("ConfigMap", "gpuwatchd-policy")["data"])
    data["70-test.yaml"] = f"state_dir: {state}\ndevices_dir: {tmp_path / 'dev'}\n"
    (tmp_path / "dev").mkdir()
    (etc / "gpuwatchd.yaml").write_text((REPO / "config" / "gpuwatchd.yaml").read_text())
    layout = tmp_path / "layout"
    configmap_tree(layout, data)
    nvml_state = tmp_path / "nvml.json"
    nvml_state.write_text(json.dumps({"gpus": [gpu(0)]}))
    gpuwatchd = f"{sys.executable} -m gpuwatchd"
    config = f"--config {etc / 'gpuwatchd.yaml'}"
    env = {
        "LD_LIBRARY_PATH": str(library.parent),
        "FAKENVML_STATE": str(nvml_state),
        "FAKENVML_DEVICES_DIR": str(tmp_path / "dev"),
    }
    # The kubelet's view: a file system of its own holding the volume, mounted read-only.
    kubelet = _in_mount_namespace(
        f"""
        mount -t tmpfs -o mode=0755 tmpfs {conf_d}
        cp -a {layout}/. {conf_d}/
        chmod 0777 {conf_d}
        mount -o remount,ro {conf_d}
        stat -c %a {conf_d}
        {gpuwatchd} check-config {config} >/dev/null
        {gpuwatchd} run --once --timeout 20s {config}
        """,
        **env,
    )
    assert kubelet.returncode == 0, kubelet.stdout + kubelet.stderr
    assert kubelet.stdout.splitlines()[0] == "777"
    assert EventName.DAEMON_START in kubelet.stderr
    # The same layout, writable by anyone: refused.
    writable = _in_mount_namespace(
        f"""
        mount -t tmpfs -o mode=0777 tmpfs {conf_d}
        cp -a {layout}/. {conf_d}/
        exec {gpuwatchd} check-config {config}
        """
    )
    assert writable.returncode == 78, writable.stdout + writable.stderr
    assert f"{conf_d}: writable by group or others" in writable.stderr
    # Read-only here, but a bind of a folder the read-write / (or /tmp) also shows: refused.
    bound = _in_mount_namespace(
        f"""
        mount --bind {layout} {conf_d}
        mount -o remount,bind,ro {conf_d}
        exec {gpuwatchd} check-config {config}
        """
    )
    assert bound.returncode == 78, bound.stdout + bound.stderr
    assert "writable by group or others" in bound.stderr


# --- node-problem-detector -----------------------------------------------------------------

_GO_DURATION = re.compile(r"^([0-9]+(ns|us|ms|s|m|h))+$")


def _seconds(text: str) -> float:
    units = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * units[u] for n, u in re.findall(r"([0-9]+)(ns|us|ms|s|m|h)", text))


def test_the_npd_config_has_what_npd_requires() -> None:
    """What NPD's custom plugin monitor checks when it loads a config (plugin "custom", rule
    timeouts within the global one, a default condition for each permanent rule), and the
    fields it reads."""
    config = json.loads(NPD_CONFIG.read_text())
    assert config["plugin"] == "custom"
    assert config["source"]
    plugin = config["pluginConfig"]
    for key in ("invoke_interval", "timeout"):
        assert _GO_DURATION.match(plugin[key]), key
    assert isinstance(plugin["max_output_length"], int)
    assert plugin["max_output_length"] >= 80  # the command keeps within 80
    defaults = {c["type"] for c in config["conditions"]}
    for condition in config["conditions"]:
        assert set(condition) == {"type", "reason", "message"}
        assert all(condition.values())
    assert config["rules"]
    for rule in config["rules"]:
        assert rule["type"] in ("permanent", "temporary")
        assert rule["reason"]
        if rule["type"] == "permanent":
            assert rule["condition"] in defaults
        assert _GO_DURATION.match(rule["timeout"])
        assert _seconds(rule["timeout"]) <= _seconds(plugin["timeout"])
        assert rule["path"] == NPD_COMMAND_INSTALLED
    assert _seconds(plugin["timeout"]) < _seconds(plugin["invoke_interval"])


def test_the_configmap_carries_the_npd_config_file() -> None:
    data = find("ConfigMap", "gpuwatchd-npd")["data"]
    assert json.loads(data["gpuwatchd-npd.json"]) == json.loads(NPD_CONFIG.read_text())


def _npd(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(NPD_COMMAND)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env={**os.environ, **env},
    )


def _metrics_file(path: Path, text: str) -> dict[str, str]:
    path.write_text(text)
    return {"GPUWATCHD_METRICS_FILE": str(path)}


def test_npd_says_unknown_without_a_metrics_file_or_with_a_stale_one(tmp_path: Path) -> None:
    missing = _npd({"GPUWATCHD_METRICS_FILE": str(tmp_path / "none.prom")})
    assert missing.returncode == 2
    assert missing.stdout.startswith("no gpuwatchd metrics at ")
    old = time.time() - 3600
    stale = _metrics_file(
        tmp_path / "stale.prom",
        f"gpuwatchd_last_successful_poll_timestamp_seconds {old}\n"
        'gpuwatchd_gpu_clean{gpu="GPU-1",index="0"} 1.0\n',
    )
    proc = _npd(stale)
    assert (proc.returncode, proc.stdout) == (2, "gpuwatchd's last poll: 3600s ago\n")
    garbled = _npd(_metrics_file(tmp_path / "garbled.prom", "gpuwatchd_gpu_clean{{{ 1\n"))
    assert garbled.returncode == 2
    assert garbled.stdout.startswith("gpuwatchd metrics unreadable")


@pytest.mark.parametrize("ahead", [3600.0, float("inf"), float("nan")])
def test_npd_takes_a_last_poll_ahead_of_its_clock_for_unknown(tmp_path: Path, ahead: float) -> None:
    """The wall clock went back (or the file says no time): a dead daemon's last verdict is not
    fresh for as long as the step; only a poll within GPUWATCHD_NPD_MAX_AGE either way is."""
    env = _metrics_file(
        tmp_path / "ahead.prom",
        f"gpuwatchd_last_successful_poll_timestamp_seconds {time.time() + ahead}\n"
        'gpuwatchd_gpu_clean{gpu="GPU-1",index="0"} 1.0\n',
    )
    proc = _npd(env)
    assert proc.returncode == 2, proc.stdout
    assert proc.stdout.startswith("gpuwatchd's last poll: ")


@pytest.mark.parametrize(
    ("setting", "text"),
    [
        ({"GPUWATCHD_NPD_MAX_AGE": "5m"}, ""),
        ({"GPUWATCHD_NPD_MAX_OUTPUT": "eighty"}, ""),
        ({}, 'gpuwatchd_gpu_clean{, ="c"}} 1\n'),  # the parser's IndexError, not a ValueError
    ],
)
def test_npd_says_unknown_when_it_fails_never_a_problem(
    tmp_path: Path, setting: dict[str, str], text: str
) -> None:
    """An uncaught exception exits 1, which NPD takes for the problem (the node cordoned): a
    setting written as a duration, or a file the parser stumbles on, is unknown (2)."""
    now = time.time()
    body = text or f"gpuwatchd_last_successful_poll_timestamp_seconds {now}\n"
    proc = _npd({**_metrics_file(tmp_path / "m.prom", body), **setting})
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.startswith("gpuwatchd-npd failed: ")
    assert "\n" not in proc.stdout.rstrip("\n")


@pytest.mark.parametrize("value", ["no", "false", "Auto"])
def test_npd_problem_setting_other_than_auto_or_yes_raises_no_problem(
    tmp_path: Path, value: str
) -> None:
    """GPUWATCHD_NPD_PROBLEM=no meant "not in dry-run" but counted as yes (anything but
    "auto" did): the rollout week's dirty GPU became the problem. Unknown, saying why."""
    env = _metrics_file(
        tmp_path / "dry.prom",
        f"gpuwatchd_last_successful_poll_timestamp_seconds {time.time()}\n"
        "gpuwatchd_dry_run 1.0\n"
        'gpuwatchd_gpu_clean{gpu="GPU-1",index="0"} 0.0\n',
    )
    proc = _npd({**env, "GPUWATCHD_NPD_PROBLEM": value})
    assert proc.returncode == 2, proc.stdout
    assert "GPUWATCHD_NPD_PROBLEM" in proc.stdout
    assert len(proc.stdout.rstrip("\n")) <= 80


def test_npd_message_fits_the_limit(tmp_path: Path) -> None:
    now = time.time()
    uuid = "GPU-" + "f" * 120
    env = _metrics_file(
        tmp_path / "long.prom",
        f"gpuwatchd_last_successful_poll_timestamp_seconds {now}\n"
        f'gpuwatchd_gpu_clean{{gpu="{uuid}",index="0"}} 0.0\n',
    )
    proc = _npd(env)
    assert proc.returncode == 1
    assert len(proc.stdout.rstrip("\n")) == 80
    assert proc.stdout.startswith(f"not clean on {uuid[:20]}")


@pytest.mark.parametrize("dry", [True, False])
def test_npd_takes_the_mode_of_the_policy_the_daemon_runs_when_the_files_do_not_validate(
    tmp_path: Path, dry: bool
) -> None:
    """Issue 35: a bad drop-in is no reason to raise the problem. The daemon runs its last
    accepted policy and writes that one's dry_run beside gpuwatchd_policy_rejected; that
    dry_run decides."""
    env = _metrics_file(
        tmp_path / "rejected.prom",
        f"gpuwatchd_last_successful_poll_timestamp_seconds {time.time()}\n"
        "gpuwatchd_policy_rejected 1.0\n"
        f"gpuwatchd_dry_run {1.0 if dry else 0.0}\n"
        'gpuwatchd_gpu_clean{gpu="GPU-1",index="0"} 0.0\n'
        'gpuwatchd_gpu_not_clean_reasons{gpu="GPU-1",index="0",kind="orphaned"} 1.0\n',
    )
    proc = _npd(env)
    if dry:
        assert (proc.returncode, proc.stdout) == (0, "dry-run: would report orphaned on GPU-1\n")
    else:
        assert (proc.returncode, proc.stdout) == (1, "orphaned on GPU-1\n")


def host_npd(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """The NPD command reading the metrics a real daemon wrote: a dead job's memory on GPU 0
    (dry-run, then enforcing), then a clean host."""
    with SimHost(root, gpus=2) as host:
        orphan_host(host)
        pinned = [process(host.pids["trainer"], 700 * MiB)]
        host.nvml([gpu(0, allocated=3 * GiB, processes=pinned), gpu(1)])
        textfile = root / "metrics" / "gpuwatchd.prom"
        textfile.parent.mkdir()
        daemon = Run(host, dry_run=True, metrics={"textfile": str(textfile)})
        env = {"GPUWATCHD_METRICS_FILE": str(textfile)}
        run = [sys.executable, str(NPD_COMMAND)]

        def npd(**extra: str) -> dict[str, Any]:
            proc = subprocess.run(
                run, env={**os.environ, **env, **extra}, capture_output=True, text=True, check=False
            )
            return {"code": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}

        def judged(*clean: str) -> bool:  # the daemon's verdicts in the file, GPU 0 first
            text = textfile.read_text() if textfile.exists() else ""
            return re.findall(r"^gpuwatchd_gpu_clean\{.*\} (\S+)$", text, re.M) == list(clean)

        daemon.start()  # only the daemon writes the file (never run --once)
        try:
            assert daemon.wait_for(lambda: judged("0.0", "1.0")), "GPU 0 never judged dirty"
            # The rollout week: a dry-run policy reports, never raises the problem.
            dry, dirty = npd(), npd(GPUWATCHD_NPD_PROBLEM="yes")
            uuid = host.scan_json(daemon.config)["gpus"][0]["uuid"]
            os.kill(host.pids["worker"], 9)
            host.wait_gone("worker")
            host.nvml([gpu(0), gpu(1)])
            assert daemon.wait_for(lambda: judged("1.0", "1.0")), "GPU 0 never judged clean"
        finally:
            daemon.stop()
        return {"uuid0": uuid, "dry": dry, "dirty": dirty, "clean": npd()}


@pytest.mark.slow
@pytest.mark.skipif(pid_namespace_command() is None, reason="needs a PID namespace")
def test_npd_exit_codes_on_a_dirty_and_a_clean_simulated_host(tmp_path: Path) -> None:
    """Dry-run policy: OK with what would be reported; GPUWATCHD_NPD_PROBLEM=yes: a problem;
    judged from the verdict the daemon wrote into its metrics file, as an unprivileged plugin
    can."""
    r = run_in_pid_namespace(f"{__name__}:host_npd", {}, root=tmp_path, timeout=120)
    assert r["dry"]["code"] == 0, r["dry"]
    assert re.fullmatch(
        rf"dry-run: would report (dead_process|orphaned) on {r['uuid0']}\n", r["dry"]["stdout"]
    )
    assert r["dirty"]["code"] == 1, r["dirty"]
    message = r["dirty"]["stdout"].rstrip("\n")
    assert "\n" not in message
    assert len(message) <= 80
    assert re.fullmatch(rf"(dead_process|orphaned) on {r['uuid0']}", message), message
    assert r["clean"] == {"code": 0, "stdout": "gpuwatchd: every GPU is clean\n", "stderr": ""}


def test_npd_runs_as_nobody_without_privilege() -> None:
    """The plugin needs to read one world-readable file, nothing more: as an unprivileged user
    with no capability, under Debian's python3 as in the image, it judges as root would."""
    system_python = "/usr/bin/python3"
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the plugin as nobody")
    probe = subprocess.run([system_python, "-c", "import prometheus_client"], check=False)
    if probe.returncode != 0:
        pytest.skip("Debian's python3-prometheus-client missing (run tests/systemd/host-setup.sh)")
    folder = Path(tempfile.mkdtemp(prefix="gpuwatchd-npd-"))
    try:
        folder.chmod(0o755)
        plugin = folder / "gpuwatchd-npd"
        shutil.copy(NPD_COMMAND, plugin)
        env = _metrics_file(
            folder / "gpuwatchd.prom",
            f"gpuwatchd_last_successful_poll_timestamp_seconds {time.time()}\n"
            'gpuwatchd_gpu_clean{gpu="GPU-1",index="0"} 1.0\n',
        )
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"]
        proc = subprocess.run(
            [*nobody, system_python, "-I", str(plugin)],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
            env={"PATH": "/usr/bin:/bin", **env},
        )
    finally:
        shutil.rmtree(folder)
    assert (proc.returncode, proc.stdout) == (0, "gpuwatchd: every GPU is clean\n"), proc.stderr


def test_the_npd_command_is_executable() -> None:
    assert os.access(NPD_COMMAND, os.X_OK)
    assert NPD_COMMAND.read_text().startswith("#!/usr/bin/python3\n")
