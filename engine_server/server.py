"""The generation engine server: one vLLM engine, kept alive, serving whatever weights each request names.

Run by the ``rlhf`` command from the engine's own environment (``bash scripts/setup-vllm.sh`` makes
``.venv-vllm``; :mod:`runtime.engine` starts and stops this process), or by a user who runs one for
several commands::

    .venv-vllm/bin/python engine_server/server.py --model POLICY_DIR --port 8100
    rlhf run --set sampling.engine=vllm --set execution.engine_url=http://127.0.0.1:8100

It imports only the standard library and vLLM (the project's own packages are not installed in that
environment), and speaks JSON over HTTP (:mod:`runtime.engine_client` is its one client):

* ``GET /health`` -> ``{"state": "loading" | "ready" | "failed", "error", "vllm", "device", "model", "dtype",
  "lora_mode", "eager", "tensor_parallel_size", "max_num_batched_tokens", "max_num_seqs"}`` (from ``dtype`` on: how
  it samples, which the stages' keys name, :data:`runtime.engine.ENGINE_SETTINGS`);
* ``POST /generate`` with ``{"weights", "adapter", "prompts", "seeds", "temperature", "top_k", "top_p",
  "max_tokens", "stop_token_id", "probe", "verified"}`` -> ``{"tokens", "logprobs", "swap_seconds", "state",
  "probe"}``; ``probe`` (optional) is ``{"sequences", "prompt_lengths"}``, answered with ``{"logprobs", "seconds"}``
  when the engine's ``state`` is not the ``verified`` one (choice 8), else null;
* ``POST /score`` with ``{"weights", "adapter", "sequences", "prompt_lengths"}`` -> ``{"logprobs", "swap_seconds",
  "state", "seconds"}``: the log-prob of every token of each sequence after its prompt (temperature 1, the whole
  vocabulary).

Choices:
1. The engine is built once, from the initial policy. A request names the weights it must be sampled
   from: a full model folder is swapped in place (``collective_rpc("reload_weights", weights_path=...)``,
   layerwise, no rebuild) when it is not the one loaded; a LoRA adapter folder goes with the request as a
   ``LoRARequest`` over the loaded base (``--lora-mode request``), or is merged into a copy of the base weights
   that is then swapped in like a full folder (``--lora-mode merge``: vLLM's LoRA kernels on CPU halved SmolLM2's
   tokens/s, a merge and a swap cost about a second a stage). A merge sums in fp32 and needs an fp32 engine
   (:func:`merged_lora_weights`). Folders are told apart by their files' sizes, times
   and inodes, so a folder rewritten at the same path is loaded again.
2. Reproducible tokens: every request has its own seed; prefix caching is off (a cached prefix is computed
   in other batches than a fresh one); the engine core runs in this process
   (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the launcher); requests are served one at a time.
3. Sampling means what it means for the project's own sampler: EOS is the tokenizer's, given per request
   (``ignore_eos`` plus ``stop_token_ids``, so no generation config adds stop tokens); temperature, top-k,
   top-p and ``max_tokens`` as given; one sample per request (no ``n > 1``). The log-prob of each sampled
   token is vLLM's processed one (after temperature).
4. A batch's prompts are sent to the engine in chunks whose prompt tokens fill at most half of a step's
   token budget (``max_num_batched_tokens``): no prompt's prefill is split over steps, which the CPU build
   cannot do for seeded requests ("CPU Generator does not use offset").
6. After a swap, a tied output layer is tied to the new input embeddings again (:func:`retie_output_embeddings`):
   vLLM 0.32 reloads the embeddings only, and sampled from a mix of old and new weights (measured on CPU, tied
   Llama and GPT-2). A model whose weights still do not survive a reload of its own folder is refused at start.
7. The HTTP socket is bound before the engine is built: a taken port ends the process at once (exit code 3)
   and the launcher can report the engine's progress and its failure (``state: failed``).
8. Every swap can be proved (:mod:`runtime.engine_probe` on the client's side): the engine reports its ``state``,
   which changes with every swap begun and with the adapter a request goes with, and names this engine process (a
   nonce: a restarted engine never repeats a state a client proved); a request may carry a probe batch
   and the state its client last verified, and when the state differs the probe is scored in the same request,
   under the same lock, right after the swap and before the request's own prompts. So every sampled token comes
   from a state that was scored, whoever else uses the engine. The identity of the loaded weights is cleared
   before a swap begins and set only once it succeeded. A client refuses an answer from a state it did not prove
   that carries no probe scores.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder (flows/) comes first on the path, and its modules would shadow the standard
# library's (flows/inspection.py is not `inspect`): the server imports nothing of the project.
if sys.path and os.path.realpath(sys.path[0]) == os.path.dirname(os.path.realpath(__file__)):
    del sys.path[0]

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import uuid  # noqa: E402
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # noqa: E402

ADDRESS_IN_USE = 3
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The adapter ranks vLLM accepts as ``max_lora_rank``."""


