"""The PPO update of sizes S and M in 1 process, 2 DDP processes and 2 FSDP2 processes (issue 25): wall time and
every process's peak memory, one run each.

    PYTHONPATH=. python -m bench.sharded_update          # about 5 minutes on 2 shared cores

Each run is a worker (``--worker SIZE VARIANT OUT``, alone or under ``accelerate launch`` with 2 gloo processes)
that builds the size's GPT-2 actor and critic from seeds, makes one rollout of ``rollout_batch`` prompts of random
tokens (the experience every variant trains on), then, inside the stage's own peak-memory measure
(:func:`runtime.stage.peak_memory`: the growth of the resident set's high-water mark on CPU), builds the trained
actor and critic (sharded with FSDP2), their AdamW optimizers, and runs ``ppo_epochs`` epochs of one minibatch of
the whole batch. Wall time is the update's (models built and prepared, then the epochs); peak memory is each
process's, so it holds the trained models' weights, gradients and AdamW states (sharded: 1/N of them) plus the
activations of its share of every minibatch. Results go to ``bench/.scratch/sharded_update.json`` and print as the
table of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import PROJECT_PYTHON, REPO, SCRATCH, SIZES, Size, machine, thread_env

VARIANTS = ("1 process", "2 DDP", "2 FSDP2")
PROMPT_LENGTH = 16


def _worker(size: Size, variant: str, out: Path) -> None:
    import torch
    from accelerate import PartialState
    from accelerate.utils import gather_object
    from transformers import AutoModelForCausalLM, GPT2Config

    from rlhf_core.config import AdvantageConfig, PPOConfig, SamplingConfig, Sharding
    from rlhf_core.distributed import prepare, shard_model
    from rlhf_core.experience_maker import ExperienceMaker, score_experience
    from rlhf_core.models import Critic, freeze
    from rlhf_core.ppo import ppo_update
    from runtime.metering import peak_memory
    from runtime.models import accelerator_for
    from runtime.worker import leave_process_group

    torch.set_num_threads(1)
    state = PartialState(cpu=True)
    config = GPT2Config(
        vocab_size=size.vocab_size, n_positions=size.n_positions, n_embd=size.n_embd, n_layer=size.n_layer,
        n_head=size.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip

    def models():
        torch.manual_seed(size.seed)
        return AutoModelForCausalLM.from_config(config), Critic(config=config)

    actor, critic = models()
    maker = ExperienceMaker(
        freeze(actor), freeze(critic), lambda ids, mask: (ids % 7 == 3).float().mean(1), freeze(models()[0]),
        sampling=SamplingConfig(max_new_tokens=size.response_length, temperature=size.temperature),
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(size.seed)
    prompts = torch.randint(3, size.vocab_size, (size.rollout_batch, PROMPT_LENGTH), generator=generator)
    experience = maker.make_experience(prompts, torch.ones_like(prompts), generator=generator)
    experience = score_experience(experience, AdvantageConfig(kl_coef=size.kl_coef))
    del actor, critic, maker
    ppo = PPOConfig(epochs=size.ppo_epochs, minibatch_size=size.rollout_batch)
    accelerator = accelerator_for(torch.device("cpu"), "fp32")
    with peak_memory(torch.device("cpu")) as peak:
        started = time.perf_counter()
        trained = list(models())
        if variant == "2 FSDP2":
            trained = [shard_model(model, Sharding()) for model in trained]
        optimizers = [torch.optim.AdamW(model.parameters(), lr=size.learning_rate) for model in trained]
        (actor, critic), optimizers = prepare(accelerator, trained, optimizers)
        stats = ppo_update(
            actor, critic, *optimizers, experience, ppo, accelerator=accelerator, temperature=size.temperature,
            generator=torch.Generator().manual_seed(1),
        )  # fmt: skip
        seconds = time.perf_counter() - started
        peaks = gather_object([peak()])
    parameters = sum(p.numel() for p in models()[0].parameters()) + sum(p.numel() for p in models()[1].parameters())
    if state.is_main_process:
        result = {"seconds": seconds, "peak_memory_mb": peaks, "steps": stats.optimizer_steps, "parameters": parameters}
        out.write_text(json.dumps(result))
    leave_process_group(state)


def _run(size: str, variant: str, out: Path) -> dict:
    worker = ["-m", "bench.sharded_update", "--worker", size, variant, str(out)]
    if variant == "1 process":
        command = [str(PROJECT_PYTHON), *worker]
    else:
        command = [str(PROJECT_PYTHON), "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
        command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        command += ["--main_process_port", "0", *worker]
    environment = {**thread_env(1), "PYTHONPATH": str(REPO)}
    subprocess.run(command, cwd=REPO, env={**os.environ, **environment}, check=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", nargs=3, metavar=("SIZE", "VARIANT", "OUT"))
    args = parser.parse_args()
    if args.worker:
        size, variant, out = args.worker
        _worker(SIZES[size], variant, Path(out))
        return
    SCRATCH.mkdir(parents=True, exist_ok=True)
    facts = machine()
    results = {
        size: {variant: _run(size, variant, SCRATCH / "sharded_update_run.json") for variant in VARIANTS}
        for size in ("S", "M")
    }
    (SCRATCH / "sharded_update.json").write_text(json.dumps({"machine": facts, "results": results}, indent=1))
    print(f"machine: {facts}")  # noqa: T201
    print("| size (parameters, actor + critic) | variant | wall s | peak MiB per process | steps |")  # noqa: T201
    print("| --- | --- | --- | --- | --- |")  # noqa: T201
    for size, runs in results.items():
        for variant, run in runs.items():
            peaks = " / ".join(f"{peak:.0f}" for peak in run["peak_memory_mb"])
            print(  # noqa: T201
                f"| {size} ({run['parameters'] / 1e6:.1f} M) | {variant} | {run['seconds']:.1f} | {peaks} | {run['steps']} |"
            )


if __name__ == "__main__":
    sys.exit(main())
