"""The probe gate's own parts (issue 36), without an engine: the gap, the campaign's probe file, the trainer's side
of the probe, and what a gate does with an engine's answer (a stand-in engine answering over HTTP as the server
does). The gate against the real engine, broken on purpose, is tests/flows/test_engine_faults.py."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rlhf_core.config import SamplingConfig
from rlhf_core.loading import ModelLoader
from rlhf_core.sequences import sequence_logprobs
from runtime.engine_client import ServedPolicy
from runtime.engine_probe import (
    GAP_METRIC,
    TOLERANCES,
    EngineProbeError,
    OtherWeights,
    Probe,
    campaign_probe,
    gated_policy,
    in_floors,
    offset_toward,
    probe_failures_named,
    probe_gap,
    record_metrics,
    recording,
    rms_difference,
    trainer_logprobs,
)
from tests.conftest import left_padded, tiny_causal_lm

PROBE = Probe(prompts=((1, 5, 6), (1, 7)), responses=((8, 9, 2), (10,)))


def test_the_gap_is_the_largest_difference_over_every_token():
    # |0.5 - 0.25| = 0.25, |-1 - -1.5| = 0.5, |-2 - -2| = 0: the largest is 0.5
    assert probe_gap([[0.5, -1.0], [-2.0]], [[0.25, -1.5], [-2.0]]) == 0.5
    assert probe_gap([[0.0]], [[0.0, 1.0]]) == float("inf")  # rows that do not line up never pass
    assert probe_gap([[float("nan")]], [[0.0]]) == float("inf")


def test_the_probe_is_made_once_and_found_again(tmp_path):
    made = []

    def make() -> Probe:
        made.append(1)
        return PROBE

    path = tmp_path / "engine_probe.json"
    assert campaign_probe(path, make) == PROBE
    assert campaign_probe(path, lambda: pytest.fail("made a second time")) == PROBE
    assert made == [1] and json.loads(path.read_text())["responses"] == [[8, 9, 2], [10]]
    batch = PROBE.batch()
    assert batch.sequences == [[1, 5, 6, 8, 9, 2], [1, 7, 10]] and batch.prompt_lengths == [3, 2]


def test_the_trainers_side_is_the_stages_own_forward_of_each_row():
    """One row at a time, temperature 1: the same log-probs as the stages' padded batch forward (fp32)."""
    model = tiny_causal_lm("llama").eval()
    rows = trainer_logprobs(model, PROBE)
    ids, mask = left_padded([list(p) for p in PROBE.prompts])  # (2, 3)
    responses = torch.tensor([[8, 9, 2], [10, 0, 0]])  # (2, 3), right-padded
    sequences = torch.cat([ids, responses], dim=1)  # (2, 6)
    attention = torch.cat([mask, torch.tensor([[1, 1, 1], [1, 0, 0]])], dim=1)
    with torch.no_grad():
        batch = sequence_logprobs(model, sequences, attention, 3, temperature=1.0)  # (2, 3)
    torch.testing.assert_close(torch.tensor(rows[0]), batch[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(rows[1]), batch[1, :1], rtol=0, atol=1e-5)


class _Engine:
    """A stand-in engine server: answers ``/generate`` with fixed tokens, and a probe's log-probs (``shift`` away from
    ``truth``) whenever its state is not the verified one; each request may swap (a new state)."""

    def __init__(self, truth: list[list[float]]) -> None:
        self.truth, self.shift, self.state, self.requests, self.scores = truth, 0.0, 0, [], True
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.requests.append(request)
                probe = None
                if engine.scores and request["probe"] is not None and request["verified"] != str(engine.state):
                    probe = {"logprobs": [[v + engine.shift for v in row] for row in engine.truth], "seconds": 0.01}
                body = {"tokens": [[4]], "logprobs": [[-1.0]], "swap_seconds": 0.0, "state": str(engine.state)}
                data = json.dumps({**body, "probe": probe}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def engine_and_gate():
    model = tiny_causal_lm("llama").eval()
    loader = ModelLoader(device=torch.device("cpu"), precision="fp32")
    gate = gated_policy(ServedPolicy("", "/runs/ppo_update/abc/actor"), model, PROBE, models=loader, iteration=3)
    engine = _Engine(gate.expected)
    gate.policy = ServedPolicy(engine.url, "/runs/ppo_update/abc/actor")
    yield engine, gate
    engine.server.shutdown()


def test_a_swap_within_tolerance_is_recorded_and_proved_once(engine_and_gate):
    engine, gate = engine_and_gate
    config = SamplingConfig(max_new_tokens=4)
    engine.shift = 5e-5  # within fp32's 1e-4
    with recording() as records:
        gate.sample([[1, 2]], [7], config=config, eos_token_id=2)
        gate.sample([[1, 2]], [8], config=config, eos_token_id=2)  # the same state: not scored again
        engine.state += 1  # someone swapped the engine in between
        gate.sample([[1, 2]], [9], config=config, eos_token_id=2)
    assert [request["verified"] for request in engine.requests] == [None, "0", "0"]
    assert [record["engine_state"] for record in records] == ["0", "1"]
    assert records[0]["gap"] == pytest.approx(5e-5, abs=1e-6) and records[0]["tolerance"] == 1e-4
    assert record_metrics(records) == {GAP_METRIC: pytest.approx(5e-5, abs=1e-6)}
    assert record_metrics([]) == {}


def test_a_swap_beyond_tolerance_stops_before_its_tokens_are_used(engine_and_gate):
    engine, gate = engine_and_gate
    engine.shift = 0.02
    with recording() as records, pytest.raises(EngineProbeError) as refused, probe_failures_named("rollout"):
        gate.sample([[1, 2]], [7], config=SamplingConfig(max_new_tokens=4), eos_token_id=2)
    message = str(refused.value)
    assert message.startswith("rollout, iteration 3: the generation engine does not sample the trainer's weights")
    assert "/runs/ppo_update/abc/actor" in message and "0.02 from the trainer's forward (tolerance 0.0001)" in message
    assert refused.value.exit_code == 2 and "\n" not in message
    assert records[0]["gap"] == pytest.approx(0.02, abs=1e-6)  # recorded before the refusal
    assert gate.verified is None


def test_issue42_an_engine_that_swaps_without_scoring_the_probe_is_not_sampled_from(engine_and_gate):
    """The gate asked for a proof and the engine sent none: a server that ignores the probe (an old one, a proxy that
    drops the field) fails the stage at its first request, and again after a swap it did not prove."""
    engine, gate = engine_and_gate
    config = SamplingConfig(max_new_tokens=4)
    engine.scores = False
    with pytest.raises(
        EngineProbeError, match=r"iteration 3: .* from a state it was not proved in \(0; proved: None\)"
    ):
        gate.sample([[1, 2]], [7], config=config, eos_token_id=2)
    engine.scores = True
    gate.sample([[1, 2]], [7], config=config, eos_token_id=2)  # proved: state 0
    engine.scores, engine.state = False, 1
    with pytest.raises(EngineProbeError, match=r"\(1; proved: 0\)"):
        gate.sample([[1, 2]], [8], config=config, eos_token_id=2)


def test_issue42_the_offset_toward_other_weights_by_hand():
    """c = 0, o = 1 on N = 4 tokens (|d|^2 = 4, its root mean square 1). An engine at e = (0.9, 1.1, 1, 1): r.d = 4,
    position 1, offset 4 / sqrt(4 * 4) = 1, all the way; at 0.5 everywhere, halfway: 0.5 and 0.5; at
    e = (0.1, -0.1, 0, 0), across the line: 0 and 0, though its gap's root mean square is sqrt(0.02 / 4) = 0.0707.
    Equal log-probs give no offset. 0.1 is 10 floors of 0.01."""
    own, other = [[0.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]
    assert offset_toward([[0.9, 1.1], [1.0, 1.0]], own, other) == pytest.approx((1.0, 1.0))
    assert offset_toward([[0.5, 0.5], [0.5, 0.5]], own, other) == (0.5, 0.5)
    assert offset_toward([[0.1, -0.1], [0.0, 0.0]], own, other) == pytest.approx((0.0, 0.0))
    assert rms_difference([[0.1, -0.1], [0.0, 0.0]], own) == pytest.approx(0.02**0.5 / 2)
    assert offset_toward([[0.3, 0.0], [0.0, 0.0]], own, own) == (0.0, 0.0)
    assert (
        in_floors(0.1, 0.01) == pytest.approx(10) and in_floors(0.0, 0.0) == 0.0 and in_floors(0.1, 0.0) == float("inf")
    )


def _wide_probe(vocab_size: int) -> Probe:
    """8 rows of 4 prompt and 16 response tokens: 128 scored tokens."""
    ids = torch.randint(3, vocab_size, (8, 20), generator=torch.Generator().manual_seed(0)).tolist()
    return Probe(prompts=tuple(tuple(row[:4]) for row in ids), responses=tuple(tuple(row[4:]) for row in ids))


def test_issue42_within_the_bf16_tolerance_an_engine_offset_toward_other_served_weights_is_refused(tmp_path):
    """The previous policy and the one an update made from it (every weight moved by 1e-3: their log-probs 0.009 nats
    apart, root mean square, far inside bf16's tolerance of 0.5). The campaign's first gate, of the previous policy,
    keeps its log-probs and its engine's noise as the campaign's floor (0.0009 nats); the next gate, of the new
    policy, refuses an engine that still serves the previous one (its log-probs with the same noise: offset 10
    floors toward them, position 1.01) and one that applied half the swap (5 floors, 0.51), passes one that serves the
    new one (0.07 floors), and passes an engine halfway toward weights whose log-probs are rounding away from its own
    (0.5 floors): a correct engine's rounding can put it there."""
    previous = tiny_causal_lm("llama").eval()
    current = tiny_causal_lm("llama").eval()
    with torch.no_grad():
        for weight in current.parameters():
            weight.add_(1e-3 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(1)))
    probe = _wide_probe(current.config.vocab_size)
    loader = ModelLoader(device=torch.device("cpu"), precision="bf16")
    first = gated_policy(
        ServedPolicy("", "/runs/initialize/a/actor"), previous, probe, models=loader, iteration=0, served=tmp_path
    )
    stale = torch.tensor(first.expected, dtype=torch.float64)  # (8, 16)
    noise = torch.randn(stale.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 0.001
    with recording() as records:
        first.check((stale + noise).tolist(), state="1", seconds=0.0)
    assert records[0]["noise_floor"] == records[0]["noise"] == pytest.approx(0.00091, abs=1e-5)
    gate = gated_policy(
        ServedPolicy("", "/runs/ppo_update/b/actor"), current, probe, models=loader, iteration=1, served=tmp_path
    )
    assert first.others == () and [other.weights for other in gate.others] == ["/runs/initialize/a/actor"]
    new = torch.tensor(gate.expected, dtype=torch.float64)
    for answer, floors, shown in (
        (stale + noise, 10.05, ("1.01", "10")),
        ((stale + new) / 2 + noise, 5.06, ("0.51", "5.06")),
    ):
        assert probe_gap(answer.tolist(), gate.expected) < TOLERANCES["bf16"]
        with recording() as records, pytest.raises(EngineProbeError) as refused:
            gate.check(answer.tolist(), state="2", seconds=0.0)
        message = str(refused.value)
        assert f"lie {shown[0]} of the way from the trainer's to those of /runs/initialize/a/actor" in message
        assert f"offset toward them by {shown[1]} noise floors (at most 1.5;" in message and gate.verified is None
        assert records[0]["others"][0]["offset_floors"] == pytest.approx(floors, abs=0.01)
    with recording() as records:
        gate.check((new + noise).tolist(), state="2", seconds=0.0)
    assert gate.verified == "2" and records[0]["others"][0]["offset_floors"] == pytest.approx(0.07, abs=0.01)
    assert records[0]["noise_floor"] == pytest.approx(0.00091, abs=1e-5)  # the campaign's, not this swap's
    rounding = torch.randn(stale.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 0.001
    gate.others = (
        OtherWeights("/runs/initialize/a/actor", "/runs/initialize/a/zero-adapter", (new + rounding).tolist()),
    )
    with recording() as records:
        gate.check((new + rounding / 2 + 0.3 * noise).tolist(), state="3", seconds=0.0)
    judged = records[0]["others"][0]
    assert gate.verified == "3" and judged["position"] == pytest.approx(0.51, abs=0.01)
    assert judged["offset_floors"] == pytest.approx(0.53, abs=0.01)
