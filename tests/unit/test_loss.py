import math

import pytest
import torch

from pipelinerl_trainer.loss import LossConfig, effective_sample_size, policy_loss, sequence_mean, token_logprobs

T = torch.tensor


def test_token_logprobs_shift_and_temperature():
    logits = T([[0.0, math.log(3.0)], [math.log(2.0), 0.0], [0.0, 0.0]])
    lp, ent = token_logprobs(logits, T([0, 1, 0]), temperature=1.0)
    # token 1 predicted from row 0: p(1) = 3/4; token 2 (=0) from row 1: p(0) = 2/3.
    assert lp.tolist() == pytest.approx([0.0, math.log(0.75), math.log(2 / 3)])
    assert ent[1].item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    lp2, _ = token_logprobs(logits, T([0, 1, 0]), temperature=2.0)
    # logits halved: p(1) = sqrt(3) / (1 + sqrt(3)).
    assert lp2[1].item() == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))))


def setup(new, old, adv, w):
    new = T(new, dtype=torch.float32, requires_grad=True)
    return new, T(old), T(adv), T(w)


def test_reinforce_truncated_is_by_hand():
    new, old, adv, w = setup([-1.0, -0.5, -2.0], [-1.0, -1.0, -2.0], [1.0, 2.0, -1.0], [0.5, 0.5, 0.0])
    loss, stats = policy_loss(new, old, adv, w, LossConfig("reinforce", epsilon_high=0.2))
    # ratios 1, e^0.5 → capped 1.2; third token untrained.
    expected = -(0.5 * 1.0 * -1.0 * 1.0 + 0.5 * 2.0 * -0.5 * 1.2)
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    # d/dnew = -w·A·capped ratio (no gradient through the cap).
    assert new.grad.tolist() == pytest.approx([-0.5, -1.2, 0.0])
    assert stats["clipped"] == 1 and stats["tokens"] == 2


def test_sequence_importance_weights_every_token_by_its_samples_ratio():
    # Sample 0: token ratios e^0.1 and e^0.2 -> weight e^0.3 on both tokens; sample 1 ratio e^2,
    # truncated at 1 + epsilon_high; the untrained prompt token (weight 0) does not count.
    new, old, adv, w = setup(
        [-3.0, -1.0, -0.5, -0.1], [0.0, -1.1, -0.7, -2.1], [1.0, 1.0, 1.0, -1.0], [0.0, 0.5, 0.5, 1.0]
    )
    ids = T([0, 0, 0, 1])
    cfg = LossConfig("reinforce", epsilon_high=1.0, importance="sequence")
    loss, stats = policy_loss(new, old, adv, w, cfg, sample_ids=ids)
    loss.backward()
    assert new.grad.tolist() == pytest.approx([0.0, -0.5 * math.exp(0.3), -0.5 * math.exp(0.3), 2.0])
    assert stats["clipped"] == 1
    # The per-token statistics stay per token (ESS measures staleness the same way in both).
    assert stats["ratio_sum"].item() == pytest.approx(math.exp(0.1) + math.exp(0.2) + math.exp(2.0))
    new.grad = None
    policy_loss(
        new, old, adv, w, LossConfig("cispo", epsilon_low=0.2, epsilon_high=1.0, importance="sequence"), sample_ids=ids
    )[0].backward()
    assert new.grad.tolist() == pytest.approx([0.0, -0.5 * math.exp(0.3), -0.5 * math.exp(0.3), 2.0])
    with pytest.raises(ValueError, match="sample_ids"):
        policy_loss(new, old, adv, w, cfg)
    with pytest.raises(ValueError, match="unknown importance weights 'trajectory'"):
        policy_loss(new, old, adv, w, LossConfig("reinforce", importance="trajectory"), sample_ids=ids)


def test_ppo_clip_by_hand():
    new, old, adv, w = setup([math.log(1.5), math.log(0.5)], [0.0, 0.0], [1.0, -1.0], [1.0, 1.0])
    loss, stats = policy_loss(new, old, adv, w, LossConfig("ppo", epsilon_low=0.2, epsilon_high=0.2))
    # token 0: min(1.5, 1.2) = 1.2; token 1: min(-0.5, -0.8) = -0.8 → loss = -(1.2 - 0.8).
    assert loss.item() == pytest.approx(-0.4)
    loss.backward()
    assert new.grad.tolist() == pytest.approx([0.0, 0.0])  # both clipped: no gradient
    assert stats["clipped"] == 2


def test_cispo_clips_weight_but_keeps_gradient():
    new, old, adv, w = setup([math.log(2.0)], [0.0], [1.0], [1.0])
    loss, _ = policy_loss(new, old, adv, w, LossConfig("cispo", epsilon_low=0.5, epsilon_high=0.2))
    assert loss.item() == pytest.approx(-1.2 * math.log(2.0))
    loss.backward()
    assert new.grad.item() == pytest.approx(-1.2)
    # Bounded above only, sg(clip(r, ·, 1+ε)): a token the policy moved away from (r = 0.5) keeps
    # its weight 0.5, not a floor of 1 - ε_low = 0.8.
    new, old, adv, w = setup([math.log(0.5)], [0.0], [1.0], [1.0])
    loss, stats = policy_loss(new, old, adv, w, LossConfig("cispo", epsilon_low=0.2, epsilon_high=0.2))
    loss.backward()
    assert new.grad.item() == pytest.approx(-0.5) and stats["clipped"] == 0


