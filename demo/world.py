"""The embedded default world's folder: what it holds, where, and whether a complete one is there.

Reading a world needs neither torch nor transformers (:mod:`demo.build` builds one), so a command that only
locates the demo's inputs, such as ``rlhf run`` of a finished campaign, starts without them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

FORMAT_VERSION = 1
"""Bump when the world's layout or the meaning of a config field changes."""
DEFAULT_CACHE_DIR = Path(".rlhf") / "cache" / "demo-world"
"""Where ``python -m demo`` finds (or builds) the world unless told otherwise: where the demo campaign keeps it with
the default ``run_root`` (``.rlhf``, in the working directory)."""
MODEL_DIR, PROMPTS_FILE, EVAL_PROMPTS_FILE, WORLD_FILE = "model", "prompts.jsonl", "eval_prompts.jsonl", "world.json"
WORLD_ENTRIES = frozenset({MODEL_DIR, PROMPTS_FILE, EVAL_PROMPTS_FILE, WORLD_FILE})
"""Everything a world's folder holds."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorldConfig:
    """What the world is made of; its hash (with the seed) names a cached world."""

    num_sentences: int = 20_000
    """Corpus sentences the LM is pretrained on."""
    num_train_prompts: int = 256
    """Prompts in ``prompts.jsonl``."""
    num_eval_prompts: int = 64
    """Held-out prompts in ``eval_prompts.jsonl``."""
    n_embd: int = 64
    """GPT-2 hidden size."""
    n_layer: int = 2
    """GPT-2 blocks."""
    n_head: int = 4
    """Attention heads per block."""
    n_positions: int = 64
    """Longest sequence, prompt plus response."""
    pretrain_steps: int = 800
    """AdamW steps of next-token pretraining."""
    batch_size: int = 64
    """Sentences per step."""
    learning_rate: float = 3e-3
    """Peak learning rate (small models take large rates; nanoGPT's Shakespeare-char uses 1e-3 at 10M)."""
    warmup_steps: int = 30
    """Linear warm-up steps."""

    def __post_init__(self) -> None:
        for name in ("num_sentences", "n_embd", "n_layer", "n_head", "n_positions", "pretrain_steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"`n_head` ({self.n_head}) must divide `n_embd` ({self.n_embd})")

    def hash(self) -> str:
        """A short stable hash of the fields and the format version."""
        payload = json.dumps({"format": FORMAT_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class DemoWorld:
    """Paths of a built world; everything in it is an ordinary file another program can read."""

    model_dir: Path
    """Hugging Face folder with the model and its tokenizer (``from_pretrained`` loads both)."""
    prompts_path: Path
    """JSONL, one ``{"prompt": ...}`` per line, for training stages."""
    eval_prompts_path: Path
    """JSONL of held-out prompts for evaluation."""


def world_at(root: Path) -> DemoWorld:
    """The paths of the world whose folder is ``root`` (nothing is checked or built)."""
    return DemoWorld(
        model_dir=root / MODEL_DIR, prompts_path=root / PROMPTS_FILE, eval_prompts_path=root / EVAL_PROMPTS_FILE
    )


def load_prompts(path: Path) -> list[str]:
    """The prompts of a ``{"prompt": ...}`` JSONL file, in file order."""
    with path.open(encoding="utf-8") as lines:
        return [json.loads(line)["prompt"] for line in lines if line.strip()]


def is_complete(root: Path, *, seed: int, config: WorldConfig) -> bool:
    """True if ``root`` holds a finished world built from ``seed`` and ``config``."""
    try:
        record = json.loads((root / WORLD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    world = world_at(root)
    return (
        record.get("format_version") == FORMAT_VERSION
        and record.get("seed") == seed
        and record.get("config_hash") == config.hash()
        and (world.model_dir / "config.json").is_file()
        and (world.model_dir / "model.safetensors").is_file()
        and (world.model_dir / "tokenizer.json").is_file()
        and world.prompts_path.is_file()
        and world.eval_prompts_path.is_file()
    )


def complete_world(root: Path, *, seed: int = 0, config: WorldConfig | None = None) -> DemoWorld | None:
    """The world in ``root`` when a complete one built from ``seed`` and ``config`` is there, else None."""
    return world_at(root) if is_complete(root, seed=seed, config=config or WorldConfig()) else None
