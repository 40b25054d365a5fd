"""Finished tiny campaigns built once per test run, for every test that only reads one (docs/testing.md, "Reading a
shared campaign").

A campaign of ``configs/tiny.yaml`` takes 15-40 s on CPU; most flow modules only inspect a finished one. Each campaign
here is built by the first test process that asks for it, under a file lock in a folder every process of the test
run sees (with ``pytest -n 2`` the workers share it), and read by the others once it is finished. A test that changes
a campaign (runs it again with other settings, edits or deletes an output) works on :func:`copy_campaign`.

The campaigns' Prefect flow runs, events and assets are on the server of the process that built them: a test that
reads those runs the campaign in its own process (tests/flows/test_rlhf_pipeline.py does).
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from campaign.config import PipelineConfig, load_config
from tests.once import built_once

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def tiny_config(run_root: Path, world: dict[str, Path], *overrides: str) -> PipelineConfig:
    """``configs/tiny.yaml`` at ``run_root`` on the checkpoint ``world``, with ``overrides`` last."""
    return load_config(
        TINY,
        [
            f"run_root={run_root}",
            f"model.policy={world['policy']}",
            f"data.prompts={world['prompts']}",
            f"data.eval_prompts={world['eval_prompts']}",
            *overrides,
        ],
    )


def copy_campaign(run_root: Path, into: Path) -> Path:
    """A copy at ``into`` of the finished run root ``run_root``, as if the campaign had been computed there.

    A local MLflow store records paths: each stage run's output folder, the artifact locations, the registered
    versions' and logged models' sources, the recorded config. Each of them names the copy, so what a test runs on
    the copy writes nothing outside it and reads the copy's outputs, not the original's. The run root's fingerprint
    cache keeps the original's paths: the first run on the copy hashes its outputs again.
    """
    shutil.copytree(run_root, into, symlinks=True)
    old, new = str(run_root), str(into)
    with sqlite3.connect(into / "mlflow.db") as store:
        tables = [name for (name,) in store.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for table in tables:
            for column in [row[1] for row in store.execute(f'PRAGMA table_info("{table}")')]:
                store.execute(
                    f'UPDATE "{table}" SET "{column}" = replace("{column}", ?, ?) '
                    f'WHERE typeof("{column}") = \'text\' AND instr("{column}", ?) > 0',
                    (old, new, old),
                )
    store.close()
    for path in (into / "mlartifacts").rglob("config.json"):  # each iteration's config, as a replay reads it
        path.write_text(path.read_text().replace(old, new))
    return into


def _finished_campaign(tmp_path_factory, name: str, world: dict[str, Path], *overrides: str) -> PipelineConfig:
    """The config of the shared campaign ``name`` (``configs/tiny.yaml`` on ``world`` with ``overrides``), run to
    its end in this process unless another one did."""
    from flows.rlhf_pipeline import rlhf_campaign

    folder = built_once(
        tmp_path_factory, name, lambda folder: rlhf_campaign(tiny_config(folder / "runs", world, *overrides))
    )
    return tiny_config(folder / "runs", world, *overrides)


@pytest.fixture(scope="session")
def one_iteration_campaign(prefect_server, checkpoint_world, tmp_path_factory) -> PipelineConfig:
    """``configs/tiny.yaml`` for one iteration (campaign ``tiny``: GAE, a learned reward model, the demo's gold
    labeler) on the ``checkpoint_world`` policy, finished."""
    return _finished_campaign(tmp_path_factory, "tiny-1", checkpoint_world, "iterations=1")


@pytest.fixture(scope="session")
def two_iteration_campaign(one_iteration_campaign, checkpoint_world, tmp_path_factory) -> PipelineConfig:
    """:func:`one_iteration_campaign` continued for a second iteration, on a copy (``configs/tiny.yaml`` as it is:
    campaign ``tiny``, two iterations), finished."""
    from flows.rlhf_pipeline import rlhf_campaign

    def build(folder: Path) -> None:
        copy_campaign(one_iteration_campaign.run_root, folder / "runs")
        rlhf_campaign(tiny_config(folder / "runs", checkpoint_world, "iterations=2"))

    folder = built_once(tmp_path_factory, "tiny-2", build)
    return tiny_config(folder / "runs", checkpoint_world, "iterations=2")
