"""simulate: scenario validation (file, line, field; exit 65), the daemon's wake-up semantics,
dry-run, speed, and the CLI's text and JSON output."""

from __future__ import annotations

import json
import pathlib
import time

import pytest

from gpuwatchd.cli.main import main
from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.sim.scenario import parse_scenario
from gpuwatchd.sim.scenario_spec import ScenarioError
from gpuwatchd.sim.simulation import Simulation, scenario_policy, simulate
from gpuwatchd.sim.timeline import render_text
from gpuwatchd.sim.world import WALL0, SimulationError
from tests.support.simnames import TrainerNames

ORPHANS = """\
duration: 3m
policy:
  dry_run: {dry}
gpus:
  - index: 0
processes:
  - name: trainer
    holds: [0]
    nvml: {{0: 4GiB}}
  - name: worker
    ppid: trainer
    pgid: trainer
    holds: {{gpus: [0], via: map}}
    on_sigterm: {sigterm}
events:
  - at: 10s
    exit: trainer
"""


def scenario(dry: str = "false", sigterm: str = "exit") -> str:
    return ORPHANS.format(dry=dry, sigterm=sigterm)


@pytest.mark.parametrize(
    ("text", "line", "key", "message"),
    [
        ("gpus: [{index: 0}]\n", 1, "duration", "missing required field"),
        ("duration: 5x\ngpus: [{index: 0}]\n", 1, "duration", "invalid duration"),
        (
            "duration: 1m\ngpus:\n  - index: 0\n    memroy: {}\n",
            4,
            "gpus[0].memroy",
            "did you mean",
        ),
        (
            "duration: 1m\ngpus: [{index: 0}]\nprocesses:\n  - name: a\n    ppid: nobody\n",
            5,
            "processes[0].ppid",
            "not a PID or a process name",
        ),
        (
            "duration: 1m\ngpus: [{index: 0}]\nprocesses:\n  - name: a\n    holds: [3]\n",
            5,
            "processes[0].holds[0]",
            "no GPU with index 3",
        ),
        (
            "duration: 1m\ngpus: [{index: 0}]\nprocesses:\n  - name: a\n    on_sigterm: sulk\n",
            5,
            "processes[0].on_sigterm",
            "expected exit, ignore",
        ),
        (
            "duration: 1m\ngpus: [{index: 0}]\nevents:\n  - at: 1s\n    exit: ghost\n",
            5,
            "events[0].exit",
            "no process named",
        ),
        (
            "duration: 1m\ngpus: [{index: 0}]\nprocesses:\n  - name: a\n    nvml: {\u00b2: 1GiB}\n",
            5,
            "processes[0].nvml.\u00b2",
            "no GPU with index '\u00b2'",
        ),
        ("duration: 1m\ngpus: [{index: 0}]\nevents:\n  - at: 1s\n", 4, "events[0]", "exactly one"),
        (
            "duration: 1m\ngpus: [{index: 0}]\nprocesses:\n  - name: a\n    visible: 3\n",
            5,
            "processes[0].visible",
            "expected true or false",
        ),
        (
            "duration: 1m\ngpus:\n  - index: 0\n    persistence: yes please\n",
            4,
            "gpus[0].persistence",
            "expected true or false",
        ),
        (
            'duration: 1m\ngpus: [{index: 0}]\nprocesses:\n  - name: ""\n',
            4,
            "processes[0].name",
            "a process name cannot be empty",
        ),
        ("duration: [1m\n", 2, None, "YAML syntax"),
        (  # no kernel gives it: the daemon took NVML's listing of it for an invalid PID
            "duration: 1m\ngpus: [{index: 0}]\nprocesses:\n  - {name: a, pid: 4194304}\n",
            4,
            "processes[0].pid",
            "PID 4194304 is not below host.pid_max (4194304)",
        ),
        (
            "duration: 1m\nhost: {pid_max: 1000}\ngpus: [{index: 0}]\nprocesses: [{name: a}]\n",
            4,
            "processes[0].name",
            "PID 1000 is not below host.pid_max (1000)",
        ),
        (  # as docs/simulate.md wrote it: YAML 1.1 reads it as a sexagesimal 1020.0
            "duration: 1m\ngpus:\n  - pci_bus_id: 00000000:17:00.0\n",
            3,
            "gpus[0].pci_bus_id",
            "YAML read a number (1020.0): quote a PCI bus id",
        ),
        (  # a bare integer past 2**53 bytes: the assessment's float sums no longer add up
            "duration: 1m\ngpus:\n  - memory: {total: 100000000000000000000000000000}\n",
            3,
            "gpus[0].memory.total",
            "size 100000000000000000000000000000 is too large",
        ),
        (
            "duration: 1m\ngpus: [{}]\nprocesses:\n  - {name: a, nvml: {0: 9007199254740992}}\n",
            4,
            "processes[0].nvml.0",
            "size 9007199254740992 is too large",
        ),
        (  # no kernel allows it: a listed PID of 10**7 sorted after an epilog's hand-over
            "duration: 1m\nhost:\n  pid_max: 100000000\ngpus: [{index: 0}]\n",
            3,
            "host.pid_max",
            "at most 4194304, the kernel's largest pid_max",
        ),
        (  # no driver gives it: the daemon's holder scan takes /dev/nvidia248 for no GPU
            "duration: 1m\ngpus:\n  - {index: 0, minor: 248}\n",
            3,
            "gpus[0].minor",
            "at most 247, the driver's last /dev/nvidiaN of a GPU; got 248",
        ),
        (  # its minor is its index by default: so no more than 248 GPUs
            "duration: 1m\ngpus: [" + "{}, " * 249 + "]\n",
            2,
            "gpus[248]",
            "at most 247, the driver's last /dev/nvidiaN of a GPU; got 248",
        ),
    ],
)
def test_malformed_scenario_names_line_and_field(
    text: str, line: int, key: str | None, message: str
) -> None:
    with pytest.raises(ScenarioError) as err:
        parse_scenario("s.yaml", text)
    assert err.value.line == line
    assert err.value.key == key
    assert message in err.value.message
    assert str(err.value).startswith(f"s.yaml:{line}: ")


