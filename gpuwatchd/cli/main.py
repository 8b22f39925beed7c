"""The ``gpuwatchd`` command line: subcommands, flags and exit codes, and each command's wiring.
No decision logic: commands build the daemon's collector → assess → plan core."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence

from gpuwatchd import __version__
from gpuwatchd.cli import CliError
from gpuwatchd.cli.helptext import describe
from gpuwatchd.core.paths import DEFAULT_CONFIG_PATH
from gpuwatchd.core.vocabulary import EventName, ExitCode
from gpuwatchd.decide.policy import Policy
from gpuwatchd.state.directory import StateDirError

_Add = Callable[..., argparse.ArgumentParser]  # declares a command: (name, run, summary[, parent])
_Run = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    # --config is accepted before and after the command. The command's copy must not reset a
    # value given before it (argparse would, with default=None), hence SUPPRESS there.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help=f"policy file (default {DEFAULT_CONFIG_PATH}; drop-ins from conf.d/ beside it)",
    )
    parser = argparse.ArgumentParser(
        prog="gpuwatchd",
        description="Find GPU memory left behind by dead jobs and free it, safely.",
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"gpuwatchd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def add(
        name: str, run: _Run, summary: str, parent: argparse.ArgumentParser = common
    ) -> argparse.ArgumentParser:
        """A subcommand that ``run`` carries out, taking the shared ``--config`` unless given
        another parent, with its description and exit codes (:mod:`gpuwatchd.cli.helptext`)."""
        command = sub.add_parser(name, parents=[parent], help=summary)
        command.set_defaults(run=run)
        describe(command, name)
        return command

    _add_scan_and_run(add)
    _add_checks(add)
    _add_simulate_and_explain(add)
    _add_pause(add)
    _add_spare(add)
    add(
        "reload",
        _reload,
        "check the policy, then make the running daemon reread it (where systemd does "
        "not run it: a Kubernetes pod)",
    )
    status = add(
        "status",
        _status,
        "what the daemon is doing, read from its state (exit 0 ok, 1 attention, 3 stopped)",
    )
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    return parser


def _add_scan_and_run(add: _Add) -> None:
    scan = add("scan", _scan, "read-only report of who holds each GPU")
    scan.add_argument("--json", action="store_true", help="print the report as JSON")
    scan.add_argument(
        "--full",
        action="store_true",
        help="walk all of /proc even when a running daemon's holder view could be used",
    )
    scan.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="colour the text report (default: auto, when stdout is a terminal)",
    )

    run = add("run", _run, "run the monitoring loop (the daemon)")
    run.add_argument("--dry-run", action="store_true", help="log what would be done, do nothing")
    run.add_argument(
        "--once",
        action="store_true",
        help="poll until every finding present at start has resolved or ended its ladder",
    )
    run.add_argument(
        "--ended-job",
        action="append",
        default=[],
        metavar="KIND:ID",
        help="with --once: this job has ended (slurm:42, pod:UID, container:ID, unit:NAME; a "
        "bare 'slurm' reads SLURM_JOB_ID): its remaining device holders are abandoned",
    )
    run.add_argument(
        "--timeout",
        metavar="DURATION",
        default="10m",
        help="upper bound for --once (default 10m)",
    )


def _add_checks(add: _Add) -> None:
    clean = add(
        "check-clean",
        _check_clean,
        "one read-only scan: exit 0 when the GPUs are clean, 1 when one is not (prolog)",
    )
    clean.add_argument(
        "--gpu",
        action="append",
        metavar="ID",
        help="a GPU by UUID, PCI bus id or index; repeat it or give a comma list "
        "(default: every GPU)",
    )
    clean.add_argument(
        "--slurm-gpus",
        metavar="IDS",
        help="GPUs by Slurm's GPU ids, a comma list as in $SLURM_JOB_GPUS (numbered as "
        "--slurm-order says; with --gpu, both are checked)",
    )
    clean.add_argument(
        "--slurm-order",
        choices=("files", "nvml"),
        default="files",
        help="how Slurm numbers this node's GPUs: files (by device file /dev/nvidiaN, as "
        "gres.conf's File= lines; the default) or nvml (NVML's order, gres.conf "
        "AutoDetect=nvml)",
    )

    check = add("check-config", _check_config, "validate and print the effective policy")
    check.add_argument("file", nargs="?", metavar="FILE", help="policy file to check")
    check.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="validate only: print no policy, just the OK line (the unit's reload check)",
    )


def _add_simulate_and_explain(add: _Add) -> None:
    # simulate reads no policy file unless told to: its own --config says so (the shared one
    # names the daemon's default file).
    simulate_config = argparse.ArgumentParser(add_help=False)
    simulate_config.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="simulate under this policy file and its conf.d/ drop-ins instead (the "
        "scenario's own policy is then ignored); default: the built-in defaults with the "
        "scenario's policy over them",
    )
    simulate = add(
        "simulate", _simulate, "play a scenario through the decision core", simulate_config
    )
    simulate.add_argument("scenario", metavar="SCENARIO", help="scenario YAML file")
    simulate.add_argument("--json", action="store_true", help="print the timeline as JSON")
    simulate.add_argument(
        "--enforce",
        action="store_true",
        help="preview a dry-run policy as enforcing: dry_run is turned off, nothing else",
    )

    explain = add("explain", _explain, "say what the policy would do with a scan --json report")
    explain.add_argument("snapshot", metavar="SNAPSHOT", help="output of `gpuwatchd scan --json`")
    explain.add_argument("--json", action="store_true", help="print the explanation as JSON")


def _add_for(parser: argparse.ArgumentParser, limit: str) -> None:
    help_ = f"how long (30m, 2h); at most the policy's {limit}"
    parser.add_argument("--for", dest="for_", metavar="DURATION", help=help_)


def _add_pause(add: _Add) -> None:
    pause = add("pause", _pause, "stop all actions (maintenance)")
    pause.add_argument("--reason", default="", help="why (kept in state, logged)")
    _add_for(
        pause,
        "limits.max_pause, which is also how long a pause without --for lasts; the daemon "
        "resumes by itself then",
    )
    resume = add("resume", _pause, "allow actions again")
    resume.add_argument(
        "--reason", default="", help=f"why (logged with {EventName.DAEMON_RESUMED})"
    )
    resume.add_argument(
        "--clear-latches",
        action="store_true",
        help="also clear the kill-cap latches, the reset circuit breaker and refused resets",
    )


def _add_spare(add: _Add) -> None:
    spare = add(
        "spare", _spare, "leave one process (PID) or one job's processes (job:ID) alone for a while"
    )
    spare.add_argument(
        "target",
        nargs="?",
        metavar="PID|job:ID",
        help="a process (by PID; its start time is recorded, so a reused PID is not spared) "
        "or a job (job:42 for Slurm job 42, job:pod:UID, job:container:ID, job:unit:NAME)",
    )
    _add_for(spare, "limits.max_spare")
    spare.add_argument(
        "--reason", help=f"why (logged with {EventName.SPARE_STARTED}, shown in status)"
    )
    spare.add_argument("--cancel", action="store_true", help="end the spare of the target now")
    spare.add_argument("--list", dest="list_", action="store_true", help="show the spares in force")
    spare.add_argument("--json", action="store_true", help="with --list: print JSON")


def main(argv: Sequence[str] | None = None, *, declined: str | None = None) -> int:
    """The command line; ``declined``: why the daemon did not answer this ``scan``, when it
    was asked (gpuwatchd/cli/entry.py)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "config"):  # given neither before nor after the command
        args.config = None
    args.declined = declined
    command: _Run = args.run
    try:
        if args.config == "":  # no file: never read as "not given", the default file
            why = f"--config: an empty path names no file (without --config: {DEFAULT_CONFIG_PATH})"
            raise CliError(why, ExitCode.CONFIG)
        return command(args)
    except CliError as exc:
        print(f"gpuwatchd: {exc}", file=sys.stderr)
        return exc.code
    except StateDirError as exc:  # a state_dir that cannot be trusted is never used
        print(f"gpuwatchd: {exc}; refusing to use it", file=sys.stderr)
        return ExitCode.CONFIG
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return reader_left()
    finally:
        from gpuwatchd.events import lazylog

        lazylog.reset()


