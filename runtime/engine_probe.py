"""The probe gate: every weight swap of the generation engine is proved against the trainer's own forward.

The worst RL bug is silent: the engine samples other weights than the trainer holds (an adapter that never
reaches it, a reload that is skipped or half done, a stale tied output layer, a merge that rounds the update away)
and training goes off-policy with nothing failing. So a generation stage never samples from a swap it has not
checked: the engine scores a fixed probe batch right after every swap, and the stage compares those log-probs with
the ones the stage's own model (the trainer's numerics) gives the same tokens.

Choices:
1. The probe: the first of the campaign's training prompts, each with a response of up to a number of tokens
   (both by the campaign's precision, :data:`PROBE_SIZES`) sampled once by the project's own sampler from the policy the campaign's
   first gate serves (temperature 1, seeded from the campaign's seed), stored as token ids in the run root
   (:meth:`storage.layout.RunLayout.engine_probe_file`; the first writer wins) and used by every later gate of the
   campaign. Tokens a policy of the campaign emits, in its chat template: what its updates move; fixed, so the gaps
   of every swap and iteration compare. It enters no input key: it changes no output, it only stops wrong ones.
2. Both sides score the probe at temperature 1 over the whole vocabulary: the engine with vLLM's prompt log-probs,
   the trainer with :func:`rlhf_core.sequences.sequence_logprobs` on the stage's model, one row at a time (no
   padding on either side), under the stage's autocast. The weights are compared, not the sampling settings.
3. The gap is the largest ``|engine - trainer|`` over the probe's response tokens; it must not exceed the tolerance
   of the stage's precision (:data:`TOLERANCES`). fp32: 1e-4, what the engine's tests hold today (measured: 2e-6 on
   the tiny Llama, 4.5e-5 on SmolLM2-135M). bf16: 0.5, 2.5 times the largest gap measured on SmolLM2-135M (0.20;
   the tiny Llama's 0.004): both sides round the logits to bf16, whose ulp is 0.125 at |logit| 16-32
   (bench/RESULTS.md, "The probe gate"). So in bf16 the gate catches gross faults (a stale output layer, an
   adapter missing after a real update) but not small ones, which the recorded gaps show drifting. fp16 (CUDA only,
   not measured here) takes bf16's: fp16 keeps 3 more mantissa bits, so its gaps are smaller.
4. When: every request of the stage carries the probe and the engine state the stage last proved; the engine
   scores the probe in the same request, right after the swap and before the request's own prompts, whenever its
   state has changed (``engine_server/server.py``, choice 8). So no token is sampled from an unproved swap, even
   when other processes (Dask or Ray workers, another command on a shared engine) swap it in between.
5. A gap beyond the tolerance raises :class:`EngineProbeError` inside the shard, before its rows are yielded: the
   stage writes nothing (no piece, no output, no finished MLflow run), and the command ends in one line naming the
   stage (added by :func:`probe_failures_named` around the shards), the iteration, the weights and the gap, exit
   code 2.
6. Every proved swap is recorded (:func:`recording`, opened around a process's shards by :mod:`runtime.fanout`):
   the manifest's runtime lists each (``engine_probe``) and the stage's metric ``engine_probe_gap`` is the largest
   gap, so a slow drift shows before it trips. The ``hf`` sampler needs no gate: it is the trainer's model.
7. No offset toward other weights (issue 42): in bf16 the tolerance sits above what one update at a realistic
   learning rate moves these log-probs (hundredths of a nat), so the previous weights, a stale adapter, a
   half-applied swap or the reference would pass it. So each gate also keeps the trainer's log-probs of the weights
   it serves (:meth:`storage.layout.RunLayout.engine_probe_weights_dir`, one file per weights and precision, the
   first writer wins), and measures the engine's offset toward every other weights a gate of the campaign served
   before (the previous policies, the reference): the component, along the line from the trainer's log-probs to
   theirs, of the engine's gap (:func:`offset_toward`), in root mean square nats. An engine serving the other
   weights is offset by their whole distance, one that applied half a swap by about half of it. A correct engine's
   offset is at most its noise (Cauchy-Schwarz), whatever direction its rounding takes, and the rounding can follow
   the trainer's: two forwards of the same weights that differ by rounding only (a zero LoRA adapter and none, in
   bf16) can put a correct engine halfway between them. So the bound is taken from the noise, measured once: the
   campaign's noise floor, the root mean square of the engine's gap at the campaign's first proved swap (kept beside
   the weights' files). An offset beyond :data:`NOISE_MARGIN` floors is refused. The engine is refused only where
   it is off toward other weights by more than a correct engine with that much noise can be; weights closer than
   that to the stage's cannot be told apart, and pass. The rule is the same in every precision; in fp32 the
   tolerance decides first and the floor is a millionth of a nat.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rlhf_core.errors import UserError
from runtime.engine_client import ProbeBatch, ServedPolicy, engine_generate
from storage.files import publish_file, temporary_sibling

if TYPE_CHECKING:  # transformers only where a gate is made: runtime.fanout imports this module
    from rlhf_core.config import SamplingConfig
    from rlhf_core.loading import ModelLoader

PROBE_SIZES: dict[str, tuple[int, int]] = {"fp32": (4, 16), "bf16": (16, 32), "fp16": (16, 32)}
"""Prompts in the probe batch and the longest response of each, in tokens, per precision (choice 1). In fp32 the
tolerance decides and the engine's noise is a millionth of a nat. In bf16 the relative rule (choice 7) compares the
engine's noise at each swap with the campaign's floor, both root mean squares of the gap: over up to 512 tokens they
are steady (on SmolLM2 the largest token's gap is five times the mean, bench/RESULTS.md), so the margin of twice
the floor is not eaten by the draw of a few tokens."""
TOLERANCES: dict[str, float] = {"fp32": 1e-4, "bf16": 0.5, "fp16": 0.5}
"""The largest gap (nats) a swap may show, per precision (choice 3)."""
PROBE_RECORDS = "engine_probe"
"""Where a stage's manifest runtime lists its proved swaps."""
GAP_METRIC = "engine_probe_gap"
"""The stage metric: the largest gap of its swaps."""
NOISE_MARGIN = 1.5
"""How many noise floors the engine's offset toward other weights may be (choice 7): a correct engine's offset is at
most its noise, allowed to grow to 1.5 times the campaign's first swap's. Measured on a bf16 engine (the tiny Llama
at configs/tiny.yaml's learning rate, bench/RESULTS.md): correct swaps' noise 1.0-1.2 floors and their offsets
-0.09 to 0.12 floors; a stale tied output layer 1.9-2.3, half a swap 17.5-19.5, the previous weights 36.9-40."""


class EngineProbeError(UserError, RuntimeError):
    """The generation engine's log-probs of the probe batch are not the trainer's: it samples other weights."""


@dataclass(frozen=True)
class Probe:
    """The probe batch: prompts and a response for each, as token ids (choice 1)."""

    prompts: tuple[tuple[int, ...], ...]
    responses: tuple[tuple[int, ...], ...]

    def batch(self) -> ProbeBatch:
        """The sequences (prompt then response) and prompt lengths the engine scores."""
        sequences = [
            list(prompt) + list(response) for prompt, response in zip(self.prompts, self.responses, strict=True)
        ]
        return ProbeBatch(sequences=sequences, prompt_lengths=[len(prompt) for prompt in self.prompts])

    def to_json(self) -> str:
        return json.dumps({"prompts": self.prompts, "responses": self.responses}) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Probe:
        raw = json.loads(text)
        return cls(
            prompts=tuple(tuple(ids) for ids in raw["prompts"]),
            responses=tuple(tuple(ids) for ids in raw["responses"]),
        )


def keep_first(path: Path, text: str) -> str:
    """The text of the file ``path``, written as ``text`` where there is none yet (the first writer wins: two
    processes that race both read the one stored)."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = temporary_sibling(path)
        temporary.write_text(text)
        with contextlib.suppress(FileExistsError):
            publish_file(temporary, path)
    return path.read_text()


def campaign_probe(path: Path, make: Callable[[], Probe]) -> Probe:
    """The campaign's probe from ``path``, made with ``make`` and stored there when it is not yet (the first
    writer wins: two processes that race both end up using the one stored)."""
    return Probe.from_json(path.read_text() if path.is_file() else keep_first(path, make().to_json()))


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module, probe: Probe) -> list[list[float]]:
    """The model's log-prob of every response token of the probe: temperature 1, the whole vocabulary, one row at a
    time (choice 2); the caller holds the stage's autocast.

    Shapes:
        each row: (len(response),) floats.
    """
    from rlhf_core.sequences import sequence_logprobs

    device = next(model.parameters()).device
    rows = []
    for sequence, length in zip(*probe.batch(), strict=True):
        ids = torch.tensor([sequence], device=device)  # (1, T)
        logprobs = sequence_logprobs(model, ids, torch.ones_like(ids), length, temperature=1.0)  # (1, R)
        rows.append(logprobs[0].float().cpu().tolist())
    return rows


def probe_gap(engine: list[list[float]], trainer: list[list[float]]) -> float:
    """The largest ``|engine - trainer|`` over every token (choice 3); infinite when the rows do not line up.

    Naive equivalent: ``max(abs(e - t) for row_e, row_t in zip(engine, trainer) for e, t in zip(row_e, row_t))``.
    """
    if [len(row) for row in engine] != [len(row) for row in trainer]:
        return float("inf")
    pairs = zip(engine, trainer, strict=True)
    differences = [abs(e - t) for row_e, row_t in pairs for e, t in zip(row_e, row_t, strict=True)]
    return float("inf") if any(d != d for d in differences) else max(differences, default=0.0)  # NaN fails


def rms_difference(a: list[list[float]], b: list[list[float]]) -> float:
    """The root mean square of ``a - b`` over every token of the probe (0 for none); the rows must line up."""
    values = torch.tensor([x - y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)])
    return float(values.double().square().mean().sqrt()) if values.numel() else 0.0


def offset_toward(engine: list[list[float]], own: list[list[float]], other: list[list[float]]) -> tuple[float, float]:
    """How far the engine's log-probs of the probe are offset from the trainer's of the stage's own weights toward
    those of ``other`` weights (choice 7): the position on the line from own (0) to other (1), and the offset as a
    root mean square over the probe's tokens.

    With the rows flattened into vectors e, c (own) and o (other) of N tokens, d = o - c and r = e - c: the position
    is (r . d) / |d|^2, and the offset the projection of r onto d, (r . d) / (|d| sqrt(N)), which by Cauchy-Schwarz is
    at most the root mean square of r. Identical log-probs (d = 0) give 0 and 0.

    Naive equivalent: ``position * sqrt(mean((o - c) ** 2))``, the position ``sum((e - c) * (o - c)) / sum((o - c) ** 2)``.
    """
    e, c, o = (
        torch.tensor([value for row in rows for value in row], dtype=torch.float64) for rows in (engine, own, other)
    )
    d = o - c
    length2 = float(d @ d)
    if length2 == 0.0:
        return 0.0, 0.0
    projection = float((e - c) @ d)
    return projection / length2, projection / (length2 * len(d)) ** 0.5


@dataclass(frozen=True)
class OtherWeights:
    """Weights a gate of the campaign served before, and the trainer's log-probs of the probe under them."""

    weights: str
    adapter: str | None
    logprobs: list[list[float]]

    def name(self) -> str:
        return weights_name(self.weights, self.adapter)


