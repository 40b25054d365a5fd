"""Manifests: input keys, atomic stage outputs, refusal to overwrite, corruption detection."""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import os
from pathlib import Path

import pyarrow as pa
import pytest

from storage.manifest import (
    MANIFEST_FILE,
    CorruptOutputError,
    Manifest,
    StageOutput,
    UnsupportedSchemaError,
    compute_input_key,
    find_stage_output,
    prunable_digest,
    prunable_present,
    prune_files,
    read_manifest,
)
from storage.schemas import PROMPTS, SCHEMA_VERSION
from storage.shards import read_table

CONFIG = {"lr": 1e-5, "clip_eps": 0.2, "nested": {"gamma": 1.0, "schedule": [1, 2, 3]}, "eos": None, "on": True}
UPSTREAM = {"rollout": "f" * 64}
CODE = "c0de" * 16


def _prompts(count: int) -> pa.Table:
    return pa.table(
        {"prompt_id": list(range(count)), "prompt": [f"prompt {i}" for i in range(count)], "messages": [[]] * count},
        schema=PROMPTS,
    )


def _key(stage: str, config: dict, upstream: dict) -> str:
    return compute_input_key(stage, config, upstream, code=CODE)


def _write(final_dir: Path, *, rows: int = 10) -> Manifest:
    key = _key("sample", CONFIG, UPSTREAM)
    with StageOutput(final_dir, stage="sample", input_key=key, config=CONFIG, upstream=UPSTREAM, code=CODE) as out:
        out.write_table("prompts", _prompts(rows), schema=PROMPTS, rows_per_shard=4)
        (out.path / "actor").mkdir()
        (out.path / "actor" / "config.json").write_text('{"model_type": "gpt2"}')
        out.metrics.update({"accuracy": 0.75, "count": 3})
    return out.manifest


# Input keys ------------------------------------------------------------------------------------


def test_input_key_is_stable_across_dict_order() -> None:
    reordered = {"on": True, "eos": None, "nested": {"schedule": [1, 2, 3], "gamma": 1.0}, "clip_eps": 0.2, "lr": 1e-5}
    key = compute_input_key("ppo_update", CONFIG, UPSTREAM, code=CODE)
    assert key == compute_input_key("ppo_update", reordered, dict(UPSTREAM), code=CODE)
    assert len(key) == 64 and int(key, 16) >= 0


def test_input_key_is_pinned() -> None:
    """A change of this value means every existing output is recomputed: bump it knowingly."""
    key = compute_input_key("sample", {"n": 2}, {}, code=CODE)
    assert key == compute_input_key("sample", {"n": 2}, {}, code=CODE)
    assert key != compute_input_key("sample", {"n": 2.0}, {}, code=CODE)  # an int and a float are different configs


@pytest.mark.parametrize(
    ("stage", "config", "upstream"),
    [
        ("rollout", CONFIG, UPSTREAM),
        ("ppo_update", {**CONFIG, "lr": 2e-5}, UPSTREAM),
        ("ppo_update", {**CONFIG, "nested": {"gamma": 0.99, "schedule": [1, 2, 3]}}, UPSTREAM),
        ("ppo_update", {**CONFIG, "nested": {"gamma": 1.0, "schedule": [1, 3, 2]}}, UPSTREAM),
        ("ppo_update", {**CONFIG, "eos": 0}, UPSTREAM),
        ("ppo_update", {**CONFIG, "on": 1}, UPSTREAM),
        ("ppo_update", {**CONFIG, "extra": None}, UPSTREAM),
        ("ppo_update", CONFIG, {"rollout": "e" * 64}),
        ("ppo_update", CONFIG, {**UPSTREAM, "reward_model": "d" * 64}),
    ],
)
def test_input_key_changes_with_any_input(stage: str, config: dict, upstream: dict) -> None:
    key = compute_input_key("ppo_update", CONFIG, UPSTREAM, code=CODE)
    assert compute_input_key(stage, config, upstream, code=CODE) != key


def test_input_key_changes_with_the_code() -> None:
    assert compute_input_key("sample", CONFIG, UPSTREAM, code=CODE) != compute_input_key(
        "sample", CONFIG, UPSTREAM, code="e" * 64
    )


def test_input_key_refuses_unserialisable_config() -> None:
    with pytest.raises(TypeError, match="PosixPath"):
        compute_input_key("sample", {"path": Path("/tmp")}, {}, code=CODE)


# Stage outputs ---------------------------------------------------------------------------------


