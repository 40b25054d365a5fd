"""Issue 36: the generation engine broken on purpose, and the probe gate catching every case within the swap that
caused it, with nothing written.

One engine serves the whole module (tests/flows/faulty_engine_server.py, started by the product's own launcher
through ``RLHF_ENGINE_SERVER``, fp32, eager, LoRA merged), and the fault in force is a line in a file it reads at
every swap. Every campaign runs ``rlhf run`` as a user does, on that engine (``execution.engine_url``), over a tiny
Llama with a tied output layer:

* ``full``: full fine-tuning from the Llama saved in bf16;
* ``lora``: LoRA (merged into the engine's weights) over the same bf16 Llama;
* ``embedding``: LoRA on the embeddings too (``lora_embedding_A``/``B``) over the Llama saved in fp32.

The full and LoRA campaigns' iteration 0 runs clean; then each fault runs iteration 1 on an engine reset to the
base, so its first stage (sample_candidates) swaps to the first update's weights. The gate must stop it there: exit 2, one line naming the
stage, the iteration, the weights and the gap, no output of iteration 1 (no stage folder, no finished MLflow stage
run). The embedding adapter is refused by the merge itself, and when the old merge drops it, caught at iteration 0's
evaluate, the first stage that serves an update. Last, the full and LoRA campaigns run iteration 1 with no fault, to
the end, on proved swaps.

Every command runs in the test's process (``flows.cli.main``, its exit code and standard error as a user sees them),
on the session's Prefect server: what is tested is the gate, not the process, so the 12 commands pay neither a Python
start with its imports nor a temporary Prefect server each.

Needs the engine's environment: ``pytest -m vllm tests/flows/test_engine_faults.py`` (about 15 minutes on 2 cores).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow import MlflowClient

from campaign.config import load_config
from flows.cli import main
from runtime.engine import engine_python, ensure_engine, stop_engine
from runtime.engine_client import ProbeBatch, ServedPolicy, engine_score

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not engine_python().exists(), reason="no engine environment: bash scripts/setup-vllm.sh"),
]

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
FAULTY_SERVER = Path(__file__).with_name("faulty_engine_server.py")
GATE = "the generation engine does not sample the trainer's weights"
SMALL = (
    "sizes.rollout_prompts=8", "sizes.rows_per_shard=8", "sampling.batch_size=4", "ppo.actor_learning_rate=0.01",
    "execution.engine_compile=false",
)  # fmt: skip
"""Small stages; evaluate's 8 held-out prompts are one shard of two batches (each side sampled over the shard)."""
CAMPAIGNS = {
    "full": ("bf16", ()),
    "lora": ("bf16", ("model.lora.r=8", "execution.engine_lora=merge")),
    "embedding": ("fp32", ("model.lora.r=8", "model.lora.target_modules=[embed_tokens,q_proj,v_proj]")),
}
"""Campaign -> the dtype its initial policy is saved in, and its settings."""


@contextlib.contextmanager
def broken_engine(world: dict[str, Path], fault: Path, *, precision: str, lora: bool) -> Iterator[str]:
    """The broken engine over ``world``'s policy, started by the product's launcher in ``precision`` (LoRA merged into
    its weights where ``lora``), the fault in force named in ``fault``; its URL. Stopped at the end."""
    saved = {name: os.environ.get(name) for name in ("RLHF_ENGINE_SERVER", "RLHF_ENGINE_FAULT_FILE")}
    os.environ.update(RLHF_ENGINE_SERVER=str(FAULTY_SERVER), RLHF_ENGINE_FAULT_FILE=str(fault))
    adapter = ["model.lora.r=8", "execution.engine_lora=merge"] if lora else []
    config = load_config(TINY, [f"model.policy={world['policy']}", *adapter, *SMALL[-1:]])
    try:
        yield ensure_engine(
            config.execution, precision=precision, lora_rank=8 if lora else None, policy=str(world["policy"])
        )
    finally:
        stop_engine()
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)


@pytest.fixture(scope="module")
def engine(worlds, tmp_path_factory):
    """The broken engine (no fault in force yet), its URL and the file that names the fault."""
    fault = tmp_path_factory.mktemp("fault") / "fault"
    with broken_engine(worlds["bf16"], fault, precision="fp32", lora=True) as url:
        yield url, fault


