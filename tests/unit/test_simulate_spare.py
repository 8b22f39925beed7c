"""simulate's ``spare`` event: ``gpuwatchd spare`` in a scenario, honoured by the daemon's own
rule (a PID with its start time, or a job), ended by itself, and refused when malformed."""

from __future__ import annotations

import pytest

from gpuwatchd.core.vocabulary import EventName
from gpuwatchd.sim.scenario import parse_scenario
from gpuwatchd.sim.scenario_spec import ScenarioError
from gpuwatchd.sim.simulation import simulate
from gpuwatchd.sim.timeline import SimulationResult

JOB = "/system.slice/slurmstepd.scope/job_42/step_0"
BASE = f"""\
description: an orphan, spared or not
duration: 4m
policy: {{dry_run: false}}
gpus: [{{index: 0}}]
processes:
  - {{name: trainer, pid: 4242, command: python t.py, holds: [0], nvml: {{0: 8GiB}},
      cgroup: {JOB}}}
  - {{name: worker, pid: 4250, ppid: trainer, pgid: trainer, command: python t.py,
      holds: {{gpus: [0], via: map}}, cgroup: {JOB}}}
events:
  - {{at: 20s, exit: trainer}}
"""


def play(*events: str) -> SimulationResult:
    text = BASE + "".join(f"  - {e}\n" for e in events)
    return simulate(parse_scenario("s.yaml", text))


def sigterms(result: SimulationResult) -> list[float]:
    return [t for t, name, sig, _ in result.signals() if name == "worker" and sig == "SIGTERM"]


def test_without_a_spare_the_orphan_is_stopped_after_its_confirmation() -> None:
    assert sigterms(play()) == [50.0]


def test_a_job_spare_holds_every_process_of_the_job_until_it_ends() -> None:
    r = play('{at: 5s, spare: {job: "42", for: 100s, reason: bench}}')
    assert sigterms(r) == [105.0]
    (started,) = r.entries(EventName.SPARE_STARTED)
    assert (started.fields["target"], started.fields["reason"]) == ("job:slurm:42", "bench")


def test_a_process_spare_given_after_it_exited_spares_nobody() -> None:
    r = play("{at: 5s, exit: worker}", "{at: 6s, spare: {process: worker, for: 1h, reason: x}}")
    assert r.entries(EventName.SPARE_STARTED) == []


def test_a_later_spare_of_the_same_target_replaces_the_first() -> None:
    r = play(
        "{at: 5s, spare: {process: worker, for: 60s, reason: first}}",
        "{at: 30s, spare: {process: worker, for: 60s, reason: longer}}",
    )
    assert sigterms(r) == [90.0]
    assert [e.fields.get("why") for e in r.entries(EventName.SPARE_ENDED)] == [
        "replaced by a new spare",
        "its time was up",
    ]


@pytest.mark.parametrize(
    ("event", "message"),
    [
        ("{at: 5s, spare: {process: worker}}", "spare needs 'for'"),
        ("{at: 5s, spare: {for: 1m}}", "one of 'process' or 'job'"),
        ("{at: 5s, spare: {process: worker, job: '42', for: 1m}}", "one of 'process' or 'job'"),
        ("{at: 5s, spare: {process: nobody, for: 1m, reason: x}}", "no process named 'nobody'"),
        ("{at: 5s, spare: {job: 'a b', for: 1m}}", "spare"),
        ("{at: 5s, spare: {process: worker, for: 0s, reason: x}}", "more than 0s"),
        ("{at: 5s, spare: {process: worker, for: 1m, until: 2m}}", "until"),
        ("{at: 5s, spare: {process: worker, for: 1m}}", "a 'reason'"),
        ("{at: 5s, spare: {process: worker, for: 1m, reason: ''}}", "a 'reason'"),
    ],
)
def test_a_malformed_spare_event_is_refused_naming_the_line(event: str, message: str) -> None:
    with pytest.raises(ScenarioError) as caught:
        play(event)
    assert message in str(caught.value)
    assert str(caught.value).startswith("s.yaml:12:")


@pytest.mark.parametrize("lasts", ["0.5s", "2d"])
def test_a_spare_the_spare_command_would_refuse_is_refused(lasts: str) -> None:
    """``gpuwatchd spare --for`` takes 1s to limits.max_spare (1d by default); a scenario
    played a spare the command refuses."""
    from gpuwatchd.sim.world import SimulationError

    with pytest.raises(SimulationError) as caught:
        play(f"{{at: 5s, spare: {{process: worker, for: {lasts}, reason: x}}}}")
    assert str(caught.value).startswith("s.yaml:12: spare for: ")
    assert str(caught.value).endswith("must be between 1s and limits.max_spare (1d)")
    longer = BASE.replace("{dry_run: false}", "{dry_run: false, limits: {max_spare: 2d}}")
    spared = simulate(
        parse_scenario("s.yaml", longer + "  - {at: 5s, spare: {job: '42', for: 2d, reason: x}}\n")
    )
    assert sigterms(spared) == []


def test_a_spares_reason_is_cut_and_no_more_spares_are_in_force_than_the_command_allows() -> None:
    """As ``gpuwatchd spare``: its reason is cut to MAX_REASON characters, and a spare of a new
    target while MAX_SPARES are in force is refused (one of a target in force replaces it)."""
    from gpuwatchd.core.checked import MAX_REASON
    from gpuwatchd.core.vocabulary import EventName
    from gpuwatchd.sim.world import SimulationError
    from gpuwatchd.state.spares import MAX_SPARES

    (started,) = play(f"{{at: 5s, spare: {{job: '42', for: 1m, reason: {'x' * 600}}}}}").entries(
        EventName.SPARE_STARTED
    )
    assert started.fields["reason"] == "x" * MAX_REASON
    spares = [f"{{at: 5s, spare: {{job: '{i}', for: 1m, reason: x}}}}" for i in range(MAX_SPARES)]
    again = "{at: 6s, spare: {job: '0', for: 2m, reason: longer}}"
    assert sigterms(play(*spares, again, "{at: 70s, spare: {job: '99', for: 1m, reason: x}}"))
    with pytest.raises(SimulationError) as caught:
        play(*spares, again, "{at: 7s, spare: {job: '99', for: 1m, reason: x}}")
    assert str(caught.value).startswith(f"s.yaml:{12 + MAX_SPARES + 1}: spare: ")
    assert f"{MAX_SPARES} spares are in force" in str(caught.value)