def test_stage_output_round_trip(tmp_path: Path) -> None:
    final = tmp_path / "sample" / "abababababababab"
    manifest = _write(final)
    assert sorted(os.listdir(final)) == [MANIFEST_FILE, "actor", *[f"prompts-{i:05d}.parquet" for i in range(3)]]
    assert [(entry.path, entry.rows) for entry in manifest.files] == [
        ("actor/config.json", None),
        ("prompts-00000.parquet", 4),
        ("prompts-00001.parquet", 4),
        ("prompts-00002.parquet", 2),
    ]
    assert manifest.schema_version == SCHEMA_VERSION
    assert manifest.metrics == {"accuracy": 0.75, "count": 3.0}
    assert manifest.upstream == UPSTREAM and manifest.config == CONFIG and manifest.code == CODE
    assert read_manifest(final) == manifest
    assert Manifest.from_json(manifest.to_json()).digest == manifest.digest
    assert read_table(final, "prompts").equals(_prompts(10).cast(PROMPTS))
    assert [path.name for path in tmp_path.joinpath("sample").iterdir()] == [final.name]  # no temporaries


def test_digest_is_stable_and_content_sensitive(tmp_path: Path) -> None:
    manifest = _write(tmp_path / "a")
    assert manifest.digest == Manifest.from_json((tmp_path / "a" / MANIFEST_FILE).read_text()).digest
    other = _write(tmp_path / "b", rows=11)
    assert other.digest != manifest.digest


def test_exception_inside_leaves_nothing(tmp_path: Path) -> None:
    final = tmp_path / "sample" / "abababababababab"
    with pytest.raises(RuntimeError, match="boom"):
        with StageOutput(
            final, stage="sample", input_key=_key("sample", {}, {}), config={}, upstream={}, code=CODE
        ) as out:
            out.write_table("prompts", _prompts(3), schema=PROMPTS)
            raise RuntimeError("boom")
    assert not final.exists()
    assert list(final.parent.iterdir()) == []
    with pytest.raises(RuntimeError, match="after the `with` block"):
        _ = out.manifest


def test_existing_output_is_never_overwritten(tmp_path: Path) -> None:
    final = tmp_path / "sample" / "abababababababab"
    manifest = _write(final)
    with pytest.raises(FileExistsError, match="never overwritten"):
        _write(final, rows=3)
    assert read_manifest(final) == manifest


def test_output_appearing_meanwhile_is_not_overwritten(tmp_path: Path) -> None:
    final = tmp_path / "sample" / "abababababababab"
    with pytest.raises(FileExistsError, match="never overwritten"):
        with StageOutput(
            final, stage="sample", input_key=_key("sample", {}, {}), config={}, upstream={}, code=CODE
        ) as out:
            out.write_table("prompts", _prompts(3), schema=PROMPTS)
            _write(final)  # another writer finishes first
    assert read_manifest(final).files[-1].rows == 2
    assert sorted(path.name for path in final.parent.iterdir()) == [final.name]


def test_folder_without_manifest_is_refused(tmp_path: Path) -> None:
    final = tmp_path / "sample" / "abababababababab"
    final.mkdir(parents=True)
    (final / "stray.txt").write_text("?")
    with pytest.raises(CorruptOutputError, match="delete it to recompute"):
        _write(final)


def test_manifest_file_name_is_reserved(tmp_path: Path) -> None:
    final = tmp_path / "out"
    with pytest.raises(ValueError, match="reserved"):
        with StageOutput(
            final, stage="sample", input_key=_key("sample", {}, {}), config={}, upstream={}, code=CODE
        ) as out:
            (out.path / MANIFEST_FILE).write_text("{}")
    assert not final.exists()


def _exit_immediately() -> None:
    pass


def test_stale_temporaries_of_dead_writers_are_removed(tmp_path: Path) -> None:
    process = multiprocessing.get_context("spawn").Process(target=_exit_immediately)
    process.start()
    process.join()
    final = tmp_path / "sample" / "abababababababab"
    final.parent.mkdir(parents=True)
    dead = final.parent / f".{final.name}.tmp-{process.pid}-0123abcd"
    alive = final.parent / f".{final.name}.tmp-{os.getpid()}-0123abcd"
    unrelated = final.parent / ".other.tmp-1-0123abcd"
    for folder in (dead, alive, unrelated):
        folder.mkdir()
        (folder / "half.parquet").write_bytes(b"PAR1")
    _write(final)
    assert not dead.exists()
    assert alive.exists() and unrelated.exists()


def test_non_finite_metrics_survive(tmp_path: Path) -> None:
    final = tmp_path / "out"
    with StageOutput(
        final, stage="ppo_update", input_key=_key("ppo_update", {}, {}), config={}, upstream={}, code=CODE
    ) as out:
        out.metrics["loss"] = float("nan")
    assert math.isnan(read_manifest(final).metrics["loss"])