def weights_name(weights: str, adapter: str | None) -> str:
    """Served weights as a refusal names them: the folder, and the adapter over it if any."""
    return weights + ("" if adapter is None else f" with the adapter {adapter}")


def weights_file(directory: Path, policy: ServedPolicy, precision: str) -> Path:
    """Where the trainer's log-probs of the probe under ``policy``'s weights in ``precision`` are kept."""
    identity = json.dumps([policy.weights, policy.adapter, precision])
    return directory / f"weights-{hashlib.sha256(identity.encode()).hexdigest()[:32]}.json"


def keep_and_read_others(
    directory: Path, policy: ServedPolicy, precision: str, logprobs: list[list[float]]
) -> tuple[OtherWeights, ...]:
    """Keep the trainer's ``logprobs`` of ``policy`` (the first writer wins) and read those of every other weights
    kept in ``precision`` (choice 7), in name order; a file of a probe that does not line up is passed over."""
    own = weights_file(directory, policy, precision)
    keep_first(own, json.dumps({**asdict(policy), "precision": precision, "logprobs": logprobs}) + "\n")
    others = []
    for path in sorted(directory.glob("weights-*.json")):
        kept = json.loads(path.read_text())
        same_shape = [len(row) for row in kept["logprobs"]] == [len(row) for row in logprobs]
        if path != own and kept["precision"] == precision and same_shape:
            others.append(OtherWeights(kept["weights"], kept["adapter"], kept["logprobs"]))
    return tuple(others)