def _argv(run_root: Path, world: dict[str, Path], url: str, *extra: str) -> list[str]:
    sets = [
        f"run_root={run_root}", f"model.policy={world['policy']}", f"data.prompts={world['prompts']}",
        f"data.eval_prompts={world['eval_prompts']}", "sampling.engine=vllm", f"execution.engine_url={url}",
        *SMALL, *extra,
    ]  # fmt: skip
    return ["run", "--config", str(TINY), *(f"--set={item}" for item in sets)]


def _run(argv: list[str], log: Path, capfd) -> tuple[int, str]:
    """``rlhf <argv>`` in this process; its exit code and standard error (both outputs also kept in ``log``)."""
    capfd.readouterr()
    code = main(argv)
    out, err = capfd.readouterr()
    with log.open("a") as kept:
        kept.write(out + err)
    return code, err


def _run_to_end(argv: list[str], log: Path, capfd) -> None:
    code, stderr = _run(argv, log, capfd)
    assert code == 0, f"`rlhf run` failed: {stderr[-3000:]}"


def _iterations_written(run_root: Path) -> dict[str, list[int]]:
    """Stage -> the iterations of its outputs: finished ones (manifests), and any other folder (a half output)."""
    found: dict[str, list[int]] = {}
    for folder in sorted((run_root / "tiny").glob("*/*")):
        if folder.parent.name.startswith(".") or folder.name.startswith("."):
            continue
        manifest = folder / "_manifest.json"
        iteration = json.loads(manifest.read_text())["config"]["context"]["iteration"] if manifest.is_file() else -1
        found.setdefault(folder.parent.name, []).append(iteration)
    return found


def _finished_stage_runs(run_root: Path, iteration: int) -> list[str]:
    uri = f"sqlite:///{run_root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("tiny")
    runs = client.search_runs([experiment.experiment_id], max_results=10_000)
    return [
        run.data.tags["rlhf.stage"]
        for run in runs
        if run.data.tags.get("rlhf.kind") == "stage"
        and run.data.tags.get("rlhf.iteration") == str(iteration)
        and run.info.status == "FINISHED"
    ]


class _Campaigns:
    """Each campaign's run root, its iteration 0 run on the engine with no fault when first asked for (the embedding
    adapter's is the test below: the product's merge refuses it)."""

    def __init__(self, worlds, engine, tmp_path_factory) -> None:
        self.worlds, self.url, self.fault, self.roots = worlds, engine[0], engine[1], {}
        self.tmp_path_factory = tmp_path_factory

    def get(self, name: str, capfd) -> Path:
        if name not in self.roots:
            self.roots[name] = root = self.tmp_path_factory.mktemp(f"faults-{name}")
            dtype, extra = CAMPAIGNS[name]
            if name != "embedding":
                self.fault.write_text("")
                _run_to_end(_argv(root, self.worlds[dtype], self.url, "iterations=1", *extra), root / "run.log", capfd)
        return self.roots[name]


@pytest.fixture(scope="module")
def campaigns(prefect_server, worlds, engine, tmp_path_factory) -> _Campaigns:
    return _Campaigns(worlds, engine, tmp_path_factory)


def _reset(url: str, fault: Path, policy: Path) -> None:
    """No fault, and the engine made to load ``policy`` for real: a fault may leave it naming weights it does not
    hold (a skipped reload), which the next case would otherwise find and skip swapping."""
    fault.write_text("")
    engine_score(ServedPolicy(url, str(policy)), ProbeBatch(sequences=[[1, 2, 3]], prompt_lengths=[1]))


def _caught(stderr: str, code: int, stage: str, iteration: int) -> str:
    """The gate's one line, checked: exit 2, no traceback, naming the stage, the iteration, the update's weights and a
    gap beyond fp32's tolerance."""
    lines = stderr.strip().splitlines()
    assert code == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert lines[-1].startswith(f"rlhf: {stage}, iteration {iteration}: {GATE}"), lines[-1]
    assert "ppo_update" in lines[-1] and "from the trainer's forward (tolerance 0.0001)" in lines[-1], lines[-1]
    return lines[-1]