def reader_left() -> int:
    """`gpuwatchd scan --json | head`: the reader left, not an error worth a traceback; 141
    (128 + SIGPIPE), as a shell reports it."""
    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141


def load_policy_or_exit(path: str | None, *, required: bool) -> Policy:
    """Load the policy (:func:`gpuwatchd.cli.check_clean.files_policy`); a missing default
    file is fine where ``required`` is False."""
    from gpuwatchd.cli.check_clean import files_policy
    from gpuwatchd.config.yamlsrc import ConfigError

    with _refused(ConfigError):
        return files_policy(path, required=required)


@contextlib.contextmanager
def _refused(
    *errors: type[Exception], code: int = ExitCode.CONFIG, then: str = ""
) -> Iterator[None]:
    """Any of ``errors`` as a :class:`CliError` with ``code``, its message followed by ``then``."""
    try:
        yield
    except errors as exc:
        raise CliError(f"{exc}{then}", code) from exc


def _policy(args: argparse.Namespace) -> Policy:
    """The policy of ``--config``, else of the default file when there is one."""
    return load_policy_or_exit(args.config, required=args.config is not None)


def _check_config(args: argparse.Namespace) -> int:
    from gpuwatchd.config.schema import render_policy
    from gpuwatchd.core.escape import escape

    policy = load_policy_or_exit(args.file or args.config, required=True)
    if not args.quiet:
        sys.stdout.write(render_policy(policy))
    files = ", ".join(policy.sources) or "(built-in defaults)"
    print(f"# OK: {escape(files)}", file=sys.stderr)
    return ExitCode.OK


