"""A sentence teaches behaviour: a CLIP trained on captioned CartPole frames (tests/clip_trainer.py), loaded as a user's
local model, turns a goal sentence into a reward that teaches DQN to keep the pole up. The goal is not a training
caption, but it is an in-vocabulary paraphrase of one (a light edit of "the pole is balanced upright above the cart":
every word of it is in the captions), so this proves the pipeline, not the zero-shot quality of a web-scale CLIP; whether
an out-of-vocabulary paraphrase (e.g. "the pole stands erect on the cart") would learn is not measured here.

Closes the loop text -> our reward -> our RL loop -> the behaviour the text describes, measured by the ground truth.
A sign error, a wrong channel order, a preprocessing mismatch or a frame scored one step late passes every formula
test and fails here. Numbers quoted in docs/language_proof.md come from these tests.
"""

import math
import os
from pathlib import Path

import clip_trainer
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, TINY_CLIP_FLAGS, only_run, read_csv, read_scalars, run_script

CONFIG = str(clip_trainer.CONFIG)
# the RL prompts, as a user types them: none is a training caption (checked below); both are in-vocabulary paraphrases
GOAL = "the pole is standing upright on the cart"
BASELINE = "the pole has fallen over flat"
PROMPTS = ["--goal", GOAL, "--baseline", BASELINE, "--alphas", "0", "0.5", "1"]  # the tools' prompts and alphas
ALPHA = "0.5"


@pytest.fixture(scope="session")
def cartpole_clip() -> str:
    """The trained checkpoint: trained once per source hash, cached under ~/.cache/vlmrm-tests (CI starts clean)."""
    return clip_trainer.cached_checkpoint()


def clip_flags(checkpoint: str) -> list[str]:
    return ["--clip-model", CONFIG, "--clip-checkpoint", checkpoint]


def test_rl_prompts_are_not_training_captions():
    captions = clip_trainer.all_captions()
    for prompt in (GOAL, BASELINE):
        assert not any(prompt in c for c in captions), prompt


