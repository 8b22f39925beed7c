"""Admin regexes against hostile command lines (gpuwatchd/decide/patterns.py): same answers as
``re.search``, in time linear in the line, and what cannot be matched so is refused at load."""

from __future__ import annotations

import dataclasses
import re
import sys
import time
from types import FrameType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwatchd.config.schema import parse_policy_documents
from gpuwatchd.config.yamlsrc import ConfigError
from gpuwatchd.core.model import Finding, FindingKind
from gpuwatchd.decide import patterns
from gpuwatchd.decide.patterns import (
    MAX_COMMAND_TEXT,
    MAX_REPEAT,
    NotLinear,
    TooCostly,
    check_linear,
    command_search,
)
from gpuwatchd.decide.policy import Policy, Protect, Rule, Step
from gpuwatchd.decide.targets import refusal, rule_for
from tests.support.snapshots import HostBuilder

DROP_IN = "/etc/gpuwatchd/conf.d/50-site.yaml"


@pytest.mark.parametrize(
    ("pattern", "text"),
    [
        (r"a+b", "xxaab"),
        (r"^x$", "x\n"),
        (r"x$", "x\n\n"),
        (r"(?i:ab)c", "ABc"),
        (r"(?i:ab)c", "ABC"),
        (r"[^a-z\d]", "abc1"),
        (r"\bfoo\B", "a foox"),
        (r"\bfoo\b", "a foox"),
        (r"a{2,5}?", "a"),
        (r"(a|b)*c", "ababd"),
        (r"\Afoo\Z", "foo\n"),
        (r"(?s).", "\n"),
        (r".", "\n"),
        (r"(?m)^a$", "b\na\nc"),
        (r"", ""),
        (r"python.*train.*\.py", "python x train y.py"),
        (r"(foo|bar|baz)+$", "foobarbaz"),
        (r"(?i)straße", "STRASSE"),
        (r"(?a)\w+", "é"),
        (r"\w+", "é"),
        (r"\d{3}-\w+", "tel 123-abc"),
        (r"(x*)*y", "xxxxy"),
        (r"^/opt/serving/bin/triton", "/opt/serving/bin/triton --model-repo /m"),
        (r"jupyter-lab", "/usr/bin/python3 /usr/local/bin/jupyter-lab --no-browser"),
        # Anchors where a command line has newlines (argv may hold any byte but NUL), and at
        # its edges: each answer is re's.
        (r"(?m)^a", "a"),
        (r"(?m)^b", "a\nb"),
        (r"(?m)^b", "ab"),
        (r"(?m)^b", "xb\n"),
        (r"(?m)^a", "\na"),
        (r"(?m)a$", "a"),
        (r"(?m)a$", "a\nb"),
        (r"(?m)a$", "ab"),
        (r"(?m)a$", "ba\n"),
        (r"train\Z", "python train"),
        (r"train\Z", "python train\n"),
        (r"\Atrain", "train x"),
        (r"\Atrain", "x train"),
        (r"train$", "python train\n"),
        (r"train$", "python train\nx"),
        (r"train$", "python trainx"),
        (r"\bx", "x"),
        (r"x\b", "ax"),
        (r"\Bx", "ax"),
        (r"\bx\b", "a x b"),
        (r"\b", ""),
        (r"\B", ""),
        (r"\B", "a"),
        # Counted repeats between anchors: exactly as many copies as counted, no more.
        (r"^a{2}$", "aaa"),
        (r"^a{2}$", "aa"),
        (r"^a{1,2}$", "aaa"),
        (r"^a{1,2}$", "aa"),
    ],
)
def test_command_search_answers_as_re_search_does(pattern: str, text: str) -> None:
    compiled = re.compile(pattern)
    assert command_search(compiled, text) == (compiled.search(text) is not None)


_ATOMS = st.sampled_from(["a", "b", ".", "[ab]", "[^a]", r"\w", r"\s", r"\d", "x", " "])


