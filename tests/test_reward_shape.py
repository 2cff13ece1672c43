"""Tests of reward_shape.py: CPU only, offline, a few seconds each.

The reward-peak tests use an instrumented encoder instead of CLIP: its image embedding is computed from
the drawn pole's orientation, so the true reward peak is known (the upright pole) and any mistake in
setting states, rendering, batching, scoring or reporting moves the reported argmax.
"""

import math
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import tyro

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "reward_shape.py"
TINY = str(ROOT / "tests" / "vlmrm-tiny-test.json")
sys.path.insert(0, str(ROOT))
from conftest import assert_refused, read_csv  # noqa: E402

import reward_shape  # noqa: E402

POLE_RGB = torch.tensor([202, 152, 101]).view(1, 3, 1, 1) / 255  # Gymnasium's pole colour
EMBED_DIM = 8


class PoleTiltEncoder(nn.Module):
    """A CLIP stand-in whose reward peaks exactly at the upright pole, for every alpha.

    Image: find the pole's pixels by colour, measure its tilt phi in [0, pi/2] from the principal axis
    of those pixels, embed as (cos phi, sin phi, 0, ...). Text: a prompt with "upright" -> +e1, any
    other -> -e1 (see `tokenizer`). With the default prompts g = e1 and b = -e1, so u = s - g has
    ||u_par||^2 = (1 - cos phi)^2 and ||u_perp||^2 = sin^2 phi, both increasing in phi: R falls strictly
    as the pole tilts, whatever alpha.
    """

    def __init__(self, sign: float = 1.0):
        super().__init__()
        self.sign = sign  # -1: the encoder "reads" the upright prompt as a description of a horizontal pole
        self.visual = nn.Module()
        self.visual.image_size = (400, 600)  # the frame's own size: the squash changes nothing
        self.visual.image_mean = (0.5, 0.5, 0.5)
        self.visual.image_std = (0.5, 0.5, 0.5)
        self.images_encoded = 0

    def tokenizer(self, texts: list[str]) -> torch.Tensor:
        return torch.tensor([[self.sign] if "upright" in t else [-self.sign] for t in texts])

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        embeddings = torch.zeros(len(tokens), EMBED_DIM)
        embeddings[:, 0] = tokens[:, 0]
        return embeddings

    def encode_image(self, x: torch.Tensor) -> torch.Tensor:
        self.images_encoded += len(x)
        rgb = x * 0.5 + 0.5  # undo the normalisation CLIPReward applied
        pole = (rgb - POLE_RGB).abs().amax(1) < 0.06
        embeddings = torch.zeros(len(x), EMBED_DIM)
        for i, mask in enumerate(pole):
            ys, xs = torch.nonzero(mask, as_tuple=True)
            assert len(xs) > 100, "no pole in the frame"
            cov = torch.cov(torch.stack([xs.double(), ys.double()]))
            # angle of the principal axis from the vertical: 0 = upright, pi/2 = horizontal
            phi = abs(0.5 * math.atan2(2 * cov[0, 1].item(), (cov[1, 1] - cov[0, 0]).item()))
            embeddings[i, 0], embeddings[i, 1] = math.cos(phi), math.sin(phi)
        return embeddings


def fake_clip(monkeypatch, encoder_factory=PoleTiltEncoder) -> list[PoleTiltEncoder]:
    """Replace the script's load_clip with the instrumented encoder; returns the encoders it hands out."""
    made = []

    def load(spec, device):
        encoder = encoder_factory()
        made.append(encoder)
        return encoder, encoder.tokenizer

    monkeypatch.setattr(reward_shape, "load_clip", load)
    return made


def cartpole_args(**kwargs) -> "reward_shape.Args":
    defaults = dict(env_id="CartPole-v1", clip_models=("RN50",), clip_pretrained=("none",), cuda=False, exp_name="test")
    return reward_shape.Args(**{**defaults, **kwargs})


