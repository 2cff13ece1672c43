"""VLM-RM reward shape: the CLIP reward along one state axis, per alpha and per CLIP model (paper Fig. 2).

Sets the environment's state directly along one axis (CartPole: pole angle in [-pi/2, pi/2] with the cart
centred; MountainCar-v0 and MountainCarContinuous-v0: car position in [-1.2, 0.6], goal 0.45), renders every
state exactly as the training script does (vlmrm_dqn_classic.py; vlmrm_sac_humanoid.py for the continuous car),
embeds all frames once per CLIP model and scores them with `vlm_reward` for every alpha. A good
reward model peaks at the goal state and falls off away from it. `--reward-families projection softmax` adds
the thresholded-softmax reward (`softmax_reward`: goal against --negatives) to the same plot and tables.

    python reward_shape.py --env-id CartPole-v1 --goal "pole vertically upright on top of the cart" --baseline "pole and cart"
    python reward_shape.py --env-id MountainCar-v0 --realistic \
        --goal "a car at the peak of the mountain, next to the yellow flag" --baseline "a car in the mountain"
    # model-size comparison: one --clip-pretrained tag per --clip-models entry (or one tag for all)
    python reward_shape.py --clip-models RN50 ViT-L-14 ViT-bigG-14 --clip-pretrained openai openai laion2b_s39b_b160k
    # both reward families side by side: the alpha curves and the thresholded softmax against negative prompts
    python reward_shape.py --reward-families projection softmax --negatives "pole lying flat next to the cart"
    # offline smoke test with the tiny random model (meaningless rewards)
    python reward_shape.py --clip-models tests/vlmrm-tiny-test.json --clip-pretrained none --save-frames

Writes runs/<run_name>/: reward_shape.csv (model, family, alpha, state, raw and min-max normalised reward),
summary.csv (the printed table), reward_shape_<model>.png (one curve per alpha, plus the softmax curve),
frames/ (--save-frames).
"""

import csv
import math
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame draws off-screen: no display needed
os.environ.setdefault("SDL_AUDIODRIVER", "dummy")

import gymnasium as gym
import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import numpy as np
import torch
import tyro
from scipy.stats import spearmanr

# The reward model's flags, checks and scoring are epic_eval.py's; the model and the environments are the training
# scripts' own, as the agent sees them.
from epic_eval import (
    PROMPTS,
    SOFTMAX,
    ClipArgs,
    RewardFlags,
    check_reward_args,
    clip_args_list,
    curve_name,
    flags_reward_model,
    model_label,
    score_curves,
)
from vlmrm_dqn_classic import MOUNTAINCAR_GOAL, CLIPReward, make_env
from vlmrm_sac_humanoid import make_env as make_sac_env  # MountainCarContinuous-v0: the paper's, trained with SAC
from vlmrm_utils import UserError, available_memory, load_clip


@dataclass(kw_only=True)
class Args(RewardFlags):
    """Sweep one state axis, render each state as in training and score it with each CLIP model (paper Fig. 2)."""

    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (fixes the weights of a --clip-pretrained none model)"""
    env_id: str = "CartPole-v1"
    """CartPole-v1 (sweeps the pole angle, cart centred), MountainCar-v0 or MountainCarContinuous-v0 (the car position)"""
    realistic: bool = False
    """MountainCar only: draw a landscape (sky, hills, flag, car) instead of Gymnasium's line art"""
    num_points: int = 101
    """states on the swept axis, evenly spaced, ends included (each frame holds ~0.7 MB in memory)"""
    save_frames: bool = False
    """if toggled, save every rendered frame to `runs/<run_name>/frames/` to see what CLIP saw"""
    alphas: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    """regularisation strengths in [0, 1], one curve each: 0 = cosine similarity, 1 = only the goal-baseline direction"""
    clip_checkpoint: Optional[str] = None
    """local weights file for a single `--clip-models` entry (overrides `--clip-pretrained`)"""


MAX_NUM_POINTS = 100_000
FRAME_BYTES = 400 * 600 * 3  # both envs render 600x400 RGB frames (Gymnasium's drawing and the realistic one)


