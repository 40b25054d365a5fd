"""The ``rlhf`` command line (``rlhf COMMAND --help`` documents each command).

rlhf run       run a campaign: config.iterations iterations (finished stages are reused)
rlhf iterate   run one more iteration, continuing the campaign from its latest state in MLflow
rlhf replay    re-run rewards/KL/GAE, PPO and evaluation of a recorded iteration with new settings
rlhf compare   print chosen metrics of several runs or campaigns side by side
rlhf export    write a trained model of an iteration as a plain Hugging Face folder (LoRA merged)
rlhf gc        remove the stage outputs of a campaign that nothing kept needs
rlhf serve     serve Prefect deployments of the flows (trigger them from the UI), optionally on a schedule
rlhf config    print the resolved config as YAML
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Offline-friendly defaults, set before Prefect and MLflow are imported; the user's own settings win.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "rlhf_core,storage,tasks,flows,demo")
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


def _at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlhf",
        description="Staged, resumable, replayable RLHF (PPO) on Prefect and MLflow.",
        epilog="With no --config, the built-in defaults run the embedded demo.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser("run", help="run a campaign (finished stages are reused; a crashed run resumes)")
    _add_config_arguments(run)
    iterate = commands.add_parser("iterate", help="run one more iteration from the campaign's latest state")
    _add_config_arguments(iterate)
    replay = commands.add_parser(
        "replay",
        help="re-run rewards/KL/GAE, PPO update and evaluation of a recorded iteration with new settings (no generation)",
        description="Only advantages.*, ppo.*, sizes.eval_prompts and torch_threads may differ from the source run.",
    )
    replay.add_argument("source", help="an MLflow iteration run id, or CAMPAIGN:ITERATION")
    _add_config_arguments(replay)
    compare = commands.add_parser("compare", help="print metrics of several runs or campaigns side by side")
    compare.add_argument(
        "runs", nargs="+", help="MLflow run ids, CAMPAIGN:ITERATION, or CAMPAIGN (its latest iteration)"
    )
    compare.add_argument("--metrics", help="comma-separated metric names (default: the headline evaluation metrics)")
    _add_config_arguments(compare)
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
    show = commands.add_parser("config", help="print the resolved config as YAML and exit")
    _add_config_arguments(show)
    show.add_argument(
        "--json", action="store_true", help="print JSON instead (for `prefect deployment run -p config=...`)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    from flows.config import ConfigError, load_config

    try:
        config = load_config(arguments.config, arguments.overrides)
        return _COMMANDS[arguments.command](config, arguments)
    except (ConfigError, LookupError, FileNotFoundError, FileExistsError, TimeoutError) as error:
        print(f"rlhf: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        from flows.human_labels import HumanLabelTimeout

        if not isinstance(error, HumanLabelTimeout):
            raise
        print(f"rlhf: {error}", file=sys.stderr)
        return 3


def _run(config, arguments) -> int:
    from flows.report import campaign_report
    from flows.rlhf_pipeline import rlhf_campaign

    rlhf_campaign(config)
    print(campaign_report(config))
    print(f"\nOutputs: {config.run_root / config.campaign}")
    return 0


def _iterate(config, arguments) -> int:
    from flows.report import campaign_report
    from flows.rlhf_pipeline import rlhf_iteration

    rlhf_iteration(config)
    print(campaign_report(config))
    return 0


def _replay(config, arguments) -> int:
    from flows.replay import replay_config, resolve_run
    from flows.report import compare_report
    from flows.rlhf_pipeline import rlhf_replay

    source_run_id = resolve_run(config, arguments.source)
    replay = replay_config(config, source_run_id, arguments.overrides)
    replay_run_id = rlhf_replay(replay, source_run_id)
    print(compare_report(config, [source_run_id, replay_run_id]))
    print(f"\nReplay run {replay_run_id}; compare again with: rlhf compare {arguments.source} {replay_run_id}")
    return 0


def _compare(config, arguments) -> int:
    from flows.replay import resolve_run
    from flows.report import compare_report

    metrics = arguments.metrics.split(",") if arguments.metrics else None
    print(compare_report(config, [resolve_run(config, name) for name in arguments.runs], metrics=metrics))
    return 0


def _export(config, arguments) -> int:
    from flows.export import export_model

    out_dir = export_model(config, arguments.source, arguments.out_dir, model=arguments.model)
    print(f"wrote the {arguments.model} of {arguments.source} to {out_dir}")
    return 0


def _gc(config, arguments) -> int:
    from flows.gc import collect_garbage, describe

    config = config.model_copy(update={"campaign": arguments.campaign})
    plan = collect_garbage(config, keep_last=arguments.keep_last, dry_run=arguments.dry_run)
    print(describe(plan, dry_run=arguments.dry_run))
    return 0


def _serve(config, arguments) -> int:
    from flows.serve import serve_pipeline

    serve_pipeline(config, cron=arguments.cron, interval=arguments.interval)
    return 0


def _config(config, arguments) -> int:
    import yaml

    if arguments.json:
        print(config.model_dump_json())
        return 0
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return 0


_COMMANDS = {
    "run": _run,
    "iterate": _iterate,
    "replay": _replay,
    "compare": _compare,
    "export": _export,
    "gc": _gc,
    "serve": _serve,
    "config": _config,
}


if __name__ == "__main__":
    sys.exit(main())
