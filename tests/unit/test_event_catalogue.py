"""The event catalogue (gpuwatchd/events/catalogue.py) is the one place an event is worded:
every event has a sentence of its own, the journal and simulate's timeline say the same
sentence (only the names of processes and GPUs differ), the events the engine emits carry the
catalogue's fields at one of its levels, and the journal of a kill and of a reset reads as a
short story (golden files under tests/golden/)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from gpuwatchd.core.vocabulary import RESET_STEPS, EventName, Level, SignalOutcome, level_of
from gpuwatchd.events.catalogue import CATALOGUE, notification, render
from gpuwatchd.events.logs import LEVELS, priority_prefix
from gpuwatchd.events.words import JournalNamer, Said, finding_label, outcome_table, spec_table
from gpuwatchd.sim.scenario import load_scenario
from gpuwatchd.sim.simulation import simulate
from gpuwatchd.sim.timeline import SimulationResult, TimelineNamer
from tests.support.simnames import TrainerNames

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "examples" / "scenarios"
GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden"
GPU = "GPU-5a1e7e6c-0000-4000-8000-000000000001"

# A value for every field any event carries: enough for each sentence to say something.
SAMPLE_VALUES: dict[str, object] = {
    "pid": 4242,
    "start_ticks": 987654,
    "gpu": GPU,
    "finding": f"orphaned:{GPU}:4242@987654",
    "kind": "orphaned",
    "rule": "orphans",
    "step": 1,
    "of": 2,
    "signal": "SIGTERM",
    "outcome": "delivered",
    "result": "success",
    "status": "ok",
    "why": "the reason it happened",
    "reason": "the reason it happened",
    "argv": ["/usr/bin/true", "x"],
    "hook": "on_failure",
    "returncode": 0,
    "dry_run": False,
    "comm": "python",
    "version": "1.0",
    "exit_code": 0,
    "path": "/var/lib/gpuwatchd",
    "error": "No space left on device",
    "lasted": 30,
    "wait": 30,
    "timeout": 10,
    "blockers": ["pid 7 holds the GPU"],
    "left": ["GPU 0: orphaned pid 7"],
    "steps": ["SIGTERM to pid 4242"],
    "missing": ["CAP_KILL"],
    "needs_restart": ["state_dir"],
    "job": "1234",
    "scope": "node",
    "parent": 4241,
    "seconds": 3600,
    "waited": 12,
    "failures": 1,
    "assumed": "success: would have reset",
}


def sample_fields(event: EventName) -> dict[str, object]:
    """Every field of ``event`` that has a sample value."""
    return {key: SAMPLE_VALUES[key] for key in CATALOGUE[event].fields if key in SAMPLE_VALUES}


class SameNames:
    """A timeline's names that read exactly like the journal's."""

    def pname(self, pid: object) -> str:
        return JournalNamer().process(pid)

    def gname(self, uuid: object) -> str:
        return JournalNamer().gpu(uuid)


def test_every_event_name_has_one_catalogue_entry() -> None:
    assert set(CATALOGUE) == set(EventName)


@pytest.mark.parametrize("event", list(EventName))
def test_every_event_has_a_sentence_of_its_own(event: EventName) -> None:
    """Not the fallback (the event's name): a sentence an administrator reads without docs."""
    said = render(str(event), sample_fields(event))
    assert said.isprintable()
    assert said.endswith(".")
    assert not said.startswith(str(event)), said
    assert said[0].isupper() or said.startswith(("gpuwatchd", "kcmp", "run --once")), said


@pytest.mark.parametrize("event", list(EventName))
def test_the_journal_and_the_timeline_say_one_sentence(event: EventName) -> None:
    """With names alike, the timeline's line is the journal's sentence, letter for letter;
    with the simulator's own names only the names differ. (``comm`` is an input of the
    journal's names only: the timeline names a process by the scenario's name for it.)"""
    fields = {k: v for k, v in sample_fields(event).items() if k != "comm"}
    journal = render(str(event), fields)
    assert render(str(event), fields, TimelineNamer(SameNames())) == journal
    timeline = render(str(event), fields, TimelineNamer(TrainerNames()))
    assert timeline == render(str(event), fields, _SimNamer())


class _SimNamer:
    def process(self, pid: object, comm: object = None) -> str:
        return TrainerNames().pname(pid)

    def gpu(self, uuid: object) -> str:
        return "GPU 0"

    def moment(self, monotonic: object) -> str | None:
        return f"+{float(monotonic):.1f}s" if isinstance(monotonic, (int, float)) else None


def test_a_sentence_never_raises_and_stays_one_line() -> None:
    class Broken:
        def __str__(self) -> str:
            raise RuntimeError("no")

    for event in EventName:
        said = render(str(event), dict.fromkeys(CATALOGUE[event].fields, Broken()))
        assert said
        assert said.isprintable()
        said = render(str(event), dict.fromkeys(CATALOGUE[event].fields, "a\nb\x1b[2J"))
        assert "\n" not in said
        assert "\x1b" not in said


def test_a_finding_key_is_said_in_words_not_as_the_internal_key() -> None:
    key, names = f"orphaned:{GPU}:2776@346316", TimelineNamer(TrainerNames())
    assert finding_label(key, names) == "orphaned pid 2776 (trainer) on GPU 0"
    assert "@" not in render(str(EventName.FINDING_RESOLVED), {"finding": key, "lasted": 5})
    assert finding_label(f"ghost_memory:{GPU}:{GPU}", names) == "ghost_memory GPU 0"
    # a target int() cannot read (a superscript digit, more digits than int() takes) names no
    # process, and the sentence is kept
    for target in ("\u00b2", "9" * 5000):
        assert finding_label(f"orphaned:{GPU}:{target}@1", names) == "orphaned GPU 0"
    said = render(str(EventName.FINDING_RESOLVED), {"finding": f"orphaned:{GPU}:\u00b2@1"})
    assert said.startswith("Finding resolved")


@pytest.mark.parametrize(
    ("facts", "said"),
    [
        (
            {
                "action": "signal",
                "outcome": "freed",
                "pid": 2154,
                "user": "root",
                "gpu": GPU,
                "rule": "orphans",
                "why": "target exited",
            },
            f"PID 2154 of user root on {GPU}, signalled by rule orphans, was stopped; its GPU"
            " memory is freed (target exited).",
        ),
        (
            {"action": "reset", "outcome": "reset", "gpu": GPU},
            f"{GPU} was reset.",
        ),
        (
            {"action": "reset", "outcome": "reset_failed", "gpu": GPU, "user": "ann"},
            f"{GPU} of user ann could not be reset.",
        ),
        (
            {"action": "mig_recovery", "outcome": "reset", "gpu": GPU, "gi": 1},
            f"MIG GPU instance 1 of {GPU} was re-created.",
        ),
    ],
)
def test_a_notification_reads_as_a_sentence(facts: dict[str, object], said: str) -> None:
    assert notification(facts) == said


def test_events_the_engine_emits_carry_the_catalogue_s_fields_at_its_levels() -> None:
    """Every example scenario, as written and enforced: each event's fields are among those
    the catalogue lists for it, and its level is one the catalogue allows."""
    wrong = set()
    for path in sorted(SCENARIOS.glob("*.yaml")):
        for enforce in (False, True):
            for entry in simulate(load_scenario(str(path)), enforce=enforce).timeline:
                if entry.name.startswith(("world.", "sim.")):
                    continue
                spec = CATALOGUE[EventName(entry.name)]
                extra = set(entry.fields) - set(spec.fields) - {"process"}  # simulate's own
                if extra:
                    wrong.add(f"{entry.name}: fields {sorted(extra)} not in the catalogue")
                if entry.level not in spec.levels:
                    wrong.add(f"{entry.name}: level {entry.level} not in {sorted(spec.levels)}")
    assert not wrong, "\n".join(sorted(wrong))


# --- the journal as a story (golden) --------------------------------------------------------------


def journal_story(result: SimulationResult, keep: re.Pattern[str]) -> str:
    """The journal's sentences (journal names) of the daemon's events whose sentence matches
    ``keep``, one per line, with the timeline's time."""
    lines = []
    for entry in result.timeline:
        if entry.name.startswith(("world.", "sim.")):
            continue
        said = render(entry.name, entry.fields)
        if keep.search(said):
            lines.append(f"+{entry.t:g}s {said}")
    return "\n".join(lines) + "\n"


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    assert path.read_text() == text, f"{path} differs; the journal now reads:\n{text}"


def test_the_journal_of_a_kill_reads_as_one_story() -> None:
    """The orphaned DataLoader worker 4252: found, confirmed, SIGTERM, SIGKILL, exited, over."""
    result = simulate(load_scenario(str(SCENARIOS / "dataloader-orphans.yaml")))
    story = journal_story(result, re.compile(r"PID 4252\b"))
    _golden("journal-kill.txt", story)
    assert story.count("\n") >= 6


def test_the_journal_of_a_reset_reads_as_one_story() -> None:
    """One reset is one story: every line names the reset of that GPU, its steps numbered in
    order, then its outcome and its booking."""
    result = simulate(load_scenario(str(SCENARIOS / "reset-fails-drain.yaml")))
    gpu = str(result.resets()[0][1])
    story = journal_story(result, re.compile(re.escape(gpu)))
    _golden("journal-reset.txt", story)
    steps = [int(n) for n in re.findall(r", step (\d+)/\d+ ", story)]
    assert steps == sorted(steps)
    assert len(steps) >= len(RESET_STEPS) - 2
    reset_lines = [ln for ln in story.splitlines() if "step" in ln or "booked" in ln]
    assert all(f"Reset of {gpu}" in ln for ln in reset_lines), story


# --- levels: one definition ---------------------------------------------------------------


def test_levels_are_defined_once_in_the_vocabulary() -> None:
    """The journald priorities and logging numbers of the log setup are the vocabulary's."""
    assert [(lv.value, lv.priority) for lv in Level] == [
        ("debug", 7), ("info", 6), ("warning", 4), ("error", 3), ("critical", 2),
    ]  # fmt: skip
    for level in Level:
        assert priority_prefix(level) == f"<{level.priority}>"
        assert LEVELS[level.value] == level.number
    assert level_of("exception") is Level.ERROR
    assert level_of("warn") is Level.WARNING
    assert priority_prefix("fatal") == "<2>"


def _bare_level_arguments(tree: ast.AST) -> list[int]:
    """Lines of ``Event(name, "info", …)``, ``.event(…)``, ``.emit(…)``, ``._emit(…)`` and
    ``.add(…)`` calls whose level is a bare string instead of a :class:`Level`."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or len(node.args) < 2:
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        level = node.args[1]
        if name in ("Event", "event", "emit", "_emit", "add") and (
            isinstance(level, ast.Constant) and str(level.value) in {lv.value for lv in Level}
        ):
            found.append(node.lineno)
    return found


def test_no_event_is_given_a_bare_level_string() -> None:
    offenders = []
    for path in sorted((ROOT / "gpuwatchd").rglob("*.py")):
        for line in _bare_level_arguments(ast.parse(path.read_text())):
            offenders.append(f"{path.relative_to(ROOT)}:{line}")
    assert not offenders, "use gpuwatchd.core.vocabulary.Level:\n" + "\n".join(offenders)


def test_the_bare_level_finder_finds_them() -> None:
    tree = ast.parse('w.event(E.X, "info", a=1)\nw.event(E.X, Level.INFO)\nEvent(n, "error", {})')
    assert _bare_level_arguments(tree) == [1, 3]


# --- outcome tables -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "delivered Sent.\nbogus Not an outcome.",  # a key the enum does not have
        "delivered Sent.\ndelivered Again.",  # a repeat
        "delivered",  # no sentence
        "* One.\n* Two.",  # two fallbacks
    ],
)
def test_an_outcome_table_refuses_a_line_it_cannot_mean(text: str) -> None:
    with pytest.raises(ValueError, match="SignalOutcome table: not an outcome, or again"):
        outcome_table(SignalOutcome, text)


def test_an_outcome_table_keeps_its_fallback_and_extra_outcomes() -> None:
    table = outcome_table(SignalOutcome, "\n  gone  It left.\n  error Broke.\n * Else.\n", "error")
    assert table == {"gone": "It left.", "error": "Broke.", "": "Else."}


@pytest.mark.parametrize(
    "text",
    [
        "DAEMON_STOP INFO: exit_code\n    Stopped.\nDAEMON_STOP INFO: exit_code\n    Again.",
        "DAEMON_STOP INFO: exit_code",  # no sentence
    ],
)
def test_an_event_table_refuses_an_entry_again_or_without_a_sentence(text: str) -> None:
    with pytest.raises(ValueError, match="event table: again, or no sentence"):
        spec_table(text)


@pytest.mark.parametrize(
    ("dry_run", "said"), [(True, "Dry run: Over until +5.0s."), (False, "Over.")]
)
def test_a_template_says_dry_run_and_a_deadline_where_the_namer_places_it(
    dry_run: bool, said: str
) -> None:
    fields = {"dry_run": dry_run, "due": 5.0 if dry_run else None}
    assert Said(fields, TimelineNamer(TrainerNames())).fill("{dry}Over{due:until}.") == said


def test_an_event_table_entry_has_its_levels_field_groups_and_sentence() -> None:
    table = spec_table("DAEMON_STOP INFO ERROR: MIG code\n    Stopped\n    ({code}).")
    entry = table[EventName.DAEMON_STOP]
    assert (entry.level, entry.also) == (Level.INFO, frozenset({Level.ERROR}))
    assert entry.fields == ("instance", "gi", "recovery", "code")
    assert entry.say(Said({"code": 3}, JournalNamer())) == "Stopped (3)."


@pytest.mark.parametrize(
    ("outcome", "said"),
    [
        (SignalOutcome.GONE, "PID 7 left {x}."),  # a member and its value: the same sentence
        ("gone", "PID 7 left {x}."),
        ("delivered", "Else SIGTERM."),  # not in the table
        (None, "Else SIGTERM."),
        (["gone"], "Else SIGTERM."),  # unhashable: never an error
        (7, "Else SIGTERM."),
    ],
)
def test_a_sentence_is_chosen_by_outcome_and_filled_from_pieces_then_fields(
    outcome: object, said: str
) -> None:
    table = {"gone": "{who} left {detail}.", "": "Else {signal}."}
    s = Said({"signal": "SIGTERM", "detail": "{x}"}, JournalNamer())
    assert s.by_outcome(table, outcome, who="PID 7") == said


def test_a_template_says_names_through_the_namer_and_fields_as_asked() -> None:
    s = Said(
        {"pid": 7, "gpu": GPU, "error": "boom", "left": ["a", "b"], "waited": 1.5, "why": "w"},
        TrainerNamer(),
    )
    assert s.fill("{process} on {gpu}{error:why}; {left:items} after {waited:seconds}{why}.") == (
        "pid 7 (trainer) on GPU 0: boom; a; b after 1.5s: w."
    )
    assert s.fill("{missing}|{missing:why}|{missing:items}|{missing:seconds}|") == "?||?|?|"
    # {x:=text}: the field, or text (perhaps nothing) where it is unset, never "?".
    assert s.fill("{error:=none}|{missing:=none}|{missing:=}|") == "boom|none||"
    # {x|y:why}: the first of the fields that is set.
    assert s.fill("{missing|error|why:why}|{missing|other:why}|") == ": boom||"
    with pytest.raises(ValueError, match="no way to say a field called 'why='"):
        s.fill("{error:why=}")
    with pytest.raises(ValueError, match="no way to say a field called 'upper'"):
        s.fill("{error:upper}")


@pytest.mark.parametrize("value", [10**400, float("nan"), float("-inf"), True], ids=repr)
def test_a_number_no_float_holds_is_said_unknown_not_the_bare_event_name(value: object) -> None:
    said = render(EventName.CLOCK_STEPPED_BACK.value, {"seconds": value})
    assert said == "The wall clock went back ?: counted as no time passed."
    timeline = Said({"due": value}, TimelineNamer(TrainerNames()))
    assert timeline.fill("Over{due:until}.") == "Over."


class TrainerNamer:
    """The timeline's names, as a :class:`Namer`."""

    def process(self, pid: object, comm: object = None) -> str:
        return f"pid {pid} (trainer)"

    def gpu(self, uuid: object) -> str:
        return "GPU 0"

    def moment(self, monotonic: object) -> str | None:
        return None


def test_a_reload_that_changed_many_keys_is_said_in_one_sentence_of_at_most_400_characters() -> (
    None
):
    changed = {f"key_{n}": "1s -> 2s" for n in range(40)}
    said = render(str(EventName.CONFIG_RELOADED), {"changed": changed})
    assert len(said) == 400
    assert said.startswith("Policy reloaded; changed: key_0 (1s -> 2s), key_1 (1s -> 2s)")
    assert said.endswith("....")
    few = {f"key_{n}": "1s -> 2s" for n in range(3)}
    said = render(str(EventName.CONFIG_RELOADED), {"changed": few})
    assert said == (
        "Policy reloaded; changed: key_0 (1s -> 2s), key_1 (1s -> 2s), key_2 (1s -> 2s)."
    )