def folder_identity(folder: str) -> tuple:
    """The folder's real path and its weight files' names, sizes, modification times and inodes."""
    path = os.path.realpath(folder)
    files = []
    for name in sorted(os.listdir(path)):
        if name.endswith((".safetensors", ".bin", ".json")):
            status = os.stat(os.path.join(path, name))
            files.append((name, status.st_size, status.st_mtime_ns, status.st_ino))
    return (path, tuple(files))


LORA_PAIR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<half>[AB])\.weight$")
"""The adapter tensors a merge consumes: each module's ``lora_A.weight`` (r, in) and ``lora_B.weight`` (out, r)."""


def merged_lora_weights(base: dict, adapter: dict, config: dict, *, dtype) -> dict:
    """``base``'s tensors with a peft LoRA adapter's updates added: ``W + s * B @ A`` for each adapted module
    (Hu et al. 2021), ``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA), transposed for a
    ``fan_in_fan_out`` layer (GPT-2's Conv1D stores ``W`` as (in, out)).

    The sum is taken in fp32 and the merged weight written in ``dtype``, the dtype the engine runs: a LoRA update is
    far below half a bf16 ulp of its weight (B ~ 1e-4 against |W| ~ 0.05), so a sum taken in a bf16 checkpoint's own
    dtype (peft's ``merge_and_unload`` into a bf16 layer) drops most of it, while the trainer computes
    ``W.float() + s * B @ A``. An fp32 engine on a bf16 base therefore gets the trainer's exact fp32 sum; an engine
    in bf16 or fp16 cannot hold it, and is never asked to merge (``runtime.engine.engine_lora_mode``).

    Args:
        base: the base model's tensors by name (``model.layers.0.self_attn.q_proj.weight``).
        adapter: the adapter's tensors as peft saves them (``base_model.model.<module>.lora_A.weight``: (r, in);
            ``lora_B``: (out, r)).
        config: the adapter's ``adapter_config.json``.
        dtype: the torch dtype of the merged weights (the others keep their own: the engine casts them exactly).

    Raises:
        ValueError: an adapter this merge does not cover (DoRA, per-module ranks or alphas, extra saved modules),
            a tensor it would not consume (LoRA on embeddings, ``lora_embedding_A``/``B``; LoRA bias tensors), named,
            or a module the base does not have.
    """
    import math

    unsupported = [
        name for name in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save") if config.get(name)
    ]
    if unsupported:
        raise ValueError(f"the adapter sets {', '.join(unsupported)}, which a merge does not cover")
    pairs: dict[str, dict[str, object]] = {}
    for key, tensor in adapter.items():
        match = LORA_PAIR.match(key)
        if match is None:
            raise ValueError(f"the adapter holds {key}, which a merge does not consume: serve it as a LoRA request")
        pairs.setdefault(match["module"], {})[match["half"]] = tensor
    rank, alpha = config["r"], config["lora_alpha"]
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    merged = dict(base)
    for module, halves in pairs.items():
        name = f"{module}.weight"
        if name not in merged:
            raise ValueError(f"the adapter's module {module} is not a weight of the base model")
        if set(halves) != {"A", "B"}:
            raise ValueError(f"the adapter holds only lora_{next(iter(halves))} of {module}")
        delta = (halves["B"].float() @ halves["A"].float()) * scale  # (out, in), fp32
        merged[name] = (merged[name].float() + (delta.T if config.get("fan_in_fan_out") else delta)).to(dtype)
    return merged