def noise_floor_file(directory: Path, precision: str) -> Path:
    """Where the campaign's noise floor in ``precision`` is kept (choice 7)."""
    return directory / f"noise-floor-{precision}.json"


def in_floors(nats: float, floor: float) -> float:
    """``nats`` in noise floors (infinite over a floor of 0, unless it is 0 too)."""
    if nats == 0.0:
        return 0.0
    return float("inf") if floor == 0.0 else nats / floor


_records: contextvars.ContextVar[list[dict] | None] = contextvars.ContextVar("engine_probe_records", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list[dict]]:
    """Collect the records of every swap proved in the block (choice 6), in order."""
    records: list[dict] = []
    token = _records.set(records)
    try:
        yield records
    finally:
        _records.reset(token)


def record_metrics(records: list[dict]) -> dict[str, float]:
    """The stage metric of its proved swaps: ``engine_probe_gap``, the largest gap; none without a swap."""
    return {GAP_METRIC: max(record["gap"] for record in records)} if records else {}


@contextlib.contextmanager
def probe_failures_named(stage: str) -> Iterator[None]:
    """Name the stage in a failed gate's line (the gate itself runs in a shard, which does not know it)."""
    try:
        yield
    except EngineProbeError as error:
        raise EngineProbeError(f"{stage}, {error}") from None


