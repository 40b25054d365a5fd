"""N-process training (issue 11): 2 gloo processes under a real ``accelerate launch`` (the test run's one launch,
tests/two_processes.py) end where this process does, with DDP and with the models sharded over the processes
(FSDP2, issue 25).

Same models, data, global minibatches and shuffles; each process trains on its share of every minibatch
(:mod:`rlhf_core.distributed`). Weights match to float rounding (the shares' forward passes batch differently
and DDP adds the gradients in another order), and discrete outcomes match exactly: the steps taken, the ``target_kl``
early stop and the KL budget's stop, each decided on all-reduced values. The sharded runs also train a Llama with LoRA
(PPO and reward model) and with gradient checkpointing (PPO).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_core.distributed import rank_share
from tests.rlhf_core.distributed_job import PPO_CASES, SHARDED_CASES, train_all


def test_rank_share_splits_rows_contiguously_and_gives_a_rank_without_rows_a_weightless_stand_in():
    # 7 rows over 2 ranks: tensor_split gives the first rank the extra row.
    assert rank_share(7, rank=0, world=2)[0].tolist() == [0, 1, 2, 3]
    assert rank_share(7, rank=1, world=2)[0].tolist() == [4, 5, 6]
    assert rank_share(7, rank=1, world=2)[1] == 1.0
    # 1 row over 2 ranks: rank 1 computes on row 0 with weight 0, so it still joins DDP's all-reduce.
    rows, weight = rank_share(1, rank=0, world=2)
    assert rows.tolist() == [0] and weight == 1.0
    rows, weight = rank_share(1, rank=1, world=2)
    assert rows.tolist() == [0] and weight == 0.0


SHARDED_ONLY = [*SHARDED_CASES, "reward_model_llama_lora"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """Every case trained in this process: what the 2 processes must end with."""
    folder = tmp_path_factory.mktemp("distributed") / "one"
    train_all(folder, shard=False, sharded_cases=True)
    return folder


@pytest.fixture(scope="module")
def runs(one_process, two_processes) -> tuple[Path, Path]:
    return one_process, two_processes / "ddp"


@pytest.fixture(scope="module")
def sharded_runs(one_process, two_processes) -> tuple[Path, Path]:
    return one_process, two_processes / "fsdp"


@pytest.mark.parametrize("case", [*PPO_CASES, "reward_model"])
def test_two_processes_give_the_weights_and_statistics_of_one(runs, case):
    _assert_same_training(runs, case)


@pytest.mark.parametrize("case", [*PPO_CASES, "reward_model", *SHARDED_ONLY])
def test_two_sharded_processes_give_the_weights_and_statistics_of_one_issue_25(sharded_runs, case):
    """The sharded weights are gathered on the main process (:func:`rlhf_core.distributed.full_state_dict`)."""
    _assert_same_training(sharded_runs, case)


def _assert_same_training(runs: tuple[Path, Path], case: str) -> None:
    one, two = (torch.load(folder / f"{case}.pt") for folder in runs)
    assert one["weights"].keys() == two["weights"].keys()
    for role, weights in one["weights"].items():
        assert weights.keys() == two["weights"][role].keys(), role
        for name, value in weights.items():
            torch.testing.assert_close(two["weights"][role][name], value, rtol=1e-4, atol=1e-5, msg=f"{role}.{name}")
    assert one["stats"]["optimizer_steps"] == two["stats"]["optimizer_steps"]
    for name, value in one["stats"].items():
        if isinstance(value, torch.Tensor | float):
            torch.testing.assert_close(
                torch.as_tensor(two["stats"][name]), torch.as_tensor(value), rtol=1e-4, atol=1e-5
            )
        else:
            assert two["stats"][name] == value, name


def test_the_target_kl_early_stop_is_taken_and_at_the_same_step(runs):
    one, two = (torch.load(folder / "ppo_target_kl.pt") for folder in runs)
    assert one["stats"]["early_stopped"] and two["stats"]["early_stopped"]
    assert one["stats"]["optimizer_steps"] == two["stats"]["optimizer_steps"] < PPO_CASES["ppo_target_kl"].epochs * 2


def test_the_kl_budget_stop_is_taken_at_the_same_step(runs):
    one, two = (torch.load(folder / "ppo_kl_budget.pt") for folder in runs)
    assert one["stats"]["at_kl_budget"] and two["stats"]["at_kl_budget"]
    assert one["stats"]["optimizer_steps"] == two["stats"]["optimizer_steps"] == 4


def test_the_sharded_lora_runs_train_their_adapters(sharded_runs):
    """LoRA's B matrices start at zero: a sharded update that trained them leaves them nonzero."""
    for case in ("ppo_llama_lora", "reward_model_llama_lora"):
        weights = torch.load(sharded_runs[1] / f"{case}.pt")["weights"]
        adapters = [value for role in weights.values() for name, value in role.items() if "lora_B" in name]
        assert adapters and all(value.abs().sum() > 0 for value in adapters), case
