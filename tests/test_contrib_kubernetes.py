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
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.fakenvml import GiB, MiB, gpu, process
from tests.support.simhost import SimHost, pid_namespace_command, run_in_pid_namespace
from tests.test_e2e_run import ORPHAN_RULE, orphan_host

REPO = Path(__file__).resolve().parent.parent
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


def pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = find("DaemonSet", "gpuwatchd")["spec"]["template"]["spec"]
    return spec


def container(name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [c for c in pod_spec()["containers"] if c["name"] == name]
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
    # The plugin only reads: never KILL.
    npd = container("node-problem-detector")["securityContext"]
    assert set(npd["capabilities"]["add"]) == unit_capabilities() - {"KILL"}
    assert npd["capabilities"]["drop"] == ["ALL"]


def test_the_only_host_path_is_the_state_directory() -> None:
    volumes = pod_spec()["volumes"]
    host_paths = [v["hostPath"]["path"] for v in volumes if "hostPath" in v]
    assert host_paths == ["/var/lib/gpuwatchd"]
    mounts = {m["mountPath"]: m for m in container("node-problem-detector")["volumeMounts"]}
    assert mounts["/var/lib/gpuwatchd"]["readOnly"] is True  # the plugin never writes state
    daemon = {m["mountPath"] for m in container("gpuwatchd")["volumeMounts"]}
    assert daemon == {"/etc/gpuwatchd/conf.d", "/var/lib/gpuwatchd", "/tmp"}


def test_the_daemon_enters_the_host_cgroup_namespace() -> None:
    """Without it namespace_check keeps the daemon report-only (docs/operations.md)."""
    command = container("gpuwatchd")["command"]
    assert command[:2] == ["nsenter", "--cgroup=/proc/1/ns/cgroup"]
    assert command[-2:] == ["/usr/bin/gpuwatchd", "run"]


def configmap_tree(root: Path, data: dict[str, str]) -> Path:
    """Lay ``data`` out as the kubelet does: files in a timestamped folder, ``..data`` linking
    to it, and each key a link through ``..data``."""
    stamp = root / "..2026_12_03_08_00_00.000000001"
    stamp.mkdir(parents=True)
    for key, text in data.items():
        (stamp / key).write_text(text)
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
    configmap_tree(etc / "conf.d", data)
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


def _fake_gpuwatchd(tmp_path: Path, status: dict[str, Any]) -> Path:
    script = tmp_path / "gpuwatchd"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> "{tmp_path}/calls"\n'
        f"case \"$1\" in status) cat '{tmp_path}/status.json' ;; check-clean) exit 0 ;; esac\n"
    )
    script.chmod(0o755)
    (tmp_path / "status.json").write_text(json.dumps(status))
    return script


def _npd(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(NPD_COMMAND)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env={**os.environ, **env},
    )


def test_npd_says_unknown_and_scans_nothing_while_the_daemon_resets(tmp_path: Path) -> None:
    status = {"running": True, "resets": {"in_progress": {"gpu": "GPU-1234", "step": "reset"}}}
    proc = _npd({"GPUWATCHD": str(_fake_gpuwatchd(tmp_path, status))})
    assert proc.returncode == 2
    assert proc.stdout == "gpuwatchd is resetting GPU-1234; not scanned\n"
    assert (tmp_path / "calls").read_text().split("\n")[0].startswith("status")
    assert "check-clean" not in (tmp_path / "calls").read_text()


def test_npd_message_fits_the_limit(tmp_path: Path) -> None:
    script = tmp_path / "gpuwatchd"
    script.write_text(
        "#!/bin/sh\n"
        'case "$1" in status) echo "{}" ;; check-clean) echo "boom"; '
        f'echo "{"x" * 300}" >&2; exit 69 ;; esac\n'
    )
    script.chmod(0o755)
    proc = _npd({"GPUWATCHD": str(script)})
    assert proc.returncode == 2
    assert len(proc.stdout.rstrip("\n")) == 80
    assert proc.stdout.startswith("check-clean exit 69: xxx")


def host_npd(arg: dict[str, Any], root: Path) -> dict[str, Any]:
    """The NPD command on a host with a dead job's memory on GPU 0, then on a clean one."""
    with SimHost(root, gpus=2) as host:
        orphan_host(host)
        pinned = [process(host.pids["trainer"], 700 * MiB)]
        host.nvml([gpu(0, allocated=3 * GiB, processes=pinned), gpu(1)])
        config = host.config(rules=[ORPHAN_RULE])
        env = {**host.env(), "GPUWATCHD": str(Path(sys.executable).parent / "gpuwatchd")}
        env["GPUWATCHD_CONFIG"] = str(config)
        run = [sys.executable, str(NPD_COMMAND)]
        dirty = subprocess.run(run, env=env, capture_output=True, text=True, check=False)
        uuid = host.scan_json(config)["gpus"][0]["uuid"]
        os.kill(host.pids["worker"], 9)
        host.wait_gone("worker")
        host.nvml([gpu(0), gpu(1)])
        clean = subprocess.run(run, env=env, capture_output=True, text=True, check=False)
        (root / "bad.yaml").write_text("interval: sometimes\n")
        env["GPUWATCHD_CONFIG"] = str(root / "bad.yaml")
        broken = subprocess.run(run, env=env, capture_output=True, text=True, check=False)
        return {
            "uuid0": uuid,
            **{
                name: {"code": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
                for name, p in (("dirty", dirty), ("clean", clean), ("broken", broken))
            },
        }


@pytest.mark.slow
@pytest.mark.skipif(pid_namespace_command() is None, reason="needs a PID namespace")
def test_npd_exit_codes_on_a_dirty_and_a_clean_simulated_host(tmp_path: Path) -> None:
    r = run_in_pid_namespace(f"{__name__}:host_npd", {}, root=tmp_path, timeout=120)
    assert r["dirty"]["code"] == 1, r["dirty"]
    message = r["dirty"]["stdout"].rstrip("\n")
    assert "\n" not in message
    assert len(message) <= 80
    assert re.fullmatch(rf"(dead_process|orphaned) on {r['uuid0']}", message), message
    assert r["clean"] == {"code": 0, "stdout": "gpuwatchd: every GPU is clean\n", "stderr": ""}
    assert r["broken"]["code"] == 2
    assert r["broken"]["stdout"].startswith("check-clean exit 78: ")


def test_the_npd_command_is_executable() -> None:
    assert os.access(NPD_COMMAND, os.X_OK)
    assert NPD_COMMAND.read_text().startswith("#!/usr/bin/python3\n")
