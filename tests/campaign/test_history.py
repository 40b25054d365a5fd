"""What differs from what produced a campaign's finished iterations: the library versions (issue 32), read from the
iteration runs' tags as :func:`campaign.history.provenance` records them."""

from __future__ import annotations

import json

from campaign.history import provenance, versions_in_use, what_differs
from runtime.context import BaseInputs, InputFile
from storage.mlflow_store import RunSummary
from storage.tracking import TAG_VERSIONS

BASE = BaseInputs(
    policy=InputFile(path="/inputs/policy", sha256="p" * 64),
    tokenizer=InputFile(path="/inputs/policy", sha256="p" * 64),
    prompts=InputFile(path="/inputs/prompts.jsonl", sha256="1" * 64),
    eval_prompts=InputFile(path="/inputs/eval_prompts.jsonl", sha256="2" * 64),
)


def _run(number: int, tags: dict[str, str]) -> RunSummary:
    return RunSummary(
        run_id=f"run{number}", status="FINISHED", tags=tags, start_time=number, artifact_uri="", metrics={}
    )


def _finished(*versions: dict[str, str] | None) -> dict[int, RunSummary]:
    """Finished iteration runs recorded by this code and these inputs, with these versions (None: no versions tag,
    as a run of a previous release)."""
    tags = provenance(BASE, None)
    del tags[TAG_VERSIONS]
    return {
        number: _run(number, tags if recorded is None else {**tags, TAG_VERSIONS: json.dumps(recorded)})
        for number, recorded in enumerate(versions)
    }


def test_issue32_a_library_in_another_version_is_said_in_one_line():
    now = versions_in_use(BASE, None)
    older = {**now, "torch": "2.0.0", "transformers": "4.40.0"}
    note = what_differs(_finished(now, older), BASE, vllm=None)
    assert note == (
        f"iterations 0-1 were computed with other library versions (torch 2.0.0 there, {now['torch']} here; "
        f"transformers 4.40.0 there, {now['transformers']} here): they are kept as they are, and iteration 2 on use "
        "what is here now (`rlhf run --from-iteration N` recomputes from N)"
    )


def test_issue32_runs_of_a_previous_release_and_libraries_not_used_now_say_nothing():
    now = versions_in_use(BASE, None)
    assert what_differs(_finished(None, None), BASE, vllm=None) is None  # recorded before versions were
    assert what_differs(_finished(now, None), BASE, vllm=None) is None
    # vLLM sampled the finished iterations; nothing asks the engine now (a finished campaign's rerun): not compared.
    assert what_differs(_finished({**now, "vllm": "0.10.0"}), BASE, vllm=None) is None
