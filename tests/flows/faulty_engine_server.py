"""The generation engine server, broken on purpose (issue 36's fault injection; test code, never the product's).

``engine_server/server.py`` itself, with some of its functions replaced by ones that fail in the ways peers' engines
have failed (an adapter that never reaches the engine, a reload that is skipped or half done, a stale tied output
layer, a merge that rounds the update away or drops tensors, stale weights). The fault in force is read from the
file ``RLHF_ENGINE_FAULT_FILE`` names, at every swap, so one engine (one start: 10-90 s on a CPU) serves every case
of tests/flows/test_engine_faults.py; an empty or missing file is no fault. Started through the product's own
launcher (``RLHF_ENGINE_SERVER``, :mod:`runtime.engine`), in the engine's environment, where the project is not
installed: the repository root is put on the path to import the server.

Faults:
* ``adapter_not_applied``: the merge returns the base weights (the adapter never reaches the engine);
* ``reload_skipped``: a swap loads nothing (and still names the new weights);
* ``swap_fails_midway``: a swap loads the new folder's first layer only, the rest stays as it was;
* ``tied_output_stale``: a tied output layer is not tied to the reloaded embeddings again;
* ``old_merge``: the merge before issue 36: in the base's own dtype (a bf16 base keeps too little of the update),
  and tensors it does not know (``lora_embedding_A``/``B``, LoRA biases) dropped without a word;
* ``previous_weights``: a swap loads the initial policy, the weights of the iteration before the first update.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine_server import server  # noqa: E402

REAL_RELOAD = server.Engine.reload
REAL_MERGE = server.merged_lora_weights
REAL_RETIE = server.retie_output_embeddings
INITIAL = server.parse_arguments(sys.argv[1:]).model


def fault() -> str:
    path = os.environ.get("RLHF_ENGINE_FAULT_FILE")
    return Path(path).read_text().strip() if path and Path(path).is_file() else ""


def reload(self, folder: str) -> None:
    if fault() == "reload_skipped":
        self.weights, self.swaps = None, self.swaps + 1  # the bookkeeping of a swap, without the swap
        return
    if fault() == "previous_weights":
        return REAL_RELOAD(self, INITIAL)
    if fault() == "swap_fails_midway":
        return half_reload(self, folder)
    return REAL_RELOAD(self, folder)


def half_reload(self, folder: str) -> None:
    """Load the new folder's first layer, and every other tensor as the engine holds it now (the initial policy's,
    in these tests): what a reload that stopped after its first layer leaves."""
    import shutil

    from safetensors.torch import save_file

    new, old = server.read_tensors(folder), server.read_tensors(INITIAL)
    mixed = {name: (new[name] if ".layers.0." in name else old[name]).contiguous() for name in new}
    with tempfile.TemporaryDirectory(prefix="rlhf-faulty-engine-") as half:
        save_file(mixed, f"{half}/model.safetensors")
        shutil.copy(Path(folder) / "config.json", half)
        REAL_RELOAD(self, half)


def old_merge(base: dict, adapter: dict, config: dict, *, dtype) -> dict:
    """The merge before issue 36: in the weight's own dtype, skipping any tensor but ``lora_A``/``lora_B``."""
    rank, alpha = config["r"], config["lora_alpha"]
    merged = dict(base)
    for key, down in adapter.items():
        if ".lora_A." not in key:
            continue
        name = key.split(".lora_A.")[0].removeprefix("base_model.model.") + ".weight"
        weight = merged[name]
        delta = (adapter[key.replace(".lora_A.", ".lora_B.")].to(weight.dtype) @ down.to(weight.dtype)) * (alpha / rank)
        merged[name] = weight + delta
    return merged


def merged_lora_weights(base: dict, adapter: dict, config: dict, *, dtype) -> dict:
    if fault() == "adapter_not_applied":
        return dict(base)
    if fault() == "old_merge":
        return old_merge(base, adapter, config, dtype=dtype)
    return REAL_MERGE(base, adapter, config, dtype=dtype)


def retie_output_embeddings(worker) -> bool:
    return False if fault() == "tied_output_stale" else REAL_RETIE(worker)


server.Engine.reload = reload
server.merged_lora_weights = merged_lora_weights
server.retie_output_embeddings = retie_output_embeddings

if __name__ == "__main__":
    sys.exit(server.main())
