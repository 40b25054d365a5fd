"""The training stages' checkpointer (issue 32): models, optimizers and training state through torch distributed
checkpointing, so an update resumes on another number of processes.

A PPO update sharded over 2 gloo processes (FSDP2, in the test run's one real ``accelerate launch``,
tests/two_processes.py), stopped after its checkpoint of epoch 2 and resumed in 1 process, and one stopped in 1
process and resumed on 2, end with the weights of an uninterrupted update to float rounding (the tolerance of
tests/rlhf_core/test_distributed.py), with LoRA too; on as many processes a resumed update is the uninterrupted one
exactly. The optimizer states an output keeps, written by 1 process or 2, are read back exactly by the other, so the
next update continues them on any number of processes; so are the previous release's
(tests/runtime/policy_before_issue32), whichever number of processes wrote them.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from rlhf_core.loading import ModelLoader
from runtime.checkpointer import OPTIMIZERS, Checkpointer
from runtime.context import Execution
from runtime.models import accelerator_for
from storage.checkpoints import CHECKPOINT_METADATA
from tests.runtime.checkpointer_job import BEFORE, read_states, update


@pytest.fixture(scope="module")
def work(two_processes) -> SimpleNamespace:
    """The updates and reads of the module docstring: started in the test run's 2 sharded processes
    (:func:`checkpointer_job.on_two_processes`, after :func:`checkpointer_job.before_two_processes` here) and
    finished in this process, in the launch's folder (no other module writes there)."""
    work = two_processes / "checkpointer"
    policy = str(work / "policy")
    # what 2 processes wrote, read before this process resumes from it
    written_by_two = sorted(path.name for path in (work / "from_two.partial" / "epoch-00002").iterdir())
    lora_checkpoint = FileSystemReader(work / "lora_from_two.partial" / "epoch-00002").read_metadata()
    # the updates stopped on 2 processes resumed here; the uninterrupted LoRA update; one stopped and resumed here
    update(work, name="from_two", source=policy)
    update(work, name="lora_from_two", source=policy, lora=True)
    update(work, name="lora_uninterrupted", source=policy, lora=True)
    update(work, name="stopped_on_one", source=policy, stop_after=2)
    update(work, name="stopped_on_one", source=policy)
    # the optimizer states read here: the previous release's, and those the update resumed on 2 processes kept
    for kind in ("whole", "sharded"):
        read_states(work, name=f"before_{kind}_read_on_one", source=str(BEFORE / "whole"), continues=str(BEFORE / kind))
    read_states(work, name="from_one_read_on_one", source=str(work / "from_one"), continues=str(work / "from_one"))
    return SimpleNamespace(folder=work, written_by_two=written_by_two, lora_checkpoint=lora_checkpoint)


def _weights(output: Path) -> dict[str, torch.Tensor]:
    """Every tensor the output's model folders hold (weights, adapters, heads), by ``folder/file:name``."""
    return {
        f"{file.parent.name}/{file.name}:{name}": value
        for file in sorted(output.glob("*/*.safetensors"))
        for name, value in load_file(file).items()
    }


def _assert_same_weights(expected: Path, found: Path) -> None:
    """To float rounding: the tolerance of tests/rlhf_core/test_distributed.py."""
    weights, other = _weights(expected), _weights(found)
    assert weights and weights.keys() == other.keys(), found.name
    for key, value in weights.items():
        torch.testing.assert_close(other[key], value, rtol=1e-4, atol=1e-5, msg=f"{found.name}: {key}")


def _states(work: SimpleNamespace, name: str) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """``{model: {parameter: {moment: tensor}}}``: the whole optimizer states :func:`checkpointer_job._dump` wrote."""
    return torch.load(work.folder / f"{name}.pt", weights_only=True)


def test_every_process_writes_its_part_of_a_checkpoint(work):
    assert work.written_by_two == [CHECKPOINT_METADATA, "__0_0.distcp", "__1_0.distcp", "training_state.json"]
    written = {path.name for path in (work.folder / "from_one" / OPTIMIZERS).iterdir()}
    assert written == {CHECKPOINT_METADATA, "__0_0.distcp", "__1_0.distcp"}


def test_a_sharded_update_resumes_on_one_process_and_a_one_process_update_on_two(work):
    """Weights and statistics to float rounding, the same steps taken, the training curve across the resume."""
    expected = json.loads((work.folder / "uninterrupted.json").read_text())
    for name in ("from_two", "from_one"):
        _assert_same_weights(work.folder / "uninterrupted", work.folder / name)
        stats = json.loads((work.folder / f"{name}.json").read_text())
        assert stats["optimizer_steps"] == expected["optimizer_steps"] == 12
        torch.testing.assert_close(stats, expected, rtol=1e-4, atol=1e-5, msg=name)
        curve = json.loads((work.folder / name / "training_curve.json").read_text())
        assert [row["step"] for row in curve] == list(range(1, 13)), name  # 4 epochs of 3 steps


def test_a_sharded_lora_update_resumes_on_one_process_from_its_adapters_and_heads_alone(work):
    """The frozen base is read from the model's source again, not from the checkpoint."""
    saved = [key for key in work.lora_checkpoint.state_dict_metadata if ".weights." in key]
    assert saved and all(".lora_" in key or ".value_head." in key for key in saved), saved
    assert {key.split(".")[0] for key in saved} == {"actor", "critic"}
    _assert_same_weights(work.folder / "lora_uninterrupted", work.folder / "lora_from_two")


def test_the_optimizer_states_an_output_keeps_are_read_exactly_on_another_process_count(work):
    """Written by 1 process and read by 2, written by 2 and read by 1: the next update continues them anywhere."""
    for written, read in (("uninterrupted", "uninterrupted_read_on_two"), ("from_one", "from_one_read_on_one")):
        torch.testing.assert_close(_states(work, read), _states(work, written), rtol=0, atol=0, msg=read)