def _errors_only_logging() -> None:
    """Log errors only, and load structlog only if one is logged (:mod:`gpuwatchd.events.lazylog`):
    what NVML or /proc lacked is said once, in the report and its exit line."""
    from gpuwatchd.events import lazylog

    def setup() -> None:
        from gpuwatchd.events.logs import configure_logging

        configure_logging(fmt="console" if sys.stderr.isatty() else "logfmt", level="error")

    lazylog.defer_setup(setup, floor="error")


def _scan(args: argparse.Namespace) -> int:
    # The NVML worker first, its request sent: its start-up overlaps our imports and the walk.
    import atexit
    import gc

    from gpuwatchd.collect.nvml import NvmlClient

    # Frozen, the objects the imports made are not walked by the last collection at exit
    # (~10 ms); a scan leaves nothing for a finalizer to do (no file written, worker stopped).
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    _errors_only_logging()
    nvml = NvmlClient()
    nvml.prefetch()
    try:
        from gpuwatchd.state.compiled_policy import load_compiled

        # The daemon's compiled policy when the files are unchanged: no YAML to parse.
        compiled = load_compiled(args.config or DEFAULT_CONFIG_PATH, Policy().state_dir)
        policy = compiled or _policy(args)
        from gpuwatchd.cli.scan import scan_host, scan_output

        # Not answered by the daemon (gpuwatchd/cli/entry.py): this scan walks by itself.
        why = "--full" if args.full else (args.declined or "the daemon was not asked")
        result = scan_host(policy, nvml=nvml, why=why)
        color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
        output = scan_output(result, as_json=bool(args.json), color=color)
        # One string, one write (json.dump would issue thousands of small writes).
        sys.stdout.write(output.stdout)
        sys.stdout.flush()  # the report is out before the worker is reaped
        for line in output.stderr:
            print(line, file=sys.stderr)
        return output.exit_code
    finally:
        nvml.stop()