def _patterns() -> st.SearchStrategy[str]:
    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        return st.one_of(
            st.tuples(inner, inner).map("".join),
            st.tuples(inner, inner).map(lambda p: f"(?:{p[0]}|{p[1]})"),
            st.tuples(inner, st.sampled_from(["*", "+", "?", "*?", "{2}", "{1,3}", "{0,2}?"])).map(
                lambda p: f"(?:{p[0]}){p[1]}"
            ),
        )

    body = st.recursive(_ATOMS, extend, max_leaves=8)
    return st.tuples(
        st.sampled_from(["", "^", r"\b"]), body, st.sampled_from(["", "$", r"\b", r"\B"])
    ).map("".join)


@settings(max_examples=400, deadline=None)
@given(_patterns(), st.text(alphabet="ab x1\n", max_size=24))
def test_any_supported_pattern_agrees_with_re_on_any_text(pattern: str, text: str) -> None:
    compiled = re.compile(pattern)
    assert command_search(compiled, text) == (compiled.search(text) is not None)


@pytest.mark.parametrize(
    ("pattern", "line"),
    [
        # Exponential for a backtracking engine: `re` would not finish before the sun does.
        (r"^(a+)+$", "a" * 4000 + "!"),
        (r"(\w+\s?)+$", "word " * 800 + "!"),
        # Polynomial (n^3 over 4096 characters): tens of seconds with `re`.
        (r"python.*train.*\.py", "pythontrain" * 372),
    ],
    ids=["nested-plus", "words", "dot-stars"],
)
def test_a_line_crafted_for_a_backtracking_pattern_is_searched_in_milliseconds(
    pattern: str, line: str
) -> None:
    compiled = re.compile(pattern)
    check_linear(compiled)  # accepted at load: the automaton does not care
    started = time.perf_counter()
    assert command_search(compiled, line) is False
    assert time.perf_counter() - started < 2.0


def _assert_refused_at_load(section: str, pattern: str, why: str) -> None:
    """A drop-in whose ``section`` (a ``%s`` where the pattern goes) names ``pattern`` is
    refused, naming the file, the key, the pattern and ``why``."""
    text = section % repr(pattern).replace("\\\\", "\\")
    with pytest.raises(ConfigError) as caught:
        parse_policy_documents([(DROP_IN, text + "\n")])
    message = str(caught.value)
    assert DROP_IN in message
    assert "commands[0]" in message
    assert repr(pattern) in message
    assert why in message


@pytest.mark.parametrize(
    ("pattern", "what"),
    [
        (r"(a)\1", "a backreference"),
        (r"python(?!3)", "a negative lookahead or lookbehind"),
        (r"(?<=/)serve", "a lookahead or lookbehind"),
        (r"(?>a+)b", "an atomic group"),
        (r"a*+b", "a possessive repeat"),
        (r"(a)?(?(1)b|c)", "a conditional"),
    ],
)
def test_what_cannot_be_matched_in_linear_time_is_refused_at_load_naming_file_key_and_pattern(
    pattern: str, what: str
) -> None:
    with pytest.raises(NotLinear, match=re.escape(what)):
        check_linear(re.compile(pattern))
    for section in ("protect: {commands: [%s]}", "rules: [{name: r, kind: orphaned, "
                    "commands: [%s], steps: [{signal: SIGTERM, wait: 1s}]}]"):  # fmt: skip
        _assert_refused_at_load(section, pattern, "cannot be matched in linear time")


@pytest.mark.parametrize(
    "pattern", [r"[^/]{1,4000}/x", r"(a{100}){300}", r"(a{8}){9}", r"\d{40}-\w{40}", r"x{65,}"]
)
def test_counted_repeats_past_the_bound_are_refused_at_load_naming_key_and_value(
    pattern: str,
) -> None:
    """Before: ``[^/]{1,4000}/x`` passed check-config and cost 2-3 s per 4 KiB command line
    (each copy a live state on every character). Now counted repeats may make at most
    MAX_REPEAT copies in all, nested ones multiplied; the refusal names file, key and pattern."""
    with pytest.raises(TooCostly, match=f"more than {MAX_REPEAT} copies"):
        check_linear(re.compile(pattern))
    _assert_refused_at_load("protect: {commands: [%s]}", pattern, "too costly")


