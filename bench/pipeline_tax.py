"""Pipeline tax and replay: the real flows on a temporary run root against the same work in a plain loop.

``.venv/bin/python -m bench.pipeline_tax --mode flow|plain --iterations 3 --world DIR --out result.json``

``flow`` runs ``rlhf_iteration`` (the real Prefect flow, with MLflow on SQLite and Parquet shards,
checkpoints and manifests under a temporary ``run_root``; ``PREFECT_HOME`` is set by the caller),
one top-level flow run per iteration as ``rlhf_campaign`` does, then ``rlhf_replay`` of the last
iteration with another ``kl_coef`` when that flow exists. ``plain`` calls the same ``rlhf_core``
entry points (and the same gold labeler and prompt helpers) in one loop with every model kept in
memory: no Prefect, no MLflow, no files. Both use ``configs/demo.yaml`` (the RLHF demo).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import shutil
import tempfile
import time
from pathlib import Path

from bench.common import REPO, Clock, set_threads

STAGES = (
    "sample_candidates",
    "collect_preferences",
    "train_reward_model",
    "rollout",
    "compute_advantages",
    "ppo_update",
    "evaluate",
)


BUCKETS = (
    ("torch (compute)", ("/torch/", "/transformers/", "/accelerate/", "/rlhf_core/", "/demo/", "/tasks/labelers")),
    ("MLflow + SQLAlchemy", ("/mlflow/", "/sqlalchemy/", "/alembic/", "storage/tracking", "storage/mlflow_store")),
    (
        "Prefect + its HTTP/async stack",
        (
            "/prefect/",
            "/httpx/",
            "/httpcore/",
            "/anyio/",
            "/asyncio/",
            "/uvicorn/",
            "/starlette/",
            "/fastapi/",
            "/pydantic",
            "/websockets/",
            "/sniffio/",
            "threading.py",
            "/queue.py",
            "selectors.py",
        ),
    ),
    (
        "Parquet, manifests, checkpoints",
        ("/pyarrow/", "/polars/", "/safetensors/", "/storage/", "hashlib", "/shutil.py", "/tokenizers/"),
    ),
)


def profile_buckets(profile: cProfile.Profile) -> dict[str, float]:
    """Self time of one profiled flow iteration, summed by the package each function lives in."""
    totals: dict[str, float] = {}
    for (filename, _, name), (_, _, self_time, _, _) in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        where = f"{filename}:{name}"
        bucket = next((label for label, marks in BUCKETS if any(mark in where for mark in marks)), "other")
        if filename == "~" and ("torch" in name or "built-in method torch" in name):
            bucket = "torch (compute)"
        totals[bucket] = totals.get(bucket, 0.0) + self_time
    return totals


CAUSES = (
    ("loading models", "rlhf_core/loading.py", ("load",)),
    ("saving models and optimizer states", "", ("save_model_folder", "save_state")),
    ("writing and verifying outputs (hashes, manifests)", "storage/manifest.py", ("_finish", "find_stage_output")),
    ("recording stage runs in MLflow", "runtime/record.py", ("record_stage",)),
    ("closing the iteration: its run, figure, Prefect artifact", "flows/iterations.py", ("close_iteration",)),
    ("  of which the over-optimisation figure", "flows/iterations.py", ("_log_overoptimisation",)),
)
"""What the flow does that the plain loop does not: (label, file, functions), timed by their cumulative time in
the profiled iteration. The first five do not call each other; the figure is part of closing the iteration."""


def profile_causes(profile: cProfile.Profile) -> dict[str, float]:
    """Cumulative seconds under the profiler of each of :data:`CAUSES` in one profiled flow iteration, and the
    iteration's whole profiled time (``"profiled iteration"``)."""
    stats = pstats.Stats(profile)
    causes = {label: 0.0 for label, _, _ in CAUSES}
    for (filename, _, name), (_, _, _, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        for label, where, names in CAUSES:
            if name in names and where in filename:
                causes[label] += cumulative
    causes["profiled iteration"] = stats.total_tt  # type: ignore[attr-defined]
    return causes


def flow_run(world: Path, iterations: int) -> dict:
    clock = Clock()
    with clock.measure("import"):
        from campaign.config import load_config
        from flows import rlhf_pipeline
        from flows.iterations import tracking_store
        from flows.prefect_server import flow_settings
        from rlhf_core.config import AdvantageConfig
        from storage.tracking import KIND_ITERATION, TAG_ITERATION, TAG_KIND
    root = Path(tempfile.mkdtemp(prefix="rlhf-bench-"))
    try:
        shutil.copytree(world, root / "cache" / "demo-world")
        config = load_config(REPO / "configs" / "demo.yaml", [f"run_root={root}", "execution.torch_threads=1"])
        state, profile = None, cProfile.Profile()
        for iteration in range(iterations):
            if iteration == iterations - 1:
                profile.enable()
            with clock.measure("iteration"), flow_settings():  # the Prefect settings `rlhf run` gives its flows
                state = rlhf_pipeline.rlhf_iteration(config, iteration, state)
        profile.disable()
        tracker = tracking_store(config).tracker()
        experiment = tracker.experiment_id(config.campaign)
        stage_seconds = [
            {stage: metrics.get(f"{stage}/seconds", float("nan")) for stage in ("initialize", *STAGES)}
            for _, metrics in tracker.iteration_metrics(experiment)
        ]
        replay = None
        if hasattr(rlhf_pipeline, "rlhf_replay"):
            source = tracker.find_run(experiment, tags={TAG_KIND: KIND_ITERATION, TAG_ITERATION: str(iterations - 1)})
            replay_config = config.model_copy(update={"advantages": AdvantageConfig(kl_coef=0.1)})
            with clock.measure("replay"), flow_settings():
                rlhf_pipeline.rlhf_replay(replay_config, source)
            replay = True
        return {
            "phases": clock.to_json(),
            "stage_seconds": stage_seconds,
            "replay_flow": replay,
            "profile_buckets": profile_buckets(profile),
            "profile_causes": profile_causes(profile),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def plain_run(world: Path, iterations: int) -> dict:
    """The seven stages' ``rlhf_core`` calls per iteration, models in memory, no files."""
    import pyarrow as pa
    import torch

    from campaign.config import load_config
    from campaign.identity import GOLD_JUDGE
    from demo.world import world_at
    from rlhf_core.experience_maker import ExperienceMaker, score_experience
    from rlhf_core.generation import generate, sample_candidates
    from rlhf_core.loading import ModelLoader
    from rlhf_core.models import evaluating
    from rlhf_core.ppo import ppo_update
    from rlhf_core.reward_training import PreferenceBatch, fit_reward_model
    from rlhf_core.sequences import sequence_logprobs
    from runtime.models import accelerator_for
    from runtime.references import JudgeReference, load_judge
    from runtime.seeds import stage_seed
    from storage.experience_io import experience_to_table, table_to_experience
    from tasks.evaluate import _gold_metrics
    from tasks.labelers import CandidatePair, JudgeLabeler
    from tasks.tensors import encode_prompts, pad_token_lists, response_token_lists
    from tasks.text import batches, conversation_id_lists, decode, load_tokenizer, read_prompts, rotating_subset

    config = load_config(REPO / "configs" / "demo.yaml", ["execution.torch_threads=1"])
    paths = world_at(world)
    clock = Clock()
    tokenizer = load_tokenizer(str(paths.model_dir))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    train_prompts, eval_prompts = read_prompts(paths.prompts_path), read_prompts(paths.eval_prompts_path)
    models = ModelLoader(device=torch.device("cpu"), precision="fp32")
    accelerator = accelerator_for(models.device, models.precision)
    actor = models.load("actor", paths.model_dir, trainable=True)
    torch.manual_seed(stage_seed(config.seed, "initialize", 0))
    critic = models.load("critic", paths.model_dir, trainable=True)
    reference = models.load("reference", paths.model_dir)
    labeler = JudgeLabeler(load_judge(GOLD_JUDGE))
    actor_optimizer = torch.optim.AdamW(actor.parameters(), lr=config.ppo.actor_learning_rate)
    critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=config.ppo.critic_learning_rate)
    actor, critic, actor_optimizer, critic_optimizer = accelerator.prepare(
        actor, critic, actor_optimizer, critic_optimizer
    )
    reward_model, labelled = None, []
    single = config.sampling
    candidates_per_prompt = config.sizes.candidates_per_prompt

    def seeded(stage: str, iteration: int) -> torch.Generator:
        return torch.Generator().manual_seed(stage_seed(config.seed, stage, iteration))

    for iteration in range(iterations):
        with clock.measure("iteration"):
            # 1. sample candidates, N per preference prompt
            with clock.measure("sample_candidates"):
                sampling = config.sampling
                chosen = rotating_subset(train_prompts, count=config.sizes.preference_prompts, iteration=iteration)
                generator, pairs = seeded("sample_candidates", iteration), []
                for part in batches(len(chosen), sampling.batch_size):
                    texts = [text for _, text in chosen[part]]
                    ids, mask = encode_prompts(tokenizer, texts)
                    out = sample_candidates(
                        actor, ids, mask, num_samples=candidates_per_prompt, config=sampling, eos_token_id=eos,
                        pad_token_id=pad, generator=generator,
                    )  # fmt: skip
                    responses = response_token_lists(out.sequences, out.action_mask)
                    decoded = decode(tokenizer, responses)
                    prompt_lists = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
                    for row in range(0, len(responses), 2):
                        prompt_row = row // candidates_per_prompt
                        pairs.append(
                            CandidatePair(
                                prompt=texts[prompt_row],
                                first=decoded[row],
                                second=decoded[row + 1],
                                first_ids=prompt_lists[prompt_row] + responses[row],
                                second_ids=prompt_lists[prompt_row] + responses[row + 1],
                            )
                        )
            # 2. label the pairs with the hidden gold rubric
            with clock.measure("collect_preferences"):
                for pair, label in zip(pairs, labeler.label(pairs), strict=True):
                    better, worse = (pair.second, pair.first) if label.winner else (pair.first, pair.second)
                    labelled.append((pair.prompt, better, worse, label.margin))
            # 3. continue training the reward model on every pair so far
            with clock.measure("train_reward_model"):
                prompts = [p for p, *_ in labelled]
                responses = [c for _, c, _, _ in labelled] + [r for _, _, r, _ in labelled]
                rows = conversation_id_lists(tokenizer, prompts + prompts, responses)
                ids, mask = pad_token_lists(rows, pad_token_id=pad)
                n = len(labelled)
                margin = torch.tensor([m for *_, m in labelled], dtype=torch.float32)
                preference = PreferenceBatch(ids[:n], mask[:n], ids[n:], mask[n:], margin)
                generator = seeded("train_reward_model", iteration)
                order = torch.randperm(n, generator=generator)
                held_out = max(1, int(n * config.reward_model.eval_fraction))
                torch.manual_seed(stage_seed(config.seed, "train_reward_model", iteration))
                model = reward_model or models.load("reward_model", paths.model_dir, trainable=True)
                optimizer = torch.optim.AdamW(model.parameters(), lr=config.reward_model.learning_rate)
                model, optimizer = accelerator.prepare(model, optimizer)
                rm_stats = fit_reward_model(
                    model,
                    optimizer,
                    preference.select(order[held_out:]),
                    preference.select(order[:held_out]),
                    config.reward_model,
                    accelerator=accelerator,
                    generator=generator,
                )
                reward_model = model
            # 4. roll out one response per prompt, scored by reference, critic and reward model
            with clock.measure("rollout"):
                maker = ExperienceMaker(
                    actor, critic, reward_model, reference, sampling=single, eos_token_id=eos, pad_token_id=pad
                )
                prompts = rotating_subset(
                    train_prompts, count=config.sizes.rollout_prompts, iteration=iteration, offset=7919
                )
                generator, tables = seeded("rollout", iteration), []
                for part in batches(len(prompts), single.batch_size):
                    ids, mask = encode_prompts(tokenizer, [text for _, text in prompts[part]])
                    group_ids = torch.tensor([index for index, _ in prompts[part]])
                    rollouts = maker.make_experience(ids, mask, group_ids=group_ids, generator=generator)
                    tables.append(experience_to_table(rollouts))
                # the rows as the pipeline's stages hand them on: Arrow rows, re-padded on read
                experience = table_to_experience(pa.concat_tables(tables), pad_token_id=pad)
            # 5. rewards, KL, GAE
            with clock.measure("compute_advantages"):
                scored = score_experience(
                    experience, config.advantages, score_mean=rm_stats.score_mean, score_std=rm_stats.score_std
                )
            # 6. PPO
            with clock.measure("ppo_update"):
                ppo_update(
                    actor,
                    critic,
                    actor_optimizer,
                    critic_optimizer,
                    scored,
                    config.ppo,
                    accelerator=accelerator,
                    temperature=config.sampling.temperature,
                    generator=seeded("ppo_update", iteration),
                )
            # 7. evaluate against the initial policy
            with clock.measure("evaluate"):
                records = []
                for part in batches(config.sizes.eval_prompts, single.batch_size):
                    texts = eval_prompts[part]
                    ids, mask = encode_prompts(tokenizer, texts)
                    answers, scores = {}, {}
                    for name, policy in (("policy", actor), ("reference", reference)):
                        generator = torch.Generator().manual_seed(stage_seed(config.seed, "evaluate", 0) + part.start)
                        out = generate(
                            policy, ids, mask, config=single, eos_token_id=eos, pad_token_id=pad, generator=generator
                        )
                        answers[name] = decode(tokenizer, response_token_lists(out.sequences, out.action_mask))
                        with evaluating(reward_model), torch.no_grad():
                            scores[name] = reward_model(out.sequences, out.attention_mask).tolist()
                        if name == "policy":
                            sequence_logprobs(
                                reference,
                                out.sequences,
                                out.attention_mask,
                                ids.shape[1],
                                temperature=single.temperature,
                            )
                    records += [
                        {"prompt": prompt.text, **{f"{k}_response": v[row] for k, v in answers.items()}}
                        for row, prompt in enumerate(texts)
                    ]
                _gold_metrics(records, JudgeReference.of(GOLD_JUDGE))
    return {"phases": clock.to_json()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["flow", "plain"], required=True)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--world", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    started = time.perf_counter()
    set_threads(1)
    run = flow_run if args.mode == "flow" else plain_run
    result = run(args.world, args.iterations)
    result["process_seconds"] = time.perf_counter() - started
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
