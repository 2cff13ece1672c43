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
from typing import Literal, Optional, Union

os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame draws off-screen: no display needed
os.environ.setdefault("SDL_AUDIODRIVER", "dummy")

import gymnasium as gym
import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import numpy as np
import torch
import tyro

# One source of truth: the reward model and the environments are the training scripts' own, as the agent sees them.
from vlmrm_dqn_classic import (
    DEFAULT_PROMPTS,
    MOUNTAINCAR_GOAL,
    CLIPReward,
    UserError,
    available_memory,
    check_clip_args,
    check_goal_direction,
    load_clip,
    make_env,
    resolve_negatives,
    same_prompts,
    softmax_reward,
    vlm_reward,
)
from vlmrm_sac_humanoid import make_env as make_sac_env  # MountainCarContinuous-v0: the paper's, trained with SAC


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (fixes the weights of a --clip-pretrained none model)"""
    cuda: bool = True
    """if toggled, CUDA (when available) runs the reward model"""

    # Environment and sweep
    env_id: str = "CartPole-v1"
    """CartPole-v1 (sweeps the pole angle, cart centred), MountainCar-v0 or MountainCarContinuous-v0 (the car position)"""
    realistic: bool = False
    """MountainCar only: draw a landscape (sky, hills, flag, car) instead of Gymnasium's line art"""
    num_points: int = 101
    """states on the swept axis, evenly spaced, ends included (each frame holds ~0.7 MB in memory)"""
    save_frames: bool = False
    """if toggled, save every rendered frame to `runs/<run_name>/frames/` to see what CLIP saw"""

    # Reward
    goal: Optional[tuple[str, ...]] = None
    """goal prompt(s); default: a description of the task's goal state"""
    baseline: Optional[tuple[str, ...]] = None
    """baseline prompt(s) for the goal-baseline projection; default: a description of the scene"""
    alphas: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    """regularisation strengths in [0, 1], one curve each: 0 = plain cosine similarity, 1 = only the goal-baseline direction"""
    clip_models: tuple[str, ...] = ("ViT-bigG-14",)
    """open_clip architecture names, or paths of open_clip model configs (.json); several = a model comparison"""
    clip_pretrained: tuple[str, ...] = ("laion2b_s39b_b160k",)
    """open_clip pretrained tag per --clip-models entry, or one tag for all ("none" = random weights, for tests only)"""
    clip_checkpoint: Optional[str] = None
    """local weights file for a single `--clip-models` entry (overrides `--clip-pretrained`)"""
    clip_cache_dir: Optional[str] = None
    """where downloaded CLIP weights are cached (default: the Hugging Face cache)"""
    reward_batch_size: int = 64
    """frames scored per CLIP forward pass"""
    reward_families: tuple[Literal["projection", "softmax"], ...] = ("projection",)
    """reward families to draw side by side: projection (one curve per --alphas), softmax (one curve: goal vs --negatives)"""
    negatives: Optional[tuple[str, ...]] = None
    """softmax family: prompts the goal is contrasted with; default: our negatives for the default --goal (none for others)"""
    temperature: float = 0.01
    """softmax family: temperature tau of the softmax over cosine similarities (0.01 = CLIP's own logit scale 100)"""
    threshold: float = 0.5
    """softmax family: the reward is 1 when the goal's probability is above this, else 0; in (0, 1)"""
    soft: bool = False
    """softmax family: if toggled, the reward is the goal's probability itself instead of 0/1"""
    antialias: bool = False
    """if toggled, antialias the bicubic squash of frames to CLIP's input (default off, as in the paper's code)"""


@dataclass
class ClipModelArgs:
    """One entry of --clip-models, with the field names that check_clip_args and load_clip read."""

    clip_model: str
    clip_pretrained: str
    clip_checkpoint: Optional[str]
    clip_cache_dir: Optional[str]


MAX_NUM_POINTS = 100_000
FRAME_BYTES = 400 * 600 * 3  # both envs render 600x400 RGB frames (Gymnasium's drawing and the realistic one)