def test_a_scenario_s_true_false_keys_take_their_defaults_when_absent() -> None:
    text = "duration: 1m\ngpus: [{index: 0}, {index: 1, lost: true, persistence: false}]\n"
    text += "processes: [{name: a}, {name: b, visible: false, subreaper: true}]\n"
    scenario = parse_scenario("s.yaml", text)
    gpus = [(g.mig, g.coherent, g.persistence, g.lost) for g in scenario.gpus]
    assert gpus == [(False, False, True, False), (False, False, False, True)]
    procs = [(p.visible, p.subreaper, p.stops_for_reset) for p in scenario.processes]
    assert procs == [(True, False, False), (False, True, False)]


def test_inline_policy_errors_keep_the_scenario_line_numbers() -> None:
    text = "duration: 1m\ngpus: [{index: 0}]\npolicy:\n  dry_run: false\n  intervall: 5s\n"
    with pytest.raises(ScenarioError) as err:
        simulate(parse_scenario("s.yaml", text))
    assert err.value.line == 5
    assert err.value.key == "policy.intervall"
    assert "did you mean 'interval'" in err.value.message


@pytest.mark.parametrize("null", ["", "~", "null", "Null", "NULL"])
def test_an_empty_inline_policy_is_no_change_however_null_is_spelled(null: str) -> None:
    """``policy: Null`` passed the scenario's check as null and was then read as the text
    ``Null``, a policy whose top level is not a mapping."""
    scenario = parse_scenario("s.yaml", f"duration: 1m\ngpus: [{{index: 0}}]\npolicy: {null}\n")
    assert scenario.policy == ("s.yaml", "")


