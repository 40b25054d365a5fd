"""Issue 42: the probe gate on a **bf16** engine, at the learning rate of the configs, where the tolerance alone
(0.5 nats) passes an engine that samples the previous weights: one update at ``configs/tiny.yaml``'s actor learning
rate (2e-4) moves the probe's log-probs by far less. The gate's offset rule (runtime/engine_probe.py, choice 7: the
engine's gap may not point toward other weights the campaign served by more than 1.5 noise floors) catches it.

The same tied tiny Llama saved in bf16 and the same broken engine as tests/flows/test_engine_faults.py, here
started in bf16; the campaign's precision is bf16 (the trainer's side under bf16 autocast), full fine-tuning.
Iteration 0 runs clean; then iteration 1 on an engine that loads the initial policy at its swap
(``previous_weights``: measured offsets of 36.9-40 floors toward the initial policy, gap 0.21-0.23), loads nothing
(``reload_skipped``: the same), loads the first layer only (``swap_fails_midway``: 17.5-19.5 floors, gap 0.11-0.12)
or leaves a tied output layer stale (``tied_output_stale``: 1.9-2.3 floors, gap 0.017-0.019) must stop at its first
stage with one line, with a gap inside the tolerance; and with no fault, iteration 1 runs to the end with every
offset within the margin (measured: -0.09 to 0.12 floors).

Needs the engine's environment: ``pytest -m vllm tests/flows/test_engine_faults_bf16.py``.
"""

from __future__ import annotations

import json
import re

import pytest

from runtime.engine import engine_python
from runtime.engine_probe import NOISE_MARGIN
from tests.flows.test_engine_faults import (
    GATE,
    _finished_stage_runs,
    _iterations_written,
    _reset,
    _run,
    _run_to_end,
    broken_engine,
)
from tests.flows.test_engine_faults import _argv as _fp32_argv

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not engine_python().exists(), reason="no engine environment: bash scripts/setup-vllm.sh"),
]

SETTINGS = ("precision=bf16", "ppo.actor_learning_rate=2.0e-4")
"""bf16 on both sides, and configs/tiny.yaml's own actor learning rate (after SMALL's 0.01: the last one wins)."""


@pytest.fixture(scope="module")
def engine(worlds, tmp_path_factory):
    """The broken engine in bf16 (no fault in force yet), its URL and the file that names the fault."""
    fault = tmp_path_factory.mktemp("fault") / "fault"
    with broken_engine(worlds["bf16"], fault, precision="bf16", lora=False) as url:
        yield url, fault


@pytest.fixture(scope="module")
def campaign(prefect_server, engine, tmp_path_factory):
    """A bf16 campaign's run root (its iteration 0 is run, clean, by the first test that needs it: a module fixture
    cannot capture a command's output)."""
    return tmp_path_factory.mktemp("faults-bf16")


def _argv(root, worlds, url: str, iterations: int) -> list[str]:
    return _fp32_argv(root, worlds["bf16"], url, f"iterations={iterations}", *SETTINGS)


def _swaps(root) -> list[dict]:
    """Every swap the campaign's gates proved, with its stage."""
    found = []
    for manifest in sorted((root / "tiny").glob("*/*/_manifest.json")):
        for swap in json.loads(manifest.read_text())["runtime"].get("engine_probe", []):
            found.append({"stage": manifest.parent.parent.name, **swap})
    return found


@pytest.mark.parametrize("fault_name", ["previous_weights", "reload_skipped", "swap_fails_midway", "tied_output_stale"])
def test_issue42_stale_weights_inside_the_bf16_tolerance_are_caught_by_their_offset(
    worlds,
    engine,
    campaign,
    capfd,
    fault_name,
):
    url, fault = engine
    if not (campaign / "tiny").is_dir():  # iteration 0, clean, once for the module
        fault.write_text("")
        _run_to_end(_argv(campaign, worlds, url, 1), campaign / "run.log", capfd)
    before = _iterations_written(campaign)
    _reset(url, fault, worlds["bf16"]["policy"])
    fault.write_text(fault_name)
    try:
        code, stderr = _run(_argv(campaign, worlds, url, 2), campaign / "run.log", capfd)
    finally:
        _reset(url, fault, worlds["bf16"]["policy"])
    line = stderr.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert (
        line.startswith(f"rlhf: sample_candidates, iteration 1: {GATE}")
        and "of the way from the trainer's to those of" in line
    ), line
    gap = float(re.search(r"gap ([0-9.e-]+), tolerance 0.5\)", line).group(1))
    assert gap < 0.5, line  # the tolerance alone would have let it sample
    assert _iterations_written(campaign) == before and _finished_stage_runs(campaign, 1) == []


def test_issue42_with_no_fault_iteration_1_runs_on_a_bf16_engine_within_the_offset_margin(
    worlds,
    engine,
    campaign,
    capfd,
):
    url, fault = engine
    fault.write_text("")
    _run_to_end(_argv(campaign, worlds, url, 2), campaign / "run.log", capfd)
    swaps = _swaps(campaign)
    offsets = [other["offset_floors"] for swap in swaps for other in swap["others"]]
    assert offsets and max(offsets) <= NOISE_MARGIN, swaps
    print("noise over the floor, offsets in floors:", [
        (swap["stage"], round(swap["noise"] / swap["noise_floor"], 2), [round(o["offset_floors"], 3) for o in swap["others"]])
        for swap in swaps
    ])  # fmt: skip
