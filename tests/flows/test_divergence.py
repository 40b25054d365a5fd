"""Issue 23: a learning rate that makes a model diverge is one clear line naming the stage, the iteration and the
setting to lower (exit 2), and the stage that found it writes nothing; the maths of each check is in
tests/rlhf_core/test_divergence.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


def _rlhf_run(tmp: Path, world: dict[str, Path], *overrides: str) -> list[str]:
    sets = [
        f"run_root={tmp / 'runs'}",
        f"model.policy={world['policy']}",
        f"data.prompts={world['prompts']}",
        f"data.eval_prompts={world['eval_prompts']}",
        "iterations=1",
        *overrides,
    ]
    return ["run", "--config", str(TINY), *(f"--set={item}" for item in sets)]


@pytest.mark.parametrize(
    ("setting", "stage"),
    [("ppo.actor_learning_rate", "ppo_update"), ("reward_model.learning_rate", "train_reward_model")],
)
def test_issue23_a_diverging_learning_rate_fails_its_stage_in_one_line_and_writes_nothing(
    prefect_server, checkpoint_world, tmp_path, capfd, setting, stage
):
    capfd.readouterr()
    code = main(_rlhf_run(tmp_path, checkpoint_world, f"{setting}=1e6"))
    stderr = capfd.readouterr().err
    assert code == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    (message,) = [line for line in stderr.splitlines() if line.startswith("rlhf: ")]
    assert message.startswith(f"rlhf: {stage}, iteration 0: the ")
    assert "is not finite at optimizer step" in message and "(learning rate 1e+06)" in message
    assert f"lower `{setting}`" in message
    written = [path for path in (tmp_path / "runs" / "tiny" / stage).glob("*") if (path / "_manifest.json").exists()]
    assert not written