@pytest.mark.parametrize(
    ("pattern", "shown"),
    [(r"x{65,}", "{65,}"), (r"a{2,}" * 33, "{2,}"), (r"a{0,2}" * 33, "{0,2}"),
     (r"\d{40}-\w{40}", "{40}")],
)  # fmt: skip
def test_a_refused_count_is_shown_as_written(pattern: str, shown: str) -> None:
    """``{n,}`` counts its n copies, ``{0,m}`` its m; the refusal shows the count that passed."""
    with pytest.raises(TooCostly, match=f"^its counted repeats \\({re.escape(shown)} here\\)"):
        check_linear(re.compile(pattern))


# *, + and ? are no counts: any number of them loads.
@pytest.mark.parametrize(
    "pattern",
    [r"[0-9a-f]{64}", r"(a{3}){4}", r"a+b*c?(d|e)+", r"x{2,}", r"(?:a+b?c*)" * 65],
)
def test_counts_within_the_bound_and_plain_repeats_load(pattern: str) -> None:
    check_linear(re.compile(pattern))
    assert command_search(re.compile(pattern), "y" * 10) is False


def _orphan(cmdline: tuple[str, ...]) -> tuple[HostBuilder, Finding]:
    host = HostBuilder().gpu(0).proc(500, cmdline=cmdline, holds={0}, uvm=True)
    finding = Finding(FindingKind.ORPHANED, "gpu", 500, 10_000 + 500 * 7, "orphaned")
    return host, finding


def test_a_line_longer_than_the_searched_part_is_protected_not_guessed() -> None:
    """A protect pattern that did not match in the first 4096 characters might match further
    on: unknown protects. A rule's filter is not selected by unknown either."""
    long_line = ("python3", "x" * MAX_COMMAND_TEXT, "--serve")
    host, finding = _orphan(long_line)
    snapshot = host.build()
    protect = Protect(commands=(re.compile("--serve$"),))
    policy = dataclasses.replace(Policy(), protect=protect)
    why = refusal(snapshot.processes[500], finding, snapshot, policy, frozenset())
    assert why is not None
    assert "longer than the 4096 characters" in why
    rule = Rule("r", FindingKind.ORPHANED, (Step("SIGTERM", 1.0),), commands=(re.compile("--s"),))
    assert rule_for(finding, snapshot.processes[500], Policy(rules=(rule,)), lasted=60) is None
    short = _orphan(("python3", "--serve"))[0].build()
    why = refusal(short.processes[500], finding, short, policy, frozenset())
    assert "command matches" in str(why)
    assert rule_for(finding, short.processes[500], Policy(rules=(rule,)), lasted=60) is rule


def test_a_crafted_line_does_not_stall_the_protect_check() -> None:
    """The attack: an admin protects `^(a+)+$` (a natural mistake); a user's process runs with
    a line of 4000 'a' and a '!'. `re.search` would never return; the poll would stall."""
    host, finding = _orphan(("a" * 4000 + "!",))
    snapshot = host.build()
    policy = Policy(protect=Protect(commands=(re.compile(r"^(a+)+$"),)))
    started = time.perf_counter()
    assert refusal(snapshot.processes[500], finding, snapshot, policy, frozenset()) is None
    assert time.perf_counter() - started < 2.0


def test_a_pattern_that_cannot_be_matched_in_linear_time_is_unknown_never_no() -> None:
    """The loader refuses such a pattern; should one reach the matcher anyway, its answer is
    unknown (a protect pattern then protects), not "no match"."""
    assert command_search(re.compile(r"(a)\1"), "aa") is None
    assert command_search(re.compile(r"(?=a)a"), "b") is None


