"""Code keys (issues 32 and 42): a stage's key is the code that runs it. Table-driven over every stage: a semantic edit
in any module of a stage's closure (the seed derivation, model loading and prompt rendering included) changes its
key; a docstring, comment or layout edit anywhere changes none; an edit to a module outside every closure changes
none. A user's reward module is keyed with the modules beside it that it imports, not with installed ones. The
engine's server and identity enter the keys of the stages that sample on it."""

from __future__ import annotations

import dataclasses
import importlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import runtime.code
from rlhf_core.config import SamplingConfig
from runtime.code import FIRST_PARTY, CodeChangedError, code_closure, code_fingerprint, normalised, pinned_code
from runtime.context import Execution, InputFile
from runtime.declaration import StageSettings, setting
from runtime.job import Job
from runtime.stage import Stage, run_stage
from tasks.settings import STAGES
from tests.runtime.conftest import stage_context

STAGE_MODULES = sorted(settings.module for settings in STAGES)
GENERATION = ("tasks.sample_candidates", "tasks.rollout", "tasks.evaluate")
TRAINING = ("tasks.initialize", "tasks.train_reward_model", "tasks.ppo_update")


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory) -> Iterator[Path]:
    """A copy of the project's packages that the fingerprints read instead of the real ones."""
    root = Path(runtime.code.__file__).resolve().parents[1]
    copy = tmp_path_factory.mktemp("source")
    for package in FIRST_PARTY:
        shutil.copytree(root / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runtime.code, "_SOURCE_ROOT", copy)
        yield copy


def _project_modules(root: Path) -> list[str]:
    modules = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return modules


def _keys() -> dict[str, str]:
    return {module: code_fingerprint(module) for module in STAGE_MODULES}


def _file(root: Path, module: str) -> Path:
    base = root.joinpath(*module.split("."))
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"


def test_every_closure_holds_what_runs_the_stage():
    closures = {module: code_closure(module) for module in STAGE_MODULES}
    for module, closure in closures.items():
        assert {"runtime.seeds", "runtime.stage", "runtime.job"} <= closure.keys(), module  # seeds and mechanism
        assert all(name.split(".")[0] in FIRST_PARTY for name in closure), module  # installed code is not followed
        assert "storage.schemas" in closure, module  # what a shard's columns are
        if module not in ("tasks.compute_advantages", "tasks.critic_values"):  # the stages that render no text
            assert {"tasks.text", "storage.importers"} <= closure.keys(), module  # how a chat prompt is rendered
    for module in TRAINING:
        assert "rlhf_core.loading" in closures[module]  # LoRA creation, dtype rules, head initialisation
    for module in GENERATION:
        assert {"runtime.shards", "tasks.sampler", "runtime.engine_client"} <= closures[module].keys()
    assert "tasks.reward_function" in closures["tasks.rollout"]  # what a reward function is called with
    assert "rlhf_core.ppo" in closures["tasks.ppo_update"] and "rlhf_core.gae" in closures["tasks.compute_advantages"]
    assert {"rlhf_core.loading", "rlhf_core.experience_maker"} <= closures[
        "tasks.critic_values"
    ].keys()  # the rollout's values
    assert "demo.corpus" in code_closure("demo.gold")  # the gold judge's word lists (a judge's key)


def test_a_semantic_edit_changes_exactly_the_keys_whose_closure_holds_the_module(source_copy: Path):
    """Every module of the project, edited in turn (a constant added): the key of each stage changes if and only if
    the module is in that stage's closure."""
    before = _keys()
    closures = {module: set(code_closure(module)) for module in STAGE_MODULES}
    inside, outside = 0, 0
    for module in _project_modules(source_copy):
        path = _file(source_copy, module)
        text = path.read_text()
        path.write_text(text + "\n_KEY_PROBE = 1\n")
        try:
            after = _keys()
        finally:
            path.write_text(text)
        changed = {stage for stage in STAGE_MODULES if after[stage] != before[stage]}
        assert changed == {stage for stage in STAGE_MODULES if module in closures[stage]}, module
        inside, outside = inside + bool(changed), outside + (not changed)
    assert inside > 50 and outside > 20  # both kinds are exercised: most of campaign, flows and demo lie outside


