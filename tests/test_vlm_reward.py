"""vlm_reward and softmax_reward against the closed forms of SPEC section 1, in both training scripts.

The tools import them from the training scripts, so these tests cover the tools too.
"""

import importlib
import inspect
import math

import pytest
import torch
import torch.nn.functional as F

SCRIPTS = ["vlmrm_dqn_classic", "vlmrm_sac_humanoid"]  # each is copyable alone, so each has its own copy
D = 16


@pytest.fixture(params=SCRIPTS)
def vlm_reward(request):
    return importlib.import_module(request.param).vlm_reward


@pytest.fixture(params=SCRIPTS)
def softmax_reward(request):
    return importlib.import_module(request.param).softmax_reward


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


# ------------------------------------------------------------------------------------------------
# The thresholded softmax over negative prompts ("Vision-Language Models as a Source of Rewards")
# ------------------------------------------------------------------------------------------------
def softmax_reference(s, goals, negatives, temperature):
    """p = exp(c_goal / tau) / sum_k exp(c_k / tau) written out in float64; the goal is the re-normalised mean."""
    s = unit(s.double())
    g = unit(unit(goals.double()).mean(0))
    logits = torch.cat([(s @ g)[:, None], s @ unit(negatives.double()).T], dim=1) / temperature
    return logits.exp()[:, 0] / logits.exp().sum(1)


@pytest.mark.parametrize("temperature", [0.01, 0.1, 1.0])
def test_softmax_with_two_prompts_is_a_logistic_of_the_scaled_similarity_difference(softmax_reward, temperature):
    torch.manual_seed(6)
    s, g, n = torch.randn(64, D), torch.randn(1, D), torch.randn(1, D)
    difference = (F.cosine_similarity(s.double(), g.double()) - F.cosine_similarity(s.double(), n.double())) / temperature
    expected = torch.sigmoid(difference).float()
    torch.testing.assert_close(softmax_reward(s, g, n, temperature, 0.5, soft=True), expected, atol=1e-6, rtol=1e-5)
    # binary: exactly the indicator of p > threshold (the logit above log(beta / (1 - beta)))
    for threshold in (0.1, 0.5, 0.9):
        binary = softmax_reward(s, g, n, temperature, threshold)
        margin = difference - math.log(threshold / (1 - threshold))
        clear = margin.abs() > 1e-4  # leave out float32 round-off right at the boundary
        assert clear.sum() > 40
        torch.testing.assert_close(binary[clear], (margin[clear] > 0).float())


def test_threshold_boundary_is_strict(softmax_reward):
    """A frame exactly as similar to the goal as to the one negative has p = 1/2: 1[p > 0.5] = 0, not 1."""
    e = torch.eye(D)
    s, g, n = (e[0] + e[1])[None], e[:1], e[1:2]
    assert softmax_reward(s, g, n, 0.01, 0.5, soft=True).item() == 0.5
    assert softmax_reward(s, g, n, 0.01, 0.5).item() == 0.0
    assert softmax_reward(s, g, n, 0.01, 0.5 - 1e-6).item() == 1.0
    assert softmax_reward(s, g, n, 0.01, 0.5 + 1e-6).item() == 0.0
    # p = sigmoid(1) for a similarity gap of exactly tau: just above and below it
    s = torch.tensor([[1.0, 0.0]])
    g, n = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])  # cosines 1 and 0
    p = 1 / (1 + math.exp(-1.0))
    assert softmax_reward(s, g, n, 1.0, 0.5, soft=True).item() == pytest.approx(p, abs=1e-7)
    assert softmax_reward(s, g, n, 1.0, p - 1e-4).item() == 1.0
    assert softmax_reward(s, g, n, 1.0, p + 1e-4).item() == 0.0


@pytest.mark.parametrize("temperature", [0.01, 0.5])
def test_softmax_matches_the_explicit_formula_with_several_prompts(softmax_reward, temperature):
    torch.manual_seed(7)
    s, goals, negatives = torch.randn(50, D), torch.randn(3, D), torch.randn(4, D)
    expected = softmax_reference(s, goals, negatives, temperature)
    torch.testing.assert_close(
        softmax_reward(s, goals, negatives, temperature, 0.5, soft=True), expected.float(), atol=1e-6, rtol=1e-5
    )
    # several goal prompts are one class: the re-normalised mean of their unit embeddings
    mean_goal = unit(unit(goals).mean(0, keepdim=True))
    torch.testing.assert_close(
        softmax_reward(s, goals, negatives, temperature, 0.5, soft=True),
        softmax_reward(s, mean_goal, negatives, temperature, 0.5, soft=True),
        atol=1e-6,
        rtol=0,
    )
    # the order of the prompts does not matter; every negative is its own class, so more negatives lower p
    torch.testing.assert_close(
        softmax_reward(s, goals.flip(0), negatives.flip(0), temperature, 0.5, soft=True),
        expected.float(),
        atol=1e-6,
        rtol=1e-5,
    )
    fewer = softmax_reward(s, goals, negatives[:2], temperature, 0.5, soft=True)
    full = softmax_reward(s, goals, negatives, temperature, 0.5, soft=True)
    assert torch.all(fewer >= full - 1e-6) and torch.any(fewer > full + 1e-3)