def test_find_stage_output(tmp_path: Path) -> None:
    key = _key("sample", CONFIG, UPSTREAM)
    final = tmp_path / "sample" / key[:16]
    assert find_stage_output(final, key) is None
    manifest = _write(final)
    assert find_stage_output(final, key) == manifest
    assert find_stage_output(final, key[:16] + "cd" * 24) is None  # same folder prefix, another key
    (final / "prompts-00001.parquet").write_bytes(b"garbage")
    with pytest.raises(CorruptOutputError, match="prompts-00001.parquet"):
        find_stage_output(final, key)


# Corruption ------------------------------------------------------------------------------------


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "file", "message"),
    [
        (_truncate, "prompts-00001.parquet", "bytes; the manifest says"),
        (_flip_byte, "prompts-00001.parquet", "altered"),
        (Path.unlink, "prompts-00002.parquet", "missing"),
        (_flip_byte, "actor/config.json", "altered"),
        (Path.unlink, MANIFEST_FILE, "missing"),
        (_truncate, MANIFEST_FILE, "corrupt"),
    ],
)
def test_damage_is_detected_and_named(tmp_path: Path, damage, file: str, message: str) -> None:
    final = tmp_path / "out"
    _write(final)
    damage(final / file)
    with pytest.raises(CorruptOutputError, match=message) as caught:
        read_manifest(final)
    assert caught.value.path == final / file
    assert str(final / file) in str(caught.value)


def test_unlisted_file_is_detected(tmp_path: Path) -> None:
    final = tmp_path / "out"
    _write(final)
    (final / "prompts-00003.parquet").write_bytes(b"sneaked in")
    with pytest.raises(CorruptOutputError, match=r"prompts-00003.parquet is not listed"):
        read_manifest(final)


def _edit_manifest(final: Path, edit) -> None:
    raw = json.loads((final / MANIFEST_FILE).read_text())
    edit(raw)
    (final / MANIFEST_FILE).write_text(json.dumps(raw))


@pytest.mark.parametrize(
    "edit",
    [
        lambda raw: raw["metrics"].update(accuracy=0.99),
        lambda raw: raw.update(input_key="cd" * 32),
        lambda raw: raw["files"][1].update(rows=5),
        lambda raw: raw.pop("manifest_sha256"),
        lambda raw: raw.pop("config"),
    ],
)
def test_edited_manifest_is_detected(tmp_path: Path, edit) -> None:
    final = tmp_path / "out"
    _write(final)
    _edit_manifest(final, edit)
    with pytest.raises(CorruptOutputError, match=f"{MANIFEST_FILE} is corrupt") as caught:
        read_manifest(final)
    assert caught.value.path == final / MANIFEST_FILE


def test_edited_manifest_with_a_consistent_checksum_still_fails_on_files(tmp_path: Path) -> None:
    """Rewriting the checksum does not help: the listed sizes and hashes are checked too."""
    final = tmp_path / "out"
    manifest = _write(final)
    entries = list(manifest.files)
    entries[1] = type(entries[1])(entries[1].path, "0" * 64, entries[1].bytes, entries[1].rows)
    forged = Manifest(**{**manifest.__dict__, "files": tuple(entries)})
    (final / MANIFEST_FILE).write_text(forged.to_json())
    with pytest.raises(CorruptOutputError, match="prompts-00000.parquet has been altered"):
        read_manifest(final)
    assert read_manifest(final, verify=False) == forged


def test_unsupported_schema_version(tmp_path: Path) -> None:
    final = tmp_path / "out"
    manifest = _write(final)
    future = Manifest(**{**manifest.__dict__, "schema_version": SCHEMA_VERSION + 1})
    (final / MANIFEST_FILE).write_text(future.to_json())
    with pytest.raises(UnsupportedSchemaError, match="schema version"):
        read_manifest(final)


def test_an_older_manifest_format_names_its_schema_version(tmp_path: Path) -> None:
    # Version 1 manifests had other fields (no code or runtime): the version is named, not "corrupt".
    final = tmp_path / "out"
    manifest = _write(final)
    old = {k: v for k, v in json.loads(manifest.to_json()).items() if k not in ("code", "runtime")}
    (final / MANIFEST_FILE).write_text(json.dumps({**old, "schema_version": 1, "package_version": "0.1.0"}))
    with pytest.raises(
        UnsupportedSchemaError, match=r"schema version 1 \(rlhf-pipeline 0.1.0\).*run the iteration again"
    ):
        read_manifest(final)


def test_path_escaping_the_folder_is_refused(tmp_path: Path) -> None:
    final = tmp_path / "out"
    manifest = _write(final)
    outside = tmp_path / "secret.txt"
    outside.write_text("x")
    entries = (*manifest.files, type(manifest.files[0])("../secret.txt", "0" * 64, 1, None))
    (final / MANIFEST_FILE).write_text(Manifest(**{**manifest.__dict__, "files": entries}).to_json())
    with pytest.raises(CorruptOutputError, match="invalid path"):
        read_manifest(final)


