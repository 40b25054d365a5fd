"""The pairs a DPO update trains on: the decisive ones, and the stored table read back as the tensors it was made of."""

from __future__ import annotations

import pyarrow as pa
import torch

from rlhf_core.preference_losses import SequenceLogprob
from storage.schemas import PREFERENCES, REFERENCE_LOGPROBS
from tasks.dpo_update import stored_pairs
from tasks.reference_logprobs import decisive
from tasks.tensors import preference_pairs


def test_issue45_a_tie_of_a_scoring_labeler_is_dropped_and_a_margin_of_zero_given_by_no_one_is_kept():
    labelers = ["gold", "gold", "function", "reward_model", "import", "human"]
    margins = [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    table = pa.table(
        {
            "pair_id": list(range(6)),
            "prompt": ["p"] * 6,
            "messages": [[]] * 6,
            "chosen": ["a"] * 6,
            "rejected": ["b"] * 6,
            "margin": margins,
            "labeler": labelers,
        },
        schema=PREFERENCES,
    )
    assert decisive(table).column("pair_id").to_pylist() == [1, 4, 5]


def test_issue45_the_stored_pairs_read_back_as_the_tensors_the_reference_scored():
    prompts, chosen, rejected = [[5, 6], [7]], [[8, 9, 2], [10, 2]], [[11, 2], [12, 13, 14, 2]]
    reference = {"ref_logprobs_chosen": [-3.0, -2.0], "ref_logprobs_rejected": [-4.0, -5.5]}
    means = {"ref_logprobs_chosen_mean": [-1.0, -1.0], "ref_logprobs_rejected_mean": [-2.0, -1.375]}
    table = pa.table(
        {
            "pair_id": [0, 1],
            "prompt_ids": prompts,
            "chosen_ids": chosen,
            "rejected_ids": rejected,
            **reference,
            **means,
            "chosen_tokens": [3, 2],
            "rejected_tokens": [2, 4],
        },
        schema=REFERENCE_LOGPROBS,
    )
    pairs = stored_pairs(table, pad_token_id=0)
    expected = preference_pairs(prompts, chosen, rejected, pad_token_id=0)
    assert torch.equal(pairs.prompt_ids, expected.prompt_ids) and torch.equal(
        pairs.rejected_mask, expected.rejected_mask
    )
    assert pairs.prompt_ids.tolist() == [[5, 6], [0, 7]]  # prompts on the left, responses on the right
    assert pairs.chosen_ids.tolist() == [[8, 9, 2, 0], [10, 2, 0, 0]] and pairs.chosen_mask.sum(1).tolist() == [3, 2]
    assert isinstance(pairs.ref_chosen, SequenceLogprob) and pairs.ref_chosen.total.tolist() == [-3.0, -2.0]
    torch.testing.assert_close(pairs.ref_rejected.mean, torch.tensor([-2.0, -1.375]))
