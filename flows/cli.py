"""The ``rlhf`` command line.

rlhf run [--config FILE] [--set section.field=value ...]   run a campaign
rlhf config [--config FILE] [--set ...]                    print the resolved config as YAML
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlhf", description="Staged, resumable, replayable RLHF (PPO) on Prefect and MLflow."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a campaign (every finished stage is reused)")
    _add_config_arguments(run)
    show = commands.add_parser("config", help="print the resolved config as YAML and exit")
    _add_config_arguments(show)
    return parser


def main(argv: list[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    import yaml

    from flows.config import ConfigError, load_config

    try:
        config = load_config(arguments.config, arguments.overrides)
    except ConfigError as error:
        print(f"rlhf: {error}", file=sys.stderr)
        return 2
    if arguments.command == "config":
        print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
        return 0

    from flows.report import campaign_report
    from flows.rlhf_pipeline import rlhf_campaign

    rlhf_campaign(config)
    print(campaign_report(config))
    print(
        f"\nOutputs: {config.run_root / config.campaign}    MLflow: {config.tracking_uri or 'sqlite:///' + str(config.run_root / config.campaign / 'mlflow.db')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
