"""Critic and RewardModel on GPT-2, Llama and Qwen2 backbones (tiny, random init, built in code)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from rlhf_core.models import Critic, RewardModel, dropout_disabled, evaluating, freeze
from tests.conftest import PAD, TINY_VOCAB, tiny_causal_lm, tiny_config

CLOSE = dict(rtol=0.0, atol=1e-5)
TEXT = [5, 9, 3, 17, 4]  # one "text" of 5 tokens


def build(cls, arch: str, seed: int = 0, **config_kwargs):
    torch.manual_seed(seed)
    return cls(config=tiny_config(arch, **config_kwargs)).eval()


def padded(text: list[int], *, left: int = 0, right: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[PAD] * left + text + [PAD] * right])
    mask = torch.tensor([[0] * left + [1] * len(text) + [0] * right])
    return ids, mask


def test_critic_gives_one_value_per_position(arch):
    critic = build(Critic, arch)
    ids = torch.randint(3, TINY_VOCAB, (3, 7))
    values = critic(ids, torch.ones_like(ids))
    assert values.shape == (3, 7) and values.dtype == torch.float32
    torch.testing.assert_close(critic(ids), values, rtol=0.0, atol=0.0)  # no mask means all real tokens


def test_critic_values_are_causal(arch):
    # The value at column i sees tokens 0..i only: it is the state *before* the token at column i + 1.
    critic = build(Critic, arch)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    changed = ids.clone()
    changed[0, 4:] = torch.tensor([20, 21])
    torch.testing.assert_close(critic(changed)[:, :4], critic(ids)[:, :4], **CLOSE)
    assert (critic(changed)[:, 4:] - critic(ids)[:, 4:]).abs().max().item() > 1e-6


def test_reward_model_gives_one_score_per_sequence(arch):
    model = build(RewardModel, arch)
    ids = torch.randint(3, TINY_VOCAB, (4, 6))
    scores = model(ids, torch.ones_like(ids))
    assert scores.shape == (4,) and scores.dtype == torch.float32


@pytest.mark.parametrize("cls", [RewardModel, Critic])
def test_padding_left_or_right_changes_nothing(arch, cls):
    model = build(cls, arch)
    plain = model(*padded(TEXT))
    left = model(*padded(TEXT, left=3))
    right = model(*padded(TEXT, right=2))
    both = model(*padded(TEXT, left=1, right=2))
    if cls is RewardModel:  # the head reads the last non-padding token
        for other in (left, right, both):
            torch.testing.assert_close(other, plain, **CLOSE)
    else:  # values at the real positions
        torch.testing.assert_close(left[:, 3:], plain, **CLOSE)
        torch.testing.assert_close(right[:, :5], plain, **CLOSE)
        torch.testing.assert_close(both[:, 1:6], plain, **CLOSE)


def test_reward_model_scores_in_a_mixed_padded_batch_equal_scores_alone(arch):
    model = build(RewardModel, arch)
    texts = [TEXT, [7, 8], [11, 12, 13, 14, 15, 16, 17]]
    alone = torch.cat([model(*padded(text)) for text in texts])
    width = max(map(len, texts))
    left = torch.cat([torch.cat(padded(t, left=width - len(t)), dim=0)[None] for t in texts])  # (3, 2, width)
    right = torch.cat([torch.cat(padded(t, right=width - len(t)), dim=0)[None] for t in texts])
    torch.testing.assert_close(model(left[:, 0], left[:, 1]), alone, **CLOSE)
    torch.testing.assert_close(model(right[:, 0], right[:, 1]), alone, **CLOSE)


def test_token_ids_under_padding_never_matter(arch):
    model = build(RewardModel, arch)
    ids, mask = padded(TEXT, left=2, right=2)
    scrambled = ids.clone()
    scrambled[mask == 0] = torch.tensor([30, 31, 29, 28])
    torch.testing.assert_close(model(scrambled, mask), model(ids, mask), **CLOSE)


def test_reward_head_is_initialised_normal_with_std_one_over_hidden_plus_one():
    # ColossalChat's init: weight ~ normal(0, 1 / (H + 1)), bias 0. With H = 1024 the sample std
    # of the 1024 weights is within a few percent of 1/1025 (its relative standard error is ~2.2%).
    hidden = 1024
    for seed in (0, 1):
        model = build(RewardModel, "llama", seed=seed, hidden=hidden, layers=1)
        weight = model.reward_head.weight.detach().flatten()
        expected_std = 1.0 / (hidden + 1)
        assert abs(weight.std().item() / expected_std - 1.0) < 0.1
        assert abs(weight.mean().item()) < 4 * expected_std / hidden**0.5
        assert bool((model.reward_head.bias == 0).all())


def test_reward_head_std_follows_the_hidden_size():
    small = build(RewardModel, "gpt2", hidden=32).reward_head.weight.std().item()
    large = build(RewardModel, "gpt2", hidden=512, layers=1).reward_head.weight.std().item()
    # 1/33 vs 1/513: a ratio of about 15.5 (loose: only 32 samples in the small head).
    assert 8 < small / large < 30


@pytest.mark.parametrize("cls", [RewardModel, Critic])
def test_save_and_load_round_trip_keeps_heads_exactly(arch, cls, tmp_path):
    model = build(cls, arch)
    with torch.no_grad():  # make the head distinguishable from any fresh init
        head = model.head
        head.weight.normal_()
        head.bias.fill_(0.25)
    model.save_pretrained(tmp_path)
    names = {path.name for path in tmp_path.iterdir()}
    assert f"{cls.head_name}.safetensors" in names and "model.safetensors" in names and "config.json" in names
    assert not [name for name in names if name.endswith((".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"))], names
    loaded = cls.from_pretrained(tmp_path).eval()
    original_state, loaded_state = model.state_dict(), loaded.state_dict()
    assert original_state.keys() == loaded_state.keys()
    for key, value in original_state.items():
        assert torch.equal(value, loaded_state[key]), key
    ids = torch.randint(3, TINY_VOCAB, (2, 5))
    torch.testing.assert_close(loaded(ids), model(ids), rtol=0.0, atol=0.0)


def test_critic_from_a_plain_causal_lm_checkpoint_gets_its_backbone_and_a_fresh_head(arch, tmp_path):
    actor = tiny_causal_lm(arch, seed=3)
    actor.save_pretrained(tmp_path)
    critic = Critic.from_pretrained(tmp_path).eval()
    backbone_state = actor.base_model.state_dict()
    for key, value in critic.model.state_dict().items():
        assert torch.equal(value, backbone_state[key]), key  # weights loaded, not re-initialised
    assert critic.value_head.weight.shape == (1, 32)
    torch.manual_seed(0)
    another = Critic.from_pretrained(tmp_path)
    assert torch.equal(another.model.get_input_embeddings().weight, critic.model.get_input_embeddings().weight)
    # The backbone's hidden states equal the actor's own.
    ids = torch.randint(3, TINY_VOCAB, (2, 6))
    with torch.no_grad():
        actor_hidden = actor.eval()(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(critic.last_hidden_state(ids, None), actor_hidden, **CLOSE)


def test_reward_model_from_a_plain_causal_lm_checkpoint(arch, tmp_path):
    tiny_causal_lm(arch, seed=4).save_pretrained(tmp_path)
    model = RewardModel.from_pretrained(tmp_path)
    assert model(torch.tensor([[5, 6, 7]])).shape == (1,)


def test_embeddings_are_the_backbones(arch):
    critic = build(Critic, arch)
    embeddings = critic.get_input_embeddings()
    assert isinstance(embeddings, nn.Embedding)
    assert embeddings is critic.model.get_input_embeddings()
    assert embeddings.weight.shape == (TINY_VOCAB, 32)
    # The backbone has no language-model head: nothing to return.
    assert critic.get_output_embeddings() is None
    lm = AutoModelForCausalLM.from_config(tiny_config(arch))
    assert isinstance(lm.get_output_embeddings(), nn.Linear)
    assert critic.config is critic.model.config


@pytest.mark.parametrize("cls", [RewardModel, Critic])
def test_every_parameter_changes_after_one_optimizer_step(arch, cls):
    model = build(cls, arch).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)  # no weight decay: only gradients move weights
    before = {name: value.detach().clone() for name, value in model.named_parameters()}
    ids, mask = padded(TEXT, left=1)
    ids = torch.cat([ids, torch.tensor([[PAD, 6, 7, 8, 9, 10]])])
    mask = torch.cat([mask, torch.tensor([[0, 1, 1, 1, 1, 1]])])
    output = model(ids, mask)
    loss = (output - 1.0).square().mean() if cls is RewardModel else ((output - 1.0).square() * mask).mean()
    loss.backward()
    optimizer.step()
    unchanged = [name for name, value in model.named_parameters() if torch.equal(value, before[name])]
    assert not unchanged


def test_freeze_turns_off_gradients_and_dropout(arch):
    lm = tiny_causal_lm(arch).train()
    assert freeze(lm) is lm
    assert not lm.training
    assert not any(parameter.requires_grad for parameter in lm.parameters())
    critic = freeze(build(Critic, arch).train())
    assert not any(parameter.requires_grad for parameter in critic.parameters())
    assert not critic(torch.tensor([[5, 6]])).requires_grad


def test_evaluating_restores_each_mode_and_ignores_plain_callables():
    trained, evaluated = nn.Linear(2, 2).train(), nn.Linear(2, 2).eval()
    with evaluating(trained, evaluated, len):
        assert not trained.training and not evaluated.training
    assert trained.training and not evaluated.training
    with pytest.raises(RuntimeError), evaluating(trained):
        raise RuntimeError
    assert trained.training


def test_exactly_one_of_pretrained_and_config():
    with pytest.raises(ValueError, match="exactly one of `pretrained`"):
        Critic()
    with pytest.raises(ValueError, match="exactly one of `pretrained`"):
        RewardModel(pretrained="somewhere", config=tiny_config("gpt2"))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_dropout_disabled_computes_the_eval_forward_in_train_mode_and_restores_everything(arch):
    config = tiny_config(arch)
    if arch == "gpt2":
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.5
    else:
        config.attention_dropout = 0.5
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        with dropout_disabled(model):
            assert model.training
            assert torch.equal(model(input_ids=ids).logits, expected)
        assert not model.training
        model.train()
        assert not torch.equal(model(input_ids=ids).logits, expected)  # dropout is back, at 0.5
    probabilities = [m.p for m in model.modules() if isinstance(m, nn.Dropout)]
    attention = [
        m.attention_dropout for m in model.modules() if isinstance(getattr(m, "attention_dropout", None), float)
    ]
    assert all(p == 0.5 for p in probabilities + attention) and probabilities + attention
