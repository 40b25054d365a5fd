"""The library versions every stage manifest records (issue 32): read from the installed distributions, vLLM's from
the generation engine's identity, read from its ``/health`` answer (a real HTTP server here, answering as ``engine_server/server.py`` does)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import platform
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pytest

from rlhf_core.config import SamplingConfig
from runtime.context import Execution, InputFile, StageContext
from runtime.declaration import StageSettings, setting
from runtime.engine import ENGINE_SETTINGS, engine_identity
from runtime.job import Job
from runtime.stage import Stage, run_stage
from runtime.versions import library_versions, stage_versions
from storage.manifest import read_manifest
from storage.schemas import PROMPTS
from tests.runtime.conftest import FILE, stage_context

GGUF = InputFile(path="/runs/cache/gguf/k", sha256="b" * 64, source="/models/m.gguf")


@pytest.fixture(scope="module")
def engine_url():
    """A server answering ``GET /health`` as the generation engine does, with a vLLM version."""

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            answer = {"state": "ready", "error": None, "vllm": "0.99.1", "device": "cpu", "max_num_seqs": 256}
            body = json.dumps(answer).encode()
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


def _context(tmp_path: Path, *, engine_url: str | None = None, policy: InputFile = FILE) -> StageContext:
    """A stage context; with ``engine_url``, on that engine, whose identity is read from its ``/health`` as a command
    reads it (:func:`flows.iterations.execution_of`)."""
    engine = None if engine_url is None else engine_identity(engine_url)
    execution = Execution(device="cpu", torch_threads=1, engine_url=engine_url, engine=engine)
    return stage_context(tmp_path, policy=policy, execution=execution)


def test_issue32_the_versions_are_the_installed_ones_and_gguf_only_where_asked():
    versions = library_versions()
    assert versions["python"] == platform.python_version()
    for name in ("torch", "transformers", "peft", "accelerate"):
        assert versions[name] == importlib.metadata.version(name)
    assert "gguf" not in versions and "vllm" not in versions
    assert library_versions(gguf=True)["gguf"] == importlib.metadata.version("gguf")


def test_issue32_vllm_is_the_engines_and_only_for_a_stage_sampling_on_it(tmp_path, engine_url):
    context = _context(tmp_path, engine_url=engine_url)
    assert stage_versions(context, on_engine=True)["vllm"] == "0.99.1"
    assert "vllm" not in stage_versions(context, on_engine=False)  # a stage that samples nothing, or not on the engine
    assert "gguf" in stage_versions(_context(tmp_path, policy=GGUF), on_engine=False)  # converted from a GGUF file


@dataclasses.dataclass(frozen=True)
class SampledSettings(StageSettings):
    stage = "sampled"
    sampling: SamplingConfig = setting("sampling")


def _write_prompt(job: Job[SampledSettings]) -> dict[str, float]:
    table = pa.table({"prompt_id": [0], "prompt": ["p"], "messages": [[]]}, schema=PROMPTS)
    job.out.write_table("prompts", table, schema=PROMPTS)
    return {}


sampled = Stage(SampledSettings, work=_write_prompt)


def test_issue32_a_stage_manifest_records_the_versions_it_ran_with(tmp_path, engine_url):
    context = _context(tmp_path, engine_url=engine_url)
    result = run_stage(sampled, context, SampledSettings(sampling=SamplingConfig(engine="vllm")))
    assert read_manifest(result.directory).runtime["versions"] == {**library_versions(), "vllm": "0.99.1"}


def test_issue42_the_engine_is_identified_by_what_it_says_it_samples_with_and_the_script_it_runs(
    engine_url, monkeypatch
):
    """Its ``/health`` settings (the scheduler's sequence budget here) and the server the command runs: the script
    ``RLHF_ENGINE_SERVER`` names is keyed, not taken for this project's server."""
    identity = engine_identity(engine_url)
    assert identity["max_num_seqs"] == 256 and identity["vllm"] == "0.99.1"
    assert set(identity) == {"server", *ENGINE_SETTINGS}
    faulty = Path(__file__).resolve().parents[1] / "flows" / "faulty_engine_server.py"
    monkeypatch.setenv("RLHF_ENGINE_SERVER", str(faulty))
    assert engine_identity(engine_url)["server"] != identity["server"]