def test_issue32_a_re_signed_manifest_naming_a_file_outside_its_folder_is_refused_before_pruning(tmp_path: Path):
    """Its checksum is right (anyone can compute it again), and pruning reads it without verifying the files: the
    file it names outside the folder is never touched."""
    final = tmp_path / "out"
    manifest = _write(final)
    outside = tmp_path / "secret.txt"
    outside.write_text("keep me")
    entries = (*manifest.files, type(manifest.files[0])("../secret.txt", "0" * 64, 7, None, prunable=True))
    (final / MANIFEST_FILE).write_text(Manifest(**{**manifest.__dict__, "files": entries}).to_json())
    with pytest.raises(CorruptOutputError, match=r"invalid path '\.\./secret\.txt'"):
        prune_files(final)
    assert outside.read_text() == "keep me"


@pytest.mark.parametrize(
    "forged",
    [{"upstream": {"rollout": "e" * 64}}, {"config": {**CONFIG, "lr": 1.0}}, {"code": "f00d" * 16}],
    ids=["upstream", "config", "code"],
)
def test_issue42_a_manifest_signed_again_with_other_inputs_is_refused(tmp_path: Path, forged: dict) -> None:
    """The digest leaves the recorded inputs out, and anyone can compute the self-checksum again: an upstream, config
    or code changed in a manifest signed again is refused, since its input key is not theirs."""
    final = tmp_path / "out"
    manifest = _write(final)
    (final / MANIFEST_FILE).write_text(Manifest(**{**manifest.__dict__, **forged}).to_json())
    with pytest.raises(CorruptOutputError, match="are not the ones its input key was computed from") as caught:
        read_manifest(final, verify=False)
    assert caught.value.path == final / MANIFEST_FILE


def test_issue42_an_output_is_written_only_under_the_key_of_its_inputs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not the key of this config, upstream and code"):
        StageOutput(tmp_path / "out", stage="sample", input_key="ab" * 32, config=CONFIG, upstream=UPSTREAM, code=CODE)


def test_missing_folder_is_not_corruption(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_manifest(tmp_path / "nowhere")


def test_digest_ignores_creation_time_and_metrics_but_the_checksum_does_not(tmp_path: Path) -> None:
    manifest = _write(tmp_path / "a")
    rewritten = dataclasses.replace(
        manifest, created_at="2000-01-01T00:00:00Z", metrics={"seconds": 1.0}, runtime={"device": "cuda:0"}
    )
    assert rewritten.digest == manifest.digest
    assert rewritten.checksum != manifest.checksum


def test_prunable_files_leave_the_digest_and_may_be_pruned(tmp_path: Path) -> None:
    final = tmp_path / "ppo"
    with StageOutput(
        final, stage="ppo_update", input_key=_key("ppo_update", {}, {}), config={}, upstream={}, code=CODE
    ) as out:
        (out.path / "actor").mkdir()
        (out.path / "actor" / "model.safetensors").write_bytes(b"weights")
        (out.path / "actor_optimizer").mkdir()
        (out.path / "actor_optimizer" / "optimizer.pt").write_bytes(b"adam moments")
        out.prunable.add("actor_optimizer")
    manifest = out.manifest
    assert [(e.path, e.prunable) for e in manifest.files] == [
        ("actor/model.safetensors", False),
        ("actor_optimizer/optimizer.pt", True),
    ]
    state = prunable_digest(manifest)
    assert state is not None and prunable_present(final, manifest)
    assert prune_files(final) == len(b"adam moments")
    assert not (final / "actor_optimizer").exists()
    assert read_manifest(final).digest == manifest.digest  # verifies, identity unchanged
    assert prunable_digest(read_manifest(final)) == state and not prunable_present(final, manifest)
    (final / "actor" / "model.safetensors").write_bytes(b"other!!")  # a kept file is still verified
    with pytest.raises(CorruptOutputError, match="altered"):
        read_manifest(final)


def test_issue33_an_output_of_schema_5_is_still_read(tmp_path: Path) -> None:
    """Schema 6 only adds experience's `policy_version` column: a schema-5 output is read as it was (its experience
    as on-policy rows, tests/storage/test_experience_io.py), so a campaign of schema-5 iterations continues."""
    final = tmp_path / "out"
    manifest = _write(final)
    key_then = compute_input_key("sample", CONFIG, UPSTREAM, code=CODE, schema_version=5)  # keyed as schema 5 keyed
    older = Manifest(**{**manifest.__dict__, "schema_version": 5, "input_key": key_then})
    (final / MANIFEST_FILE).write_text(older.to_json())
    assert read_manifest(final).schema_version == 5
    (final / MANIFEST_FILE).write_text(Manifest(**{**older.__dict__, "schema_version": 4}).to_json())
    with pytest.raises(UnsupportedSchemaError, match="this version reads schema 5, 6 and 7 only"):
        read_manifest(final)