def _check_clean(args: argparse.Namespace) -> int:
    from gpuwatchd.cli.check_clean import EXIT_FAILED, check_clean, split_selectors

    _errors_only_logging()
    slurm = None
    if args.slurm_gpus is not None:
        slurm = (split_selectors([args.slurm_gpus]) or [], args.slurm_order)
    try:
        code, error = check_clean(args.config, split_selectors(args.gpu), slurm=slurm)
    except (CliError, StateDirError, BrokenPipeError):  # each has its own line and code
        raise
    except Exception as exc:  # exit 1 says "not clean": a bug must not say it (docs/operations.md)
        import traceback

        print(
            f"gpuwatchd: check-clean failed ({type(exc).__name__}: {exc}): no answer; "
            "this is a bug, please report it with the lines below",
            file=sys.stderr,
        )
        traceback.print_exc()
        return EXIT_FAILED
    if error is not None:
        raise CliError(error, code)
    return code


def _run(args: argparse.Namespace) -> int:
    from gpuwatchd.cli.run import run_daemon
    from gpuwatchd.collect.jobs import scheduler_ended_job
    from gpuwatchd.config.units import parse_duration
    from gpuwatchd.config.yamlsrc import ConfigError

    with _refused(ConfigError):
        timeout = parse_duration(args.timeout, where="--timeout")
    if args.ended_job and not args.once:
        raise CliError("--ended-job needs --once (it is true for one run)", ExitCode.CONFIG)
    with _refused(ValueError):
        ended = frozenset(scheduler_ended_job(spec, os.environ) for spec in args.ended_job[:64])
    if len(args.ended_job) > 64:
        raise CliError("--ended-job: at most 64 jobs per run", ExitCode.CONFIG)
    config_path = args.config or DEFAULT_CONFIG_PATH
    rejected = None
    try:
        policy = load_policy_or_exit(config_path, required=True)
    except CliError as exc:
        if not os.path.lexists(config_path):
            raise  # no file: a typo
        # The daemon does not leave the node unwatched over a rejected file: it runs with the
        # last policy it accepted, loudly (gpuwatchd/state/accepted.py); so does run --once (an
        # epilog waits as the running daemon works, by that policy). Never accepted one: 78.
        from gpuwatchd.state.accepted import load_fallback

        fallback = load_fallback(config_path)
        if fallback.policy is None:
            why = "; ".join(fallback.problems) or f"{fallback.describe()} to fall back to"
            raise CliError(f"{exc}\n(not started: {why})", ExitCode.CONFIG) from exc
        policy, rejected = fallback.policy, (str(exc), fallback)
    return run_daemon(
        policy,
        config_path=config_path,
        dry_run=bool(args.dry_run),
        once=bool(args.once),
        once_timeout=timeout,
        ended_jobs=ended,
        rejected=rejected,
    )


def _simulate(args: argparse.Namespace) -> int:
    from gpuwatchd.config.yamlsrc import ConfigError
    from gpuwatchd.sim.scenario import load_scenario
    from gpuwatchd.sim.scenario_spec import ScenarioError
    from gpuwatchd.sim.simulation import simulate
    from gpuwatchd.sim.timeline import render_text
    from gpuwatchd.sim.world import SimulationError

    with _refused(ConfigError), _refused(ScenarioError, SimulationError, code=ExitCode.DATAERR):
        result = simulate(load_scenario(args.scenario), args.config, enforce=args.enforce)
    return _print(args.json, result.to_json, lambda: render_text(result))


def _explain(args: argparse.Namespace) -> int:
    from gpuwatchd.cli.explain import explain_file, render_explanation
    from gpuwatchd.cli.report_read import SnapshotError

    with _refused(SnapshotError, code=ExitCode.DATAERR):
        explanation = explain_file(args.snapshot, _policy(args))
    return _print(args.json, lambda: explanation, lambda: render_explanation(explanation))