def test_cli_exits_65_on_a_malformed_scenario(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("duration: 1m\ngpus:\n  - index: zero\n")
    assert main(["simulate", str(path)]) == 65
    assert f"{path}:3: gpus[0].index:" in capsys.readouterr().err


def test_worker_ignoring_sigterm_gets_sigkill_when_the_wait_ends() -> None:
    r = simulate(parse_scenario("s.yaml", scenario(sigterm="ignore")))
    # confirmed 30s after it appeared at +10s; SIGKILL after the 30s wait.
    assert r.signals() == [
        (40.0, "worker", "SIGTERM", "delivered"),
        (70.0, "worker", "SIGKILL", "delivered"),
    ]


def test_exit_after_a_delay_is_seen_at_once_not_at_the_next_poll() -> None:
    r = simulate(parse_scenario("s.yaml", scenario(sigterm="exit_after 2500ms")))
    exits = r.entries(EventName.TARGET_EXITED)
    assert [e.t for e in exits] == [42.5]
    assert [s for _, _, s, _ in r.signals()] == ["SIGTERM"]


def test_a_process_exits_once_when_two_of_its_exits_fall_at_the_same_instant() -> None:
    text = scenario().replace("    nvml: {0: 4GiB}\n", "    nvml: {0: 4GiB}\n    exits_at: 10s\n")
    r = simulate(parse_scenario("s.yaml", text))
    exits = [(e.t, e.fields["process"]) for e in r.entries("world.exit")]
    assert exits == [(10.0, "trainer"), (40.0, "worker")]
    assert "(scenario: exit)" in r.entries("world.exit")[0].text


def test_dry_run_sends_nothing_and_says_what_it_would_do() -> None:
    r = simulate(parse_scenario("s.yaml", scenario(dry="true")))
    assert r.signals() == [
        (40.0, "worker", "SIGTERM", "dry_run"),
        (70.0, "worker", "SIGKILL", "dry_run"),
    ]
    assert r.final["signals_delivered"] == 0
    assert all(p["status"] != "exited" or p["name"] == "trainer" for p in r.final["processes"])  # type: ignore[attr-defined]


def test_pause_holds_the_ladder_until_resume() -> None:
    text = scenario() + "  - at: 5s\n    pause: maintenance\n  - at: 100s\n    resume: null\n"
    r = simulate(parse_scenario("s.yaml", text))
    assert [t for t, *_ in r.signals()] == [100.0]


def test_one_hour_scenario_runs_in_well_under_a_second() -> None:
    text = scenario().replace("duration: 3m", "duration: 1h")
    parsed = parse_scenario("s.yaml", text)
    started = time.process_time()  # the simulator's work (CPU), not the wall clock a load stretches
    r = simulate(parsed)
    assert time.process_time() - started < 1.0
    assert r.polls >= 3600 / 5


def test_cli_text_and_json(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(scenario())
    assert main(["simulate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "   +40.0s  action   Sent SIGTERM to pid" in out
    assert "final state at +180.0s" in out
    assert main(["simulate", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dry_run"] is False
    assert any(e["event"] == EventName.ACTION_SIGNAL and e["t"] == 40.0 for e in doc["timeline"])


def test_the_json_gives_the_interval_the_run_polled_at_as_the_header_does() -> None:
    r = simulate(parse_scenario("s.yaml", "duration: 1m\ninterval: 2s\ngpus: [{}]\n"))
    assert r.to_json()["interval"] == 2.0
    assert ", interval 2s, " in render_text(r).splitlines()[0]
    assert r.polls == 31
    r = simulate(parse_scenario("s.yaml", "duration: 1m\ngpus: [{}]\n"))
    assert r.to_json()["interval"] == 5.0  # the policy's


def test_config_file_replaces_the_inline_policy(tmp_path: pathlib.Path) -> None:
    config = tmp_path / "gpuwatchd.yaml"
    config.write_text(
        "dry_run: true\nrules:\n"
        "  - {name: o, kind: orphaned, steps: [{signal: SIGKILL, wait: 1s}]}\n"
    )
    r = simulate(parse_scenario("s.yaml", scenario()), str(config))
    assert r.signals() == [(10.0, "worker", "SIGKILL", "dry_run")]


# --- the reset: reset.perform_reset itself, against the virtual host ---------------------------

GHOST = """\
duration: 5m
policy:
  dry_run: {dry}
  reset:
    confirm_for: 1m
    timeout: 90s
    command: [/nonexistent/nvidia-smi, --gpu-reset, -i, "{{uuid}}"]
    before:
      - command: [systemctl, stop, nvidia-dcgm]
    after:
      - command: [systemctl, start, nvidia-dcgm]
gpus:
  - index: 0
    memory: {{leaked: 8GiB}}
processes:
  - name: nv-hostengine
    command: /usr/bin/nv-hostengine -n
    cgroup: /system.slice/nvidia-dcgm.service
    holds: {{gpus: [0], uvm: false}}
    stops_for_reset: true
events:
  - {{at: 0s, reset_result: {result}}}
"""


def ghost(result: str = "success", dry: str = "false") -> str:
    return GHOST.format(result=result, dry=dry)


@pytest.mark.parametrize(
    ("scripted", "result", "at", "needs_reboot", "reason"),
    [
        ("success", "success", 60.0, False, "successfully reset"),
        ("fail", "failed", 60.0, False, "exit 255: nvidia-smi reported an error"),
        ("in_use", "in_use", 60.0, False, "the driver says the GPU is in use by another client"),
        ("hang", "timeout", 150.0, False, "did not finish within 90.0s"),
        ("fell_off_bus", "failed", 60.0, True, "exit 15: GPU has fallen off the bus"),
    ],
)
def test_the_real_reset_procedure_reads_each_scripted_nvidia_smi_answer(
    scripted: str, result: str, at: float, needs_reboot: bool, reason: str
) -> None:
    r = simulate(parse_scenario("s.yaml", ghost(scripted)))
    [outcome] = r.entries(EventName.RESET_OUTCOME)
    assert (outcome.t, outcome.fields["result"]) == (at, result)
    assert outcome.fields["needs_reboot"] is needs_reboot
    assert reason in str(outcome.fields["reason"])
    assert r.final["gpus"][0]["lost"] is (scripted == "fell_off_bus")  # type: ignore[index]
    [command] = [e for e in r.entries(EventName.RESET_STEP) if e.fields["step"] == "reset"]
    assert command.fields["argv"] == [
        "/nonexistent/nvidia-smi",
        "--gpu-reset",
        "-i",
        r.scenario.gpus[0].uuid,
    ]
    # The undo and the after hooks run whatever the result.
    steps = [e.fields["step"] for e in r.entries(EventName.RESET_STEP)]
    assert steps[-3:] == ["persistence_on", "start_monitors", "after_hooks"]
    freed = r.final["gpus"][0]["allocated"] == r.final["gpus"][0]["idle"]  # type: ignore[index]
    assert freed is (result == "success")


def test_a_before_hook_stops_the_processes_that_stop_for_a_reset() -> None:
    r = simulate(parse_scenario("s.yaml", ghost()))
    [exit_] = r.entries("world.exit")
    assert exit_.t == 60.0
    assert "stopped by the reset's before hook" in exit_.text
    scan, reading = [e for e in r.entries(EventName.RESET_STEP) if e.fields["step"] == "final_scan"]
    assert (scan.fields["status"], reading.fields["status"]) == ("clear", "as_planned")
    assert r.resets()[0][2] == "success"


def test_a_dry_run_reset_runs_nothing_but_still_scans_for_holders() -> None:
    r = simulate(parse_scenario("s.yaml", ghost(dry="true")))
    outcome = r.entries(EventName.RESET_OUTCOME)[0]
    assert outcome.fields["result"] == "dry_run"
    # dry-run: no hook ran, so DCGM was never stopped, and the scan says a real reset would fail.
    assert "would be refused" in str(outcome.fields["reason"])
    assert "nv-hostengine" in str(outcome.fields["blockers"])
    assert r.entries("world.exit") == []
    statuses = {e.fields["status"] for e in r.entries(EventName.RESET_STEP)}
    assert statuses <= {"would_run", "blocked", "skipped"}
    assert r.final["gpus"][0]["allocated"] > r.final["gpus"][0]["idle"]  # type: ignore[index]


def test_a_during_event_happens_once_at_that_reset_step() -> None:
    text = ghost("in_use").replace(
        "events:\n",
        "events:\n  - during: persistence_off\n    set_memory: {gpu: 0, allocated: 9GiB}\n",
    )
    r = simulate(parse_scenario("s.yaml", text))
    [memory] = r.entries("world.memory")
    assert memory.t == 60.0
    assert memory.fields["during"] == "persistence_off"
    assert "(during the reset's persistence_off step)" in memory.text
    names = [e.name for e in r.timeline if e.t == 60.0]
    assert names.index("world.memory") < names.index(EventName.RESET_OUTCOME)


@pytest.mark.parametrize(
    ("text", "known"),
    [
        (
            "duration: 1m\ngpus: [{index: 0}]\nhosts: {}\n",
            "(did you mean 'host'?); known: description, duration, interval, policy, host, "
            "gpus, processes, events",
        ),
        (
            "duration: 1m\ngpus: [{index: 0}]\nprocesses: [{name: a, pids: 3}]\n",
            "(did you mean 'pid'?); known: name, pid, ppid, pgid, sid, user, uid, command, "
            "comm, exe, exe_trusted, cgroup, state, holds, nvml, on_sigterm, on_sigkill, "
            "on_exit, exits_at, visible, subreaper, stops_for_reset, files",
        ),
    ],
)
def test_an_unknown_field_names_the_known_ones_in_the_formats_order(text: str, known: str) -> None:
    with pytest.raises(ScenarioError) as err:
        parse_scenario("s.yaml", text)
    assert err.value.message == f"unknown field {known}"
    assert err.value.line == 3


@pytest.mark.parametrize(
    ("event", "message"),
    [
        ("{during: rest, exit: a}", "expected one of drain, stop_nvml"),
        ("{during: done, exit: a}", "expected one of drain"),
        ("{at: 1s, during: drain, exit: a}", "'at' or 'during', not both"),
        ("{exit: a}", "missing required field 'at'"),
    ],
)
def test_malformed_during_events_are_refused(event: str, message: str) -> None:
    text = f"duration: 1m\ngpus: [{{index: 0}}]\nprocesses: [{{name: a}}]\nevents:\n  - {event}\n"
    with pytest.raises(ScenarioError) as err:
        parse_scenario("s.yaml", text)
    assert message in err.value.message
    assert err.value.line == 5


def test_the_summary_names_findings_instead_of_printing_their_keys() -> None:
    from gpuwatchd.events.words import finding_label
    from gpuwatchd.sim.timeline import TimelineNamer

    names = TimelineNamer(TrainerNames())
    key = "dead_process:GPU-00000000-0000-0000-0000-000000000000:91234"
    assert finding_label(key, names) == "dead_process pid 91234 (trainer) on GPU 0"
    gpu_key = "ghost_memory:GPU-00000000-0000-0000-0000-000000000000:gpu"
    assert finding_label(gpu_key, names) == "ghost_memory GPU 0"


def test_the_summary_names_a_reused_pid_by_the_process_that_has_it_at_the_end() -> None:
    text = """\
duration: 1m
gpus: [{}]
processes:
  - {name: first, pid: 5000, holds: [0], exits_at: 10s}
events:
  - {at: 20s, start: {name: second, pid: 5000, holds: [0]}}
"""
    r = simulate(parse_scenario("s.yaml", text))
    summary = render_text(r).splitlines()[-1]
    assert summary == "  open findings: hidden_holder pid 5000 (second) on GPU 0"


@pytest.mark.parametrize("description", ['" "', '"\\n"', "|\n  first\n  second"])
def test_the_header_shows_a_descriptions_first_line_and_nothing_for_a_blank_one(
    description: str,
) -> None:
    r = simulate(
        parse_scenario("s.yaml", f"description: {description}\nduration: 1m\ngpus: [{{}}]\n")
    )
    shown = render_text(r).splitlines()[1]
    assert shown == ("  first" if "first" in description else "")


def test_the_summary_gives_a_gpus_memory_in_one_unit() -> None:
    text = ORPHANS.format(dry="true", sigterm="ignore").replace("4GiB", "5GiB")
    path = "one-unit.yaml"
    result = simulate(parse_scenario(path, text))
    (line,) = [ln for ln in render_text(result).splitlines() if ln.strip().startswith("GPU 0:")]
    assert "GiB" not in line
    assert "MiB allocated (idle" in line


@pytest.mark.parametrize(
    ("field", "value"),
    [("uuid", "GPU-1,GPU-2"), ("uuid", "GPU-not-hex"), ("pci_bus_id", "-i0")],
)
def test_a_gpu_id_the_driver_would_never_report_is_refused_with_its_line(
    field: str, value: str
) -> None:
    text = f"duration: 1m\ngpus:\n  - index: 0\n    {field}: '{value}'\n"
    with pytest.raises(ScenarioError) as caught:
        parse_scenario("ids.yaml", text)
    assert caught.value.line == 4
    assert f"gpus[0].{field}" in str(caught.value)


@pytest.mark.parametrize(("value", "what"), [("abc", "invalid duration"), ("0s", "must be >=")])
def test_a_refused_scenario_interval_names_its_line(value: str, what: str) -> None:
    """A malformed duration names its line, as an out-of-range one always did."""
    with pytest.raises(ScenarioError) as caught:
        parse_scenario("s.yaml", f"duration: 1m\ninterval: {value}\ngpus: [{{}}]\n")
    assert caught.value.line == 2
    assert str(caught.value).startswith(f"s.yaml:2: interval: {what}")


LONG = "x" * 5000


@pytest.mark.parametrize(
    "text",
    [
        f"host: {LONG}\n",
        f"processes: [{{name: a, ppid: {LONG}}}]\n",
        f"processes: [{{name: a, state: {LONG}}}]\n",
        f"events: [{{at: 1s, exit: {LONG}}}]\n",
        f"gpus: [{{mig: {{instances: [{{gi: 1, profile: {LONG}}}]}}}}]\n",
    ],
)
def test_a_scenario_error_quotes_a_long_value_cut_short(text: str) -> None:
    """A value in a scenario error is quoted as a policy's is (at most 60 characters), never
    whole: a hostile file may hold a megabyte in one value."""
    with pytest.raises(ScenarioError) as err:
        parse_scenario(
            "s.yaml", "duration: 1m\n" + (text if "gpus" in text else "gpus: [{}]\n" + text)
        )
    assert "x" * 50 in err.value.message
    assert len(err.value.message) < 200


def test_a_scenario_error_names_a_boolean_as_a_policy_error_does() -> None:
    with pytest.raises(ScenarioError) as err:
        parse_scenario("s.yaml", "duration: 1m\ngpus: [{index: 0}]\nhost: true\n")
    assert err.value.message == "expected a mapping, got boolean true"


@pytest.mark.parametrize(
    ("gpus", "line", "key", "message"),
    [
        ("  - {}\n  - {pci_bus_id: '0000:17:00.0'}\n", 4, "gpus[1].pci_bus_id", "00:17:00.0'"),
        ("  - {}\n  - {index: 1, minor: 0}\n", 4, "gpus[1].minor", "minor 0"),
    ],
)
def test_two_gpus_with_one_name_are_refused_at_the_second(
    gpus: str, line: int, key: str, message: str
) -> None:
    """A PCI bus id is compared however it is spelled (the default of GPU 0 is 00000000:17:00.0)."""
    with pytest.raises(ScenarioError) as err:
        parse_scenario("s.yaml", f"duration: 1m\ngpus:\n{gpus}")
    assert (err.value.line, err.value.key) == (line, key)
    assert err.value.message.startswith("two GPUs have the same ")
    assert message in err.value.message


def test_the_default_pci_bus_ids_of_many_gpus_differ() -> None:
    """The default bus number repeats every 16 GPUs; the 17th is in PCI domain 1."""
    scenario = parse_scenario("s.yaml", "duration: 1m\ngpus: [" + "{}, " * 40 + "]\n")
    buses = [gpu.pci_bus_id for gpu in scenario.gpus]
    assert len(set(buses)) == 40
    assert buses[:2] + buses[15:17] == [
        "00000000:17:00.0", "00000000:27:00.0", "00000000:07:00.0", "00000001:17:00.0"
    ]  # fmt: skip


def test_an_automatic_pid_skips_every_pid_the_scenario_writes() -> None:
    """b's PID is written after a's is assigned; an event's start may name a PID as well."""
    text = "duration: 1m\ngpus: [{}]\nprocesses: [{name: a}, {name: b, pid: 1000}, {name: c}]\n"
    text += "events: [{at: 5s, start: {name: d, pid: 1001}}, {at: 6s, start: {name: e}}]\n"
    scenario = parse_scenario("s.yaml", text)
    assert [p.pid for p in scenario.processes] == [1002, 1000, 1003]
    assert [e.process.pid for e in scenario.events if e.process] == [1001, 1004]


def test_two_processes_listed_with_one_pid_are_refused_at_the_second() -> None:
    text = (
        "duration: 1m\ngpus: [{}]\nprocesses:\n  - {name: a, pid: 5000}\n  - {name: b, pid: 5000}\n"
    )
    with pytest.raises(ScenarioError) as err:
        parse_scenario("s.yaml", text)
    assert (err.value.line, err.value.key) == (5, "processes[1].pid")
    assert err.value.message == "two processes have PID 5000 ('a' and 'b')"


@pytest.mark.parametrize("interval", ["10ms", "2h"])
def test_a_scenario_interval_is_bounded_as_the_policys(interval: str) -> None:
    """The daemon never polls every 10ms: its policy refuses it, and so does the scenario."""
    with pytest.raises(ScenarioError) as err:
        parse_scenario("s.yaml", f"duration: 1m\ninterval: {interval}\ngpus: [{{}}]\n")
    assert (err.value.line, err.value.key) == (2, "interval")
    assert err.value.message.startswith("must be >= 100ms and <= 1h, got")


def test_a_scenario_s_names_and_commands_are_shown_escaped_one_line_each() -> None:
    """docs/threat-model.md: simulate's terminal output shows every control character as a
    visible escape. A process named with a line break or an ANSI escape (a double-quoted YAML
    escape) forged timeline lines and painted the terminal, in the text and in the JSON's
    sentences alike."""
    text = (
        'duration: 1m\ndescription: "a \\e[2J scenario"\ngpus: [{index: 0}]\nprocesses:\n'
        '  - {name: "t\\e[31m", holds: [0], nvml: {0: 1GiB}}\n'
        '  - {name: "w\\nforged", ppid: "t\\e[31m", holds: [0]}\n'
        'events:\n  - {at: 1s, exit: "t\\e[31m"}\n'
        '  - {at: 2s, start: {name: s, command: ["sh", "-c", "x\\ny"]}}\n'
    )
    result = simulate(parse_scenario("s.yaml", text))
    lines = render_text(result).splitlines()
    assert all(line.isprintable() for line in lines)
    assert not any(line.startswith("forged") or line == "y" for line in lines)
    assert "w\\nforged" in render_text(result)
    assert "t\\x1b[31m" in render_text(result)
    assert all(entry.text.isprintable() for entry in result.timeline)


def test_a_pause_is_read_at_the_daemons_next_poll_not_in_the_middle_of_a_reset() -> None:
    """The daemon reads the pause file when a poll starts: a ``gpuwatchd pause`` between two
    polls, or while a reset runs, holds nothing before the next poll. The simulation paused
    the engine at the event itself, so a pause during a reset's drain step withheld that
    reset's on_failure hooks, which the daemon runs, and said the pause seconds early."""
    text = (
        "duration: 3m\npolicy:\n  dry_run: false\n  reset: {confirm_for: 1m, cooldown: 1h}\n"
        "  on_failure:\n    - command: [logger, reset failed]\n"
        "gpus: [{index: 0, memory: {leaked: 10GiB}}]\n"
        "events:\n  - {at: 0s, reset_result: fail}\n  - {during: drain, pause: maintenance}\n"
        "  - {at: 97s, resume: null}\n"
    )
    r = simulate(parse_scenario("s.yaml", text))
    assert r.final["hooks_run"] == 1  # on_failure, run as the daemon would
    assert [e.t for e in r.entries(EventName.DAEMON_PAUSED)] == [65.0]  # the poll after the reset
    assert [e.t for e in r.entries(EventName.DAEMON_RESUMED)] == [100.0]


def test_a_process_killed_while_stuck_in_d_state_dies_when_it_leaves_it() -> None:
    """SIGKILL stays pending while a process sleeps uninterruptibly; it dies as soon as the
    driver lets it go. The simulated worker lived on, SIGKILLed and in state S, its memory
    pinned and its finding open, where the daemon would have seen it exit."""
    text = scenario(sigterm="ignore").replace("via: map}", "via: map}\n    on_sigkill: stuck")
    r = simulate(parse_scenario("s.yaml", text + "  - {at: 150s, state: {worker: S}}\n"))
    worker = next(p for p in r.final["processes"] if p["name"] == "worker")  # type: ignore[attr-defined]
    assert [s["signal"] for s in worker["signals"]] == ["SIGTERM", "SIGKILL"]
    assert (worker["status"], worker["exited_at"]) == ("exited", 150.0)
    assert r.final["open_findings"] == []


def test_a_zombie_whose_parent_exits_is_reaped_by_init() -> None:
    """A zombie's parent exits: init inherits it and reaps it at once (NVML then lists a dead
    PID). The simulated zombie stayed in the process table for good, its finding saying that
    its parent 1 must reap it, a state no host shows."""
    text = (
        "duration: 1m\ngpus: [{}]\nprocesses:\n  - {name: parent}\n"
        "  - {name: child, ppid: parent, holds: [0], nvml: {0: 4GiB}, on_exit: zombie}\n"
        "  - {name: grandchild, ppid: child, holds: [0]}\n"
        "events:\n  - {at: 10s, exit: child}\n  - {at: 20s, exit: parent}\n"
    )
    r = simulate(parse_scenario("s.yaml", text))
    child = next(p for p in r.final["processes"] if p["name"] == "child")  # type: ignore[attr-defined]
    assert child["status"] == "exited"
    assert "init reaps its zombie child child (pid 1001)" in r.entries("world.exit")[-1].text
    assert not any("parent 1 must reap" in e.text for e in r.timeline)
    kinds = {key.split(":")[0] for key in r.final["open_findings"]}  # type: ignore[attr-defined]
    assert "dead_process" in kinds
    assert "zombie" not in kinds


def test_a_pid_still_in_use_is_refused_naming_the_processes_escaped() -> None:
    """The refusal names both processes as the timeline does: escaped, on one line."""
    text = (
        'duration: 1m\ngpus: [{}]\nprocesses:\n  - {name: "a\\nforged", pid: 5000}\n'
        'events:\n  - {at: 1s, start: {name: "b\\e[2J", pid: 5000}}\n'
    )
    with pytest.raises(SimulationError) as err:
        simulate(parse_scenario("s.yaml", text))
    assert str(err.value) == "s.yaml:6: pid 5000 (b\\x1b[2J) is still in use by a\\nforged at +1s"


def test_a_listed_mps_server_makes_the_node_report_only_as_the_daemon_reads_it() -> None:
    """The daemon's collector says an MPS server runs when a trusted one is in the process
    table (clients' contexts live in it: report-only). The simulated host said so only by
    host.mps_server_running, so a scenario listing root's nvidia-cuda-mps-server had its
    orphan signalled, which the daemon on that host would never do."""
    mps = "  - {name: mps, command: /usr/bin/nvidia-cuda-mps-server, holds: [0]}\n"
    text = scenario().replace("processes:\n", "processes:\n" + mps)
    r = simulate(parse_scenario("s.yaml", text))
    assert r.signals() == []
    new = r.entries(EventName.FINDING_NEW)
    assert new
    assert all(e.fields["actionable"] is False for e in new)
    assert "(report only: no rule acts on it)" in new[0].text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "duration: 1h\ngpus: [{}]\nprocesses:\n"
            + "".join(f"  - {{name: p{i}}}\n" for i in range(3999))
            + "events:\n  - {at: 1s, start: {name: s}}\n",
            "4000 processes over 720 polls are 2,880,000 process-polls; at most 2,000,000 are "
            "simulated (fewer processes, a shorter duration or a longer interval)",
        ),
        (
            "duration: 1d\ngpus: [" + "{}, " * 248 + "]\n",
            "248 GPUs over 17280 polls are 4,285,440 GPU-polls; at most 2,000,000 are "
            "simulated (fewer GPUs, a shorter duration or a longer interval)",
        ),
    ],
)
def test_a_scenario_of_too_many_processes_or_gpus_over_its_polls_is_refused_up_front(
    text: str, message: str
) -> None:
    """Each poll reads every process (some 40 us each): 4,000 processes over an hour at 5s were
    two minutes of work, and a 1 MiB scenario of 35,000 over 100,000 polls hours, a run that
    never ends for whoever started it. And every GPU, some 100 us each at 248 and more past it
    (3 s a poll at 4,000): one of 250,000 GPUs took hours a poll (a GPU's minor is at most the
    driver's 247, so there are at most 248). Refused before the first poll, as too many polls
    are."""
    parsed = parse_scenario("s.yaml", text)
    with pytest.raises(SimulationError) as err:
        Simulation(parsed, scenario_policy(parsed, None)[0])
    assert str(err.value) == f"s.yaml: {message}"


def test_a_pause_without_resume_ends_by_itself_after_limits_max_pause() -> None:
    """``gpuwatchd pause`` without --for lasts limits.max_pause (docs/policy.md: a forgotten
    pause ends by itself), and the daemon resumes at its first poll after that. The simulated
    pause had no end: the orphan was never signalled, where the daemon signals it."""
    text = scenario().replace("  dry_run: false\n", "  dry_run: false\n  limits: {max_pause: 1m}\n")
    r = simulate(parse_scenario("s.yaml", text + "  - {at: 5s, pause: maintenance}\n"))
    (paused,) = r.entries(EventName.DAEMON_PAUSED)
    assert (paused.t, paused.fields["until"]) == (5.0, WALL0 + 65.0)
    (resumed,) = r.entries(EventName.DAEMON_RESUMED)
    assert resumed.t == 65.0
    assert resumed.fields["reason"] == "the pause ended by itself (its time was up)"
    assert [(t, sig) for t, name, sig, _ in r.signals() if name == "worker"] == [(65.0, "SIGTERM")]