def check_args(args: Args) -> list[ClipArgs]:
    """Reject bad flags before anything expensive (model download, rendering) happens; returns one entry per model."""
    if args.env_id not in SWEEPS:
        raise UserError(f"--env-id {args.env_id} is not supported; choose one of: {', '.join(SWEEPS)}.")
    if args.realistic and not args.env_id.startswith("MountainCar"):
        raise UserError(
            f"--realistic only changes MountainCar-v0 and MountainCarContinuous-v0 drawings, not {args.env_id}'s; "
            "drop it or use a MountainCar."
        )
    check_reward_args(args)
    if args.num_points < 2:
        raise UserError(f"--num-points must be at least 2 to draw a curve, got {args.num_points}.")
    if args.num_points > MAX_NUM_POINTS:
        raise UserError(
            f"--num-points must be at most {MAX_NUM_POINTS:,} (every point is a {FRAME_BYTES / 1e6:.2g} MB "
            f"frame held in memory, and a curve needs far fewer), got {args.num_points:,}."
        )
    frames_bytes, available = 2 * args.num_points * FRAME_BYTES, available_memory()  # the frames and their stacked copy
    if available and frames_bytes > 0.8 * available:
        raise UserError(
            f"--num-points {args.num_points:,} needs about {frames_bytes / 2**30:.1f} GiB of memory for its "
            f"frames but only {available / 2**30:.1f} GiB is available; use at most "
            f"{int(0.8 * available / (2 * FRAME_BYTES)):,} points."
        )
    if Path("runs").exists() and not Path("runs").is_dir():
        raise UserError(
            "runs is a file, but the results go to the folder runs/; move the file away or run from another folder."
        )
    if args.reward_batch_size < 1:
        raise UserError(f"--reward-batch-size must be a positive integer, got {args.reward_batch_size}.")
    if args.clip_checkpoint is not None and len(args.clip_models) != 1:
        raise UserError(
            f"--clip-checkpoint is a weights file for one model, but --clip-models names {len(args.clip_models)}; "
            "run once per checkpoint."
        )
    checkpoints = (args.clip_checkpoint,) * len(args.clip_models)
    return clip_args_list(args.clip_models, args.clip_pretrained, checkpoints, args.clip_cache_dir, "--clip-checkpoint")


# ----------------------------------------------------------------------------------------------
# Reward shape: sweep one state axis, render, score, summarise, plot
# ----------------------------------------------------------------------------------------------
SWEEPS = {  # env -> (axis label, low, high): the paper's Fig. 2 ranges
    "CartPole-v1": ("pole angle theta (rad), cart centred", -math.pi / 2, math.pi / 2),
    "MountainCar-v0": ("car position x", -1.2, 0.6),
    "MountainCarContinuous-v0": ("car position x", -1.2, 0.6),
}
EPISODE_LENGTH = 200  # make_env needs one; the sweep never steps, so it has no effect


def set_state(env: gym.Env, env_id: str, value: float) -> None:
    """Put the env in the swept state; everything else at rest (cart centred, no velocity)."""
    env.unwrapped.state = np.array([0.0, 0.0, value, 0.0] if env_id == "CartPole-v1" else [value, 0.0], dtype=np.float64)


def render_states(env_id: str, realistic: bool, states: np.ndarray, seed: int) -> tuple[np.ndarray, float]:
    """uint8 frames (N, H, W, 3), one per state, through the same wrapper stack as training; and the goal state
    (the upright pole, or the paper's flag where FixedLengthMountainCar and RealisticMountainCar put it)."""
    if env_id == "MountainCarContinuous-v0":  # render size and quality only apply to MuJoCo scenes
        env = make_sac_env(env_id, seed, 0, EPISODE_LENGTH, 480, "high", realistic)()
    else:
        env = make_env(env_id, seed, 0, EPISODE_LENGTH, realistic)()
    env.reset(seed=seed)  # the env renders only after a reset
    frames = []
    for value in states:
        set_state(env, env_id, float(value))
        frames.append(env.render())
    env.close()
    return np.stack(frames), 0.0 if env_id == "CartPole-v1" else MOUNTAINCAR_GOAL


@torch.no_grad()
def score_frames(
    reward_model: CLIPReward, frames: np.ndarray, alphas: tuple[float, ...], softmax: bool = False
) -> dict[Union[float, str], np.ndarray]:
    """Rewards per curve (one per alpha, and the thresholded softmax under SOFTMAX); the frames are embedded once."""
    chunks = torch.from_numpy(np.ascontiguousarray(frames)).split(reward_model.batch_size)
    return score_curves(reward_model, torch.cat([reward_model.embed_images(chunk) for chunk in chunks]), alphas, softmax)