def check_args(args: Args) -> list[ClipModelArgs]:
    """Reject bad flags before anything expensive (model download, rendering) happens; returns one entry per model."""
    if args.env_id not in PROMPTS:
        raise UserError(f"--env-id {args.env_id} is not supported; choose one of: {', '.join(PROMPTS)}.")
    if args.realistic and not args.env_id.startswith("MountainCar"):
        raise UserError(
            f"--realistic only changes MountainCar-v0 and MountainCarContinuous-v0 drawings, not {args.env_id}'s; "
            "drop it or use a MountainCar."
        )
    if not args.reward_families:
        raise UserError("--reward-families needs at least one of: projection, softmax.")
    projection = "projection" in args.reward_families
    if projection and not args.alphas:
        raise UserError("--alphas needs at least one value in [0, 1], e.g. --alphas 0 0.5 1.")
    for alpha in args.alphas if projection else ():
        if not 0.0 <= alpha <= 1.0:  # also rejects nan
            raise UserError(f"--alphas must all be in [0, 1], got {alpha}.")
    if not args.goal or any(not g.strip() for g in args.goal):
        raise UserError(
            '--goal needs at least one non-empty prompt, e.g. --goal "pole vertically upright on top of the cart".'
        )
    if projection and max(args.alphas) > 0 and (not args.baseline or any(not b.strip() for b in args.baseline)):
        raise UserError("--baseline needs at least one non-empty prompt when an alpha is > 0.")
    if projection and max(args.alphas) > 0 and same_prompts(args.goal, args.baseline):
        raise UserError(
            f"--goal and --baseline are the same prompts (ignoring case and spaces), so the goal-baseline direction is zero; change one or use --alphas 0 (got alpha {max(args.alphas)})."
        )
    if not 0 < args.temperature < float("inf"):  # also rejects nan
        raise UserError(f"--temperature must be a positive number, got {args.temperature}.")
    if not 0 < args.threshold < 1:
        raise UserError(f"--threshold must be in (0, 1), got {args.threshold}.")
    if "softmax" in args.reward_families:
        args.negatives = resolve_negatives(args.goal, args.negatives, "--reward-families softmax")
    if args.num_points < 2:
        raise UserError(f"--num-points must be at least 2 to draw a curve, got {args.num_points}.")
    if args.num_points > MAX_NUM_POINTS:
        raise UserError(
            f"--num-points must be at most {MAX_NUM_POINTS:,} (every point is a {FRAME_BYTES / 1e6:.2g} MB "
            f"frame held in memory, and a curve needs far fewer), got {args.num_points:,}."
        )
    frames_bytes = 2 * args.num_points * FRAME_BYTES  # the rendered frames, and their stacked copy
    available = available_memory()
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
    if not args.clip_models:
        raise UserError("--clip-models needs at least one model, e.g. --clip-models ViT-bigG-14.")
    if len(args.clip_pretrained) not in (1, len(args.clip_models)):
        raise UserError(
            f"--clip-pretrained needs one tag, or one per --clip-models entry ({len(args.clip_models)}), got {len(args.clip_pretrained)}."
        )
    if args.clip_checkpoint is not None and len(args.clip_models) != 1:
        raise UserError(
            f"--clip-checkpoint is a weights file for one model, but --clip-models names {len(args.clip_models)}; run once per checkpoint."
        )
    tags = args.clip_pretrained * len(args.clip_models) if len(args.clip_pretrained) == 1 else args.clip_pretrained
    specs = [ClipModelArgs(m, t, args.clip_checkpoint, args.clip_cache_dir) for m, t in zip(args.clip_models, tags)]
    labels = [model_label(spec) for spec in specs]
    if len(set(labels)) != len(labels):
        raise UserError(f"--clip-models/--clip-pretrained name the same model twice ({', '.join(labels)}); list each once.")
    for spec in specs:  # every model is checked before the first one is loaded
        check_clip_args(spec)
    return specs


# ----------------------------------------------------------------------------------------------
# Reward shape: sweep one state axis, render, score, summarise, plot
# ----------------------------------------------------------------------------------------------
SWEEPS = {  # env -> (axis label, low, high): the paper's Fig. 2 ranges
    "CartPole-v1": ("pole angle theta (rad), cart centred", -math.pi / 2, math.pi / 2),
    "MountainCar-v0": ("car position x", -1.2, 0.6),
    "MountainCarContinuous-v0": ("car position x", -1.2, 0.6),
}
PROMPTS = {**DEFAULT_PROMPTS, "MountainCarContinuous-v0": DEFAULT_PROMPTS["MountainCar-v0"]}  # the SAC script's defaults too
EPISODE_LENGTH = 200  # make_env needs one; the sweep never steps, so it has no effect