# ------------------------------------------------------------------------------------------------
# The reward peak is found where it is
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sign, num_points, peak, score",
    [
        (1.0, 101, 0.0, 1.0),  # 101 points: several batches of 16
        (-1.0, 21, math.pi / 2, -1.0),  # negative control: g = -e1, R rises with the tilt, peaks at +-pi/2 for every alpha
    ],
)
def test_argmax_follows_the_encoder(monkeypatch, tmp_path, capsys, sign, num_points, peak, score):
    monkeypatch.chdir(tmp_path)
    encoders = fake_clip(monkeypatch, lambda: PoleTiltEncoder(sign))
    run_dir = reward_shape.main(cartpole_args(reward_batch_size=16, num_points=num_points))
    assert encoders[0].images_encoded == num_points, "frames must be embedded once, not once per alpha"
    summary = read_csv(run_dir / "summary.csv")
    assert [float(r["alpha"]) for r in summary] == [0.0, 0.25, 0.5, 0.75, 1.0]
    for row in summary:
        assert math.isclose(abs(float(row["argmax_state"])), peak, abs_tol=1e-9), row
        assert math.isclose(float(row["distance_to_goal"]), peak, abs_tol=1e-9), row
        assert float(row["shape_score"]) * score > 0.99, row
    table = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["RN50/none"]]
    assert len(table) == 5 and all(math.isclose(abs(float(cols[2])), peak, abs_tol=1e-4) for cols in table)


def test_both_reward_families_side_by_side(monkeypatch, tmp_path, capsys):
    """The thresholded softmax is drawn next to the alpha curves, from the same embeddings.

    With the instrumented encoder g = e1 and both default negatives = -e1, so the goal's probability is
    p = 1 / (1 + 2 exp(-2 cos(phi) / tau)): at tau = 1 it falls strictly as the pole tilts, from 0.787 (upright)
    to 1/3 (horizontal), and 1[p > 0.7] holds for cos(phi) > ln(14/3) / 2, i.e. |theta| < 0.692 rad.
    """
    monkeypatch.chdir(tmp_path)
    encoders = fake_clip(monkeypatch)
    soft_dir = reward_shape.main(
        cartpole_args(reward_families=("projection", "softmax"), alphas=(0.0, 1.0), num_points=21, temperature=1.0, soft=True)
    )
    assert encoders[0].images_encoded == 21, "both families score the same embeddings"
    summary = read_csv(soft_dir / "summary.csv")
    assert list(summary[0])[:3] == ["model", "family", "alpha"]
    assert [(r["family"], r["alpha"]) for r in summary] == [("projection", "0.0"), ("projection", "1.0"), ("softmax", "")]
    for row in summary:
        assert abs(float(row["argmax_state"])) < 1e-9 and float(row["shape_score"]) > 0.99, row
    rows = read_csv(soft_dir / "reward_shape.csv")
    assert len(rows) == 3 * 21
    states = np.array([float(r["state"]) for r in rows if r["family"] == "softmax"])
    p = np.array([float(r["reward"]) for r in rows if r["family"] == "softmax"])
    assert p[10] == pytest.approx(1 / (1 + 2 * math.exp(-2)), abs=1e-4)  # upright
    assert p[0] == pytest.approx(1 / 3, abs=2e-2)  # horizontal (the pixel-measured tilt is nearly pi/2)
    table = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["RN50/none"]]
    assert [cols[1] for cols in table] == ["alpha=0", "alpha=1", "softmax-p"]
    assert (soft_dir / "reward_shape_RN50_none.png").is_file()

    time.sleep(1)  # the run folder is named by the second
    binary_dir = reward_shape.main(cartpole_args(reward_families=("softmax",), num_points=21, temperature=1.0, threshold=0.7))
    rows = read_csv(binary_dir / "reward_shape.csv")
    assert {r["family"] for r in rows} == {"softmax"} and len(rows) == 21  # no alpha curves asked for
    binary = np.array([float(r["reward"]) for r in rows])
    np.testing.assert_array_equal(binary, (p > 0.7).astype(float))
    assert set(binary) == {0.0, 1.0}
    assert np.all(binary[np.abs(states) < 0.6] == 1) and np.all(binary[np.abs(states) > 0.8] == 0)
    (row,) = read_csv(binary_dir / "summary.csv")
    assert float(row["shape_score"]) > 0.5 and float(row["reward_min"]) == 0 and float(row["reward_max"]) == 1


# ------------------------------------------------------------------------------------------------
# Normalisation and the shape score
# ------------------------------------------------------------------------------------------------
def test_min_max_normalise():
    np.testing.assert_allclose(reward_shape.min_max_normalise(np.array([3.0, 1.0, 2.0, 5.0])), [0.5, 0.0, 0.25, 1.0])
    np.testing.assert_array_equal(reward_shape.min_max_normalise(np.full(4, 0.7)), np.zeros(4))  # flat: no nan


