"""Packing (:mod:`rlhf_core.packing`): the partition into rows and the packed layout pinned by hand, and on real tiny
GPT-2 and Llama models (saved and loaded as the stage loads them, sdpa and eager attention) every example's logits
packed equal its logits alone, so the SFT loss of a packed minibatch and its gradient equal those of the same
examples padded; a model whose attention does not honour packing (Bloom: ALiBi, no positions) is found."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, BloomConfig

from rlhf_core.packing import keeps_packed_examples_apart, pack, pack_rows
from rlhf_core.sft import SFTExamples, example_loss
from tests.conftest import tiny_causal_lm

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
"""fp32: packed and padded forwards differ by rounding only (another matmul shape, another mask)."""


def test_the_rows_of_fewest_cells_by_hand():
    """Lengths 3, 5, 2, 4, 1 (15 tokens) into rows of at most 6, longest first into the emptiest row:
    5 rows: one example each, 5 wide: 25 cells. 4 rows: 5 | 4 | 3 | 2 + 1: 20 cells.
    3 rows: 5 | 4 + 1 | 3 + 2: 15 cells, no padding. 2 rows: 5 + 2 + 1 | 4 + 3: 8 wide, beyond 6. So 3 rows."""
    assert pack_rows([3, 5, 2, 4, 1], 6) == [[1], [3, 4], [0, 2]]
    # One row of 6 or three of 2 (the same 6 cells): three, as narrow as unpacked.
    assert pack_rows([2, 2, 2], 6) == [[0], [1], [2]]
    # Never more cells than padding: 8, 7 and 1 padded to 8 are 24 cells; [8 | 7 + 1] are 16 (first fit into rows of
    # 15 would make [8 + 7 | 1]: 30).
    assert pack_rows([8, 7, 1], 15) == [[0], [1, 2]]
    with pytest.raises(ValueError, match="7 tokens does not fit a packed row of 6"):
        pack_rows([3, 7], 6)


def test_the_packed_layout_by_hand():
    """Three right-padded examples of 3, 2 and 4 tokens into rows of at most 6: [example 2 | a cell of padding] and
    [example 0 | example 1] (10 cells; 12 unpacked); positions restart at each example and at the padding; an
    example's first token is never a target, even where its own mask says so (example 1's)."""
    input_ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [11, 12, 13, 14]])
    loss_mask = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 1, 1]], dtype=torch.bool)
    rows = pack(input_ids, loss_mask, [3, 2, 4], length=6)
    assert rows.input_ids.tolist() == [[11, 12, 13, 14, 11], [5, 6, 7, 8, 9]]  # padding: the row's first id
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    assert rows.loss_mask.int().tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 0, 1]]
    assert set(rows.model_inputs()) == {"input_ids", "position_ids"}  # no attention mask: the positions say it


def _rows(count: int = 7, seed: int = 0) -> list[tuple[list[int], list[bool]]]:
    """``count`` examples of random tokens, 3-12 long, learned after a prompt of 1-3 tokens."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        length = int(torch.randint(3, 13, (1,), generator=generator))
        prompt = int(torch.randint(1, 4, (1,), generator=generator))
        ids = torch.randint(3, 30, (length,), generator=generator).tolist()
        rows.append((ids, [False] * prompt + [True] * (length - prompt)))
    return rows


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def saved(request, tmp_path_factory):
    """A tiny random model of the family, saved with ``save_pretrained`` (loaded back as the stage loads one)."""
    folder = tmp_path_factory.mktemp(request.param)
    tiny_causal_lm(request.param).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_an_examples_logits_are_unchanged_by_what_is_packed_beside_it(saved, attention):
    model = AutoModelForCausalLM.from_pretrained(saved, attn_implementation=attention).eval()
    examples = SFTExamples.of(_rows(), pad_token_id=0)
    lengths = examples.lengths
    rows = examples.pack(16)
    bins = pack_rows(lengths, 16)  # where pack put each example: row b holds bins[b], in this order
    assert len(bins) < len(examples)  # several examples share a row
    with torch.no_grad():
        packed = model(**rows.model_inputs(), use_cache=False).logits  # (B', T', V)
        for row, members in enumerate(bins):
            start = 0
            for index in members:
                alone = model(input_ids=examples.input_ids[index : index + 1, : lengths[index]]).logits[0]
                torch.testing.assert_close(packed[row, start : start + lengths[index]], alone, **TOLERANCE)
                start += lengths[index]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_minibatchs_loss_and_gradient_equal_the_padded_ones(saved, attention):
    """The SFT loss (the sum over the assistant tokens / their count) of 7 examples packed into rows of 16 and of the
    same 7 padded to the longest, and the gradient of every parameter, to fp32 rounding."""
    model = AutoModelForCausalLM.from_pretrained(saved, attn_implementation=attention)
    examples = SFTExamples.of(_rows(), pad_token_id=0)

    def loss_and_gradient(rows):
        model.zero_grad()
        loss = example_loss(model, rows)
        loss.backward()
        return loss.detach(), [parameter.grad.clone() for parameter in model.parameters()]

    padded, padded_gradient = loss_and_gradient(examples)
    packed, packed_gradient = loss_and_gradient(examples.pack(16))
    torch.testing.assert_close(packed, padded, **TOLERANCE)
    for a, b in zip(packed_gradient, padded_gradient, strict=True):
        torch.testing.assert_close(a, b, **TOLERANCE)


def test_gpt2_and_llama_keep_packed_examples_apart(saved):
    assert keeps_packed_examples_apart(AutoModelForCausalLM.from_pretrained(saved))


def test_a_model_whose_attention_ignores_the_positions_is_found():
    torch.manual_seed(0)
    bloom = AutoModelForCausalLM.from_config(BloomConfig(vocab_size=32, hidden_size=32, n_layer=2, n_head=2))
    assert not keeps_packed_examples_apart(bloom)  # ALiBi: no positions, a plain causal mask over the whole row