# ---------------------------------------------------------------------------- the tools agree
def test_reward_shape_peaks_upright(cartpole_clip, tmp_path):
    result = run_script(
        "reward_shape.py",
        "--clip-models",
        CONFIG,
        "--clip-checkpoint",
        cartpole_clip,
        *PROMPTS,
        "--num-points",
        "61",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    summary = {float(r["alpha"]): r for r in read_csv(only_run(tmp_path) / "summary.csv")}
    rows = read_csv(only_run(tmp_path) / "reward_shape.csv")
    # the peak is at the upright pole: within one sweep step (pi/60 = 3 deg) of 12 deg, the ground truth's "upright"
    assert abs(float(summary[0.0]["argmax_state"])) <= math.radians(12) + math.pi / 60, summary[0.0]
    shape = [float(summary[a]["shape_score"]) for a in (0.0, 0.5, 1.0)]
    width = [half_max_width(rows, a) for a in (0.0, 0.5, 1.0)]
    print(f"shape_score (Spearman with closeness to upright) per alpha 0, 0.5, 1: {shape}; half-max width (rad): {width}")
    # alpha shapes it better: the goal-baseline projection ranks the states closer to upright higher (Spearman up by
    # 0.06 at alpha 0.5 and 1 here; 0.66, 0.90, 0.89 at alpha 0, 0.5, 1 on the CI machine, whose floats train another CLIP).
    # It does not narrow the peak of this model (half-max width in the print above): its goal-baseline direction separates
    # upright from fallen as a broad ramp
    assert min(shape) > 0.5, shape
    assert shape[1] > shape[0] + 0.03 and shape[2] > shape[0] + 0.03, shape


def half_max_width(rows: list[dict], alpha: float) -> float:
    """Width (rad) of the part of the sweep where the min-max normalised reward is above 0.5."""
    curve = [(float(r["state"]), float(r["reward_normalised"])) for r in rows if r["alpha"] and float(r["alpha"]) == alpha]
    states = np.array([s for s, _ in curve])
    return float((np.array([v for _, v in curve]) > 0.5).sum() * (states[1] - states[0]))


def test_epic_distance_to_ground_truth_is_clearly_lower_than_a_random_models(cartpole_clip, tmp_path):
    data = str(tmp_path / "cartpole")
    result = run_script(
        "epic_eval.py",
        "collect",
        "--env-id",
        "CartPole-v1",
        "--num-frames",
        "200",
        "--episode-length",
        "50",
        "--seed",
        "3",
        "--out",
        data,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    epic = {}
    for name, flags in (
        ("trained", ["--clip-models", CONFIG, "--clip-checkpoints", cartpole_clip]),
        ("random", ["--clip-models", TINY_CLIP_FLAGS[1], "--clip-pretrained", "none"]),
    ):
        out = tmp_path / name
        out.mkdir()
        result = run_script(
            "epic_eval.py",
            "score",
            "--dataset",
            data,
            "--labels",
            "gt",
            *flags,
            *PROMPTS,
            "--bootstrap",
            "200",
            cwd=out,
        )
        assert result.returncode == 0, result.stderr
        epic[name] = {
            float(r["alpha"]): (float(r["epic"]), float(r["epic_high"]), float(r["epic_low"]))
            for r in read_csv(only_run(out) / "epic.csv")
        }
    print(f"EPIC (distance, upper, lower bound) vs ground-truth upright labels: {epic}")
    for alpha, (trained, trained_high, _) in epic["trained"].items():
        random_epic, _, random_low = epic["random"][alpha]
        assert trained_high < random_low, (alpha, epic)  # the bootstrap intervals do not overlap
        assert trained < random_epic - 0.15, (alpha, epic)


# ---------------------------------------------------------------------------- preprocessing sensitivity
def test_scripts_tensor_preprocessing_agrees_with_open_clips_pil_transform(cartpole_clip):
    """The model learnt from open_clip's PIL transform; the scripts resize batched tensors. Same frames, both paths.

    Tolerance: the learning test needs the reward's ordering of states (its peak and slope around upright), not its
    exact values. So: same argmax (within one 5 deg step), Pearson >= 0.9 over the whole circle of pole angles, for
    the branch's resize and for both antialias settings of F.interpolate (the paper's torch 2.0 resize had none).
    """
    from PIL import Image

    import reward_shape
    import vlmrm_dqn_classic as classic
    import vlmrm_utils

    args = classic.Args(clip_model=CONFIG, clip_checkpoint=cartpole_clip)
    model, tokenizer = vlmrm_utils.load_clip(args, torch.device("cpu"))
    reward_model = classic.CLIPReward(model, tokenizer, (GOAL,), (BASELINE,), float(ALPHA), 64, torch.device("cpu"))
    _, transform, _ = clip_trainer.model_and_transform()
    states = np.linspace(-math.pi, math.pi, 73)
    frames, _ = reward_shape.render_states("CartPole-v1", False, states, seed=0)

    with torch.no_grad():
        pil = reward_model.rewards(model.encode_image(torch.stack([transform(Image.fromarray(f)) for f in frames]))).numpy()
        x = torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255

        def tensor_path(antialias: bool) -> np.ndarray:
            resized = F.interpolate(x, size=reward_model.image_size, mode="bicubic", align_corners=False, antialias=antialias)
            return reward_model.rewards(model.encode_image((resized - reward_model.mean) / reward_model.std)).numpy()

        paths = {"scripts": reward_model(frames), "antialias": tensor_path(True), "no antialias": tensor_path(False)}
    spread = pil.max() - pil.min()
    for name, r in paths.items():
        pearson = np.corrcoef(r, pil)[0, 1]
        print(
            f"{name}: max |reward - PIL reward| = {np.abs(r - pil).max() / spread:.3f} of the PIL reward's range, "
            f"Pearson {pearson:.4f}, argmax {math.degrees(states[r.argmax()]):.0f} deg "
            f"vs {math.degrees(states[pil.argmax()]):.0f}"
        )
        assert abs(states[r.argmax()] - states[pil.argmax()]) <= states[1] - states[0] + 1e-9, name
        assert pearson >= 0.9, name


# ---------------------------------------------------------------------------- learning
DQN_FLAGS = [
    "--total-timesteps",
    "10000",
    "--learning-starts",
    "1000",
    "--exploration-fraction",
    "0.2",
    "--learning-rate",
    "1e-3",
    "--train-frequency",
    "1",
    "--target-network-frequency",
    "200",
    "--save-model",
    "--eval-episodes",
    "5",
    "--save-buffer",  # the final checkpoint holds every transition: the rewards are checked against their frames
    "--checkpoint-frequency",
    "10000",
    "--no-cuda",  # a CPU experiment: the rewards are re-scored on the CPU (on a GPU the image tower runs in float16)
]


def random_policy_upright_fraction(episodes: int = 20, seed: int = 0) -> float:
    """Ground-truth upright fraction of uniformly random actions in the same fixed-length CartPole."""
    import vlmrm_dqn_classic as classic

    env = classic.make_env("CartPole-v1", seed, 0, 200, False)()
    env.action_space.seed(seed)
    upright = []
    for episode in range(episodes):
        env.reset(seed=seed + episode)
        upright += [env.step(env.action_space.sample())[1] for _ in range(200)]
    env.close()
    return float(np.mean(upright))


def eval_upright_fraction(run_dir: Path) -> float:
    """The script's own greedy evaluation: mean ground-truth return / episode length."""
    return float(np.mean([v for _, v in read_scalars(run_dir)["eval/gt_return"]])) / 200


def assert_rewards_score_the_frame_after_the_step(run_dir: Path, samples: int = 64) -> None:
    """The run's stored rewards are the CLIP scores of the frames after the step (next_obs), not before it (obs).

    A reward scored on the frame before the step still learns (a one-step shift barely changes the best policy), so
    learning alone cannot catch it. CartPole's observation is its state: re-render sampled transitions of the run's own
    replay buffer at both states and score them with the run's reward model.
    """
    import vlmrm_dqn_classic as classic

    saved = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)
    reward_model = classic.make_reward_model(classic.Args(**saved["args"]), torch.device("cpu"))
    buffer = {k: v.numpy() for k, v in saved["replay_buffer"].items() if torch.is_tensor(v)}
    index = np.random.default_rng(0).choice(len(buffer["rewards"]), samples, replace=False)
    env = classic.make_env("CartPole-v1", 0, 0, 200, False)()
    env.reset(seed=0)  # the env renders only after a reset

    def scores(states: np.ndarray) -> np.ndarray:
        frames = []
        for state in states:
            env.unwrapped.state = state.astype(np.float64)
            frames.append(env.render())
        return reward_model(np.stack(frames))

    stored, after, before = buffer["rewards"][index], scores(buffer["next_obs"][index]), scores(buffer["obs"][index])
    env.close()
    error_after, error_before = np.abs(stored - after).max(), np.abs(stored - before).mean()
    print(
        f"stored rewards vs scores of the frame after the step: max |diff| {error_after:.2e}; before: mean {error_before:.2e}"
    )
    assert error_after < 1e-4, (error_after, error_before)
    assert error_before > 100 * error_after + 1e-4, (error_after, error_before)  # the sample can tell the two apart


# the CI seed; docs/language_proof.md gives the margins on seeds 1, 2, 3 (python tests/plot_language_proof.py --seeds)
SEED = 1


def learning_runs(checkpoint: str, cwd: Path, seed: int = SEED) -> dict[str, float]:
    """Ground-truth upright fraction of the greedy evaluation of the goal run and of the swapped control (two processes
    at once, one core each), and of a random policy."""
    import subprocess
    import sys

    runs = {"upright": (GOAL, BASELINE), "swapped": (BASELINE, GOAL)}  # the control asks for a fallen pole
    procs = {}
    for name, (goal, baseline) in runs.items():
        (cwd / name).mkdir()
        command = [sys.executable, str(ROOT / "vlmrm_dqn_classic.py"), *clip_flags(checkpoint), "--goal", goal]
        command += ["--baseline", baseline, "--alpha", ALPHA, *DQN_FLAGS, "--seed", str(seed)]
        procs[name] = subprocess.Popen(
            command,
            cwd=cwd / name,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    upright = {"random": random_policy_upright_fraction()}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=1800)  # a generous hang guard: shared machines are slow
        assert proc.returncode == 0, out[-3000:]
        upright[name] = eval_upright_fraction(only_run(cwd / name))
    return upright


def test_a_sentence_teaches_dqn_to_keep_the_pole_up_and_the_swapped_sentence_does_not(cartpole_clip, tmp_path):
    upright = learning_runs(cartpole_clip, tmp_path)
    print(
        f"ground-truth upright fraction: random policy {upright['random']:.3f}, goal {GOAL!r} {upright['upright']:.3f}, "
        f"swapped {upright['swapped']:.3f}; runs in {tmp_path}"
    )
    # margins that held on seeds 1, 2 and 3 (docs/language_proof.md)
    assert upright["upright"] >= upright["random"] + 0.5, upright
    assert_rewards_score_the_frame_after_the_step(only_run(tmp_path / "upright"))
    assert upright["swapped"] <= upright["random"] + 0.1, upright