def test_docstring_comment_and_layout_edits_anywhere_change_no_key(source_copy: Path):
    before = _keys()
    originals = {}
    for module in _project_modules(source_copy):
        path = _file(source_copy, module)
        originals[path] = text = path.read_text()
        edited = "# an edited comment\n\n" + text.replace('"""', '"""Edited. ', 1) + "\n\n# the end\n"
        path.write_text(edited)
    try:
        assert _keys() == before
    finally:
        for path, text in originals.items():
            path.write_text(text)


def test_the_engine_server_is_fingerprinted_like_a_stage_module(source_copy: Path):
    before = code_fingerprint("engine_server.server")
    server = _file(source_copy, "engine_server.server")
    text = server.read_text()
    try:
        server.write_text(text.replace('"processed_logprobs"', '"raw_logprobs"'))
        assert code_fingerprint("engine_server.server") != before
        server.write_text("# comment\n" + text)
        assert code_fingerprint("engine_server.server") == before
    finally:
        server.write_text(text)


FILE = InputFile(path="/p", sha256="0" * 64)


@dataclasses.dataclass(frozen=True)
class SampledSettings(StageSettings):
    stage = "sampled"
    sampling: SamplingConfig = setting("sampling")


def _write_nothing(job: Job[SampledSettings]) -> dict[str, float]:
    (job.out.path / "done").write_text("")
    return {}


sampled = Stage(SampledSettings, work=_write_nothing)


def test_the_engines_identity_keys_exactly_the_stages_that_sample_on_it(tmp_path: Path):
    context = stage_context(tmp_path, execution=Execution(device="cpu"))
    identity = {"server": "s" * 64, "vllm": "0.32.0", "device": "cpu", "dtype": "float32", "eager": False}

    def key(engine: str, **changed: object) -> str:
        execution = dataclasses.replace(context.execution, engine={**identity, **changed})
        settings = SampledSettings(sampling=SamplingConfig(engine=engine))
        return run_stage(sampled, dataclasses.replace(context, execution=execution), settings).input_key

    on_engine = key("vllm")
    changes = (
        {"server": "t" * 64},
        {"vllm": "0.33.0"},
        {"dtype": "bfloat16"},
        {"lora_mode": "merge"},
        {"tensor_parallel_size": 2},
        {"max_num_batched_tokens": 4096},
        {"max_num_seqs": 8},
    )
    for changed in changes:
        assert key("vllm", **changed) != on_engine, changed
    assert key("hf", vllm="0.33.0", server="t" * 64) == key("hf")  # hf samples in the stage: no engine in its key


def test_normalised_code_ignores_docstrings_comments_and_layout_but_not_constants():
    one = 'def f(x):\n    """Doc."""\n    return x * 0.99  # gamma\n\nLIMIT = 3\n"""The limit."""\n'
    two = "def f(x):\n\n    return x*0.99\nLIMIT = 3\n"
    assert normalised(one) == normalised(two)
    assert normalised(two) != normalised(two.replace("0.99", "0.98"))