def read_tensors(folder: str) -> dict:
    """Every tensor of the ``*.safetensors`` files of ``folder``, by name."""
    from pathlib import Path

    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def one_line(error: BaseException) -> str:
    """The error's last non-empty line (vLLM's own messages come last), with its type."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}".strip()


class Engine:
    """The vLLM engine and what it serves now."""

    def __init__(self, arguments: argparse.Namespace) -> None:
        import vllm
        from vllm import LLM

        rank = arguments.max_lora_rank
        options = {
            "model": arguments.model,
            "dtype": arguments.dtype,
            "seed": 0,
            "enforce_eager": arguments.enforce_eager,
            "enable_prefix_caching": False,
            "max_num_batched_tokens": arguments.max_num_batched_tokens,
            "max_num_seqs": arguments.max_num_seqs,
            "logprobs_mode": "processed_logprobs",
            "skip_tokenizer_init": True,
            "generation_config": "vllm",
        }
        if arguments.max_model_len:
            options["max_model_len"] = arguments.max_model_len
        if rank:
            options.update(enable_lora=True, max_loras=1, max_lora_rank=min(r for r in LORA_RANKS if r >= rank))
        if arguments.gpu_memory_utilization:
            options["gpu_memory_utilization"] = arguments.gpu_memory_utilization
        if arguments.tensor_parallel_size > 1:
            options["tensor_parallel_size"] = arguments.tensor_parallel_size
        self.llm = LLM(**options)
        self.version = vllm.__version__
        self.weights = folder_identity(arguments.model)
        self.adapters: dict[tuple, int] = {}
        self.lora_mode = arguments.lora_mode
        self.lora_layers = bool(rank)
        self.dtype = arguments.dtype
        self.swaps = 0
        """Weight swaps begun so far: with the adapter a request names, what :meth:`state` reports."""
        self.nonce = uuid.uuid4().hex[:12]
        """This engine process's own, part of every state it reports."""
        self.token_budget = arguments.max_num_batched_tokens // 2
        self.max_sequences = arguments.max_num_seqs
        self.check_reload(arguments.model)

    def check_reload(self, folder: str) -> None:
        """Refuse a model whose weights this build cannot swap in place (choice 6): reloading its own folder must
        leave a few sampled tokens and their log-probs as they were."""
        request = {"weights": folder, "prompts": [[0, 1]], "seeds": [0], "temperature": 1.0, "top_k": 0, "top_p": 1.0}
        request.update(max_tokens=4, stop_token_id=None)
        before = self.generate(request)
        identity = self.weights
        self.reload(identity[0])
        self.weights = identity
        after = self.generate(request)
        drift = max(abs(a - b) for a, b in zip(before["logprobs"][0], after["logprobs"][0], strict=False))
        if before["tokens"] != after["tokens"] or drift > 1e-4:
            architecture = self.llm.llm_engine.model_config.architecture
            raise RuntimeError(
                f"this vLLM build ({self.version}) cannot swap {architecture} weights in place (reloading the same "
                f"weights moved log-probs by {drift:.3g}), so it cannot follow training; use a Llama-family model"
            )

    def serve(self, weights: str) -> float:
        """Make the engine hold the full weights of the folder ``weights``; returns the seconds the swap took."""
        identity = folder_identity(weights)
        if identity == self.weights:
            return 0.0
        start = time.perf_counter()
        self.reload(identity[0])
        self.weights = identity
        return time.perf_counter() - start

    def reload(self, folder: str) -> None:
        """Load the weights of ``folder`` in place, layer by layer, and tie the output layer to the input
        embeddings again where the model ties them (choice 6). The engine names no weights until the swap has
        succeeded (choice 8): one that fails midway leaves a mix of two folders, which no request may take for
        either."""
        self.weights = None
        self.swaps += 1
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": folder})
        self.llm.collective_rpc(retie_output_embeddings)

    def serve_merged(self, weights: str, adapter: str) -> float:
        """Make the engine hold the full weights of the folder ``weights`` with the LoRA ``adapter`` merged in
        (choice 1, ``--lora-mode merge``), in the engine's dtype; returns the seconds the merge and the swap took. The
        merged weights are written to a folder (in shared memory where there is some) that is removed once the engine
        has read it."""
        from pathlib import Path

        import torch
        from safetensors.torch import save_file

        identity = ("merged", folder_identity(weights), folder_identity(adapter))
        if identity == self.weights:
            return 0.0
        start = time.perf_counter()
        config = json.loads((Path(adapter) / "adapter_config.json").read_text())
        merged = merged_lora_weights(
            read_tensors(weights), read_tensors(adapter), config, dtype=getattr(torch, self.dtype)
        )
        shared = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        with tempfile.TemporaryDirectory(prefix="rlhf-engine-merged-", dir=shared) as folder:
            save_file({name: tensor.contiguous() for name, tensor in merged.items()}, f"{folder}/model.safetensors")
            shutil.copy(Path(weights) / "config.json", folder)
            self.reload(folder)
        self.weights = identity
        return time.perf_counter() - start

    def adapter(self, folder: str | None):
        """The ``LoRARequest`` of the adapter folder, or None; a new folder gets a new id."""
        if folder is None:
            return None
        from vllm.lora.request import LoRARequest

        identity = folder_identity(folder)
        number = self.adapters.setdefault(identity, len(self.adapters) + 1)
        return LoRARequest(lora_name=f"adapter-{number}", lora_int_id=number, lora_path=identity[0])

    def hold(self, request: dict):
        """Make the engine hold the weights ``request`` names (a swap when they are not the ones loaded); returns the
        seconds the swap took and the ``LoRARequest`` to send with its prompts (None but in ``request`` mode)."""
        weights, adapter = request["weights"], request.get("adapter")
        if adapter is not None and self.lora_mode == "merge":
            return self.serve_merged(weights, adapter), None
        return self.serve(weights), self.adapter(adapter)

    def state(self, lora) -> str:
        """What the engine holds for a request, as a name that changes with every swap (choice 8): this engine
        process's nonce (a restarted engine counts its swaps from 0 again, and must not repeat a name a client proved),
        the swaps begun so far, and the LoRA adapter the request goes with."""
        held = f"{self.nonce}:{self.swaps}"
        return held if lora is None else f"{held}:{lora.lora_int_id}"

    def score(self, sequences: list[list[int]], prompt_lengths: list[int], lora) -> list[list[float]]:
        """The log-prob of each token after its prompt, ``log softmax(logits)`` over the whole vocabulary
        (temperature 1, no top-k or top-p: vLLM's prompt log-probs), of each sequence under the weights held now."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if len(sequences) != len(prompt_lengths):
            raise ValueError(f"{len(sequences)} sequences but {len(prompt_lengths)} prompt lengths")
        params = SamplingParams(n=1, temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        # With LoRA layers (--max-lora-rank) vLLM 0.32's output layer gives a prompt's tokens the adapter indices of
        # the step's requests, one per request and not per token ("einsum(): subscript b has size 4 ... size 20" on
        # CPU), with or without an adapter; one request per step makes its one index every token's, which is right.
        one_by_one = ((row, row + 1) for row in range(len(sequences)))
        chunks = one_by_one if self.lora_layers else self._chunks(sequences)
        logprobs = []
        for start, stop_at in chunks:
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=ids) for ids in sequences[start:stop_at]],
                sampling_params=params,
                lora_request=lora,
                use_tqdm=False,
            )
            for output, ids, length in zip(
                outputs, sequences[start:stop_at], prompt_lengths[start:stop_at], strict=True
            ):
                steps = output.prompt_logprobs  # one per prompt token, None for the first
                logprobs.append([steps[index][ids[index]].logprob for index in range(length, len(ids))])
        return logprobs

    def probe(self, request: dict, lora) -> dict | None:
        """The probe's log-probs (:meth:`score`) when ``request`` carries a probe and the engine's state is not the
        one the client last verified (choice 8), else None."""
        probe = request.get("probe")
        state = self.state(lora)
        if probe is None or request.get("verified") == state:
            return None
        start = time.perf_counter()
        logprobs = self.score(probe["sequences"], probe["prompt_lengths"], lora)
        return {"logprobs": logprobs, "seconds": time.perf_counter() - start}

    def generate(self, request: dict) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        swap, lora = self.hold(request)
        probe = self.probe(request, lora)
        prompts, seeds = request["prompts"], request["seeds"]
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        stop = request.get("stop_token_id")

        def params(seed: int) -> SamplingParams:
            return SamplingParams(
                n=1,
                seed=seed,
                temperature=request["temperature"],
                top_k=request["top_k"],
                top_p=request["top_p"],
                max_tokens=request["max_tokens"],
                ignore_eos=True,
                stop_token_ids=[] if stop is None else [stop],
                logprobs=0,
                detokenize=False,
            )

        tokens, logprobs = [], []
        for start, stop_at in self._chunks(prompts):
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=ids) for ids in prompts[start:stop_at]],
                sampling_params=[params(seed) for seed in seeds[start:stop_at]],
                lora_request=lora,
                use_tqdm=False,
            )
            for output in outputs:
                sample = output.outputs[0]
                tokens.append(list(sample.token_ids))
                logprobs.append(
                    [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids, strict=True)]
                )
        return {"tokens": tokens, "logprobs": logprobs, "swap_seconds": swap, "state": self.state(lora), "probe": probe}

    def score_request(self, request: dict) -> dict:
        """``POST /score``: the log-probs of given sequences under the weights ``request`` names (:meth:`score`)."""
        swap, lora = self.hold(request)
        start = time.perf_counter()
        logprobs = self.score(request["sequences"], request["prompt_lengths"], lora)
        seconds = time.perf_counter() - start
        return {"logprobs": logprobs, "swap_seconds": swap, "state": self.state(lora), "seconds": seconds}

    def _chunks(self, prompts: list[list[int]]):
        """``[start, stop)`` ranges of ``prompts`` whose prompt tokens fit half a step's budget (choice 4)."""
        start, used = 0, 0
        for index, ids in enumerate(prompts):
            if index > start and (used + len(ids) > self.token_budget or index - start >= self.max_sequences):
                yield start, index
                start, used = index, 0
            used += len(ids)
        if start < len(prompts):
            yield start, len(prompts)


