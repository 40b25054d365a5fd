"""The DPO update: the policy's log-probs of a pair against a loop over tokens, the reference's read back, an update
that moves every parameter and wins its training pairs, and a resume that ends where the uninterrupted update does."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rlhf_core.config import DPOConfig
from rlhf_core.dpo import DPOProgress, PreferencePairs, dpo_update, pair_logprobs, reference_logprobs
from runtime.models import accelerator_for
from tests.conftest import left_padded, tiny_causal_lm

PAD = 0


def make_pairs(count: int = 6, seed: int = 0) -> PreferencePairs:
    """``count`` pairs of random tokens: prompts of 2-4 tokens (left-padded), responses of 1-3 (right-padded)."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(low: int, high: int) -> list[int]:
        length = int(torch.randint(low, high + 1, (1,), generator=generator))
        return torch.randint(3, 30, (length,), generator=generator).tolist()

    prompts = [tokens(2, 4) for _ in range(count)]
    chosen, rejected = [tokens(1, 3) for _ in range(count)], [tokens(1, 3) for _ in range(count)]
    width = max(len(row) for row in chosen + rejected)

    def right_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([row + [PAD] * (width - len(row)) for row in rows])
        return ids, torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])

    prompt_ids, prompt_mask = left_padded(prompts)
    return PreferencePairs(prompt_ids, prompt_mask, *right_padded(chosen), *right_padded(rejected))


