"""Hypothesis profiles for every property, fuzz and state-machine test, chosen in one place.

Loaded before any test module, so every ``@settings(...)`` in the tests inherits from the
profile named by ``GPUWATCHD_HYPOTHESIS_PROFILE`` (the counts a test sets itself stay):

- ``default`` (``make test``): derandomized, so a run on one machine is the run on another and
  a test passes or fails the same way twice.
- ``ci`` (``.ci/run``): derandomized too, with the longer runs (the state machines take 800
  examples of 80 steps; the fuzz tests scale up where they read the profile).
- ``explore`` (``make explore``): random and long, to look for what the fixed examples miss;
  a failure prints the seed and the ``@reproduce_failure`` blob to replay it.
- ``mutate`` (``make mutate``): derandomized, no shrinking (a mutant is caught by the first
  failing example; shrinking it only costs time).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, settings

from tests.support.smiguard import install

_COMMON: dict[str, object] = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow],
}

settings.register_profile(
    "default", max_examples=120, stateful_step_count=60, derandomize=True, database=None,
    **_COMMON,  # type: ignore[arg-type]
)  # fmt: skip
settings.register_profile(
    "ci", max_examples=800, stateful_step_count=80, derandomize=True, database=None,
    print_blob=True, **_COMMON,  # type: ignore[arg-type]
)  # fmt: skip
settings.register_profile(
    "explore", max_examples=2000, stateful_step_count=100, derandomize=False, print_blob=True,
    **_COMMON,  # type: ignore[arg-type]
)  # fmt: skip
settings.register_profile(
    "mutate", max_examples=120, stateful_step_count=60, derandomize=True, database=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate), **_COMMON,  # type: ignore[arg-type]
)  # fmt: skip

PROFILE = os.environ.get("GPUWATCHD_HYPOTHESIS_PROFILE", "default")
settings.load_profile(PROFILE)

# On a GPU machine, a guard stands in front of the real nvidia-smi for the whole run (and every
# process the tests start): it refuses anything that would change a GPU (tests/support/smiguard.py).
SMI_GUARD = install()

# The shared fixtures, found by name in every test module without an import: ``spawn`` (real
# child processes), ``fake_nvml`` (the fake NVML library's state), ``cgroup_base`` (a scratch
# cgroup v2 subtree) and ``proc_alone`` (a test whose processes other workers' walks of /proc
# must not see).
pytest_plugins = [
    "tests.support.children",
    "tests.support.fakenvml",
    "tests.support.proclock",  # before daemonrun, which imports it (through simhost)
    "tests.support.daemonrun",
]


# `make test` spreads the tests over the cores with pytest-xdist (`-n N --dist loadgroup`):
# tests/support/workers.py says which tests go to a worker together.
# Markers of the longest tests, started first: the containers, then the property tests (the
# CPU's work, beside the system tests' waiting), then the other slow ones.
_HEAVY_FIRST = ("systemd", "hypothesis", "slow")
_FOLDERS_FIRST = ("system", "integration")  # then by folder, the heavier kind first


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    if config.getvalue("dist") != "loadgroup":
        return None
    from tests.support.workers import ModuleFixtureScheduling

    config.option.loadscopereorder = False  # hand work out in the order sorted below
    return ModuleFixtureScheduling(config, log)


@pytest.hookimpl(trylast=True)  # after Hypothesis's plugin has marked its tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist, the order work is handed out in: the container tests first (the Slurm
    module is the longest unit of work), then the property tests and the other slow ones, the
    system and integration tests, and the many short unit tests last, so that no long test is
    left to run alone at the end."""
    if not hasattr(config, "workerinput"):
        return

    def rank(item: pytest.Item) -> tuple[int, int]:
        marks = [i for i, mark in enumerate(_HEAVY_FIRST) if item.get_closest_marker(mark)]
        folder = item.path.parent.name
        kind = _FOLDERS_FIRST.index(folder) if folder in _FOLDERS_FIRST else len(_FOLDERS_FIRST)
        return (marks[0] if marks else len(_HEAVY_FIRST), kind)

    items.sort(key=rank)
