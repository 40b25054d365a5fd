"""The ``rlhf`` command line (``rlhf COMMAND --help`` documents each command).

rlhf run       run a campaign: config.iterations iterations (finished ones are kept; --from-iteration recomputes)
rlhf iterate   run one more iteration, continuing the campaign from its latest state in MLflow
rlhf replay    re-run rewards/KL/GAE, PPO and evaluation of a recorded iteration with new settings
rlhf compare   print chosen metrics of several runs or campaigns side by side
rlhf inspect   summarise a campaign's recorded experience per iteration, flag drift, print chosen responses
rlhf export    write a trained model of an iteration as a plain Hugging Face folder (LoRA merged)
rlhf verify    hash every output of a campaign's finished iterations again and check it against its records
rlhf gc        remove the stage outputs of a campaign that nothing kept needs
rlhf serve     serve Prefect deployments of the flows (trigger them from the UI), optionally on a schedule
rlhf config    print the resolved config as YAML

Errors: a problem with what the user gave (a setting, an input file, a model, a stored output, a
run that does not exist, a campaign another process is running, a full or read-only disk, Ctrl-C)
is reported in one line naming it, with exit code 2 (3 for an unanswered human-label form); a
traceback means a bug, and ``--verbose`` shows one for user errors too. Everything a run checks
before it starts (config, input files, model, tokenizer, the campaign lock, the outputs of the finished
iterations: :mod:`campaign.verification`) is checked before any flow starts; the temporary Prefect
server is launched meanwhile, and stops with the command.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import errno
import logging
import os
import sys
import traceback
from pathlib import Path

from rlhf_core.errors import UserError

# Offline-friendly defaults, set before Prefect and MLflow are imported; the user's own settings win.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "rlhf_core,storage,tasks,campaign,flows,demo")
# The command checks its inputs before any flow runs; what those checks log is for the console only.
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="YAML config: a diff from the defaults (see configs/)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one field, e.g. --set ppo.epochs=2 --set iterations=5 (repeatable)",
    )
    parser.add_argument("--verbose", action="store_true", help="show tracebacks of errors and of failed Prefect runs")


def _at_least_zero(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}")
    return int(text)


def _at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    from campaign.settings import changeable_fields

    parser = argparse.ArgumentParser(
        prog="rlhf",
        description="Staged, resumable, replayable RLHF (PPO) on Prefect and MLflow.",
        epilog="run, iterate and serve take a --config naming your model and prompts (model.policy, data.prompts, "
        "data.eval_prompts) and who labels (labeler), or configs/demo.yaml for the embedded demo; relative paths in a "
        "config file are relative to its folder. replay, compare, export and gc read the campaign's recorded config "
        "from its MLflow store.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="run a campaign from its first unfinished iteration (finished iterations are kept; a crashed run resumes)",
    )
    _add_config_arguments(run)
    run.add_argument(
        "--from-iteration",
        type=_at_least_zero,
        metavar="N",
        help="recompute the finished iterations from N on, with this code and these inputs (the old runs are kept, "
        "marked superseded)",
    )
    iterate = commands.add_parser("iterate", help="run one more iteration from the campaign's latest state")
    _add_config_arguments(iterate)
    replay = commands.add_parser(
        "replay",
        help="re-run rewards/KL/GAE, PPO update and evaluation of a recorded iteration with new settings (no generation)",
        description="Starts from the config the source iteration ran with (recorded in MLflow): --config is needed "
        f"only for where the store is (run_root, tracking_uri). Only {', '.join(changeable_fields())} may differ "
        "from the source run.",
    )
    replay.add_argument("source", help="an MLflow iteration run id, or CAMPAIGN:ITERATION")
    _add_config_arguments(replay)
    compare = commands.add_parser("compare", help="print metrics of several runs or campaigns side by side")
    compare.add_argument(
        "runs", nargs="+", help="MLflow run ids, CAMPAIGN:ITERATION, or CAMPAIGN (its latest iteration)"
    )
    compare.add_argument("--metrics", help="comma-separated metric names (default: the headline evaluation metrics)")
    _add_config_arguments(compare)
    inspect = commands.add_parser(
        "inspect",
        help="summarise a campaign's recorded experience per iteration, flag drift, print chosen responses",
        description="Reads the shards every finished iteration (and replay) recorded, lazily. Columns and flags: "
        "docs/inspect.md. --where and --top print rollouts decoded with the campaign's tokenizer; their columns are "
        "iteration, run, row, prompt_id, length, truncated, score, reward, kl, advantage. In a DPO campaign they print "
        "the pairs its updates trained on, with the reference's and the policy's log-probs and implicit rewards.",
    )
    inspect.add_argument("target", metavar="CAMPAIGN[:ITERATION]", help="a campaign, or one iteration of it")
    inspect.add_argument(
        "--where",
        metavar="CONDITION",
        help="print the rollouts matching a SQL condition, e.g. 'length >= 8 and score > 1'",
    )
    inspect.add_argument("--top", type=_at_least_one, metavar="N", help="print the N rollouts highest by --by")
    inspect.add_argument(
        "--by", metavar="COLUMN", help="the column --top sorts by (default score; a DPO pair's reward_margin)"
    )
    inspect.add_argument("--format", choices=["table", "json", "csv"], default="table", help="default table")
    inspect.add_argument(
        "--threshold",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="change a drift threshold, e.g. --threshold length_rise=0.3 (repeatable; see docs/inspect.md)",
    )
    _add_config_arguments(inspect)
    export = commands.add_parser(
        "export",
        help="write a trained model of an iteration as a plain Hugging Face folder (LoRA adapters merged)",
        description="AutoModelForCausalLM.from_pretrained(OUT_DIR) loads the exported actor with no reference to "
        "this project. A critic or reward model is written as its backbone folder plus its head file.",
    )
    export.add_argument("source", help="CAMPAIGN, CAMPAIGN:ITERATION or an MLflow iteration run id")
    export.add_argument("out_dir", type=Path, help="a new (or empty) folder")
    export.add_argument("--model", choices=["actor", "critic", "reward_model"], default="actor")
    _add_config_arguments(export)
    verify = commands.add_parser(
        "verify",
        help="hash every file of a campaign's finished iterations again and check it against its manifest",
        description="Reads every byte of every output the campaign's finished iterations recorded (a rerun trusts a "
        "file whose size and times are unchanged) and checks each against its manifest and MLflow's record; changes "
        "nothing. One line naming the first output that differs or is missing, exit code 2.",
    )
    verify.add_argument("campaign", help="the campaign to verify")
    _add_config_arguments(verify)
    gc = commands.add_parser(
        "gc",
        help="remove the stage outputs of a campaign that no kept iteration, model version, replay or resume needs",
        description="Keeps the newest --keep-last finished iterations with the inputs they were computed from, "
        "unfinished iterations, replays of kept iterations, and model versions pinned with an alias; deletes the "
        "other registered model versions and outputs. MLflow keeps every run's metrics.",
    )
    gc.add_argument("campaign", help="the campaign to clean up")
    gc.add_argument(
        "--keep-last", type=_at_least_one, default=1, metavar="N", help="finished iterations to keep (default 1)"
    )
    gc.add_argument("--dry-run", action="store_true", help="print what would be removed and change nothing")
    _add_config_arguments(gc)
    serve = commands.add_parser(
        "serve",
        help="serve Prefect deployments of the iteration, campaign and replay flows until Ctrl-C",
        description="Creates the deployments rlhf-iteration/CAMPAIGN, rlhf-campaign/CAMPAIGN and rlhf-replay/CAMPAIGN "
        "with this config as their default parameters, and runs whatever is triggered (from the Prefect UI, "
        "`prefect deployment run`, or the schedule) in subprocesses of this one. Needs PREFECT_API_URL pointing at a "
        "Prefect server. Stopping it pauses the schedule.",
    )
    _add_config_arguments(serve)
    schedule = serve.add_mutually_exclusive_group()
    schedule.add_argument(
        "--cron", metavar="EXPR", help="also run one more iteration on this cron schedule (UTC), e.g. '0 3 * * *'"
    )
    schedule.add_argument(
        "--interval", type=float, metavar="SECONDS", help="also run one more iteration every SECONDS seconds"
    )
    serve.add_argument(
        "--replay-on-register",
        action="append",
        metavar="SETTING=VALUE",
        help="attach an automation: each policy the campaign registers has its iteration replayed with this setting "
        "changed (repeatable; only what a replay may change, e.g. advantages.kl_coef=0.1)",
    )
    show = commands.add_parser("config", help="print the resolved config as YAML and exit")
    _add_config_arguments(show)
    show.add_argument(
        "--json", action="store_true", help="print JSON instead (for `prefect deployment run -p config=...`)"
    )
    return parser


_USER_ERRNOS = {
    errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EISDIR, errno.ENOTDIR,
    errno.EADDRINUSE, errno.EADDRNOTAVAIL,
}  # fmt: skip
"""OS errors that are the machine's state, not a bug: a full or read-only disk, a missing or forbidden path, a taken
port or an address not of this machine (the labelling page's)."""


def _user_error(error: BaseException) -> bool:
    """Whether ``error`` is a problem with what the user gave or the machine's state, not a bug."""
    user_errors = (UserError, LookupError, FileNotFoundError, FileExistsError, TimeoutError, KeyboardInterrupt)
    if isinstance(error, KeyError | IndexError):  # LookupErrors of a bug, not a run or campaign that does not exist
        return False
    if isinstance(error, user_errors):
        return True
    return isinstance(error, OSError) and error.errno in _USER_ERRNOS


def _message(error: BaseException) -> str:
    """The error in at most two lines."""
    if isinstance(error, KeyboardInterrupt):
        return "interrupted; run the same command again to continue from the last finished stage"
    if isinstance(error, OSError) and error.strerror and error.filename:
        return f"{error.strerror}: {error.filename}"
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return "\n".join(lines[:2])


def _find_modules_beside(config_file: Path | None) -> None:
    """Let a user's modules (a reward function's, ``reward.function: module:callable``) be found in the config file's
    folder and the working directory, after everything installed (so neither shadows a package), in this process and
    in those it starts (Dask and Ray workers, the flow runs of ``rlhf serve``)."""
    folders = [str(Path(config_file).resolve().parent)] if config_file is not None else []
    folders.append(os.getcwd())
    for folder in folders:
        if folder not in sys.path:
            sys.path.append(folder)
    known = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    os.environ["PYTHONPATH"] = os.pathsep.join([*filter(None, known), *(f for f in folders if f not in known)])


def main(argv: list[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    if not arguments.verbose:
        from flows.console import quiet_libraries

        quiet_libraries()
    if os.environ.get("RLHF_HOLD_AT"):  # crash tests only: see storage/holds.py
        from storage.holds import arm_from_environment

        arm_from_environment()
    _find_modules_beside(arguments.config)
    try:
        from campaign.config import load_config

        config = load_config(
            arguments.config, _store_overrides(arguments), store_only=arguments.command in _STORE_COMMANDS
        )
        with _code_pinned(arguments.command):
            return _COMMANDS[arguments.command](config, arguments)
    except (Exception, KeyboardInterrupt) as error:
        if not _user_error(error):
            raise
        if arguments.verbose:
            traceback.print_exc()
        print(f"rlhf: {_message(error)}", file=sys.stderr)
        return getattr(error, "exit_code", 2)


def _code_pinned(command: str) -> contextlib.AbstractContextManager:
    """For a command that runs stages, one record of the code it reads for its whole run: every source file its
    checks fingerprint (the finished-campaign check reads every stage's, before any flow) and its flows pin
    (:func:`runtime.code.pinned_code`) must read the same until it ends. Imports nothing heavy: a refusal of the
    command's inputs still comes before torch, MLflow or Prefect is imported."""
    if command not in ("run", "iterate", "replay"):
        return contextlib.nullcontext()
    from runtime.code import pinned_code

    return pinned_code(())


class _RunFailures(logging.Filter):
    """Drops Prefect's console records of a failing flow or task run (its tracebacks and final states): the
    command reports the failure itself, once. The Prefect UI keeps them all."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(("prefect.flow_runs", "prefect.task_runs")):
            return True
        final = record.getMessage().startswith(("Finished in state Failed", "Finished in state Crashed"))
        return record.levelno < logging.ERROR and not final


def _prepare(config, arguments, *, replay: bool = False, checked: bool = False, inputs_checked: bool = False):
    """What every flow-running command does first: check the campaign's inputs, that no other process runs
    it and (but for a replay, whose config is its source's) that it was started with this config, then make
    sure a Prefect server is there, one this process owns if none is configured.

    Returns:
        The console that shows the stages (:func:`flows.console.show_stages`; close it when the flows end), or
        None with ``--verbose``, which shows the whole log instead; and the base inputs, resolved and checked
        once for the whole command (the flows take them; ``inputs_checked``: the command checked them already,
        :func:`_check_inputs_early`).

    Raises:
        LockHeld: another process is running the campaign.
        ConfigError: the campaign was started with another config.
        InputError, FileNotFoundError: an input the stages could not use.
    """
    from prefect.logging.handlers import PrefectConsoleHandler

    from campaign.config import ConfigError
    from flows.console import show_stages
    from flows.iterations import generation_engine, resolve_base
    from flows.prefect_server import ensure_prefect_api

    if config.run_root.exists() and not config.run_root.is_dir():
        raise ConfigError(f"`run_root` {config.run_root} is not a folder")
    if not checked:  # `rlhf run` checked both before it looked for finished work (:func:`_refuse_if_busy_or_other`)
        _refuse_if_busy_or_other(config, replay=replay)
    console = None
    if not arguments.verbose:
        handlers = [handler for handler in logging.getLogger().handlers if isinstance(handler, PrefectConsoleHandler)]
        for handler in handlers:
            handler.addFilter(_RunFailures())
        console = show_stages(handlers)  # before the inputs: converting a GGUF model says so there
    try:
        base = resolve_base.fn(config, checked=inputs_checked)
        if config.sampling.engine == "vllm":
            ensure_prefect_api()  # the engine takes the machine's Prefect concurrency slot before it starts
        generation_engine(config, base.policy.path)  # now: what it cannot do is told before any stage runs
    except BaseException:
        if console is not None:
            console.close()
        raise
    ensure_prefect_api()
    return console, base


def _refuse_if_busy_or_other(config, *, replay: bool = False) -> None:
    """Refuse a campaign another process runs, or (but for a replay, whose config is its source's) one started with
    a config that differs in a field defining it; creates nothing.

    Raises:
        LockHeld: another process is running the campaign.
        ConfigError: the campaign was started with another config.
    """
    from campaign.identity import check_campaign_config
    from campaign.store import campaign_layout, existing_tracker
    from storage.locks import refuse_if_locked

    if config.run_root.is_dir():
        refuse_if_locked(campaign_layout(config).lock_file(), what=f"campaign `{config.campaign}`")
    if not replay and (tracker := existing_tracker(config)) is not None:
        check_campaign_config(config, tracker)


@contextlib.contextmanager
def _server_coming_up():
    """Launch the temporary Prefect server (if the command needs one) before importing the flows, torch and the
    rest: it comes up meanwhile, and :func:`_prepare` waits for it once the inputs are checked. A command that
    ends before that (a refused input) stops it."""
    from flows.prefect_server import start_prefect_api, stop_unused_prefect_api

    start_prefect_api()
    try:
        yield
    finally:
        stop_unused_prefect_api()


@contextlib.contextmanager
def _running_flows(console):
    """Run the block's flows with this command's Prefect settings (:func:`flows.prefect_server.flow_settings`), and
    close the stage console (if any) when they end, before the command prints its report."""
    from flows.prefect_server import flow_settings

    try:
        with flow_settings():
            yield
    finally:
        if console is not None:
            console.close()


def _check_inputs_early(config):
    """The input checks that need no weights, torch, MLflow or Prefect (:func:`flows.inputs.check_files`, then
    :func:`flows.inputs.check_tokens`), before anything else, so such a refusal answers in a second or two.

    Returns:
        Where each base input is (none hashed; a GGUF model's converted folder found by the file's content), for
        :func:`_check_models`; or None where the weights are there only later, and checked then, in full
        (:func:`_prepare`): the demo world's, which the flow builds (its tokens too), and a GGUF model not
        converted yet (its tokens are checked here, from the file, before the conversion).
    """
    from campaign.identity import base_inputs, uses_demo_world
    from campaign.model_sources import is_gguf
    from flows.inputs import check_files, check_tokens

    check_files(config)
    if uses_demo_world(config):
        return None
    located = base_inputs(config, None, None)
    check_tokens(config, located)
    models = (located.policy, located.tokenizer, located.reward_model)
    return None if any(model is not None and is_gguf(model.path) for model in models) else located


def _check_models(config, located) -> None:
    """The input checks that need torch (:func:`flows.inputs.check_models`: device, weights' headers, reward head,
    reward function), before the flows are imported and the model hashed: a refusal waits for neither."""
    from flows.inputs import check_models

    if located is not None:
        check_models(config, located)


def _run(config, arguments) -> int:
    located = _check_inputs_early(config)
    from campaign.config import ConfigError
    from campaign.history import campaign_finished, difference_note, finished_iterations
    from campaign.verification import check_finished_outputs
    from flows.report import campaign_link, campaign_report

    if config.run_root.exists() and not config.run_root.is_dir():
        raise ConfigError(f"`run_root` {config.run_root} is not a folder")
    _refuse_if_busy_or_other(config)
    finished = finished_iterations(config)  # one query for the check, the decision, the note and the report
    for restored in check_finished_outputs(config, finished, below=arguments.from_iteration):
        print(f"campaign `{config.campaign}`: {restored}")
    if arguments.from_iteration is None and campaign_finished(config, finished):
        if note := difference_note(config, finished):
            print(f"campaign `{config.campaign}`: {note}")
        print(f"campaign `{config.campaign}`: all {config.iterations} iterations are finished; nothing to run")
    else:
        with _server_coming_up():
            _check_models(config, located)
            from flows.rlhf_pipeline import rlhf_campaign

            console, base = _prepare(config, arguments, checked=True, inputs_checked=located is not None)
            with _running_flows(console):
                rlhf_campaign(config, from_iteration=arguments.from_iteration, base=base)
            finished = finished_iterations(config)
    print(campaign_report(finished))
    print(f"\nOutputs: {config.run_root / config.campaign}\n{campaign_link(config)}")
    return 0


def _iterate(config, arguments) -> int:
    located = _check_inputs_early(config)  # as `rlhf run` does
    from campaign.history import finished_iterations
    from flows.report import campaign_link, campaign_report

    with _server_coming_up():
        _check_models(config, located)
        from flows.rlhf_pipeline import rlhf_iteration

        console, base = _prepare(config, arguments, inputs_checked=located is not None)
        with _running_flows(console):
            rlhf_iteration(config, base=base)
    print(f"{campaign_report(finished_iterations(config))}\n\n{campaign_link(config)}")
    return 0


def _replay(config, arguments) -> int:
    from flows.report import compare_report

    with _server_coming_up():
        from campaign.store import resolve_run
        from flows.replay import replay_config
        from flows.rlhf_pipeline import rlhf_replay

        source_run_id = resolve_run(config, arguments.source)
        replay = replay_config(config, source_run_id, arguments.overrides)
        console, base = _prepare(replay, arguments, replay=True)
        with _running_flows(console):
            replay_run_id = rlhf_replay(replay, source_run_id, base=base)
    print(compare_report(config, [source_run_id, replay_run_id]))
    print(f"\nReplay run {replay_run_id}; compare again with: rlhf compare {arguments.source} {replay_run_id}")
    return 0


def _compare(config, arguments) -> int:
    from campaign.store import resolve_run
    from flows.report import compare_report

    metrics = arguments.metrics.split(",") if arguments.metrics else None
    print(compare_report(config, [resolve_run(config, name) for name in arguments.runs], metrics=metrics))
    return 0


def _inspect(config, arguments) -> int:
    from flows.inspection import RENDERERS, inspect_campaign

    inspection = inspect_campaign(
        config,
        arguments.target,
        where=arguments.where,
        top=arguments.top,
        by=arguments.by,
        thresholds=arguments.threshold,
    )
    print(RENDERERS[arguments.format](inspection), end="")
    return 0


def _export(config, arguments) -> int:
    from flows.export import export_model

    out_dir = export_model(config, arguments.source, arguments.out_dir, model=arguments.model)
    print(f"wrote the {arguments.model} of {arguments.source} to {out_dir}")
    return 0


def _gc(config, arguments) -> int:
    from campaign.gc import collect_garbage, describe

    config = config.model_copy(update={"campaign": arguments.campaign})
    plan = collect_garbage(config, keep_last=arguments.keep_last, dry_run=arguments.dry_run)
    print(describe(plan, dry_run=arguments.dry_run))
    return 0


def _verify(config, arguments) -> int:
    from campaign.history import finished_iterations
    from campaign.verification import verify_campaign

    config = config.model_copy(update={"campaign": arguments.campaign})
    print(verify_campaign(config, finished_iterations(config)))
    return 0


def _serve(config, arguments) -> int:
    from flows.serve import serve_pipeline

    serve_pipeline(
        config, cron=arguments.cron, interval=arguments.interval, replay_on_register=arguments.replay_on_register
    )
    return 0


def _config(config, arguments) -> int:
    from campaign.config import ConfigError, commented_yaml, load_config

    try:  # as `rlhf run` would read it: say so if it would refuse it
        load_config(arguments.config, arguments.overrides)
        refused = None
    except ConfigError as error:
        refused = str(error)
    if arguments.json:
        if refused:
            raise ConfigError(refused)
        print(config.model_dump_json())
        return 0
    if refused:
        print(f"# `rlhf run` would refuse this config: {refused}\n")
    print(commented_yaml(config), end="")
    return 0


_STORE_COMMANDS = ("replay", "compare", "inspect", "export", "verify", "gc", "config")
"""Commands that read what runs recorded (or print the config): they need no model or prompts set. A replay, inspect,
an export and gc take the campaign's config from its store (each iteration run's ``config.json``), so ``--config`` and
``--set`` only say where the store is (``run_root``, ``tracking_uri``); only ``run`` and ``iterate`` (and ``serve``)
start or continue a campaign from a config file."""


def _store_overrides(arguments: argparse.Namespace) -> list[str]:
    """The ``--set`` overrides the command's own config takes: a replay's other overrides change its source run's
    recorded config (:func:`flows.replay.replay_config`), never the defaults, which they might not fit."""
    if arguments.command != "replay":
        return arguments.overrides
    from campaign.config import parse_override
    from campaign.settings import LOCATION

    return [text for text in arguments.overrides if parse_override(text)[0] in LOCATION]


_COMMANDS = {
    "run": _run,
    "iterate": _iterate,
    "replay": _replay,
    "compare": _compare,
    "inspect": _inspect,
    "export": _export,
    "verify": _verify,
    "gc": _gc,
    "serve": _serve,
    "config": _config,
}


_exit_status = 1
"""What :func:`command` exits with: :func:`main`'s return value once it has one (1 while a bug propagates)."""


def command() -> None:
    """The ``rlhf`` executable: :func:`main`, then an exit without the interpreter's teardown.

    With torch, transformers, Prefect and MLflow loaded, tearing the interpreter down (clearing every module and
    freeing half a million objects) took 4 s after the command's work was done: 4 s a command for the user, and
    for every command a test starts. The exit hooks still run (Prefect's log and event workers flush, the
    temporary Prefect server stops, logging is shut down), then the process leaves with ``os._exit``; the hook
    that does so is registered first, before anything this command imports registers its own, so it runs last.
    """
    global _exit_status
    atexit.register(_leave_without_teardown)
    _exit_status = main()
    sys.exit(_exit_status)


def _leave_without_teardown() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()  # registered by logging at import, before this hook, so it would run after it
    os._exit(_exit_status)


if __name__ == "__main__":
    command()