STATES = np.linspace(-math.pi / 2, math.pi / 2, 11)


@pytest.mark.parametrize(
    "rewards, expected",
    [
        (np.cos(STATES), 1.0),  # ties at +-theta handled
        (-(np.abs(STATES) ** 3), 1.0),  # only the order counts
        (np.abs(STATES), -1.0),
        (STATES, 0.0),  # a ramp through the goal is not a peak
        (np.ones(11), float("nan")),  # flat
    ],
)
def test_shape_score(rewards, expected):
    assert reward_shape.shape_score(STATES, rewards, 0.0) == pytest.approx(expected, abs=1e-9, nan_ok=True)


# ------------------------------------------------------------------------------------------------
# Outputs: CSV, PNG, frames
# ------------------------------------------------------------------------------------------------
def test_csv_png_and_frames_are_written(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    fake_clip(monkeypatch)
    args = cartpole_args(clip_models=("RN50", "ViT-B-32"), alphas=(0.0, 1.0), num_points=9, save_frames=True)
    run_dir = reward_shape.main(args)
    assert run_dir.parent == Path("runs")

    rows = read_csv(run_dir / "reward_shape.csv")
    assert list(rows[0]) == ["model", "family", "alpha", "state", "reward", "reward_normalised"]
    assert {r["family"] for r in rows} == {"projection"}  # the default: the projection family only
    assert len(rows) == 2 * 2 * 9
    for model in ("RN50/none", "ViT-B-32/none"):
        for alpha in ("0.0", "1.0"):
            curve = [r for r in rows if r["model"] == model and r["alpha"] == alpha]
            states = np.array([float(r["state"]) for r in curve])
            raw = np.array([float(r["reward"]) for r in curve])
            normalised = np.array([float(r["reward_normalised"]) for r in curve])
            np.testing.assert_allclose(states, np.linspace(-math.pi / 2, math.pi / 2, 9), atol=1e-6)
            np.testing.assert_allclose(normalised, (raw - raw.min()) / (raw.max() - raw.min()), atol=1e-5)
            assert normalised.min() == 0.0 and normalised.max() == 1.0

    import matplotlib.image

    for name in ("reward_shape_RN50_none.png", "reward_shape_ViT-B-32_none.png"):
        path = run_dir / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(path)
        assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300
        assert image[..., :3].std() > 0.05, "a blank image"

    frames = sorted((run_dir / "frames").glob("*.png"))
    assert len(frames) == 9
    import imageio.v3 as iio

    expected, _ = reward_shape.render_states("CartPole-v1", False, np.linspace(-math.pi / 2, math.pi / 2, 9), 1)
    for path, frame in zip(frames, expected):
        np.testing.assert_array_equal(iio.imread(path)[..., :3], frame)


# ------------------------------------------------------------------------------------------------
# Same frames as the training script; same reward as its CLIPReward
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "env_id, realistic",
    [
        ("CartPole-v1", False),
        ("MountainCar-v0", False),
        ("MountainCar-v0", True),
        ("MountainCarContinuous-v0", False),
        ("MountainCarContinuous-v0", True),
    ],
)
def test_frames_equal_the_training_script(env_id, realistic):
    import vlmrm_dqn_classic as classic
    import vlmrm_sac_humanoid as sac

    _, low, high = reward_shape.SWEEPS[env_id]
    assert (low, high) == ((-1.2, 0.6) if env_id.startswith("MountainCar") else (-np.pi / 2, np.pi / 2))
    states = np.linspace(low, high, 7)
    frames, goal = reward_shape.render_states(env_id, realistic, states, seed=3)
    if env_id == "MountainCarContinuous-v0":  # the paper's MountainCar, trained by the SAC script
        env = sac.make_env(env_id, 0, 0, 200, 480, "high", realistic)()
    else:
        env = classic.make_env(env_id, 0, 0, 200, realistic)()
    env.reset(seed=0)
    for value, frame in zip(states, frames):
        if env_id == "CartPole-v1":
            env.unwrapped.state = np.array([0.0, 0.0, value, 0.0])
        else:
            env.unwrapped.state = np.array([value, 0.0])
        np.testing.assert_array_equal(frame, env.render())
    assert len({f.tobytes() for f in frames}) == len(frames), "every state must look different"
    assert goal == (0.0 if env_id == "CartPole-v1" else 0.45)  # the paper's flag, not Gymnasium's goal_position 0.5
    env.close()