def legend_name(key: Union[float, str], args: Args) -> str:
    """A curve's name in the plot legend."""
    if key != SOFTMAX:
        return f"alpha = {key:g}"
    return f"softmax, tau = {args.temperature:g}, " + ("soft p" if args.soft else f"1[p > {args.threshold:g}]")


def min_max_normalise(rewards: np.ndarray) -> np.ndarray:
    """Rescale to [0, 1] for display (each alpha's rewards span a different range); a flat curve maps to 0."""
    span = rewards.max() - rewards.min()
    return (rewards - rewards.min()) / span if span > 0 else np.zeros_like(rewards)


def shape_score(states: np.ndarray, rewards: np.ndarray, goal: float) -> float:
    """Spearman rank correlation between the reward and the closeness to the goal (-|state - goal|).

    +1: the reward rises strictly as the state nears the goal, whatever its scale or curvature (the ideal
    shape); 0: unrelated; -1: highest far from the goal. nan for a flat reward.
    """
    closeness = -np.round(np.abs(states - goal), 9)  # round so that mirror states (+-theta) tie exactly
    if np.ptp(closeness) == 0 or np.ptp(rewards) == 0:  # a flat side: no ranking to correlate
        return float("nan")
    return float(spearmanr(closeness, rewards).statistic)


