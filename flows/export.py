"""``rlhf export``: a trained model of a recorded iteration as a plain Hugging Face folder.

The actor (or critic, or reward model) of an iteration is loaded through the model seam from its
stage output, LoRA adapters are merged into the base weights, and the result is saved with
``save_pretrained``: ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads the aligned policy with
no reference to this project. A critic or reward model is saved as its backbone folder plus its
head (``value_head.safetensors`` / ``reward_head.safetensors``), which
``rlhf_core.models.RewardModel.from_pretrained`` reads.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Literal

import torch

from campaign.config import PipelineConfig
from campaign.store import resolve_run, source_config, stage_run
from flows.iterations import context_for, resolve_base, supervised_base, tracking_store
from rlhf_core.loading import ModelLoader, merged
from runtime.records import recorded_result
from storage.files import temporary_sibling
from storage.tokenizers import load_tokenizer

ExportedModel = Literal["actor", "critic", "reward_model"]
_STAGE_OF = {"actor": "ppo_update", "critic": "ppo_update", "reward_model": "train_reward_model"}


def export_model(config: PipelineConfig, source: str, out_dir: Path, *, model: ExportedModel = "actor") -> Path:
    """Write the ``model`` of the iteration ``source`` (a run id, ``CAMPAIGN:ITERATION`` or ``CAMPAIGN``)
    into the new folder ``out_dir``.

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty.
        LookupError: no such campaign, iteration or recorded output.
    """
    out_dir = Path(out_dir).absolute()
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"export folder {out_dir} exists and is not empty")
    run_id = resolve_run(config, source)
    recorded = source_config(config, run_id).model_copy(
        update={"run_root": config.run_root, "tracking_uri": config.tracking_uri}
    )
    base = supervised_base(recorded, resolve_base.fn(recorded), in_flow=False)  # adapters over an SFT model
    tracker = tracking_store(recorded).tracker()
    context = context_for(recorded, 0, base, tracker.experiment_id(recorded.campaign))
    stage = "dpo_update" if model == "actor" and recorded.update == "dpo" else _STAGE_OF[model]
    output = recorded_result(context, stage_run(context.tracker, context.experiment_id, run_id, stage))
    folder = output.directory / model
    if not folder.is_dir():
        raise LookupError(f"{source} has no {model}: it was trained by a critic-free estimator")
    loader = ModelLoader(device=torch.device("cpu"), precision="fp32", bases=base.bases)
    plain = merged(loader.load(model, folder))
    staging = temporary_sibling(out_dir, what=".export-")
    try:
        plain.save_pretrained(staging)
        load_tokenizer(folder).save_pretrained(staging)
        if out_dir.exists():
            out_dir.rmdir()
        os.rename(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir
