"""Peak fp32 matmul throughput on one thread, measured here, and generation against it.

``.venv/bin/python -m bench.roofline --threads 1 --out peak.json``

Roofline for decoding: ``2 x N x tokens`` FLOPs, where N counts the weights every generated
token is multiplied by (all parameters except the position table; GPT-2 ties the LM head to the
token embedding, which therefore counts once, as the head). Attention over the KV cache adds
``4 x layers x context x H`` per token, under 10% here, and is left out, as the formula says.

Peak is the best of several timed repeats of ``a @ b`` for: the decode-step matmuls of each size
(B rows), a training-sized one (B x T rows), and a large square one (the machine's peak).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.common import SIZES, set_threads


def matmul_gflops(m: int, k: int, n: int, *, seconds: float = 0.3, repeats: int = 5) -> float:
    """Best GFLOP/s of ``(m, k) @ (k, n)`` in fp32 over ``repeats`` timed loops of about ``seconds``."""
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    out = torch.empty(m, n)
    for _ in range(3):
        torch.matmul(a, b, out=out)
    start = time.perf_counter()
    torch.matmul(a, b, out=out)
    once = max(time.perf_counter() - start, 1e-7)
    loops = max(1, int(seconds / once))
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(loops):
            torch.matmul(a, b, out=out)
        best = max(best, 2 * m * k * n * loops / (time.perf_counter() - start) / 1e9)
    return best


def shapes() -> dict[str, tuple[int, int, int]]:
    table = {}
    for size in SIZES.values():
        B, H, V = size.rollout_batch, size.n_embd, size.vocab_size
        table[f"{size.name} decode MLP ({B}x{H} @ {H}x{4 * H})"] = (B, H, 4 * H)
        table[f"{size.name} decode LM head ({B}x{H} @ {H}x{V})"] = (B, H, V)
        T = B * (size.response_length + 8)
        table[f"{size.name} training MLP ({T}x{H} @ {H}x{4 * H})"] = (T, H, 4 * H)
    table["large (2048x2048 @ 2048x2048)"] = (2048, 2048, 2048)
    return table


def decode_parameters(model) -> int:
    """Weights each generated token is multiplied by: all but the position-embedding table."""
    positions = model.get_position_embeddings() if hasattr(model, "get_position_embeddings") else None
    skip = positions.weight.numel() if positions is not None else 0
    return sum(p.numel() for p in model.parameters()) - skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    set_threads(args.threads)
    result = {name: matmul_gflops(*shape) for name, shape in shapes().items()}
    args.out.write_text(json.dumps({"gflops": result}, indent=2))


if __name__ == "__main__":
    main()