def plot_model(path: Path, label: str, states, goal: float, rewards: dict, axis_label: str, title: str, warning=None) -> None:
    """One curve per legend entry (alpha, softmax), each min-max normalised, with its maximum (a triangle) and
    the goal state marked; the softmax curve is drawn in red, dotted, to stand apart from the alpha curves."""
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    colours = iter(plt.cm.viridis(np.linspace(0, 0.9, max(sum(not n.startswith(SOFTMAX) for n in rewards), 1))))
    for name, r in rewards.items():
        softmax = name.startswith(SOFTMAX)
        colour = "tab:red" if softmax else next(colours)
        style = dict(linestyle=":", linewidth=2) if softmax else dict(linestyle="-", linewidth=1.5)
        ax.plot(states, min_max_normalise(r), color=colour, label=name, **style)
        if r.max() > r.min():  # a flat curve has no maximum to mark
            ax.plot(states[int(np.argmax(r))], 1.0, marker="v", markersize=8, color=colour, clip_on=False)
    ax.axvline(goal, color="black", linestyle="--", linewidth=1, label=f"goal state ({goal:g})")
    ax.set(
        xlabel=axis_label, ylabel="CLIP reward, min-max normalised per curve", xlim=(states[0], states[-1]), ylim=(-0.03, 1.03)
    )
    ax.set_title(f"{label}, {title}", fontsize=8)
    if warning:
        fig.text(0.5, -0.02, warning, ha="center", va="top", color="red", fontsize=9)  # below the x label, hides nothing
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: never hides a curve
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def write_tables(run_dir: Path, results: dict, states: np.ndarray, goal: float, args: Args) -> None:
    """reward_shape.csv (every point of every curve), summary.csv and the printed table (one row per curve)."""
    family = lambda key: ("softmax", "") if key == SOFTMAX else ("projection", key)  # noqa: E731 - (family, alpha)
    with open(run_dir / "reward_shape.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "family", "alpha", "state", "reward", "reward_normalised"])
        for label, curves in results.items():
            for key, r in curves.items():
                for value, raw, norm in zip(states, r, min_max_normalise(r)):
                    writer.writerow([label, *family(key), f"{value:.8f}", f"{raw:.8f}", f"{norm:.8f}"])
    rows = []
    for label, curves in results.items():
        for key, r in curves.items():
            # a binary curve: the first state where it is 1; a flat curve has no maximum (nan)
            best = states[int(np.argmax(r))] if r.max() > r.min() else float("nan")
            rows.append([label, key, best, abs(best - goal), shape_score(states, r, goal), r.min(), r.max()])
    header = ["model", "family", "alpha", "argmax_state", "distance_to_goal", "shape_score", "reward_min", "reward_max"]
    with open(run_dir / "summary.csv", "w", newline="") as f:
        csv.writer(f).writerows([header] + [[r[0], *family(r[1])] + [f"{v:.10g}" for v in r[2:]] for r in rows])
    width = max(len(h) for h in header[:1] + [r[0] for r in rows])
    axis_label = SWEEPS[args.env_id][0]
    print(
        f"\nreward shape on {args.env_id}, state axis: {axis_label}, goal state {goal:g}; "
        "shape_score = Spearman correlation of reward and closeness to the goal (1 = ideal)"
    )
    columns = ["curve", "argmax_state", "distance_to_goal", "shape_score", "reward_min", "reward_max"]
    print(f"{'model':<{width}}  {columns[0]:>10}  " + "  ".join(f"{c:>{max(len(c), 10)}}" for c in columns[1:]))
    for label, key, best, distance, score, r_min, r_max in rows:
        print(
            f"{label:<{width}}  {curve_name(key, args.soft):>10}  {best:>12.4f}  {distance:>16.4f}  {score:>11.3f}  "
            f"{r_min:>10.4f}  {r_max:>10.4f}"
        )


def main(args: Args) -> Path:
    if args.env_id in PROMPTS:  # an unknown env is reported by check_args, in one sentence
        default_goal, default_baseline = PROMPTS[args.env_id]
        args.goal = args.goal if args.goal is not None else (default_goal,)
        args.baseline = args.baseline if args.baseline is not None else (default_baseline,)
    specs = check_args(args)
    run_dir = Path("runs") / f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"  # made once scored
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")

    axis_label, low, high = SWEEPS[args.env_id]
    states = np.linspace(low, high, args.num_points)
    start = time.perf_counter()
    frames, goal = render_states(args.env_id, args.realistic, states, args.seed)
    look = " (realistic)" if args.realistic else ""
    print(
        f"run: {run_dir} on {device}; rendered {len(frames)} {args.env_id}{look} states in "
        f"{time.perf_counter() - start:.1f} s; goal={args.goal}, baseline={args.baseline}"
        + (f", negatives={args.negatives}" if SOFTMAX in args.reward_families else "")
    )
    alphas = args.alphas if "projection" in args.reward_families else ()
    softmax = SOFTMAX in args.reward_families
    results: dict[str, dict[Union[float, str], np.ndarray]] = {}
    for spec in specs:
        label = model_label(spec)
        torch.manual_seed(args.seed)  # a random-weights model is the same whatever its position in --clip-models
        model, tokenizer = load_clip(spec, device)
        reward_model = flags_reward_model(args, model, tokenizer, device)
        start = time.perf_counter()
        results[label] = score_frames(reward_model, frames, alphas, softmax)
        print(f"{label}: scored {len(frames)} frames in {time.perf_counter() - start:.1f} s")
        del model, reward_model  # free the memory before the next (possibly bigger) model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    run_dir.mkdir(parents=True, exist_ok=True)  # only now: a refused run (e.g. prompts CLIP cannot tell apart) leaves none
    if args.save_frames:
        import imageio

        (run_dir / "frames").mkdir(exist_ok=True)
        for i, (value, frame) in enumerate(zip(states, frames)):
            imageio.imwrite(run_dir / "frames" / f"{i:04d}_{value:+.4f}.png", frame)
        print(f"frames saved to {run_dir / 'frames'} (CLIP sees each one squashed to its square input size)")
    write_tables(run_dir, results, states, goal, args)

    for spec, (label, curves) in zip(specs, results.items()):
        title = f"{args.env_id}{look}\ngoal: {' | '.join(args.goal)}"
        title += f"\nbaseline: {' | '.join(args.baseline)}" if alphas else ""
        title += f"\nnegatives: {' | '.join(args.negatives)}" if softmax else ""
        random_weights = spec.clip_pretrained == "none" and spec.clip_checkpoint is None
        warning = "RANDOM WEIGHTS (--clip-pretrained none): a test model, its curves mean nothing" if random_weights else None
        path = run_dir / f"reward_shape_{re.sub(r'[^A-Za-z0-9._-]+', '_', label)}.png"
        plot_model(path, label, states, goal, {legend_name(k, args): r for k, r in curves.items()}, axis_label, title, warning)
        print(f"plot: {path}")
    print(f"csv: {run_dir / 'reward_shape.csv'}, {run_dir / 'summary.csv'}")
    return run_dir


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message=".*No pretrained weights.*")
    try:
        main(tyro.cli(Args))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