def _print(as_json: bool, data: Callable[[], object], text: Callable[[], str]) -> int:
    if as_json:
        import json

        json.dump(data(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(text())
    return ExitCode.OK


def _status(args: argparse.Namespace) -> int:
    from gpuwatchd.cli.check_clean import judging_policy
    from gpuwatchd.cli.status import status_command

    # The daemon runs on despite a rejected policy (gpuwatchd/state/accepted.py): show it, from
    # the state_dir it uses, after saying what is wrong with the files.
    judge = judging_policy(args.config)
    if judge.policy is None:  # rejected, and none accepted before
        raise CliError(str(judge.problem), ExitCode.CONFIG)
    if judge.problem is not None:
        print(f"gpuwatchd: {judge.problem}", file=sys.stderr)
    return status_command(judge.policy, as_json=bool(args.json))


def _reload(args: argparse.Namespace) -> int:
    from gpuwatchd.cli.reload import reload_command

    config_path = args.config or DEFAULT_CONFIG_PATH
    policy = load_policy_or_exit(config_path, required=True)  # a broken policy: 78, no signal
    return reload_command(policy, config_path)


def _spare(args: argparse.Namespace) -> int:
    from gpuwatchd.cli.spare import spare_command

    policy = _policy(args)
    with _writing(policy.state_dir, "nothing is changed"):
        return spare_command(
            policy,
            target=args.target,
            for_=args.for_,
            reason=args.reason,
            cancel=args.cancel,
            listing=args.list_,
            as_json=args.json,
        )


@contextlib.contextmanager
def _writing(state_dir: str, unchanged: str) -> Iterator[None]:
    """A failed write to ``state_dir`` as one line and its exit code (``unchanged``: what
    that leaves as it was)."""
    try:
        yield
    except StateDirError:
        raise  # not trusted, so never written: main's line, exit 78
    except PermissionError as exc:
        where = exc.filename or state_dir
        raise CliError(f"{where}: permission denied (run as root)", ExitCode.NOPERM) from exc
    except OSError as exc:
        why = f"state_dir {state_dir}: {unchanged}: {exc.strerror or exc}"
        raise CliError(why, ExitCode.IOERR) from exc


_UNCHANGED = " (the switch is not changed)"


def _pause(args: argparse.Namespace) -> int:
    from gpuwatchd.cli.humantime import duration, for_seconds, stamp
    from gpuwatchd.collect.boottime import BootTime
    from gpuwatchd.collect.procfs import ProcFS
    from gpuwatchd.config.yamlsrc import ConfigError
    from gpuwatchd.state.directory import StateDir
    from gpuwatchd.state.pause import set_pause

    policy = _policy(args)
    path, paused = policy.state_dir, args.command == "pause"
    length = policy.limits.max_pause if paused else 0.0  # a pause without --for: the longest
    if paused and args.for_ is not None:
        with (
            _refused(ConfigError, then=_UNCHANGED),
            _refused(ValueError, then="; the switch is not changed"),
        ):
            length = for_seconds(
                args.for_, command="pause", limit="limits.max_pause", maximum=length
            )
    with (
        _writing(path, "the switch is not changed"),
        _refused(StateDirError, then=_UNCHANGED),
        StateDir.open(path, create=True) as state_dir,
    ):
        if paused:
            clock = BootTime.read(time.time(), ProcFS(policy.proc_root).boot_id())
            set_pause(state_dir, reason=args.reason, clock=clock, seconds=length)
            when = stamp(clock.wall + length, zone=True)
            print(f"gpuwatchd: actions paused for {duration(length)}, until {when} ({path})")
        else:
            set_pause(state_dir, reason=None, note=args.reason, clear=args.clear_latches)
            print("gpuwatchd: actions resumed")
    return ExitCode.OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