def test_softmax_scale_invariance_shape_dtype_and_range(softmax_reward):
    torch.manual_seed(8)
    s, goals, negatives = torch.randn(9, D), torch.randn(2, D), torch.randn(3, D)
    base = softmax_reward(s, goals, negatives, 0.05, 0.3, soft=True)
    scaled = softmax_reward(s * (torch.rand(9, 1) * 10 + 0.1), goals * 3.0, negatives * 0.01, 0.05, 0.3, soft=True)
    torch.testing.assert_close(scaled, base, atol=1e-6, rtol=1e-5)
    p = softmax_reward(s.half(), goals, negatives, 0.05, 0.3, soft=True)
    binary = softmax_reward(s.half(), goals, negatives, 0.05, 0.3)
    assert p.shape == binary.shape == (9,) and p.dtype == binary.dtype == torch.float32
    assert torch.all((p > 0) & (p < 1))
    assert set(binary.tolist()) <= {0.0, 1.0}
    torch.testing.assert_close(binary, (p > 0.3).float())
    # a colder softmax is more decisive: the goal's probability moves away from its value at tau = infinity
    e = torch.eye(D)
    frame = (2 * e[0] + e[1])[None]  # closer to the goal e0 than to the negative e1
    assert softmax_reward(frame, e[:1], e[1:2], 0.01, 0.5, soft=True) > softmax_reward(
        frame, e[:1], e[1:2], 1.0, 0.5, soft=True
    )


@pytest.mark.parametrize(
    "temperature, threshold",
    [
        (0.0, 0.5),
        (-0.01, 0.5),
        (float("nan"), 0.5),
        (float("inf"), 0.5),
        (0.01, 0.0),
        (0.01, 1.0),
        (0.01, -0.1),
        (0.01, 1.5),
        (0.01, float("nan")),
    ],
)
def test_softmax_rejects_bad_temperature_and_threshold(softmax_reward, temperature, threshold):
    with pytest.raises(ValueError):
        softmax_reward(torch.randn(3, D), torch.randn(1, D), torch.randn(2, D), temperature, threshold)


def test_softmax_rejects_no_negatives(softmax_reward):
    with pytest.raises(ValueError, match="negative"):
        softmax_reward(torch.randn(3, D), torch.randn(1, D), torch.zeros(0, D), 0.01, 0.5)


# what the two training scripts still share, the method: the same text, in the same order, so that
# `diff vlmrm_dqn_classic.py vlmrm_sac_humanoid.py` shows the algorithms; the plumbing lives once, in vlmrm_utils.py
SHARED = """DEFAULT_PROMPTS DEFAULT_NEGATIVES vlm_reward softmax_problem softmax_reward CLIPReward make_reward_model
MOUNTAINCAR_GOAL FixedLengthMountainCar RealisticMountainCar ReplayBuffer""".split()


def test_the_plumbing_is_written_once_and_imports_no_training_script():
    import ast

    import vlmrm_utils

    modules = [importlib.import_module(script) for script in SCRIPTS]
    for name in "UserError read_checkpoint save_checkpoint load_clip check_clip_args Progress Run FramesInInfo".split():
        assert all(getattr(m, name, getattr(vlmrm_utils, name)) is getattr(vlmrm_utils, name) for m in modules), name
    import vlmrm_tools
    import vlmrm_warp

    for module in (vlmrm_utils, vlmrm_warp, vlmrm_tools):  # plumbing imports no script or tool: no cycle
        tree = ast.parse(inspect.getsource(module))
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not imported & {*SCRIPTS, "epic_eval", "success_eval", "reward_shape", "sweep"}, (module, imported)
        assert module is vlmrm_tools or "vlmrm_tools" not in imported  # the tools' module builds on utils, not back
        assert module is not vlmrm_utils or "vlmrm_warp" not in imported  # the warp backend builds on utils, not back


@pytest.mark.parametrize("name", SHARED)
def test_shared_code_is_identical_in_both_training_scripts_and_the_tools_use_it(name):
    objects = [getattr(importlib.import_module(script), name) for script in SCRIPTS]
    if name in ("DEFAULT_PROMPTS", "DEFAULT_NEGATIVES", "MOUNTAINCAR_GOAL"):  # values, not code
        assert objects[0] == objects[1]
    else:
        sources = [inspect.getsource(obj) for obj in objects]
        assert sources[0] == sources[1], f"{name} differs between {SCRIPTS}"
    for tool in ["reward_shape", "epic_eval"]:  # one source of truth: the tools score with the training code itself
        tool_object = getattr(importlib.import_module(tool), name, None)
        assert tool_object is None or tool_object is objects[0]


def test_shared_code_is_in_the_same_order_and_ends_with_the_same_main_block():
    modules = [importlib.import_module(script) for script in SCRIPTS]
    assert [[n for n in vars(m) if n in SHARED] for m in modules] == [SHARED] * 2
    blocks = [inspect.getsource(m).split('\nif __name__ == "__main__":\n')[1] for m in modules]
    assert blocks[0] == blocks[1]


# ------------------------------------------------------------------------------------------------
# Frames to the model's input, as the paper's code did (torchvision tensor Resize of torch 2.0, OpenAI-style normalise)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(params=SCRIPTS)
def script(request):
    return importlib.import_module(request.param)


def reference_preprocess(frames, size, mean, std, antialias):
    """An independent version: torchvision's Resize to (size, size) (a squash, bicubic) then Normalize, on float/255."""
    from torchvision.transforms import InterpolationMode, Normalize, Resize

    x = torch.from_numpy(frames).permute(0, 3, 1, 2).double() / 255
    x = Resize((size, size), interpolation=InterpolationMode.BICUBIC, antialias=antialias)(x)
    return Normalize(mean, std)(x).float()


@pytest.mark.parametrize("antialias", [False, True])
def test_frames_reach_the_model_as_in_the_reference(script, antialias):
    import numpy as np
    import open_clip
    from conftest import TINY_CLIP

    import vlmrm_utils

    args = script.Args(clip_model=TINY_CLIP, clip_pretrained="none")
    model, tokenizer = vlmrm_utils.load_clip(args, torch.device("cpu"))
    # the model's own constants, here ViT-L-14 laion2b's (0.5, 0.5) that the paper replaced by OpenAI's
    mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    open_clip.set_model_preprocess_cfg(model, {**open_clip.get_model_preprocess_cfg(model), "mean": mean, "std": std})
    reward_model = script.CLIPReward(
        model, tokenizer, ("a goal",), ("a baseline",), 0.0, 4, torch.device("cpu"), antialias=antialias
    )
    reward_model.model.encode_image = lambda x: x.flatten(1)  # the embedding path sees exactly the model's input
    frames = np.random.default_rng(0).integers(0, 256, size=(5, 48, 100, 3), dtype=np.uint8)  # non-square, sharp
    size = reward_model.image_size[0]
    expected = reference_preprocess(frames, size, mean, std, antialias)
    seen = reward_model.embed_images(torch.from_numpy(frames)).view(5, 3, size, size)
    torch.testing.assert_close(seen, expected, atol=1e-5, rtol=0)
    # the two settings really differ, and without a clamp bicubic overshoots [0, 1] on random pixels as the reference did
    other = reference_preprocess(frames, size, mean, std, not antialias)
    assert (seen - other).abs().max() > 0.05
    if not antialias:
        assert (seen * 0.5 + 0.5).max() > 1.01 and (seen * 0.5 + 0.5).min() < -0.01


# ------------------------------------------------------------------------------------------------
# The image tower in half precision (cast once, as on CUDA): the rewards of a real-size model stay those of float32
# ------------------------------------------------------------------------------------------------
def test_half_precision_image_tower_gives_float32_rewards_within_a_bound():
    import copy

    import numpy as np
    import open_clip

    sac = importlib.import_module("vlmrm_sac_humanoid")
    env = sac.make_env("Humanoid-v5", 1, 0, 100, 224, "fast", True)()
    env.reset(seed=1)
    frames = []
    for _ in range(4):
        env.step(env.action_space.sample())
        frames.append(env.render())
    frames = np.stack(frames)
    torch.manual_seed(0)
    model, tokenizer = open_clip.create_model("ViT-B-32", pretrained=None).eval(), open_clip.get_tokenizer("ViT-B-32")
    prompts, cpu = (("a humanoid robot kneeling",), ("a humanoid robot",)), torch.device("cpu")
    rewards = {
        dtype: sac.CLIPReward(copy.deepcopy(model), tokenizer, *prompts, 0.0, 4, cpu, dtype=dtype)(frames)
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
    }
    assert rewards[torch.float32].dtype == np.float32 and np.ptp(rewards[torch.float32]) > 1e-3  # frames told apart
    # measured here: bfloat16 6e-4, float16 5e-5 (the default on CUDA: 8 more mantissa bits, the same speed on an H100)
    assert np.abs(rewards[torch.bfloat16] - rewards[torch.float32]).max() < 1e-3
    assert np.abs(rewards[torch.float16] - rewards[torch.float32]).max() < 1e-4
    assert (
        next(sac.CLIPReward(model, tokenizer, *prompts, 0.0, 4, cpu, dtype=torch.float16).model.visual.parameters()).dtype
        == torch.float16
    )