def test_an_adapter_with_embedding_tensors_is_refused_by_the_merge_and_caught_when_dropped(
    worlds, engine, campaigns, capfd
):
    """The product's merge refuses ``lora_embedding_A``/``B`` by name before the first stage writes anything; the
    merge before issue 36 dropped them without a word, which the gate catches at the first swap to an update that
    moved them: iteration 0's evaluate (a fresh embedding adapter's A is zero, so the stages before it sample the
    base, rightly)."""
    url, fault = engine
    run_root = campaigns.get("embedding", capfd)
    dtype, extra = CAMPAIGNS["embedding"]
    fault.write_text("")
    argv = _argv(run_root, worlds[dtype], url, "iterations=1", *extra)
    code, stderr = _run(argv, run_root / "run.log", capfd)
    lines = stderr.strip().splitlines()
    assert code == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert "lora_embedding_" in lines[-1] and "which a merge does not consume" in lines[-1], lines[-1]
    assert "sample_candidates" not in _iterations_written(run_root)
    fault.write_text("old_merge")
    try:
        code, stderr = _run(argv, run_root / "run.log", capfd)
    finally:
        _reset(url, fault, worlds["bf16"]["policy"])
    _caught(stderr, code, "evaluate", 0)
    written = _iterations_written(run_root)
    assert "evaluate" not in written and written["ppo_update"] == [0], written
    assert "evaluate" not in _finished_stage_runs(run_root, 0)


@pytest.mark.parametrize(
    ("fault_name", "campaign"),
    [
        ("adapter_not_applied", "lora"),
        ("old_merge", "lora"),  # a bf16 base merged in bf16
        ("reload_skipped", "full"),
        ("swap_fails_midway", "full"),
        ("tied_output_stale", "full"),
        ("previous_weights", "full"),
    ],
)
def test_every_fault_is_caught_within_its_swap_and_nothing_is_written(
    worlds, engine, campaigns, capfd, fault_name, campaign
):
    url, fault = engine
    run_root = campaigns.get(campaign, capfd)  # its iteration 0, clean, first
    dtype, extra = CAMPAIGNS[campaign]
    before = _iterations_written(run_root)
    # The engine holds the base, so iteration 1's first stage swaps (iteration 0's evaluate left it on the first
    # update's weights, proved then: its sample_candidates would reuse them, and the first swap be evaluate's).
    _reset(url, fault, worlds["bf16"]["policy"])
    fault.write_text(fault_name)
    try:
        code, stderr = _run(_argv(run_root, worlds[dtype], url, "iterations=2", *extra), run_root / "run.log", capfd)
    finally:
        _reset(url, fault, worlds["bf16"]["policy"])
    _caught(stderr, code, "sample_candidates", 1)
    assert _iterations_written(run_root) == before  # no output of iteration 1, whole or half
    assert _finished_stage_runs(run_root, 1) == []


@pytest.mark.parametrize("campaign", ["full", "lora"])
def test_with_no_fault_the_same_campaigns_run_iteration_1_on_proved_swaps(worlds, engine, campaigns, capfd, campaign):
    """A bf16 base under LoRA merged for the fp32 engine samples the trainer's weights (the gate passes at 1e-4)."""
    url, fault = engine
    fault.write_text("")
    run_root = campaigns.get(campaign, capfd)
    dtype, extra = CAMPAIGNS[campaign]
    _run_to_end(_argv(run_root, worlds[dtype], url, "iterations=2", *extra), run_root / "run.log", capfd)
    for stage in ("sample_candidates", "rollout", "evaluate"):
        assert sorted(_iterations_written(run_root)[stage]) == [0, 1], stage
    for manifest in (run_root / "tiny").glob("*/*/_manifest.json"):
        recorded = json.loads(manifest.read_text())
        if "engine_probe_gap" in recorded["metrics"]:
            assert recorded["metrics"]["engine_probe_gap"] < 1e-4, (manifest, recorded["metrics"])
        if manifest.parent.parent.name == "evaluate" and recorded["config"]["context"]["iteration"] == 1:
            # R10: one swap for its one shard (two batches), not one per batch; the reference's side is read back
            # (sampled once per campaign, in iteration 0), so the policy's is the only one
            swaps = recorded["runtime"]["engine_probe"]
            assert [swap["adapter"] is None for swap in swaps] == [campaign == "full"], swaps
