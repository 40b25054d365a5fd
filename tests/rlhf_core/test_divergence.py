"""Divergence checks (issue 23): a non-finite loss, gradient norm, weight or logit raises DivergenceError naming the
model, what was not finite and where; generation refuses non-finite logits instead of sampling from them."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.config import RewardModelConfig, SamplingConfig
from rlhf_core.divergence import DivergenceError, check_finite, check_weights
from rlhf_core.generation import generate
from rlhf_core.models import RewardModel
from rlhf_core.reward_training import PreferenceBatch, fit_reward_model
from runtime.models import accelerator_for
from tests.conftest import EOS, PAD, left_padded, tiny_causal_lm


def test_the_message_names_the_model_what_and_where():
    error = DivergenceError("actor", "loss", step=3, learning_rate=1e6)
    assert str(error) == "the actor's loss is not finite at optimizer step 3 (learning rate 1e+06): it diverged"
    assert str(DivergenceError("actor", "logits")) == "the actor's logits are not finite: it diverged"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_check_finite_refuses_any_non_finite_element(bad):
    check_finite(torch.tensor([0.0, 1e30]), model="critic", quantity="loss")
    with pytest.raises(DivergenceError, match="critic's gradient norm is not finite at optimizer step 2"):
        check_finite(torch.tensor([0.0, bad]), model="critic", quantity="gradient norm", step=2)


def test_check_weights_reads_trainable_weights_only():
    model = tiny_causal_lm("llama")
    check_weights(model, model="actor")
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(DivergenceError, match="actor's weights"):
        check_weights(model, model="actor", learning_rate=2e-5)
    model.lm_head.requires_grad_(False)
    model.get_input_embeddings().requires_grad_(False)  # tied in some families: frozen weights are not trained ones
    check_weights(model, model="actor")


def test_generation_refuses_non_finite_logits_instead_of_sampling_from_them():
    model = tiny_causal_lm("gpt2").eval()
    with torch.no_grad():
        model.lm_head.weight.fill_(float("inf"))
    ids, mask = left_padded([[3, 4, 5], [6]])
    with pytest.raises(DivergenceError, match="the actor's logits are not finite"):
        generate(
            model, ids, mask, config=SamplingConfig(max_new_tokens=4), eos_token_id=EOS, pad_token_id=PAD,
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip


def test_reward_model_training_stops_at_the_first_non_finite_loss_before_stepping():
    torch.manual_seed(0)
    model = RewardModel.wrap(tiny_causal_lm("gpt2").transformer, None)
    with torch.no_grad():
        model.head.weight.fill_(float("nan"))
    before = {name: parameter.clone() for name, parameter in model.named_parameters()}
    ids, mask = left_padded([[3, 4, 5, EOS]] * 4)
    pairs = PreferenceBatch(
        chosen_ids=ids, chosen_mask=mask, rejected_ids=ids, rejected_mask=mask, margin=torch.zeros(4)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accelerator = accelerator_for(torch.device("cpu"), "fp32")
    with pytest.raises(DivergenceError, match=r"reward_model's loss is not finite at optimizer step 1 \(learning rate"):
        fit_reward_model(model, optimizer, pairs, pairs, RewardModelConfig(batch_size=4), accelerator=accelerator)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter, before[name], equal_nan=True)  # no step was taken


def test_issue36_an_fp16_overflow_is_a_skipped_step_and_only_k_in_a_row_diverge():
    """D3: under fp16's loss scaler a non-finite gradient norm is a step the scaler skips (it halves its scale), not
    a divergence; the count restarts at every finite norm, and the K-th skip in a row is one. A CPU stand-in for the
    scaler's sequence of norms: fp16 training needs CUDA, which the suite does not have."""
    from rlhf_core.divergence import MAX_SKIPPED_STEPS, DivergenceError, skipped_steps

    inf, finite = torch.tensor(float("inf")), torch.tensor(0.5)
    options = {"scaled": True, "limit": 3, "model": "actor", "learning_rate": 1e-5}
    in_a_row = 0
    for norm, expected in ((inf, 1), (inf, 2), (finite, 0), (torch.tensor(float("nan")), 1), (finite, 0)):
        in_a_row = skipped_steps(norm, in_a_row=in_a_row, **options)
        assert in_a_row == expected
    in_a_row = skipped_steps(inf, in_a_row=skipped_steps(inf, in_a_row=0, **options), **options)
    with pytest.raises(DivergenceError, match=r"3 steps in a row skipped by the fp16 loss scaler\) is not finite"):
        skipped_steps(inf, in_a_row=in_a_row, step=7, **options)
    # without a scaler (fp32, bf16) the first non-finite norm is a divergence, as before
    with pytest.raises(DivergenceError, match="gradient norm is not finite at optimizer step 7"):
        skipped_steps(inf, scaled=False, in_a_row=0, limit=3, model="actor", step=7)
    assert skipped_steps(finite, scaled=False, in_a_row=0, limit=3, model="actor") == 0
    assert MAX_SKIPPED_STEPS == 16  # 2^16, fp16's first scale, halved 16 times is 1 (DeepSpeed's minimum)
