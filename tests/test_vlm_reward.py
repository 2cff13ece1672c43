"""vlm_reward against the closed forms of SPEC section 1, in every script that defines it."""

import importlib

import pytest
import torch
import torch.nn.functional as F

SCRIPTS = ["vlmrm_dqn_classic", "vlmrm_sac_humanoid"]
D = 16


@pytest.fixture(params=SCRIPTS)
def vlm_reward(request):
    return importlib.import_module(request.param).vlm_reward


def unit(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, dim=-1)


def reference(s, goals, baselines, alpha):
    """The formula exactly as written: R = 1 - 0.5 ||(s - g) P||^2 with an explicit D x D matrix P."""
    s, g, b = unit(s.double()), unit(goals.double()).mean(0), unit(baselines.double()).mean(0)
    d = (g - b)[None]
    P = alpha * d.T @ d / (d @ d.T) + (1 - alpha) * torch.eye(s.shape[1], dtype=torch.float64)
    return 1 - 0.5 * ((s - g) @ P).pow(2).sum(-1)


def test_alpha_zero_is_cosine_similarity_for_one_goal(vlm_reward):
    torch.manual_seed(0)
    s, g, b = torch.randn(32, D), torch.randn(1, D), torch.randn(1, D)
    expected = F.cosine_similarity(s, g, dim=-1)
    torch.testing.assert_close(vlm_reward(s, g, b, 0.0), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("alpha", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_matches_explicit_projection_matrix(vlm_reward, alpha):
    torch.manual_seed(1)
    s, goals, baselines = torch.randn(64, D), torch.randn(3, D), torch.randn(2, D)
    expected = reference(s, goals, baselines, alpha).float()
    torch.testing.assert_close(vlm_reward(s, goals, baselines, alpha), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_parallel_perpendicular_decomposition(vlm_reward, alpha):
    """R = 1 - 0.5 ||u_par||^2 - 0.5 (1 - alpha)^2 ||u_perp||^2 with u = s - g."""
    torch.manual_seed(2)
    s, g, b = unit(torch.randn(20, D)), unit(torch.randn(1, D)), unit(torch.randn(1, D))
    d_hat = unit(g - b)[0]
    u = s - g
    u_par = (u @ d_hat)[:, None] * d_hat
    u_perp = u - u_par
    expected = 1 - 0.5 * u_par.pow(2).sum(-1) - 0.5 * (1 - alpha) ** 2 * u_perp.pow(2).sum(-1)
    torch.testing.assert_close(vlm_reward(s, g, b, alpha), expected, atol=1e-6, rtol=0)


def test_alpha_one_depends_only_on_goal_baseline_direction(vlm_reward):
    torch.manual_seed(3)
    g, b = torch.randn(1, D), torch.randn(1, D)
    d_hat = unit(unit(g) - unit(b))[0]
    s1 = unit(torch.randn(10, D))
    # mirror s1 about the goal-baseline axis: same component along d, different perpendicular part, still unit
    s2 = 2 * (s1 @ d_hat)[:, None] * d_hat - s1
    assert (s1 - s2).norm(dim=-1).min() > 0.1
    torch.testing.assert_close(vlm_reward(s1, g, b, 1.0), vlm_reward(s2, g, b, 1.0), atol=1e-6, rtol=0)
    assert not torch.allclose(vlm_reward(s1, g, b, 0.5), vlm_reward(s2, g, b, 0.5), atol=1e-3)
    expected = 1 - 0.5 * ((s1 - unit(g)) @ d_hat).pow(2)
    torch.testing.assert_close(vlm_reward(s1, g, b, 1.0), expected, atol=1e-6, rtol=0)


def test_several_prompts_average_normalised_embeddings_without_renormalising(vlm_reward):
    torch.manual_seed(4)
    s, goals, b = torch.randn(8, D), torch.randn(3, D), torch.randn(1, D)
    g = unit(goals).mean(0)
    assert g.norm() < 0.99  # the mean of unit vectors is shorter: renormalising would change the reward
    expected = unit(s) @ g + (1 - g.norm() ** 2) / 2
    torch.testing.assert_close(vlm_reward(s, goals, b, 0.0), expected, atol=1e-6, rtol=0)
    # the order of the prompts does not matter, their number does
    torch.testing.assert_close(vlm_reward(s, goals.flip(0), b, 0.0), expected, atol=1e-6, rtol=0)


def test_scaling_an_embedding_does_not_change_the_reward(vlm_reward):
    torch.manual_seed(5)
    s, goals, baselines = torch.randn(8, D), torch.randn(2, D), torch.randn(2, D)
    scales = torch.rand(8, 1) * 10 + 0.1
    base = vlm_reward(s, goals, baselines, 0.6)
    torch.testing.assert_close(vlm_reward(s * scales, goals * 3.0, baselines * 0.01, 0.6), base, atol=1e-6, rtol=0)


def test_shape_dtype_and_half_precision_inputs(vlm_reward):
    s, g, b = torch.randn(5, D).half(), torch.randn(1, D), torch.randn(1, D)
    r = vlm_reward(s, g, b, 0.5)
    assert r.shape == (5,) and r.dtype == torch.float32
    assert torch.all(r <= 1 + 1e-6)  # R = 1 - 0.5 * (a squared norm)


def test_goal_equal_to_baseline_is_rejected_for_positive_alpha(vlm_reward):
    g = torch.randn(1, D)
    with pytest.raises(ValueError):
        vlm_reward(torch.randn(3, D), g, g.clone(), 0.5)
    # alpha = 0 never uses the baseline
    assert vlm_reward(torch.randn(3, D), g, g.clone(), 0.0).shape == (3,)