def model_label(spec: ClipModelArgs) -> str:
    """A readable name for a model in the CSV, table and plot: "<architecture>/<weights>"."""
    name = Path(spec.clip_model).stem if spec.clip_model.endswith(".json") else spec.clip_model
    weights = Path(spec.clip_checkpoint).name if spec.clip_checkpoint else spec.clip_pretrained
    return f"{name}/{weights}"


def goal_state(env: gym.Env, env_id: str) -> float:
    """The state the goal prompt describes: the upright pole, or the flag where the renderer draws it."""
    if env_id == "CartPole-v1":
        return 0.0
    return MOUNTAINCAR_GOAL  # the paper's flag, where FixedLengthMountainCar and RealisticMountainCar put it


def set_state(env: gym.Env, env_id: str, value: float) -> None:
    """Put the env in the swept state; everything else at rest (cart centred, no velocity)."""
    if env_id == "CartPole-v1":
        env.unwrapped.state = np.array([0.0, 0.0, value, 0.0], dtype=np.float64)
    else:
        env.unwrapped.state = np.array([value, 0.0], dtype=np.float64)


def render_states(env_id: str, realistic: bool, states: np.ndarray, seed: int) -> tuple[np.ndarray, float]:
    """uint8 frames (N, H, W, 3), one per state, through the same wrapper stack as training; and the goal state."""
    if env_id == "MountainCarContinuous-v0":  # render size and quality only apply to MuJoCo scenes
        env = make_sac_env(env_id, seed, 0, EPISODE_LENGTH, 480, "high", realistic)()
    else:
        env = make_env(env_id, seed, 0, EPISODE_LENGTH, realistic)()
    env.reset(seed=seed)  # the env renders only after a reset
    frames = []
    for value in states:
        set_state(env, env_id, float(value))
        frames.append(env.render())
    goal = goal_state(env, env_id)
    env.close()
    return np.stack(frames), goal


SOFTMAX = "softmax"  # the key of the thresholded-softmax curve; the projection curves are keyed by their alpha


@torch.no_grad()
def score_frames(
    reward_model: CLIPReward, frames: np.ndarray, alphas: tuple[float, ...], softmax: bool = False
) -> dict[Union[float, str], np.ndarray]:
    """Rewards per curve: one per alpha (projection family) and, with softmax=True, the thresholded softmax
    (the reward model's negatives, temperature, threshold and soft setting) under the key SOFTMAX.
    The frames are embedded once; only the cheap scoring is repeated per curve."""
    chunks = torch.from_numpy(np.ascontiguousarray(frames)).split(reward_model.batch_size)
    image_embeddings = torch.cat([reward_model.embed_images(chunk) for chunk in chunks])
    curves: dict[Union[float, str], np.ndarray] = {
        alpha: vlm_reward(image_embeddings, reward_model.goal_embeddings, reward_model.baseline_embeddings, alpha)
        .cpu()
        .numpy()
        for alpha in alphas
    }
    if softmax:
        curves[SOFTMAX] = (
            softmax_reward(
                image_embeddings,
                reward_model.goal_embeddings,
                reward_model.negative_embeddings,
                reward_model.temperature,
                reward_model.threshold,
                reward_model.soft,
            )
            .cpu()
            .numpy()
        )
    return curves


def curve_name(key: Union[float, str], args: Args, short: bool = False) -> str:
    """How a curve is named in the printed table (short) and the plot legend."""
    if key != SOFTMAX:
        return f"alpha={key:g}" if short else f"alpha = {key:g}"
    if short:
        return "softmax-p" if args.soft else "softmax"
    return f"softmax, tau = {args.temperature:g}, " + ("soft p" if args.soft else f"1[p > {args.threshold:g}]")


def min_max_normalise(rewards: np.ndarray) -> np.ndarray:
    """Rescale to [0, 1] for display (each alpha's rewards span a different range); a flat curve maps to 0."""
    span = rewards.max() - rewards.min()
    return (rewards - rewards.min()) / span if span > 0 else np.zeros_like(rewards)