def retie_output_embeddings(worker) -> bool:
    """Point a tied output layer at the reloaded input embeddings and prepare it again (run in the worker).

    ``reload_weights`` loads a tied output layer's weight from its one parent, the input embeddings, and leaves
    the output layer with the old tensor, and on CPU with its old packed copy: the engine then samples from the
    new body and the old output layer (measured: log-probs 0.5 away from both checkpoints' on a tied Llama).
    """
    model = getattr(worker, "model_runner", worker).get_model()
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    body = getattr(model, "model", None) or getattr(model, "transformer", None)
    embeddings = getattr(body, "embed_tokens", None) or getattr(body, "wte", None)
    if not getattr(config, "tie_word_embeddings", False) or head is None or embeddings is None:
        return False
    head.weight = embeddings.weight
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)
    return True


class State:
    engine: Engine | None = None
    error: str | None = None
    lock = threading.Lock()
    model = ""
    arguments: argparse.Namespace


def handler(state: State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args) -> None:  # noqa: A002  # the base class's name
            pass

        def _answer(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path != "/health":
                self._answer(404, {"error": f"no route {self.path}"})
                return
            engine = state.engine
            status = "failed" if state.error else ("ready" if engine else "loading")
            self._answer(
                200,
                {
                    "state": status,
                    "error": state.error,
                    "model": state.model,
                    "vllm": engine.version if engine else None,
                    "device": _device(),
                    "dtype": state.arguments.dtype,
                    "lora_mode": state.arguments.lora_mode,
                    "eager": state.arguments.enforce_eager,
                    "tensor_parallel_size": state.arguments.tensor_parallel_size,
                    "max_num_batched_tokens": state.arguments.max_num_batched_tokens,
                    "max_num_seqs": state.arguments.max_num_seqs,
                    "pid": os.getpid(),
                },
            )

        def do_POST(self) -> None:
            routes = {"/generate": "generate", "/score": "score_request"}
            if self.path not in routes:
                self._answer(404, {"error": f"no route {self.path}"})
                return
            if state.engine is None:
                self._answer(503, {"error": state.error or "the engine is still loading"})
                return
            try:
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with state.lock:
                    answer = getattr(state.engine, routes[self.path])(request)
            except Exception as error:  # the client reports it; the engine stays up for the next request
                traceback.print_exc()
                self._answer(500, {"error": one_line(error)})
                return
            self._answer(200, answer)

    return Handler


def _device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "unknown"


def say(line: str) -> None:
    """One line to the server's log (its standard error, as vLLM's own)."""
    sys.stderr.write(f"rlhf-engine: {line}\n")
    sys.stderr.flush()


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="The rlhf pipeline's generation engine server (vLLM).")
    parser.add_argument("--model", required=True, help="the initial policy: a Hugging Face folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-model-len", type=int, default=0, help="0: the model's own")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-lora-rank", type=int, default=0, help="0: no LoRA adapters")
    parser.add_argument(
        "--lora-mode",
        default="request",
        choices=["request", "merge"],
        help="serve LoRA adapters as vLLM LoRA requests, or merged into the base weights (choice 1)",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.0, help="0: vLLM's default")
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile or CUDA graphs")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs one engine shards the model over")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    if arguments.lora_mode == "merge" and arguments.dtype != "float32":
        say(f"--lora-mode merge needs --dtype float32: a {arguments.dtype} weight cannot hold a LoRA update")
        return 2
    state = State()
    state.model, state.arguments = arguments.model, arguments
    try:
        server = ThreadingHTTPServer((arguments.host, arguments.port), handler(state))
    except OSError as error:
        say(f"cannot listen on {arguments.host}:{arguments.port}: {error}")
        return ADDRESS_IN_USE
    server.daemon_threads = True
    say(f"listening on http://{arguments.host}:{server.server_address[1]}")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        start = time.perf_counter()
        state.engine = Engine(arguments)
        say(f"ready in {time.perf_counter() - start:.1f} s")
    except Exception as error:
        traceback.print_exc()
        state.error = one_line(error)
    threading.Event().wait()  # serve until stopped (SIGTERM from the launcher, or the parent's death)
    return 0


if __name__ == "__main__":
    sys.exit(main())