def naive_logprob(model, prompt: list[int], response: list[int]) -> float:
    """``sum_t log pi(y_t | x, y_<t)``, one unpadded sequence at a time."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(logprobs[len(prompt) + t - 1, token].item() for t, token in enumerate(response))


def test_pair_logprobs_equal_a_loop_over_unpadded_tokens():
    model = tiny_causal_lm("gpt2").eval()
    pairs = make_pairs()
    chosen, rejected = pair_logprobs(model, pairs)
    for b in range(len(pairs)):
        prompt = pairs.prompt_ids[b][pairs.prompt_mask[b].bool()].tolist()
        for side, ids, mask in ((chosen, pairs.chosen_ids, pairs.chosen_mask), (rejected, pairs.rejected_ids,
                                                                                    pairs.rejected_mask)):  # fmt: skip
            response = ids[b][mask[b].bool()].tolist()
            expected = naive_logprob(model, prompt, response)
            torch.testing.assert_close(side.total[b].item(), expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(side.mean[b].item(), expected / len(response), rtol=1e-5, atol=1e-5)


def test_reference_logprobs_in_batches_equal_one_pass():
    model = tiny_causal_lm("gpt2")
    pairs = make_pairs()
    whole = pair_logprobs(model.eval(), pairs)
    batched = reference_logprobs(model, pairs, batch_size=4)
    for one, other in zip(whole, batched, strict=True):
        torch.testing.assert_close(one.total, other.total, rtol=1e-5, atol=1e-5)


def _trained(config: DPOConfig, *, seed: int = 0):
    accelerator = accelerator_for(torch.device("cpu"), "fp32")
    reference = tiny_causal_lm("gpt2", seed=seed)
    pairs = make_pairs(seed=seed)
    pairs = pairs.with_reference(*reference_logprobs(reference, pairs, batch_size=8))
    actor = copy.deepcopy(reference)
    optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-3)
    actor, optimizer = accelerator.prepare(actor, optimizer)
    return accelerator, actor, optimizer, pairs


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "simpo"])
def test_an_update_moves_every_parameter_and_wins_its_training_pairs(loss):
    config = DPOConfig(loss=loss, epochs=4, batch_size=4, learning_rate=1e-3, beta=0.1 if loss != "simpo" else 2.0)
    accelerator, actor, optimizer, pairs = _trained(config)
    before = {name: value.detach().clone() for name, value in actor.named_parameters()}
    stats = dpo_update(actor, optimizer, pairs, config, accelerator=accelerator, generator=torch.Generator())
    assert stats.optimizer_steps == 4 * 2  # ceil(6 / 4) = 2 steps per epoch
    unmoved = [name for name, value in actor.named_parameters() if torch.equal(value, before[name])]
    assert unmoved == []
    names = ["loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"]
    assert set(stats.metrics) == {*names, "logps/chosen", "logps/rejected"}
    assert all(math.isfinite(value) for value in stats.metrics.values()) and math.isfinite(stats.train_loss)
    assert stats.metrics["rewards/accuracies"] > 0.5 and stats.metrics["rewards/margins"] > 0


def test_at_the_reference_every_implicit_reward_is_zero():
    """Before any step the policy is the reference: DPO's rewards are 0, its loss log 2 per pair."""
    config = DPOConfig(epochs=1, batch_size=8, learning_rate=1e-12)
    accelerator, actor, optimizer, pairs = _trained(config)
    from rlhf_core.dpo import measure_pairs

    metrics, measures = measure_pairs(actor, pairs, config, batch_size=4)
    assert metrics["rewards/chosen"] == pytest.approx(0, abs=1e-6) and metrics["rewards/accuracies"] == 0
    assert metrics["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert measures.rewards_chosen.abs().max() < 1e-6 and measures.rewards_rejected.abs().max() < 1e-6  # per pair
    assert torch.allclose(measures.logps_chosen, pairs.ref_chosen.total, atol=1e-5)  # the reference's log-probs


def test_each_pairs_measures_are_what_trls_metrics_are_the_means_of():
    config = DPOConfig(epochs=1, batch_size=4, learning_rate=1e-3, beta=0.5)
    accelerator, actor, optimizer, pairs = _trained(config)
    stats = dpo_update(actor, optimizer, pairs, config, accelerator=accelerator, generator=torch.Generator())
    measures = stats.pairs
    assert measures.rewards_chosen.shape == (len(pairs),)
    assert torch.allclose(measures.rewards_chosen, 0.5 * (measures.logps_chosen - pairs.ref_chosen.total))
    for name, value in (
        ("rewards/chosen", measures.rewards_chosen.mean()),
        ("rewards/margins", (measures.rewards_chosen - measures.rewards_rejected).mean()),
        ("logps/rejected", measures.logps_rejected.mean()),
    ):
        assert stats.metrics[name] == pytest.approx(value.item(), abs=1e-5), name


def test_resuming_after_an_epoch_gives_exactly_the_uninterrupted_update():
    config = DPOConfig(epochs=3, batch_size=4, learning_rate=1e-3)
    accelerator, actor, optimizer, pairs = _trained(config)
    expected = dpo_update(actor, optimizer, pairs, config, accelerator=accelerator, generator=torch.Generator())

    accelerator, crashed, crashed_optimizer, pairs = _trained(config)
    generator, snapshot = torch.Generator(), {}

    def save(progress: DPOProgress) -> None:
        if progress.epochs_done == 1:
            snapshot.update(
                progress=progress, model=copy.deepcopy(crashed.state_dict()),
                optimizer=copy.deepcopy(crashed_optimizer.state_dict()), generator=generator.get_state(),
            )  # fmt: skip

    dpo_update(
        crashed, crashed_optimizer, pairs, config, accelerator=accelerator, generator=generator, on_epoch_end=save
    )
    accelerator, resumed, resumed_optimizer, pairs = _trained(config)
    resumed.load_state_dict(snapshot["model"])
    resumed_optimizer.load_state_dict(snapshot["optimizer"])
    generator = torch.Generator()
    generator.set_state(snapshot["generator"])
    stats = dpo_update(
        resumed, resumed_optimizer, pairs, config, accelerator=accelerator, generator=generator,
        resume=snapshot["progress"],
    )  # fmt: skip
    assert stats._replace(pairs=None) == expected._replace(pairs=None)
    assert all(torch.equal(a, b) for a, b in zip(stats.pairs, expected.pairs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), actor.parameters(), strict=True))
