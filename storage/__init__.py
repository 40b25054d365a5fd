"""storage: the one layer that touches file formats and MLflow.

Modules:

* :mod:`storage.layout`: ``RunLayout``, the only place paths are built.
* :mod:`storage.schemas`: explicit Arrow schemas and column names, ``SCHEMA_VERSION``.
* :mod:`storage.shards`: Parquet shards (``write_shards``, ``read_table``, ``scan_table``).
* :mod:`storage.manifest`: manifests, input keys, atomic ``StageOutput``, ``read_manifest``.
* :mod:`storage.experience_io`: ``Experience`` <-> Arrow.
* :mod:`storage.checkpoints`: ``save_pretrained`` folders, and training state as torch distributed checkpoints.
* :mod:`storage.tokenizers`: saved tokenizers, loaded as the class they were saved as (no torch for the generic one).
* :mod:`storage.mlflow_store`: ``MlflowStore``, MLflow behind a small adapter: the only code that imports mlflow.
* :mod:`storage.tracking`: ``Tracker``, the pipeline's records in MLflow (campaigns, stage records), on that adapter.
* :mod:`storage.importers`: prompts, preference pairs and SFT examples from JSONL, Parquet and CSV.
* :mod:`storage.recorded`: the folder of a stage output a run recorded in MLflow.
* :mod:`storage.diagnostics`: what ``rlhf inspect`` computes from the shards, as polars expressions, and drift flags.

Names are re-exported lazily, so ``import storage`` does not pull in mlflow or transformers
until a name that needs them is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RunLayout": "layout",
    "SCHEMA_VERSION": "schemas",
    "write_shards": "shards",
    "read_table": "shards",
    "scan_table": "shards",
    "MANIFEST_FILE": "manifest",
    "CorruptOutputError": "manifest",
    "FileEntry": "manifest",
    "Manifest": "manifest",
    "StageOutput": "manifest",
    "compute_input_key": "manifest",
    "find_stage_output": "manifest",
    "read_manifest": "manifest",
    "experience_to_table": "experience_io",
    "table_to_experience": "experience_io",
    "save_model": "checkpoints",
    "save_state": "checkpoints",
    "load_state": "checkpoints",
    "load_tokenizer": "tokenizers",
    "MlflowStore": "mlflow_store",
    "StageRecord": "tracking",
    "Tracker": "tracking",
    "ImportFormatError": "importers",
    "import_preferences": "importers",
    "import_prompts": "importers",
    "import_sft_examples": "importers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'storage' has no attribute {name!r}")
    return getattr(importlib.import_module(f"storage.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