def test_gspo_uses_sequence_ratio():
    new, old, adv, w = setup([math.log(2.0), 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.5, 0.5, 1.0])
    ids = T([0, 0, 1])
    loss, _ = policy_loss(new, old, adv, w, LossConfig("gspo", epsilon_low=1.0, epsilon_high=1.0), sample_ids=ids)
    s0 = math.sqrt(2.0)  # exp(mean(log 2, 0))
    # each token's term is its sample's mean: sample 0 (two tokens of weight 0.5) weighs 0.5 in all
    assert loss.item() == pytest.approx(-(0.5 * s0 + 1.0))
    assert sequence_mean(T([2.0, 4.0, 7.0]), ids, T([1, 1, 1])).tolist() == [3.0, 3.0, 7.0]


def test_gspo_weighs_a_sample_the_same_whatever_its_length():
    """GSPO: (1/G) Σ_i s_i A_i (1/|y_i|) Σ_t ∇logπ_t. Two on-policy samples of 2 and 6 tokens,
    the same advantage and token weight: the same total gradient (it was 1 against 3)."""
    new, old, adv, w = setup([0.0] * 8, [0.0] * 8, [1.0] * 8, [0.5] * 8)
    ids = T([0, 0, 1, 1, 1, 1, 1, 1])
    policy_loss(new, old, adv, w, LossConfig("gspo"), sample_ids=ids)[0].backward()
    totals = [new.grad[:2].sum().item(), new.grad[2:].sum().item()]
    assert totals == pytest.approx([-0.5, -0.5])
    # Its KL term is its sample's mean too, as weighty against the policy's as in the other losses.
    ref = T([-1.0] * 8)
    loss, _ = policy_loss(new, old, T([0.0] * 8), w, LossConfig("gspo", kl_coef=1.0), sample_ids=ids, ref_logprobs=ref)
    k3 = math.exp(-1.0)  # e^x - x - 1 at x = -1
    assert loss.item() == pytest.approx(0.5 * k3 + 0.5 * k3)


def test_kl_and_entropy_terms():
    new, old, adv, w = setup([-1.0], [-1.0], [0.0], [1.0])
    ref = T([-2.0])
    loss, stats = policy_loss(
        new, old, adv, w, LossConfig("reinforce", kl_coef=0.1, entropy_coef=0.01), ref_logprobs=ref, entropy=T([0.7])
    )
    k3 = math.exp(-1.0) + 1.0 - 1.0
    assert loss.item() == pytest.approx(0.1 * k3 - 0.01 * 0.7)
    assert stats["kl_sum"].item() == pytest.approx(k3)
    # An untrained position (a prompt token, weight 0) whose reference logprob is far above the
    # policy's: its k3 term would overflow, and 0 · inf is NaN in the loss; it is left out.
    new, old, adv, w = setup([-1.0, -200.0], [-1.0, -200.0], [0.0, 0.0], [1.0, 0.0])
    loss, _ = policy_loss(new, old, adv, w, LossConfig("reinforce", kl_coef=0.1), ref_logprobs=T([-2.0, 0.0]))
    assert loss.item() == pytest.approx(0.1 * k3)


@pytest.mark.parametrize("kind", ["reinforce", "cispo", "ppo", "gspo"])
def test_a_token_far_off_policy_leaves_the_loss_its_gradient_and_the_ess_finite(kind):
    """An engine logprob of -95 against the policy's -0.1: exp(94.9) is inf in fp32, and PPO's
    loss was NaN where the advantage is 0 (inf · 0; DeepSpeed then skips the whole step) while
    the ESS read the inf sums as 1.0. The log-ratio is bounded first (MAX_LOG_RATIO)."""
    from pipelinerl_trainer.loss import MAX_LOG_RATIO

    new, old, adv, w = setup([0.0, -0.1, -0.2], [0.0, -95.0, -0.3], [0.0, 0.0, 1.0], [0.0, 1.0, 1.0])
    cfg = LossConfig(kind, kl_coef=0.1)
    ids = T([0, 0, 1])
    loss, stats = policy_loss(new, old, adv, w, cfg, sample_ids=ids, ref_logprobs=T([0.0, 0.0, -120.0]))
    loss.backward()
    assert math.isfinite(loss.item()) and bool(torch.isfinite(new.grad).all()), (loss, new.grad)
    ess = effective_sample_size(stats["ratio_sum"].item(), stats["ratio_sq_sum"].item(), stats["tokens"].item())
    if kind != "gspo":  # one token of two at e^20 against one near 1: all but one sample's worth
        assert stats["ratio_sum"].item() == pytest.approx(math.exp(MAX_LOG_RATIO) + math.exp(0.1), rel=1e-5)
        assert ess == pytest.approx(0.5, abs=1e-6)


def test_ess():
    assert effective_sample_size(4.0, 4.0, 4) == 1.0
    assert effective_sample_size(3.0, 5.0, 2) == pytest.approx(9 / 10)
    # rounding in the separate sums must not report more than the on-policy bound
    assert effective_sample_size(4.0000001, 4.0, 4) == 1.0


def test_unknown_loss():
    new, old, adv, w = setup([0.0], [0.0], [1.0], [1.0])
    with pytest.raises(ValueError, match="unknown loss"):
        policy_loss(new, old, adv, w, LossConfig("dpo"))
