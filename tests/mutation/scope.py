"""What ``make mutate`` mutates, which tests judge the mutants, and which survivors fail CI.

This module owns the scope of mutation testing (docs/architecture.md, "Mutation testing"):
the decide/ modules, the functions of each (all of them, or the named ones for the long
modules whose other parts are not safety gates), and which functions are *critical*: a
surviving mutant there that is not a recorded equivalent fails ``make mutate`` and CI. A name
listed here that the module no longer has is reported, not an error, so a rename in decide/
does not break the tool (the report asks for this list to be updated).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ALL", "TARGETS", "TEST_FILES", "Target"]

ALL = ("*",)


@dataclass(frozen=True)
class Target:
    """One module to mutate. ``functions``: qualified names, or ``ALL``. ``critical``: the
    functions (or ``ALL``) where a surviving mutant means a safety gate is untested."""

    name: str
    file: str
    functions: tuple[str, ...]
    critical: tuple[str, ...]

    def selects(self, qualname: str) -> bool:
        return self.functions == ALL or qualname in self.functions

    def is_critical(self, qualname: str) -> bool:
        return self.critical == ALL or qualname in self.critical


_RESET_GATES = (
    "node_block",
    "is_dry_run",
    "hold_reason",
    "_live_holder",
    "reset_gates",
    "snapshot_gates",
    "_reset_blocker",
    "escalating",
    "history_blocker",
    "consider_reset",
    "start_reset",
    # Ghost memory in a MIG GPU instance: its own gates, the instance it re-creates.
    "_instance_gates",
    "instance_recovery",
    "_refused_memory",
    "consider_health",
    "_consider_health_reset",
    "record_reset",
    "_refusal_key",
    "_book_dry_run",
    "_book_refusal",
    "_book_attempt",
    # A refused reset holds its incident (drain and before hooks once) until something changes.
    "review_refusals",
    "_reset_came_back",
    "hidden_holders",
    # reset.drain once per health incident of a GPU.
    "_drained_already",
    "_drain_hooks",
)
_KILL_LADDER = (
    "_gate",
    "_report_only",
    "cap_exceeded",
    "_kill_caps",
    "kill_cap_scope",
    "expire_latches",
    "consider_process_finding",
    "advance_ladders",
    "_advance_live_ladder",
    "_ladder_hold",
    "_last_step_over",
    "_confirmed_rule",
    "_post_action_delay",
    "_successor",
    "_restart_after_dry_run",
    "_stuck_finding",
    "_emit_step",
    "_mark_stuck",
    "_close",
    "PlanState.without_node_latch",
    "action_ended",
    "record_signal",
    "record_exit",
)
# What decides whether a signal is sent, and to whom.
_KILL_DECISIONS = (
    "_gate",
    "_report_only",
    "cap_exceeded",
    "_kill_caps",
    "kill_cap_scope",
    "expire_latches",
    "PlanState.without_node_latch",
    "consider_process_finding",
    "advance_ladders",
    "_advance_live_ladder",
    "_ladder_hold",
    "_confirmed_rule",
    "_post_action_delay",
    "_successor",
    "_emit_step",
    "record_signal",
    "record_exit",
)
# The orphan rule and what it rests on (decide/assess_*.py, by module).
_ORPHAN_SHARED = (
    "_report_only",
    "AssessorState.blocked",
    "AssessorState.add",
    "AssessorState.memory_without_owner",
)
_ORPHAN_CLASSIFICATION = (
    "HolderPass.assess_holders",
    "HolderPass.classify",
    "HolderPass.by_process_state",
    "HolderPass.worker_of",
    "HolderPass.unexplained",
    "HolderPass.tied_to_dead_owner",
    "HolderPass.hidden",
    "HolderPass.recorded_inheritance",
    "HolderPass.opened_own_files",
    "HolderPass.heir_of_dead_owner",
    "HolderPass.dead_owner_tie",
    "HolderPass.unaccounted_without_owner",
    "HolderPass.likely_heir",
    "_tree_link",
    "_lost_leader",
    # Whether a job ended: its holders are abandoned (what opt-in rules may kill).
    "job_ended",
)
# A GPU whose reset the driver refused as in use: a hidden holder (it blocks resets).
_DRIVER_REFUSALS = ("MemoryPass.assess_driver_refusals",)
# The one verdict "clean for a new job?" (a Slurm prolog's check-clean, an epilog's run --once
# exit 0): what makes a GPU dirty or unknown, what excuses a holder, and when run --once is
# done. Its wording (describe, the reset blockers' labels) is not a gate.
_VERDICT = (
    "_Judge.excuse",
    "_Judge.gpus_of",
    "_Judge.add_findings",
    "_Judge.add_unknowns",
    "_Judge.unreadable",
    "_Judge.add_memory",
    "_Judge.verdict",
    "once_progress",
    "not_clean",
)
# protect.commands and rules' command filters, matched in linear time: a wrong match would
# leave a protected process unprotected.
_PATTERNS = ("command_search", "_search", "_close", "_holds", "_one_char")

# Which of decide/plan*.py holds each planner function named above.
_PLAN_MODULES = {
    "plan": ("hidden_holders",),
    "plan_intents": (
        "is_dry_run",
        "hold_reason",
        "kill_cap_scope",
        "action_ended",
    ),
    "plan_ladders": (
        "_gate",
        "_report_only",
        "_kill_caps",
        "expire_latches",
        "consider_process_finding",
        "advance_ladders",
        "_advance_live_ladder",
        "_ladder_hold",
        "_last_step_over",
        "_confirmed_rule",
        "_post_action_delay",
        "_successor",
        "_restart_after_dry_run",
        "_stuck_finding",
        "_emit_step",
        "_mark_stuck",
        "_close",
    ),
    "plan_resets": (
        "node_block",
        "_live_holder",
        "reset_gates",
        "snapshot_gates",
        "_reset_blocker",
        "escalating",
        "history_blocker",
        "consider_reset",
        "start_reset",
        "review_refusals",
        "_instance_gates",
        "instance_recovery",
        "_refused_memory",
    ),
    "plan_shadow": ("cap_exceeded",),
    "plan_state": ("PlanState.without_node_latch",),
    "plan_health": (
        "consider_health",
        "_consider_health_reset",
        "_drained_already",
        "_drain_hooks",
    ),
    "plan_outcomes": (
        "record_reset",
        "_refusal_key",
        "_book_dry_run",
        "_book_refusal",
        "_book_attempt",
        "_reset_came_back",
        "record_signal",
        "record_exit",
    ),
}


_PLAN_FILES = {"plan": "decisions"}  # target name -> its file in decide/plan/, where they differ


def _plan_targets() -> tuple[Target, ...]:
    """One target per planner module: its share of the functions and critical functions above."""
    where = {name: module for module, names in _PLAN_MODULES.items() for name in names}
    unplaced = sorted(set(_RESET_GATES + _KILL_LADDER) - where.keys())
    if unplaced:
        raise ValueError(f"add to _PLAN_MODULES: {', '.join(unplaced)}")
    return tuple(
        Target(
            module,
            f"gpuwatchd/decide/plan/{_PLAN_FILES.get(module, module.removeprefix('plan_'))}.py",
            tuple(n for n in _RESET_GATES + _KILL_LADDER if where[n] == module),
            tuple(n for n in _RESET_GATES + _KILL_DECISIONS if where[n] == module),
        )
        for module in _PLAN_MODULES
    )


_FIRST_TARGETS = (
    Target("floor", "gpuwatchd/decide/floor.py", ALL, ALL),
    Target("targets", "gpuwatchd/decide/targets.py", ALL, ALL),
    Target("health", "gpuwatchd/decide/health/judge.py", ALL, ("drain_blockers", "_known_pids")),
    Target("argv", "gpuwatchd/decide/argv.py", ALL, ()),
    *_plan_targets(),
    Target("assess_shared", "gpuwatchd/decide/assess/shared.py", _ORPHAN_SHARED, _ORPHAN_SHARED),
    Target(
        "assess_holders",
        "gpuwatchd/decide/assess/holders.py",
        _ORPHAN_CLASSIFICATION,
        _ORPHAN_CLASSIFICATION,
    ),
    Target(
        "assess_memory", "gpuwatchd/decide/assess/memory.py", _DRIVER_REFUSALS, _DRIVER_REFUSALS
    ),
    Target("verdict", "gpuwatchd/decide/verdict.py", ALL, _VERDICT),
    Target("patterns", "gpuwatchd/decide/patterns.py", ALL, _PATTERNS),
    # MIG: which instance a holder uses (by capability only), and the per-instance view the
    # orphan rule and ghost memory judge; its wording (describe, evidence) is not a gate.
    Target(
        "mig",
        "gpuwatchd/decide/mig/instances.py",
        ALL,
        (
            "_why_not_judged",
            "mig_layout",
            "instance_view",
            "annotate_findings",
            "_parent_only_cuda",
            "busy_instances",
            "instance_users",
            "parent_of",
        ),
    ),
    # MIG: the recovery of one GPU instance — what may still use it (its own live-holder
    # gate and final scan), whether it can be re-created in place, whether it came back, and
    # a state file's record of it read back; its commands' wording is argv's.
    Target(
        "mig_recovery",
        "gpuwatchd/decide/mig/recovery.py",
        ALL,
        ("recovery_of", "instance_blockers", "recovery_blockers", "recovered", "from_record"),
    ),
    # When a poll must walk all of /proc: a GPU instance's unowned memory must make it one, or
    # its ghost memory is never confirmed.
    Target(
        "full_scan",
        "gpuwatchd/decide/full_scan.py",
        ("has_unowned_memory", "_unowned_instance"),
        ("has_unowned_memory", "_unowned_instance"),
    ),
)

# The first targets, widened where a mutation run found gates they did not mutate or did not
# count as critical, plus modules they left out.
_WIDER = {
    # What a GPU's health makes of it (drain reasons): a wrong reason drains or keeps a GPU.
    "health": Target(
        "health",
        "gpuwatchd/decide/health/judge.py",
        ALL,
        ("drain_blockers", "_known_pids", "_reasons", "assess_health", "_fabric_clock", "_finding"),
    ),
    # Whether a dead PID is explained, and whether PIDs can be trusted at all (a PID namespace).
    "assess_shared": Target(
        "assess_shared",
        "gpuwatchd/decide/assess/shared.py",
        (*_ORPHAN_SHARED, "_dead_pid_explained", "_pid_trust_problem"),
        (*_ORPHAN_SHARED, "_dead_pid_explained", "_pid_trust_problem"),
    ),
    # Ghost memory and memory no live owner accounts for: what makes a GPU a reset candidate.
    "assess_memory": Target(
        "assess_memory",
        "gpuwatchd/decide/assess/memory.py",
        ("MemoryPass.check_ghost", "MemoryPass.check_unaccounted", *_DRIVER_REFUSALS),
        ("MemoryPass.check_ghost", "MemoryPass.check_unaccounted", *_DRIVER_REFUSALS),
    ),
    # The verdict's own "clean" and a holder's role are gates too.
    "verdict": Target(
        "verdict",
        "gpuwatchd/decide/verdict.py",
        ALL,
        ("GpuVerdict.clean", "NodeVerdict.clean", "_Judge.role", *_VERDICT),
    ),
    # The recovery's commands (which GI/CI ids they name) are a gate.
    "mig_recovery": Target(
        "mig_recovery",
        "gpuwatchd/decide/mig/recovery.py",
        ALL,
        (
            "recovery_of",
            "instance_blockers",
            "recovery_blockers",
            "recovered",
            "from_record",
            "recovery_argvs",
        ),
    ),
}
TARGETS = (
    *(_WIDER.get(target.name, target) for target in _FIRST_TARGETS),
    # How a GPU is named (protect.gpus, check-clean --gpu): a wrong match leaves a protected
    # GPU unprotected or judges another GPU.
    Target("gpu_ids", "gpuwatchd/decide/gpu_ids.py", ALL, ALL),
    # Whether two processes are related (the orphan rule's worker of a live owner).
    Target("host_view", "gpuwatchd/decide/assess/host_view.py", ("relation",), ("relation",)),
    # An admin's spare: which processes are spared, and until when.
    Target(
        "spares",
        "gpuwatchd/decide/spares.py",
        ALL,
        ("_in_force", "spare_covering", "spare_reason"),
    ),
    # The idle baseline ghost memory and the verdict are judged against.
    Target(
        "baselines",
        "gpuwatchd/decide/assess/baselines.py",
        ("learn_baselines", "compared_figure"),
        ("learn_baselines", "compared_figure"),
    ),
)

# The fast, pure tests of decide/ and of what drives it (the engine over a virtual host). Each
# mutant runs only those of them that call the mutated function, fastest first.
TEST_FILES = (
    "tests/unit/test_floor.py",
    "tests/unit/test_gates.py",
    "tests/unit/test_reset_gates.py",
    "tests/unit/test_ladders.py",
    "tests/unit/test_orphan_evidence.py",
    "tests/unit/test_plan.py",
    "tests/unit/test_plan_stateful.py",
    "tests/unit/test_assess.py",
    "tests/integration/test_inherit.py",
    "tests/unit/test_health.py",
    "tests/unit/test_health_readings.py",
    "tests/unit/test_argv.py",
    "tests/integration/test_config.py",
    "tests/integration/test_config_hostile.py",
    "tests/unit/test_explain.py",
    "tests/unit/test_engine.py",
    "tests/unit/test_engine_replay.py",
    "tests/unit/test_scenarios.py",
    "tests/unit/test_simulate.py",
    "tests/unit/test_report.py",
    "tests/unit/test_verdict.py",
    "tests/unit/test_patterns.py",
    "tests/unit/test_dry_run_preview.py",
    "tests/unit/test_check_clean.py",
    "tests/integration/test_rollout_switches.py",
    "tests/unit/test_mig_assess.py",
    "tests/unit/test_mig_report.py",
    "tests/unit/test_mig_simulate.py",
    "tests/unit/test_mig_recovery.py",
    "tests/unit/test_mig_recovery_plan.py",
    "tests/unit/test_mig_recovery_edges.py",
    "tests/unit/test_reset_mig.py",
    "tests/integration/test_full_scan.py",
    "tests/unit/test_gates_proven.py",
    "tests/unit/test_gates_killed_a.py",
    "tests/unit/test_gates_killed_b.py",
    "tests/unit/test_gpu_ids.py",
    "tests/unit/test_wide_resets.py",
    "tests/unit/test_wide_verdict.py",
    "tests/unit/test_wide_health.py",
    "tests/unit/test_xid_sources.py",
    "tests/unit/test_health_rules.py",
    "tests/unit/test_spares_slurm_tree.py",
    "tests/unit/test_wide_gates.py",
    "tests/unit/test_wide_mig.py",
    "tests/unit/test_mig_reset_plan.py",
    "tests/unit/test_wide_holders.py",
    "tests/unit/test_wide_outcomes.py",
    "tests/unit/test_simulate_spare.py",
    "tests/unit/test_spared_display.py",
)