def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 0..N-1 where tied values share the mean of their ranks (as Spearman's correlation needs)."""
    ranks = np.empty(len(x))
    ranks[np.argsort(x, kind="stable")] = np.arange(len(x))
    _, tie_group, tie_count = np.unique(x, return_inverse=True, return_counts=True)
    return (np.bincount(tie_group, weights=ranks) / tie_count)[tie_group]


def shape_score(states: np.ndarray, rewards: np.ndarray, goal: float) -> float:
    """Spearman rank correlation between the reward and the closeness to the goal (-|state - goal|).

    +1: the reward rises strictly as the state nears the goal, whatever its scale or curvature (the ideal
    shape); 0: unrelated; -1: highest far from the goal. nan for a flat reward.
    """
    closeness = -np.round(np.abs(states - goal), 9)  # round so that mirror states (+-theta) tie exactly
    a, b = average_ranks(closeness), average_ranks(rewards)
    if a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


def plot_model(
    path: Path,
    label: str,
    states: np.ndarray,
    goal: float,
    rewards: dict[str, np.ndarray],
    axis_label: str,
    title: str,
    warning: Optional[str] = None,
) -> None:
    """One curve per legend entry (alpha, softmax), each min-max normalised, with its maximum (a triangle) and
    the goal state marked; the softmax curve is drawn in red, dotted, to stand apart from the alpha curves."""
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    n_projection = sum(not name.startswith(SOFTMAX) for name in rewards)
    colours = iter(plt.cm.viridis(np.linspace(0, 0.9, max(n_projection, 1))))
    for name, r in rewards.items():
        softmax = name.startswith(SOFTMAX)
        colour = "tab:red" if softmax else next(colours)
        ax.plot(
            states,
            min_max_normalise(r),
            color=colour,
            label=name,
            linestyle=":" if softmax else "-",
            linewidth=2 if softmax else 1.5,
        )
        if r.max() > r.min():  # a flat curve has no maximum to mark
            ax.plot(states[int(np.argmax(r))], 1.0, marker="v", markersize=8, color=colour, clip_on=False)
    ax.axvline(goal, color="black", linestyle="--", linewidth=1, label=f"goal state ({goal:g})")
    ax.set_xlabel(axis_label)
    ax.set_ylabel("CLIP reward, min-max normalised per curve")
    ax.set_xlim(states[0], states[-1])
    ax.set_ylim(-0.03, 1.03)
    ax.set_title(f"{label}, {title}", fontsize=8)
    if warning:
        fig.text(0.5, -0.02, warning, ha="center", va="top", color="red", fontsize=9)  # below the x label, hides nothing
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: never hides a curve
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def main(args: Args) -> Path:
    if args.env_id in PROMPTS:  # an unknown env is reported by check_args, in one sentence
        default_goal, default_baseline = PROMPTS[args.env_id]
        args.goal = args.goal if args.goal is not None else (default_goal,)
        args.baseline = args.baseline if args.baseline is not None else (default_baseline,)
    specs = check_args(args)
    run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = Path("runs") / run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")

    axis_label, low, high = SWEEPS[args.env_id]
    states = np.linspace(low, high, args.num_points)
    start = time.perf_counter()
    frames, goal = render_states(args.env_id, args.realistic, states, args.seed)
    print(
        f"run: {run_dir} on {device}; rendered {len(frames)} {args.env_id}{' (realistic)' if args.realistic else ''} "
        f"states in {time.perf_counter() - start:.1f} s; goal={args.goal}, baseline={args.baseline}"
        + (f", negatives={args.negatives}" if "softmax" in args.reward_families else "")
    )
    if args.save_frames:
        import imageio

        (run_dir / "frames").mkdir(exist_ok=True)
        for i, (value, frame) in enumerate(zip(states, frames)):
            imageio.imwrite(run_dir / "frames" / f"{i:04d}_{value:+.4f}.png", frame)
        print(f"frames saved to {run_dir / 'frames'} (CLIP sees each one squashed to its square input size)")

    alphas = args.alphas if "projection" in args.reward_families else ()
    softmax = "softmax" in args.reward_families
    results: dict[str, dict[Union[float, str], np.ndarray]] = {}
    for spec in specs:
        label = model_label(spec)
        torch.manual_seed(args.seed)  # a random-weights model is the same whatever its position in --clip-models
        model, tokenizer = load_clip(spec, device)
        # alpha and family only matter in CLIPReward.forward, which we bypass to embed the frames once for all curves
        reward_model = CLIPReward(
            model,
            tokenizer,
            args.goal,
            args.baseline,
            0.0,
            args.reward_batch_size,
            device,
            "softmax" if softmax else "projection",
            args.negatives or (),
            args.temperature,
            args.threshold,
            args.soft,
            args.antialias,
        )
        if alphas:  # prompts that differ only where CLIP cannot see (e.g. past its 77 tokens) have d = 0
            check_goal_direction(reward_model.goal_embeddings, reward_model.baseline_embeddings, max(alphas), "--alphas")
        start = time.perf_counter()
        results[label] = score_frames(reward_model, frames, alphas, softmax)
        print(f"{label}: scored {len(frames)} frames in {time.perf_counter() - start:.1f} s")
        del model, reward_model  # free the memory before the next (possibly bigger) model
        if device.type == "cuda":
            torch.cuda.empty_cache()

    with open(run_dir / "reward_shape.csv", "w", newline="") as f:
        writer = csv.writer(f)
        # family: projection or softmax; alpha: empty for the softmax curve
        writer.writerow(["model", "family", "alpha", "state", "reward", "reward_normalised"])
        for label, curves in results.items():
            for key, r in curves.items():
                family, alpha = ("softmax", "") if key == SOFTMAX else ("projection", key)
                for value, raw, norm in zip(states, r, min_max_normalise(r)):
                    writer.writerow([label, family, alpha, f"{value:.8f}", f"{raw:.8f}", f"{norm:.8f}"])

    rows = []
    for label, curves in results.items():
        for key, r in curves.items():
            # a binary curve: the first state where it is 1; a flat curve has no maximum (nan)
            best = states[int(np.argmax(r))] if r.max() > r.min() else float("nan")
            rows.append([label, key, best, abs(best - goal), shape_score(states, r, goal), r.min(), r.max()])
    header = ["model", "family", "alpha", "argmax_state", "distance_to_goal", "shape_score", "reward_min", "reward_max"]
    with open(run_dir / "summary.csv", "w", newline="") as f:
        csv.writer(f).writerows(
            [header]
            + [
                [r[0], *(("softmax", "") if r[1] == SOFTMAX else ("projection", r[1]))] + [f"{v:.10g}" for v in r[2:]]
                for r in rows
            ]
        )
    width = max(len(h) for h in header[:1] + [r[0] for r in rows])
    print(
        f"\nreward shape on {args.env_id}, state axis: {axis_label}, goal state {goal:g}; "
        "shape_score = Spearman correlation of reward and closeness to the goal (1 = ideal)"
    )
    print(
        f"{'model':<{width}}  {'curve':>10}  {'argmax_state':>12}  {'distance_to_goal':>16}  {'shape_score':>11}  {'reward_min':>10}  {'reward_max':>10}"
    )
    for label, key, best, distance, score, r_min, r_max in rows:
        print(
            f"{label:<{width}}  {curve_name(key, args, short=True):>10}  {best:>12.4f}  {distance:>16.4f}  {score:>11.3f}  {r_min:>10.4f}  {r_max:>10.4f}"
        )

    for spec, (label, curves) in zip(specs, results.items()):
        title = f"{args.env_id}{' (realistic)' if args.realistic else ''}\ngoal: {' | '.join(args.goal)}"
        if alphas:
            title += f"\nbaseline: {' | '.join(args.baseline)}"
        if softmax:
            title += f"\nnegatives: {' | '.join(args.negatives)}"
        random_weights = spec.clip_pretrained == "none" and spec.clip_checkpoint is None
        warning = "RANDOM WEIGHTS (--clip-pretrained none): a test model, its curves mean nothing" if random_weights else None
        path = run_dir / f"reward_shape_{re.sub(r'[^A-Za-z0-9._-]+', '_', label)}.png"
        plot_model(path, label, states, goal, {curve_name(k, args): r for k, r in curves.items()}, axis_label, title, warning)
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