def test_sweep_scores_equal_clip_reward_per_alpha():
    """Embedding once and projecting per alpha gives exactly CLIPReward(alpha)'s rewards (tiny random CLIP)."""
    spec = reward_shape.ClipArgs(TINY, "none")
    torch.manual_seed(0)
    model, tokenizer = reward_shape.load_clip(spec, torch.device("cpu"))
    frames, _ = reward_shape.render_states("CartPole-v1", False, np.linspace(-1.5, 1.5, 5), seed=1)
    goal, baseline = ("pole vertically upright on top of the cart",), ("pole and cart",)
    shared = reward_shape.CLIPReward(model, tokenizer, goal, baseline, 0.0, 2, torch.device("cpu"))
    swept = reward_shape.score_frames(shared, frames, (0.0, 0.5, 1.0))
    for alpha, rewards in swept.items():
        reference = reward_shape.CLIPReward(model, tokenizer, goal, baseline, alpha, 3, torch.device("cpu"))(frames)
        np.testing.assert_allclose(rewards, reference, rtol=1e-5, atol=1e-6)
    assert not np.allclose(swept[0.0], swept[1.0])
    # the softmax family: the swept curve is what CLIPReward(family="softmax") gives frame by frame
    negatives = ("pole lying flat next to the cart", "an empty road")
    for soft in (True, False):
        shared = reward_shape.CLIPReward(
            model, tokenizer, goal, baseline, 0.0, 2, torch.device("cpu"), "softmax", negatives, 0.05, 0.5, soft
        )
        swept = reward_shape.score_frames(shared, frames, (0.0,), softmax=True)
        assert list(swept) == [0.0, reward_shape.SOFTMAX]
        reference = reward_shape.CLIPReward(
            model, tokenizer, goal, baseline, 0.0, 3, torch.device("cpu"), "softmax", negatives, 0.05, 0.5, soft
        )(frames)
        np.testing.assert_allclose(swept[reward_shape.SOFTMAX], reference, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="negative"):
        reward_shape.CLIPReward(model, tokenizer, goal, baseline, 0.0, 2, torch.device("cpu"), "softmax")


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------
def run_cli(monkeypatch, capsys, *argv: str) -> tuple[int, str, str]:
    """Run the script's `__main__` block in this process (saves re-importing torch per case)."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *argv])
    code = 0
    try:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("env_id", ["MountainCar-v0", "MountainCarContinuous-v0"])
def test_cli_tiny_model(monkeypatch, tmp_path, capsys, env_id):
    monkeypatch.chdir(tmp_path)
    argv = f"--env-id {env_id} --realistic --clip-models {TINY} --clip-pretrained none --alphas 0 0.5 --num-points 5 --no-cuda"
    code, out, err = run_cli(monkeypatch, capsys, *argv.split())
    assert code == 0, err
    run_dir = next(Path("runs").iterdir())
    assert len(read_csv(run_dir / "reward_shape.csv")) == 2 * 5
    assert (run_dir / "reward_shape_vlmrm-tiny-test_none.png").is_file()
    assert "goal state 0.45" in out


def test_bad_env_in_a_real_process(tmp_path):
    """The path from a refusal to `error: <sentence>` and exit code 2, once through a real process."""
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--env-id", "Pendulum-v1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: --env-id Pendulum-v1 is not supported"), result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


@pytest.fixture
def nothing_expensive(monkeypatch, tmp_path):
    """In a temporary folder, with rendering and model loading turned into test failures: refusals must come first."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(reward_shape, "render_states", lambda *a: pytest.fail("refused before any frame is rendered"))
    monkeypatch.setattr(reward_shape, "load_clip", lambda *a: pytest.fail("refused before any model is loaded"))
    return tmp_path


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--alphas"], ["--alphas needs at least one value"]),
        (["--alphas", "0", "1.5"], ["--alphas must all be in [0, 1], got 1.5"]),
        (["--alphas", "nan"], ["--alphas must all be in [0, 1]"]),
        (["--num-points", "0"], ["--num-points must be at least 2"]),
        (["--num-points", "100001"], ["--num-points must be at most 100,000", "100,001"]),
        (["--num-points", "100000000"], ["--num-points must be at most 100,000", "100,000,000"]),
        (["--env-id", "CartPole-v1", "--realistic"], ["--realistic only changes MountainCar-v0"]),
        (["--goal", "a pole", "--baseline", "a pole"], ["same prompts"]),
        (["--goal", "A Pole", "--baseline", "a  pole "], ["same prompts"]),
        (
            ["--clip-models", "RN50", "ViT-B-32", "--clip-pretrained", "openai", "openai", "openai"],
            ["one per --clip-models entry (2), got 3"],
        ),
        (["--clip-models", "RN50", "RN50", "--clip-pretrained", "openai"], ["the same model twice"]),
        # the flags as named here (--clip-models), not as in the training scripts (--clip-model)
        (["--clip-models", "NoSuchNet"], ["--clip-models NoSuchNet is not an open_clip architecture"]),
        (["--clip-models", "nothing.json"], ["--clip-models nothing.json: no such model config file"]),
        (["--clip-models", TINY], ["is a model config", "add --clip-pretrained none"]),
        (
            ["--clip-models", "RN50", "--clip-pretrained", "nosuchtag"],
            ["--clip-models RN50 needs --clip-pretrained", "nosuchtag is not one of them"],
        ),
        (["--clip-models", "RN50", "--clip-checkpoint", "nothing.pt"], ["--clip-checkpoint nothing.pt: no such file"]),
        (["--clip-models", "RN50", "ViT-B-32", "--clip-checkpoint", "w.pt"], ["--clip-checkpoint is a weights file for one"]),
        (["--reward-families"], ["--reward-families needs at least one of: projection, softmax"]),
        (["--reward-families", "softmax", "--goal", "a pole"], ["needs at least one non-empty --negatives prompt"]),
        (["--reward-families", "projection", "softmax", "--negatives"], ["needs at least one non-empty --negatives prompt"]),
        (["--reward-families", "softmax", "--negatives", " "], ["needs at least one non-empty --negatives prompt"]),
        (["--reward-families", "softmax", "--negatives", "pole vertically upright on top of the cart"], ["share the prompt"]),
        (["--goal", "pole", "upright"], ["--goal got 2 one-word prompts", '--goal "pole upright"']),  # unquoted
        (["--temperature", "0"], ["--temperature must be a positive number, got 0.0"]),
        (["--temperature", "-1"], ["--temperature must be a positive number"]),
        (["--threshold", "1"], ["--threshold must be in (0, 1), got 1.0"]),
        (["--threshold", "0"], ["--threshold must be in (0, 1)"]),
        (["--threshold", "-0.5"], ["--threshold must be in (0, 1)"]),
    ],
)
def test_bad_input_is_one_sentence_before_any_work(nothing_expensive, argv, words):
    assert_refused(reward_shape, argv, *words)


def test_num_points_must_fit_in_memory(nothing_expensive, monkeypatch):
    monkeypatch.setattr(reward_shape, "available_memory", lambda: 2**30)  # 1 GiB: 0.8 GiB / (2 x 0.72 MB) = 596 points
    assert_refused(reward_shape, ["--num-points", "1000"], "--num-points 1,000 needs about 1.3 GiB", "at most 596 points")
    with pytest.raises(pytest.fail.Exception, match="refused before any frame is rendered"):  # 500 fit
        reward_shape.main(
            tyro.cli(reward_shape.Args, args=["--num-points", "500", "--clip-models", TINY, "--clip-pretrained", "none"])
        )


def test_runs_is_a_file(nothing_expensive):
    Path("runs").write_text("not a folder")
    with pytest.raises(reward_shape.UserError, match="^runs is a file"):
        reward_shape.main(cartpole_args(clip_models=(TINY,), num_points=3))
    assert Path("runs").read_text() == "not a folder"


def test_prompts_with_the_same_embedding_are_one_sentence(in_tmp):
    """CLIP reads at most 77 tokens: prompts that differ only after them have one embedding, so d = g - b = 0.
    Found once the model has embedded them, and still before any output."""
    argv = ["--clip-models", TINY, "--clip-pretrained", "none", "--num-points", "3", "--no-cuda"]
    assert_refused(
        reward_shape,
        [*argv, "--goal", "pole " * 80 + "left", "--baseline", "pole " * 80 + "right"],
        "same CLIP embedding",
        "--alphas 0",
    )