@dataclass
class GatedPolicy:
    """A policy the engine serves, sampled only from swaps the probe proved (an
    :class:`rlhf_core.generation.ExternalSampler`).

    Args:
        policy: the weights (and adapter) the engine serves.
        probe: the campaign's probe batch.
        expected: the trainer's log-probs of the probe (:func:`trainer_logprobs` of the same weights).
        tolerance: the largest gap allowed (:data:`TOLERANCES` of the stage's precision).
        iteration: the stage's iteration, for the failure's line.
        trainer_seconds: what the trainer's side of the probe took (recorded with the first swap).
        others: every other weights the campaign's gates served, which the engine must not be on the way to
            (choice 7).
        floor: where the campaign's noise floor is kept (the first proved swap's noise), or None: then this gate's.
    """

    policy: ServedPolicy
    probe: Probe
    expected: list[list[float]]
    tolerance: float
    iteration: int
    trainer_seconds: float = 0.0
    others: tuple[OtherWeights, ...] = ()
    floor: Path | None = None
    verified: str | None = field(default=None, init=False)

    def sample(
        self, prompts: list[list[int]], seeds: list[int], *, config: SamplingConfig, eos_token_id: int | None
    ) -> tuple[list[list[int]], list[list[float]]]:
        """One response per prompt from the engine, after proving any swap it made for them.

        Raises:
            EngineProbeError: the engine's log-probs of the probe are beyond the tolerance from the trainer's, or it
                answered from a state not proved without scoring the probe.
            runtime.engine_client.EngineError: the engine is gone or failed the request.
        """
        batch = self.probe.batch()
        answer = engine_generate(
            self.policy, prompts, seeds, config=config, eos_token_id=eos_token_id, probe=batch, verified=self.verified
        )
        if answer.probe_logprobs is not None:
            self.check(answer.probe_logprobs, state=answer.state, seconds=answer.probe_seconds)
        elif answer.state != self.verified:
            raise EngineProbeError(
                f"iteration {self.iteration}: the generation engine answered from a state it was not proved in "
                f"({answer.state}; proved: {self.verified}) without scoring the probe batch: an engine that does not "
                "prove its swaps is not sampled from"
            )
        return answer.tokens, answer.logprobs

    def check(self, engine: list[list[float]], *, state: str, seconds: float) -> None:
        """Compare the engine's log-probs of the probe with the trainer's; record the swap, or refuse it."""
        gap = probe_gap(engine, self.expected)
        weights = weights_name(self.policy.weights, self.policy.adapter)
        record = {
            "weights": self.policy.weights,
            "adapter": self.policy.adapter,
            "engine_state": state,
            "gap": gap,
            "tolerance": self.tolerance,
            "engine_seconds": seconds,
            "trainer_seconds": self.trainer_seconds,
        }
        records = _records.get()
        if records is not None:
            records.append(record)
        refused = (
            f"iteration {self.iteration}: the generation engine does not sample the trainer's weights ({weights}): "
        )
        if not gap <= self.tolerance:
            raise EngineProbeError(
                f"{refused}its log-probs of the probe batch are {gap:.3g} from the trainer's forward "
                f"(tolerance {self.tolerance:g})"
            )
        noise = rms_difference(engine, self.expected)
        floor = noise if self.floor is None else json.loads(keep_first(self.floor, json.dumps(noise) + "\n"))
        offsets = [(other, *offset_toward(engine, self.expected, other.logprobs)) for other in self.others]
        record.update(noise=noise, noise_floor=floor, others=[
            {"weights": other.name(), "position": position, "offset_floors": in_floors(offset, floor)}
            for other, position, offset in offsets
        ])  # fmt: skip
        for other, position, offset in offsets:
            if in_floors(offset, floor) > NOISE_MARGIN:
                raise EngineProbeError(
                    f"{refused}its log-probs of the probe batch lie {position:.2f} of the way from the trainer's to "
                    f"those of {other.name()}, offset toward them by {in_floors(offset, floor):.3g} noise floors (at "
                    f"most {NOISE_MARGIN:g}; gap {gap:.3g}, tolerance {self.tolerance:g})"
                )
        self.verified, self.trainer_seconds = state, 0.0


def gated_policy(
    policy: ServedPolicy,
    model: torch.nn.Module,
    probe: Probe,
    *,
    models: ModelLoader,
    iteration: int,
    served: Path | None = None,
) -> GatedPolicy:
    """``policy`` behind the probe gate, its expected log-probs from ``model`` (the same weights in the trainer, run
    under the stage's autocast; the tolerance is that of the stage's precision), kept in ``served`` (the campaign's
    :meth:`storage.layout.RunLayout.engine_probe_weights_dir`) beside those of every other weights it served, which the
    engine must be farther from (choice 7; none without ``served``)."""
    start = time.perf_counter()
    with models.autocast():
        expected = trainer_logprobs(model, probe)
    others = () if served is None else keep_and_read_others(served, policy, models.precision, expected)
    floor = None if served is None else noise_floor_file(served, models.precision)
    return GatedPolicy(
        policy=policy,
        probe=probe,
        expected=expected,
        tolerance=TOLERANCES[models.precision],
        iteration=iteration,
        trainer_seconds=time.perf_counter() - start,
        others=others,
        floor=floor,
    )