def test_a_resumed_update_on_as_many_processes_is_the_uninterrupted_one_exactly(work):
    uninterrupted, resumed = (_weights(work.folder / name) for name in ("uninterrupted", "stopped_on_one"))
    assert uninterrupted.keys() == resumed.keys()
    assert all(torch.equal(resumed[key], value) for key, value in uninterrupted.items())
    for file in ("training_curve.json", f"{OPTIMIZERS}/__0_0.distcp", f"{OPTIMIZERS}/{CHECKPOINT_METADATA}"):
        assert (work.folder / "uninterrupted" / file).read_bytes() == (
            work.folder / "stopped_on_one" / file
        ).read_bytes()


def test_the_previous_releases_optimizer_states_are_read_on_one_process_or_two(work):
    """Each read alike by 1 and 2 processes; the 2 processes' shards joined are the whole state 1 process saved after
    the same steps, to float rounding (the whole state read exactly: the next test)."""
    for kind in ("whole", "sharded"):
        on_one, on_two = (_states(work, f"before_{kind}_read_on_{count}") for count in ("one", "two"))
        torch.testing.assert_close(on_two, on_one, rtol=0, atol=0, msg=kind)
    whole, sharded = (_states(work, f"before_{kind}_read_on_one") for kind in ("whole", "sharded"))
    torch.testing.assert_close(sharded, whole, rtol=1e-4, atol=1e-6)


def _continued(folder: Path, **rates: float) -> dict[str, torch.optim.Optimizer]:
    """The optimizers of the fixture's actor and critic, in this process, continuing the states kept in ``folder``."""
    loader = ModelLoader(device=torch.device("cpu"), precision="fp32")
    models = {role: loader.load(role, BEFORE / "whole" / role, trainable=True) for role in ("actor", "critic")}
    checkpointer = Checkpointer(
        accelerator_for(torch.device("cpu"), "fp32"), Execution(), folder / "unused", generator=torch.Generator(),
        epochs=1, name="test",
    )  # fmt: skip
    factories = {role: partial(torch.optim.AdamW, lr=rate) for role, rate in rates.items()}
    return checkpointer.prepare(models, factories, continues=folder)[1]


def test_continued_states_keep_the_learning_rates_of_the_settings(work):
    """Only per-parameter states are saved: a replay that changes a learning rate trains at it."""
    optimizers = _continued(work.folder / "uninterrupted", actor=0.5, critic=0.25)
    assert [optimizers[role].param_groups[0]["lr"] for role in ("actor", "critic")] == [0.5, 0.25]
    assert {int(state["step"]) for state in optimizers["actor"].state.values()} == {12}


def test_the_previous_releases_states_load_as_saved_with_the_learning_rates_of_the_settings():
    """The whole state exactly; the 2 shards joined are the state 1 process saved after the same steps, to float
    rounding. The learning rate is the settings' (the file says 0.01): a replay that changes it trains at it."""
    for kind in ("whole", "sharded"):
        optimizers = _continued(BEFORE / kind, actor=0.5, critic=0.25)
        for role, rate in (("actor", 0.5), ("critic", 0.25)):
            saved = torch.load(BEFORE / "whole" / f"{role}_optimizer" / "optimizer.pt", weights_only=True)
            loaded = optimizers[role].state_dict()
            assert loaded["param_groups"][0]["lr"] == rate != saved["param_groups"][0]["lr"]
            assert loaded["state"].keys() == saved["state"].keys()
            for index, values in saved["state"].items():
                for name, value in values.items():
                    tolerance = {"rtol": 0, "atol": 0} if kind == "whole" else {"rtol": 1e-4, "atol": 1e-6}
                    torch.testing.assert_close(loaded["state"][index][name], value, **tolerance, msg=f"{kind} {name}")


def test_an_output_without_optimizer_states_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"keeps no optimizer states for the actor \(neither optimizers/"):
        _continued(tmp_path, actor=0.1, critic=0.1)


class _Progress(NamedTuple):
    epochs_done: int


def test_issue42_fp16s_loss_scale_is_checkpointed_and_restored_with_the_epoch(tmp_path):
    """fp16 trains under a loss scaler whose scale moves with every overflow and every run of good steps: a stage
    resumed from its checkpoint goes on with the scale it had, not the initial one. (fp16 training itself needs CUDA;
    the scaler here is PyTorch's own, on the CPU.)"""
    execution = Execution(device="cpu", torch_threads=1, checkpoint_seconds=0)

    def checkpointer(scale: float) -> tuple[Checkpointer, torch.amp.GradScaler]:
        accelerator = accelerator_for(torch.device("cpu"), "fp32")
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=scale)
        made = Checkpointer(accelerator, execution, tmp_path / "out", generator=torch.Generator(), epochs=3, name="t")
        return made, accelerator.scaler

    first, scaler = checkpointer(2.0**16)
    with first:
        first.prepare({"actor": torch.nn.Linear(2, 2)}, {"actor": partial(torch.optim.SGD, lr=0.1)})
        scaler.scale(torch.tensor(1.0))  # a step's loss scaled
        scaler.update(new_scale=1024.0)  # as after overflows: halved from 2^16 six times
        first.end_epoch(_Progress(epochs_done=1))
    resumed, fresh = checkpointer(2.0**16)
    with resumed:
        resumed.prepare({"actor": torch.nn.Linear(2, 2)}, {"actor": partial(torch.optim.SGD, lr=0.1)})
    assert resumed.resume(_Progress) == _Progress(epochs_done=1)
    assert fresh.get_scale() == 1024.0
