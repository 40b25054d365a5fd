"""PPO updates through :class:`runtime.checkpointer.Checkpointer` as the ``ppo_update`` stage drives it, for
tests/runtime/test_checkpointer.py: in the test's own process (:func:`update`), or under ``accelerate launch`` with
the models sharded over the processes (FSDP2).

``python checkpointer_job.py WORK CALLS [--shard]``: ``CALLS`` is a JSON list of the keyword arguments of
:func:`update` (or, with ``"read": true``, of :func:`read_states`), run in order. Every process loads the same policy folder and makes the same experience from it (seeded, no
dropout); an update stopped after a checkpoint leaves ``WORK/<name>.partial`` as a crashed stage would, and the next
update of that name resumes from it.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import torch
from accelerate import PartialState
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from rlhf_core.config import AdvantageConfig, LoraConfig, PPOConfig, SamplingConfig
from rlhf_core.distributed import Sharding
from rlhf_core.experience import Experience
from rlhf_core.experience_maker import ExperienceMaker, score_experience
from rlhf_core.loading import ModelLoader
from rlhf_core.ppo import PPOProgress, ppo_update
from runtime.checkpointer import Checkpointer
from runtime.context import Execution
from runtime.models import accelerator_for
from runtime.worker import leave_process_group
from tests.conftest import EOS, PAD, left_padded
from tests.rlhf_core.distributed_job import PROMPTS, TEMPERATURE

CONFIG = PPOConfig(epochs=4, minibatch_size=3, actor_learning_rate=1e-3, critic_learning_rate=2e-3)
"""8 rollouts in minibatches of 3, 3 and 2 (shares 2/1, 2/1, 1/1 on 2 processes), 3 steps an epoch."""


class Stopped(Exception):
    """The update stopped on purpose after a checkpoint, as a crash would stop it."""


def experience(policy: Path) -> Experience:
    """The prompts' rollouts by ``policy``'s actor and critic (its actor the reference too), scored."""
    loader = ModelLoader(device=torch.device("cpu"), precision="fp32")
    maker = ExperienceMaker(
        loader.load("actor", policy / "actor"),
        loader.load("critic", policy / "critic"),
        lambda sequences, mask: ((sequences == 7) & mask.bool()).float().sum(dim=1),
        loader.load("reference", policy / "actor"),
        sampling=SamplingConfig(max_new_tokens=6, temperature=TEMPERATURE),
        eos_token_id=EOS,
        pad_token_id=PAD,
        precision="fp32",
    )
    ids, mask = left_padded(PROMPTS)
    rollouts = maker.make_experience(ids, mask, generator=torch.Generator().manual_seed(0))
    return score_experience(rollouts, AdvantageConfig(kl_coef=0.05, normalize_scores=False))


def update(
    work: Path,
    *,
    name: str,
    source: str,
    continues: str | None = None,
    stop_after: int | None = None,
    lora: bool = False,
    shard: bool = False,
) -> None:
    """One PPO update of the actor and critic in ``source`` on the experience of ``WORK/policy``, continuing the
    optimizer states kept in ``continues``: writes ``WORK/<name>`` (the stage output), ``WORK/<name>.json`` (its
    statistics) and ``WORK/<name>.pt`` (:func:`_dump`), or stops after the checkpoint of epoch ``stop_after``. With
    ``lora``, both models get new adapters (a seeded draw) and only those and the critic's head are trained."""
    accelerator = accelerator_for(torch.device("cpu"), "fp32")
    generator = torch.Generator().manual_seed(3)
    checkpointer = Checkpointer(
        accelerator, _execution(shard), work / name, generator=generator, epochs=CONFIG.epochs, name=name
    )
    trained, optimizers = _prepare(checkpointer, Path(source), Path(continues) if continues else None, lora=lora)

    def end_epoch(progress: PPOProgress) -> None:
        checkpointer.end_epoch(progress)
        if progress.epochs_done == stop_after:
            raise Stopped

    try:
        with checkpointer:
            stats = ppo_update(
                trained["actor"], trained["critic"], optimizers["actor"], optimizers["critic"],
                experience(work / "policy"), CONFIG, accelerator=accelerator, temperature=TEMPERATURE,
                generator=generator, resume=checkpointer.resume(PPOProgress), on_epoch_end=end_epoch,
                on_step=checkpointer.record_step,
            )  # fmt: skip
    except Stopped:
        return
    checkpointer.save_output(work / name, tokenizer=None, keep_optimizers=True)
    _dump(checkpointer, work / f"{name}.pt")
    if accelerator.is_main_process:
        values = {key: float(value) for key, value in stats._asdict().items() if value is not None}
        (work / f"{name}.json").write_text(json.dumps(values))


def read_states(work: Path, *, name: str, source: str, continues: str, shard: bool = False) -> None:
    """The optimizers of the actor and critic in ``source`` continuing the states kept in ``continues``, as
    :func:`_dump` writes them into ``WORK/<name>.pt``."""
    accelerator = accelerator_for(torch.device("cpu"), "fp32")
    checkpointer = Checkpointer(
        accelerator, _execution(shard), work / name, generator=torch.Generator(), epochs=1, name=name
    )
    _prepare(checkpointer, Path(source), Path(continues))
    _dump(checkpointer, work / f"{name}.pt")


def _execution(shard: bool) -> Execution:
    return Execution(checkpoint_seconds=0, sharding=Sharding() if shard else None)


def _prepare(checkpointer: Checkpointer, source: Path, continues: Path | None, *, lora: bool = False):
    adapters = LoraConfig(r=4, alpha=8, dropout=0.0) if lora else None
    bases = {role: source / role for role in ("actor", "critic")}  # what an adapter's folder names as its base
    loader = ModelLoader(device=torch.device("cpu"), precision="fp32", bases=bases, lora=adapters)
    torch.manual_seed(2)  # the adapters' initialisation
    models = {role: loader.load(role, source / role, trainable=True) for role in ("actor", "critic")}
    factories = {
        "actor": partial(torch.optim.AdamW, lr=CONFIG.actor_learning_rate),
        "critic": partial(torch.optim.AdamW, lr=CONFIG.critic_learning_rate),
    }
    return checkpointer.prepare(models, factories, continues=continues)


def _dump(checkpointer: Checkpointer, path: Path) -> None:
    """The whole optimizer states of ``checkpointer``'s models (gathered from every process: collective, and {} on
    the other processes), by parameter name."""
    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    states = {
        role: get_optimizer_state_dict(model, checkpointer.optimizers[role], options=whole)
        for role, model in checkpointer.models.items()
    }
    if checkpointer.main:
        torch.save({role: state["state"] for role, state in states.items()}, path)


if __name__ == "__main__":
    torch.set_num_threads(1)
    root, calls = Path(sys.argv[1]), json.loads(sys.argv[2])
    for call in calls:
        function = read_states if call.pop("read", False) else update
        function(root, **call, shard="--shard" in sys.argv[3:])
    leave_process_group(PartialState())  # or a process may abort at exit, failing a run that succeeded
