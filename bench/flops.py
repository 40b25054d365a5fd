"""Matrix-multiply FLOPs of one PPO iteration of the TRL comparison, per side, from the model's shape.

Counted (fp32 multiply-adds as 2 FLOPs; layer norms, activations, softmax and the optimizer left out,
each under 1% here): for a GPT-2 of L layers, width H, vocabulary V, a forward pass over N tokens of
sequences T long costs ``L * (24 H^2 N + 2 H T^2 B)`` in the body (the four weight matrices, and
causal attention's two products over half the T x T scores) plus ``2 H V`` per position the LM head
runs on. A backward pass costs twice its forward.

One iteration, B sequences of T = P + R columns (P: the left-padded prompt width):

* generation: per sampled token one decode step, ``2 (12 L H^2 + H V)`` plus attention over the
  cache, and one prefill of the prompts;
* rollout: the reference (body + head), the critic (body) and the reward model (body) over (B, T);
* update: per optimizer step, forward and backward of the actor (body + head) and the critic (body).

The sides differ only in where the LM head runs: ours on the R positions that score response tokens
(:func:`rlhf_core.sequences.response_logits`), TRL's ``PPOTrainer`` on all T columns (its reference
pass and its update both take ``model(...).logits`` of the whole sequence).
"""

from __future__ import annotations


def _body(size: dict, batch: int, columns: int) -> float:
    layers, width = size["n_layer"], size["n_embd"]
    return layers * (24 * width**2 * batch * columns + 2 * width * columns**2 * batch)


def iteration_gflops(size: dict, prompt_columns: float, side: str) -> dict[str, float]:
    """``{generation, rollout, update, iteration}`` GFLOP of one iteration of ``side`` (``ours`` or ``trl``)."""
    batch, response, width, vocab = size["rollout_batch"], size["response_length"], size["n_embd"], size["vocab_size"]
    layers, epochs = size["n_layer"], size["ppo_epochs"]
    columns = round(prompt_columns) + response
    head_positions = batch * (response if side == "ours" else columns)
    head = 2 * width * vocab * head_positions
    body = _body(size, batch, columns)
    decode = batch * response * 2 * (12 * layers * width**2 + width * vocab)
    attention = sum(4 * layers * width * (prompt_columns + t) * batch for t in range(response))
    generation = decode + attention + _body(size, batch, round(prompt_columns))
    rollout = generation + (body + head) + body + body
    update = epochs * (3 * (body + head) + 3 * body)
    return {
        "generation": generation / 1e9,
        "rollout": rollout / 1e9,
        "update": update / 1e9,
        "iteration": (rollout + update) / 1e9,
    }
