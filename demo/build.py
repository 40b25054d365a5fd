"""Build, or reuse, the embedded default world: a pretrained tiny LM, its tokenizer, and prompts.

The world is one folder::

    cache_dir/
        model/               an ordinary Hugging Face folder: config.json, model.safetensors,
                             tokenizer.json, tokenizer_config.json, generation_config.json
        prompts.jsonl        {"prompt": "..."} per line (train)
        eval_prompts.jsonl   {"prompt": "..."} per line (held out; disjoint from train as strings)
        world.json           seed, WorldConfig, its hash, library versions, build time, final loss

Choices:
1. The folder is built under a temporary sibling and renamed into place when complete, so a crash
   leaves no half-built world; a folder without a matching ``world.json`` (or missing a file) is
   never reused but rebuilt, and staging folders of dead builds are deleted.
2. Reuse is decided by ``world.json`` alone: the same seed, format version and config hash mean the
   same world. Library versions are recorded, not keyed, so upgrading transformers does not
   silently rebuild (and change) every downstream input.
3. The build runs on one torch thread (restored afterwards): at this size one thread is several
   times faster on a 2-core machine than two, and a fixed thread count keeps pretraining bitwise
   reproducible for a seed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import shutil
import time
import uuid
from pathlib import Path

import tokenizers
import torch
import transformers
from transformers import AutoModelForCausalLM, GPT2Config

from demo.corpus import VOCABULARY, generate_corpus, generate_prompts
from demo.pretrain import encode_corpus, pretrain
from demo.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_tokenizer
from demo.world import (
    EVAL_PROMPTS_FILE,
    FORMAT_VERSION,
    MODEL_DIR,
    PROMPTS_FILE,
    WORLD_ENTRIES,
    WORLD_FILE,
    DemoWorld,
    WorldConfig,
    is_complete,
    world_at,
)

logger = logging.getLogger(__name__)

_BUILDING_MARK = ".building-"


def build_default_world(
    cache_dir: Path, *, seed: int = 0, progress: bool = True, config: WorldConfig | None = None
) -> DemoWorld:
    """Return the demo world in ``cache_dir``, building it first unless a complete one for ``seed`` is there.

    Args:
        cache_dir: the world's folder. It is created if missing and replaced if it holds an outdated
            or damaged world; a folder holding anything else is refused rather than overwritten.
        seed: fixes the corpus, prompts, initial weights and pretraining batches.
        progress: show a progress bar while pretraining.
        config: sizes and training settings; the default is the embedded default world.

    Returns:
        The paths of the world's model folder and prompt files.
    """
    config = config or WorldConfig()
    cache_dir = Path(cache_dir).absolute()
    if is_complete(cache_dir, seed=seed, config=config):
        return world_at(cache_dir)
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(cache_dir)
    staging = cache_dir.with_name(f".{cache_dir.name}{_BUILDING_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        _build_into(staging, seed=seed, config=config, progress=progress)
        _install(staging, cache_dir, seed=seed, config=config)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return world_at(cache_dir)


def _build_into(root: Path, *, seed: int, config: WorldConfig, progress: bool) -> None:
    """Write a complete world into the empty folder ``root``; ``world.json`` is written last."""
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # 1. Text: corpus and prompts.
        sentences = generate_corpus(config.num_sentences, seed=seed)
        train_prompts, eval_prompts = generate_prompts(config.num_train_prompts, config.num_eval_prompts, seed=seed)
        # 2. Tokenizer over the grammar's whole vocabulary.
        tokenizer = build_tokenizer(VOCABULARY, model_max_length=config.n_positions)
        # 3. A fresh tiny GPT-2, initialised and pretrained from the seed alone.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(_model_config(config, vocab_size=len(tokenizer)))
        final_loss = pretrain(
            model,
            encode_corpus(sentences, tokenizer),
            pad_token_id=PAD_ID,
            steps=config.pretrain_steps,
            batch_size=config.batch_size,
            learning_rate=config.learning_rate,
            warmup_steps=config.warmup_steps,
            seed=seed,
            progress=progress,
        )
    finally:
        torch.set_num_threads(threads)
    # 4. Files: model + tokenizer in one Hugging Face folder, prompts as JSONL, then the record.
    root.mkdir(parents=True)
    model.save_pretrained(root / MODEL_DIR)
    tokenizer.save_pretrained(root / MODEL_DIR)
    _write_prompts(root / PROMPTS_FILE, train_prompts)
    _write_prompts(root / EVAL_PROMPTS_FILE, eval_prompts)
    seconds = time.perf_counter() - started
    record = {
        "format_version": FORMAT_VERSION,
        "seed": seed,
        "config_hash": config.hash(),
        "config": dataclasses.asdict(config),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "build_seconds": round(seconds, 2),
        "final_pretrain_loss": round(final_loss, 4),
    }
    (root / WORLD_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    logger.info("built the demo world in %.1f s (final pretraining loss %.3f)", seconds, final_loss)


def _model_config(config: WorldConfig, *, vocab_size: int) -> GPT2Config:
    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=config.n_positions,
        n_embd=config.n_embd,
        n_layer=config.n_layer,
        n_head=config.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )


def _write_prompts(path: Path, prompts: list[str]) -> None:
    path.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in prompts), encoding="utf-8")


def _install(staging: Path, root: Path, *, seed: int, config: WorldConfig) -> None:
    """Move the finished ``staging`` folder to ``root``, replacing an outdated world there."""
    if root.exists():
        if is_complete(root, seed=seed, config=config):
            return  # another process finished the same world first
        strangers = sorted(path.name for path in root.iterdir() if path.name not in WORLD_ENTRIES)
        if strangers:
            raise FileExistsError(
                f"`cache_dir` {root} holds files that are not part of a demo world ({', '.join(strangers[:3])}); "
                "refusing to overwrite it"
            )
        outdated = root.with_name(f".{root.name}.outdated-{uuid.uuid4().hex[:8]}")
        root.rename(outdated)
        shutil.rmtree(outdated, ignore_errors=True)
    try:
        staging.rename(root)
    except OSError:
        if not is_complete(root, seed=seed, config=config):
            raise


def _remove_abandoned_builds(root: Path) -> None:
    """Delete staging folders of ``root`` left by builds whose process is gone (a crash or a kill)."""
    for staging in root.parent.glob(f".{root.name}{_BUILDING_MARK}*"):
        pid = staging.name.removeprefix(f".{root.name}{_BUILDING_MARK}").split("-")[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(staging, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