def test_a_line_of_exactly_the_searched_length_is_searched_whole() -> None:
    exact = "x" * MAX_COMMAND_TEXT
    assert command_search(re.compile("--serve"), exact) is False
    assert command_search(re.compile("--serve"), exact + "y") is None
    assert command_search(re.compile("x$"), exact) is True


@pytest.mark.parametrize(
    ("pattern", "after", "found"),
    [
        (r"train\.py$", " --resume", None),  # the cut is no end of the line
        (r"train\.py\Z", " --resume", None),
        (r"(?m)train\.py$", " --resume", None),
        (r"train\.py\b", "x --resume", None),  # nor a word boundary
        (r"train\.py\B", "x --resume", True),
        (r"train\.py$", "\n", True),  # what follows the cut tells, as re.search is told
        (r"train\.py$", "\n--resume", None),  # a newline that does not end the line
        (r"train\.py\b", " --resume", True),
    ],
)
def test_the_cut_of_a_longer_line_is_not_its_end(
    pattern: str, after: str, found: bool | None
) -> None:
    """Only the first 4096 characters are searched, but an anchor at the 4096th is judged by
    the line as it goes on: `train\\.py$` does not select a longer line whose first 4096
    characters end in train.py (re.search would not find it), so no rule acts on that guess."""
    head = "python3 " + "a" * (MAX_COMMAND_TEXT - len("python3  train.py")) + " train.py"
    assert len(head) == MAX_COMMAND_TEXT
    assert command_search(re.compile(pattern), head + after) is found
    assert bool(re.search(pattern, head + after)) is bool(found)
    host, finding = _orphan(tuple((head + after).split(" ")))
    rule = Rule("r", FindingKind.ORPHANED, (Step("SIGTERM", 1.0),), commands=(re.compile(pattern),))
    selected = rule_for(finding, host.build().processes[500], Policy(rules=(rule,)), lasted=60)
    assert selected is (rule if found else None)


def test_a_verbose_pattern_is_read_with_its_flags() -> None:
    verbose = re.compile(r"train \.py  # the script", re.VERBOSE)
    assert command_search(verbose, "python train.py") is True
    assert command_search(verbose, "python train .py  # the script") is False


def test_an_inline_flag_applies_to_the_whole_pattern() -> None:
    assert command_search(re.compile("(?i)PYTHON train"), "python TRAIN.py") is True
    assert command_search(re.compile("PYTHON train"), "python TRAIN.py") is False


@pytest.mark.parametrize("av", [None, [], (0, 1, [])])
def test_a_construct_the_automaton_does_not_know_is_refused_never_guessed(av: object) -> None:
    """What a later Python's parser may produce (an unknown op, whatever its argument looks
    like: a class's list, a repeat's tuple) is refused, never built as something else."""
    with pytest.raises(NotLinear, match=r"^unsupported regular expression construct NEW_OP$"):
        patterns._Builder().item("NEW_OP", av, 0, 0)


def _frames() -> int:
    frame: FrameType | None = sys._getframe()
    count = 0
    while frame is not None:
        frame, count = frame.f_back, count + 1
    return count


def _check_with_stack(pattern: re.Pattern[str], room: int) -> None:
    """check_linear with only ``room`` frames left above this one."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(_frames() + room)
    try:
        check_linear(pattern)
    finally:
        sys.setrecursionlimit(limit)


def test_a_pattern_nested_past_the_stack_is_refused_not_crashed() -> None:
    # Python parses a group level in about 2 frames and the automaton is built in about 4:
    # with 300 frames left, 100 levels parse but cannot be built; with 50, none parse.
    nested = re.compile("(?:" * 100 + "a*" + ")*" * 100)
    with pytest.raises(NotLinear, match=r"^nested too deeply$"):
        _check_with_stack(nested, 300)
    with pytest.raises(NotLinear, match=r"^invalid regular expression: maximum recursion"):
        _check_with_stack(nested, 50)
    check_linear(nested)  # with the stack it needs, it is linear
