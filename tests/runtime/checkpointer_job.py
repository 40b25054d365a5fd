"""PPO updates through :class:`runtime.checkpointer.Checkpointer` as the ``ppo_update`` stage drives it, for
tests/runtime/test_checkpointer.py: in the test's own process (:func:`update`), or in the test run's
``accelerate launch`` of 2 processes (tests/two_processes_job.py) with the models sharded over them (FSDP2).

Every process loads the same policy folder and makes the same experience from it (seeded, no dropout); an update
stopped after a checkpoint leaves ``WORK/<name>.partial`` as a crashed stage would, and the next update of that name
resumes from it. The test's work happens in three steps: :func:`before_two_processes` in one process, then
:func:`on_two_processes` in the 2 processes, then the rest in the test's process.
"""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import torch
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
from tests.conftest import EOS, PAD, left_padded
from tests.rlhf_core.distributed_job import PROMPTS, TEMPERATURE

BEFORE = Path(__file__).with_name("policy_before_issue32")
"""A policy output of the previous release: optimizer states written by 1 process (``whole``) and by 2 (``sharded``)."""
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


def before_two_processes(work: Path) -> None:
    """What the 2 processes continue, made in this process: the policy every update starts from (the previous
    release's, without its optimizer states), ``from_one`` stopped after its checkpoint of epoch 2 (of 4), and the
    uninterrupted update, whose kept optimizer states the 2 processes read."""
    shutil.copytree(BEFORE / "whole", work / "policy", ignore=shutil.ignore_patterns("*_optimizer"))
    policy = str(work / "policy")
    update(work, name="from_one", source=policy, stop_after=2)
    update(work, name="uninterrupted", source=policy)


def on_two_processes(work: Path) -> None:
    """In every process of 2, sharded: ``from_two`` and ``lora_from_two`` stopped after their checkpoint of epoch 2,
    ``from_one`` resumed, and the optimizer states the uninterrupted update kept (written by 1 process) and the
    previous release's (written by 1 process and by 2) read."""
    policy, uninterrupted = str(work / "policy"), str(work / "uninterrupted")
    update(work, name="from_two", source=policy, stop_after=2, shard=True)
    update(work, name="lora_from_two", source=policy, stop_after=2, lora=True, shard=True)
    update(work, name="from_one", source=policy, shard=True)
    read_states(work, name="uninterrupted_read_on_two", source=uninterrupted, continues=uninterrupted, shard=True)
    for kind in ("whole", "sharded"):
        read_states(
            work, name=f"before_{kind}_read_on_two", source=str(BEFORE / "whole"), continues=str(BEFORE / kind),
            shard=True,
        )  # fmt: skip