def test_a_users_module_is_keyed_with_the_modules_beside_it_it_imports_and_not_with_installed_ones(
    tmp_path: Path, monkeypatch
):
    """A reward function's module importing a helper beside it (issue 42): an edit to the helper re-keys, as an edit
    to the module itself does; an installed library it imports (numpy) is not followed (its version is recorded in
    every manifest instead)."""
    (tmp_path / "my_helpers.py").write_text("BONUS = 1.0\n")
    (tmp_path / "my_rubric.py").write_text(
        "import numpy\nfrom my_helpers import BONUS\n\ndef score(prompt, response):\n    return BONUS\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    first = code_fingerprint("my_rubric")
    assert set(code_closure("my_rubric")) == {"my_rubric", "my_helpers"}
    (tmp_path / "my_helpers.py").write_text("BONUS = 2.0\n")
    assert code_fingerprint("my_rubric") != first
    (tmp_path / "my_helpers.py").write_text("# a comment\nBONUS = 1.0\n")
    assert code_fingerprint("my_rubric") == first
    (tmp_path / "my_rubric.py").write_text(
        "import numpy\nfrom my_helpers import BONUS\n\ndef score(prompt, response):\n    return 2 * BONUS\n"
    )
    assert code_fingerprint("my_rubric") != first
    with pytest.raises(ValueError, match="cannot find module"):
        code_fingerprint("no_such_module_anywhere")
    with pytest.raises(ValueError, match="cannot find module"):
        code_fingerprint("numpy")  # installed: nothing of our own to fingerprint


def test_a_file_edited_while_a_run_goes_on_is_refused_before_its_stage_computes(source_copy: Path, tmp_path: Path):
    """Issue 42: a run keys every stage with the code it started with. An edit of a module of a stage's closure after
    that (a ``git pull`` mid-campaign) is refused in one line at the next stage, which writes nothing; outside a run
    the same edit is simply a new key."""
    context = stage_context(tmp_path, execution=Execution(device="cpu"))
    settings = SampledSettings(sampling=SamplingConfig(engine="hf"))
    seeds = _file(source_copy, "runtime.seeds")
    text = seeds.read_text()
    with pinned_code(STAGE_MODULES):
        first = run_stage(sampled, context, settings)
        seeds.write_text(text + "\n_EDITED = 1\n")
        try:
            with pytest.raises(CodeChangedError, match=r"runtime/seeds\.py changed on disk while this run") as refused:
                run_stage(sampled, dataclasses.replace(context, iteration=1), settings)
            assert len(str(refused.value).splitlines()) == 1
            (written,) = (tmp_path / "camp" / "sampled").iterdir()  # the first stage's output alone
            assert first.input_key.startswith(written.name)
        finally:
            seeds.write_text(text)
    seeds.write_text(text + "\n_EDITED = 1\n")
    try:
        assert run_stage(sampled, dataclasses.replace(context, iteration=1), settings).input_key != first.input_key
    finally:
        seeds.write_text(text)


def _as_a_new_process() -> None:
    """Forget what this process parsed and found, as a new command starts: only the cache on disk is left."""
    runtime.code._parsed.cache_clear()
    runtime.code._users_module_file.cache_clear()
    runtime.code._own_modules.cache_clear()
    runtime.code._cached = None
    importlib.invalidate_caches()


def test_a_new_process_reads_what_parsing_gave_from_the_cache_and_decides_the_closure_from_the_files(
    tmp_path: Path, monkeypatch
):
    """Issue 41: a command parses no file another command parsed (the keys are the same, read from the cache on
    disk); an edit is parsed again (the cache is by content); which names are our own modules is decided from the
    files in each process (a helper module written after its importer was cached joins the closure); a damaged cache is
    parsed again, to the same keys."""
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "my_rubric_c.py").write_text("from my_helpers_c import BONUS\n\ndef score(p, r):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    parses = []
    real_parse = runtime.code._parse
    monkeypatch.setattr(runtime.code, "_parse", lambda source: parses.append(source) or real_parse(source))
    _as_a_new_process()
    with pinned_code([*STAGE_MODULES, "my_rubric_c"]):  # what a command does first; it writes the cache
        keys = {module: code_fingerprint(module) for module in (*STAGE_MODULES, "my_rubric_c")}
    assert parses and set(code_closure("my_rubric_c")) == {"my_rubric_c"}

    parses.clear()
    _as_a_new_process()
    assert {module: code_fingerprint(module) for module in keys} == keys
    assert parses == []

    (tmp_path / "my_helpers_c.py").write_text("BONUS = 2.0\n")
    _as_a_new_process()
    with pinned_code(["my_rubric_c"]):
        assert set(code_closure("my_rubric_c")) == {"my_rubric_c", "my_helpers_c"}
        assert code_fingerprint("my_rubric_c") != keys["my_rubric_c"]
    (tmp_path / "my_rubric_c.py").write_text("def score(p, r):\n    return 2.0\n")
    parses.clear()
    _as_a_new_process()
    with pinned_code(["my_rubric_c"]):
        assert code_fingerprint("my_rubric_c") not in (keys["my_rubric_c"], code_fingerprint("my_helpers_c"))
    assert len(parses) == 1  # the edited file alone

    (cache_file,) = (tmp_path / "cache" / "code").iterdir()
    for damaged in ("{not json", '{"' + "0" * 64 + '": ["zz", 3]}', "[]"):
        cache_file.write_text(damaged)
        _as_a_new_process()
        assert {module: code_fingerprint(module) for module in STAGE_MODULES} == {m: keys[m] for m in STAGE_MODULES}
