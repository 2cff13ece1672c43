"""VLM-RM reward shape: the CLIP reward along one state axis, per alpha and per CLIP model (paper Fig. 2), and a pose
probe for the humanoid: which of a gallery of scripted poses does your sentence reward most, before a GPU-day of SAC?

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
    # the humanoid: 13 poses set by joint angles, rendered as vlmrm_sac_humanoid.py renders them, scored per prompt and alpha
    python reward_shape.py --env-id Humanoid-v5 --goal "a humanoid robot kneeling" --prompts "a robot on its knees" \
        --expect "a humanoid robot kneeling=kneeling" "a robot on its knees=kneeling"

Writes runs/<run_name>/: reward_shape.csv (model, family, alpha, state, raw and min-max normalised reward),
summary.csv (the printed table), reward_shape_<model>.png (one curve per alpha, plus the softmax curve),
frames/ (--save-frames). Humanoid-v5 writes poses.csv (one row per pose, one column per prompt and alpha), poses.png
(the same as a heat map, with a thumbnail of each pose) and verdict.txt (--expect).
"""

import csv
import io
import math
import os
import re
import textwrap
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, NamedTuple, Optional, Union

os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame draws off-screen: no display needed
os.environ.setdefault("SDL_AUDIODRIVER", "dummy")

import gymnasium as gym
import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import numpy as np
import torch
from scipy.spatial.transform import Rotation
from scipy.stats import spearmanr

# The reward model's flags, checks and scoring are epic_eval.py's; the model and the environments are the training
# scripts' own, as the agent sees them.
from epic_eval import (
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
from vlmrm_dqn_classic import DEFAULT_PROMPTS, MOUNTAINCAR_GOAL, CLIPReward, make_env
from vlmrm_sac_humanoid import make_env as make_sac_env  # MountainCarContinuous-v0: the paper's, trained with SAC
from vlmrm_sac_humanoid import mujoco  # imported there on MUJOCO_GL's backend (a missing library: one sentence)
from vlmrm_tools import write_folder
from vlmrm_utils import (
    GIVEN,
    UserError,
    available_memory,
    check_one_word_prompts,
    check_writable,
    cli,
    load_clip,
    same_prompts,
)


@dataclass(kw_only=True)
class Args(RewardFlags):
    """Sweep one state axis, render each state as in training and score it with each CLIP model (paper Fig. 2)."""

    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (fixes the weights of a --clip-pretrained none model)"""
    env_id: str = "CartPole-v1"
    """CartPole-v1 (sweeps the pole angle, cart centred), MountainCar-v0 or MountainCarContinuous-v0 (the car position),
    Humanoid-v5 (scores a gallery of poses)"""
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
    prompts: tuple[str, ...] = ()
    """Humanoid-v5: other goal sentences to compare, each scored on its own (same --baseline) beside --goal"""
    expect: tuple[str, ...] = ()
    """Humanoid-v5: "PROMPT=POSE", one per prompt: where does POSE rank for PROMPT? (a verdict, never a failure)"""
    render_size: int = 480
    """Humanoid-v5: square frame size in pixels, as vlmrm_sac_humanoid.py --render-size"""
    render_quality: Literal["fast", "high"] = "high"
    """Humanoid-v5: as vlmrm_sac_humanoid.py --render-quality (high: shadows and reflections; fast: neither)"""
    camera: Literal["paper", "tracking"] = "paper"
    """Humanoid-v5: as vlmrm_sac_humanoid.py --camera (the paper's fixed camera, or one following the torso)"""
    renderer: Literal["egl", "warp"] = "egl"
    """Humanoid-v5: as vlmrm_sac_humanoid.py --renderer (warp: MuJoCo Warp's ray tracer)"""
    supersample: int = 2  # Humanoid-v5 with --renderer warp: rays per pixel along each axis


MAX_NUM_POINTS = 100_000
FRAME_BYTES = 400 * 600 * 3  # both envs render 600x400 RGB frames (Gymnasium's drawing and the realistic one)


def check_args(args: Args) -> list[ClipArgs]:
    """Reject bad flags before anything expensive (model download, rendering) happens; returns one entry per model."""
    if args.env_id not in (*SWEEPS, HUMANOID):
        raise UserError(f"--env-id {args.env_id} is not supported; choose one of: {', '.join((*SWEEPS, HUMANOID))}.")
    if args.realistic and not args.env_id.startswith("MountainCar"):
        raise UserError(
            f"--realistic only changes MountainCar-v0 and MountainCarContinuous-v0 drawings, not {args.env_id}'s; "
            "drop it or use a MountainCar."
        )
    if args.renderer == "warp":  # imported only with the flag
        import vlmrm_warp

        vlmrm_warp.check_available(args)  # drawn by make_env's default: CUDA when there is one
    check_reward_args(args)
    if args.env_id == HUMANOID:
        if args.num_points != Args.num_points or "num_points" in GIVEN:  # CartPole refuses 0; the probe ran with it
            raise UserError(
                f"--num-points is for the envs whose state axis is swept ({', '.join(SWEEPS)}); {HUMANOID} scores a "
                f"gallery of {len(POSES)} poses, so drop it."
            )
        check_probe_args(args)
    elif args.prompts or args.expect:
        raise UserError(f"--prompts and --expect are for the {HUMANOID} pose probe; {args.env_id} sweeps one state axis.")
    elif args.num_points < 2:
        raise UserError(f"--num-points must be at least 2 to draw a curve, got {args.num_points}.")
    elif args.num_points > MAX_NUM_POINTS:
        raise UserError(
            f"--num-points must be at most {MAX_NUM_POINTS:,} (every point is a {FRAME_BYTES / 1e6:.2g} MB "
            f"frame held in memory, and a curve needs far fewer), got {args.num_points:,}."
        )
    frames_bytes, available = 2 * args.num_points * FRAME_BYTES, available_memory()  # the frames and their stacked copy
    if args.env_id != HUMANOID and available and frames_bytes > 0.8 * available:
        raise UserError(
            f"--num-points {args.num_points:,} needs about {frames_bytes / 2**30:.1f} GiB of memory for its "
            f"frames but only {available / 2**30:.1f} GiB is available; use at most "
            f"{int(0.8 * available / (2 * FRAME_BYTES)):,} points."
        )
    if Path("runs").exists() and not Path("runs").is_dir():
        raise UserError(
            "runs is a file, but the results go to the folder runs/; move the file away or run from another folder."
        )
    check_writable("runs", advice="run from a folder where runs/ can be written")  # before the rendering, not after
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


# ----------------------------------------------------------------------------------------------
# Humanoid pose probe: does the sentence rank the pose you mean first? Scripted poses, rendered as in training
# ----------------------------------------------------------------------------------------------
HUMANOID = "Humanoid-v5"
MAX_PROBE_COLUMNS = 100  # models x prompts x curves: 100 columns make a heat map about 6,300 px wide
# arm joint angles in degrees, found by searching the joints' ranges for where the hands should be
ARMS_UP = dict(right_shoulder1=-84, right_shoulder2=-26, right_elbow=-41, left_shoulder1=83, left_shoulder2=35, left_elbow=-30)
ARMS_DOWN = dict(
    right_shoulder1=45, right_shoulder2=-40, right_elbow=-85, left_shoulder1=-45, left_shoulder2=40, left_elbow=-85
)
ARMS_OUT = dict(
    right_shoulder1=-50, right_shoulder2=-45, right_elbow=-70, left_shoulder1=50, left_shoulder2=45, left_elbow=-70
)
LEFT_ARM_DOWN = {k: v for k, v in ARMS_DOWN.items() if k.startswith("left")}
POSES = {  # name: ((yaw, pitch, roll) of the torso, {joint: angle}), degrees; unlisted joints at 0, the stock pose.
    # Turned so that the fixed camera sees what makes the pose (side-on to bend, three-quarters for the legs); the
    # angles are within the joints' ranges and were tuned so that what the pose rests on touches the floor and the
    # centre of mass is above it (tests/test_pose_probe.py checks both with MuJoCo's own contacts).
    "standing": ((0, 0, 0), {}),  # the stock pose, as after a reset
    "arms_raised": ((0, 0, 0), ARMS_UP),
    "one_arm_raised": ((0, 0, 0), {**ARMS_UP, **LEFT_ARM_DOWN}),
    "arms_out": ((0, 0, 0), ARMS_OUT),
    "hands_on_hips": (
        (0, 0, 0),
        dict(right_shoulder1=48, right_shoulder2=-79, right_elbow=-10, left_shoulder1=-48, left_shoulder2=79, left_elbow=-10),
    ),
    "one_leg_raised": ((50, -5.4, -6.2), dict(right_hip_y=-90, right_knee=-90)),
    "bending_over": ((90, 71.1, 0), dict(right_hip_y=-90, left_hip_y=-90, right_knee=-2, left_knee=-2)),
    "crouching": ((50, 35.6, 0), dict(abdomen_y=-30, right_hip_y=-110, left_hip_y=-110, right_knee=-140, left_knee=-140)),
    "kneeling": ((50, 0, 0), dict(abdomen_y=-10, right_hip_y=10, left_hip_y=10, right_knee=-94.7, left_knee=-94.7)),
    "sitting": ((50, -10, 0), dict(abdomen_y=-20, right_hip_y=-110, left_hip_y=-110, right_knee=-101.1, left_knee=-101.1)),
    "splits": (
        (0, 0, 0),
        dict(ARMS_OUT, right_hip_y=-91.9, left_hip_y=-91.9, right_hip_z=-60, left_hip_z=-60, right_knee=-2, left_knee=-2),
    ),
    "lying_on_back": ((90, -94.1, 0), dict(ARMS_DOWN, abdomen_y=3.8, right_hip_y=3.5, left_hip_y=3.5)),
    "lying_face_down": ((90, 87.1, 0), dict(ARMS_DOWN, abdomen_y=0.5, right_hip_y=3.4, left_hip_y=3.4)),
}


def set_pose(env: gym.Env, torso: tuple[float, float, float], joints: dict[str, float]) -> None:
    """Put the humanoid at rest in a pose: its centre of mass above the origin (where the paper's camera looks), its
    lowest point on the floor."""
    model, data = env.unwrapped.model, env.unwrapped.data
    data.qpos[:], data.qvel[:] = 0.0, 0.0
    x, y, z, w = Rotation.from_euler("ZYX", torso, degrees=True).as_quat()  # yaw, then pitch, then roll
    data.qpos[2:7] = 2.0, w, x, y, z  # high enough that nothing is below the floor yet
    for name, degrees in joints.items():
        data.qpos[model.jnt_qposadr[model.joint(name).id]] = math.radians(degrees)
    mujoco.mj_forward(model, data)
    floor = model.geom("floor").id
    lowest = min(mujoco.mj_geomDistance(model, data, g, floor, 10.0, None) for g in range(model.ngeom) if g != floor)
    data.qpos[:3] -= [*data.subtree_com[model.body("torso").id][:2], lowest]
    mujoco.mj_forward(model, data)


def render_poses(render_size: int, render_quality: str, camera: str, seed: int, renderer="egl", supersample=2) -> np.ndarray:
    """uint8 frames (poses, S, S, 3) from the training script's own env: its textured scene, camera and renderer."""
    look = (render_size, render_quality, True, camera, True, renderer, supersample)
    env = make_sac_env(HUMANOID, seed, 0, EPISODE_LENGTH, *look)()
    env.reset(seed=seed)  # the env renders only after a reset
    frames = []
    for torso, joints in POSES.values():
        set_pose(env, torso, joints)
        frames.append(env.render())
    env.close()
    return np.stack(frames)


def drawn_by(args: Args) -> str:
    """How the frames were drawn, as the gallery and the log say it."""
    return f"{args.render_quality} quality" if args.renderer == "egl" else f"MuJoCo Warp, {args.supersample}x supersampled"


def pose_key(name: str) -> str:
    """A pose as typed ("one leg raised", "One-Leg-Raised") -> its name in POSES ("one_leg_raised")."""
    return "_".join(name.lower().replace("-", " ").replace("_", " ").split())


def probed_prompts(args: Args) -> list[tuple[str, ...]]:
    """The goals scored, each one column per alpha: the --goal prompts together (averaged, as in training), then each
    --prompts sentence on its own."""
    return [tuple(args.goal), *((p,) for p in args.prompts)]


def prompt_name(goal: tuple[str, ...]) -> str:
    return " + ".join(f'"{g}"' for g in goal)


def expectations(args: Args) -> dict[int, int]:
    """--expect "PROMPT=POSE" -> {index in probed_prompts: index in POSES}; a PROMPT is any --goal or --prompts entry."""
    normal = lambda text: " ".join(text.lower().split())  # noqa: E731 - as CLIP's tokenizer reads it
    goals = [[normal(g) for g in goal] for goal in probed_prompts(args)]
    expected = {}
    for item in args.expect:
        prompt, sep, pose = item.rpartition("=")
        if not sep or not prompt.strip() or not pose.strip():
            raise UserError(f'--expect takes "PROMPT=POSE", e.g. "a humanoid robot kneeling=kneeling"; got "{item}".')
        if pose_key(pose) not in POSES:
            raise UserError(f'--expect "{item}": {pose.strip()} is not a pose here; choose one of: {", ".join(POSES)}.')
        entry = next((i for i, goal in enumerate(goals) if normal(prompt) in goal), None)
        if entry is None:
            raise UserError(f'--expect "{item}": "{prompt.strip()}" is not probed; add it with --goal or --prompts.')
        if entry in expected:
            raise UserError(f"--expect names the prompt {prompt_name(probed_prompts(args)[entry])} twice; give one pose each.")
        expected[entry] = list(POSES).index(pose_key(pose))
    return expected


def check_probe_args(args: Args) -> None:
    """The pose probe's own flags, in one sentence each."""
    if not 16 <= args.render_size <= 2048:  # the training script's bounds
        raise UserError(f"--render-size must be between 16 and 2048 pixels, got {args.render_size}.")
    alphas = args.alphas if "projection" in args.reward_families else ()
    check_one_word_prompts(args.prompts, "--prompts")
    for prompt in args.prompts:
        if not prompt.strip():
            raise UserError("--prompts needs non-empty sentences, got an empty one.")
        if alphas and max(alphas) > 0 and same_prompts((prompt,), args.baseline):
            raise UserError(
                f'--prompts "{prompt}" is the --baseline (ignoring case and spaces), so its goal-baseline direction is '
                "zero; drop it or use only --alphas 0."
            )
        if SOFTMAX in args.reward_families and prompt in args.negatives:
            raise UserError(f'--prompts "{prompt}" is one of the --negatives; a negative is what the goal is not.')
    curves = len(alphas) + (SOFTMAX in args.reward_families)
    columns = len(args.clip_models) * (1 + len(args.prompts)) * curves
    if columns > MAX_PROBE_COLUMNS:  # 200 prompts took 115 s, 3.1 GB and drew a heat map 62,537 px wide
        raise UserError(
            f"--prompts {len(args.prompts)} with {curves} curve{'s' * (curves > 1)} (--alphas, --reward-families) and "
            f"{len(args.clip_models)} model{'s' * (len(args.clip_models) > 1)} make {columns:,} columns in poses.png, at "
            f"most {MAX_PROBE_COLUMNS} fit in one readable heat map; probe fewer prompts, alphas or models per run."
        )
    sentences = [" ".join(p.lower().split()) for p in (*args.goal, *args.prompts)]
    twice = next(
        (p for i, p in enumerate(args.prompts) if sentences[len(args.goal) + i] in sentences[: len(args.goal) + i]), None
    )
    if twice is not None:
        raise UserError(f'--prompts "{twice}" is already probed (as --goal or earlier in --prompts); list each once.')
    expectations(args)


class Column(NamedTuple):
    """One column of the probe: a model's reward for one goal at one alpha (or the softmax family), per pose."""

    model: str
    goal: int  # index in probed_prompts
    curve: str  # "alpha=0.5", "softmax", "softmax-p"
    rewards: np.ndarray


def score_poses(args: Args, specs: list[ClipArgs], frames: np.ndarray, device: torch.device) -> list[Column]:
    """Every model x goal x curve; each model embeds the frames once, each goal reuses the embeddings."""
    alphas = args.alphas if "projection" in args.reward_families else ()
    columns = []
    for spec in specs:
        label = model_label(spec)
        torch.manual_seed(args.seed)  # a random-weights model is the same whatever its position in --clip-models
        model, tokenizer = load_clip(spec, device)
        start = time.perf_counter()
        embeddings = None
        for i, goal in enumerate(probed_prompts(args)):
            reward_model = flags_reward_model(replace(args, goal=goal), model, tokenizer, device)
            if embeddings is None:
                chunks = torch.from_numpy(frames).split(args.reward_batch_size)
                embeddings = torch.cat([reward_model.embed_images(chunk) for chunk in chunks])
            for key, rewards in score_curves(reward_model, embeddings, alphas, SOFTMAX in args.reward_families).items():
                columns.append(Column(label, i, curve_name(key, args.soft), rewards))
        print(f"{label}: scored {len(frames)} poses in {time.perf_counter() - start:.1f} s")
        del model, embeddings  # free the memory before the next (possibly bigger) model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return columns


def ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def percent(fraction: float) -> str:
    return f"{100 * fraction:.0f}%" if fraction >= 0.1 else f"{100 * fraction:.2g}%"


def verdict(column: Column, pose: int, prompt: str, model: Optional[str]) -> str:
    """One line: where the expected pose ranks for the prompt, its margin over the next pose, or what beats it."""
    names, r = list(POSES), column.rewards
    rank, ties = 1 + int((r > r[pose]).sum()), int((r == r[pose]).sum()) - 1
    others = np.delete(np.arange(len(r)), pose)
    where = f"for {prompt} at {column.curve}" + (f" ({model})" if model else "")
    spread = r.max() - r.min()
    if rank == 1 and ties == 0:
        runner_up = others[np.argmax(r[others])]
        margin = r[pose] - r[runner_up]
        return (
            f"{names[pose]} ranks 1st of {len(r)} poses {where} (margin {margin:.2g} over {names[runner_up]}, "
            f"{percent(margin / spread)} of the spread over poses)"
        )
    if rank == 1:
        return f"{names[pose]} ties for 1st of {len(r)} poses with {ties} other(s) {where}: NOT first on its own"
    top = int(np.argmax(r))
    return (
        f"{names[pose]} ranks {ordinal(rank)} of {len(r)} poses {where}: NOT first; {names[top]} scores "
        f"{r[top] - r[pose]:.2g} more ({percent((r[top] - r[pose]) / spread)} of the spread over poses)"
    )


def column_title(column: Column, args: Args, several_models: bool) -> str:
    prompt = " + ".join(probed_prompts(args)[column.goal])
    return (f"{column.model}: " if several_models else "") + f"{prompt} @ {column.curve}"


def thumbnail_box(size: int, camera: str) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) pixels of a pose's thumbnail: a square around where the body is, standing with raised
    hands or lying (the paper's camera: measured against the empty scene, tests/test_pose_probe.py)."""
    top, left, side = (0.2, 0.14, 0.72) if camera == "paper" else (0.175, 0.175, 0.65)
    return int(top * size), int((top + side) * size), int(left * size), int((left + side) * size)


def plot_poses(path: Union[Path, io.BytesIO], frames: np.ndarray, columns: list[Column], expected: dict, args: Args,
               warning=None) -> None:  # fmt: skip
    """A heat map, one row per pose (with the middle of its frame as a thumbnail), one column per model x goal x curve.
    Colour: the reward min-max scaled within its column (the column's favourite pose is the brightest); text: the pose's
    rank in its column and its gap to the column's best (the best: its margin over the second). The pose each --expect
    names is boxed in its prompt's columns."""
    names, several = list(POSES), len({c.model for c in columns}) > 1
    row, width, thumb, name_w, head = 0.72, 0.62, 0.72, 1.25, 1.5  # inches
    fig_w = max(name_w + thumb + width * len(columns) + 0.3, 6.5)
    baseline = (
        f"baseline: {' | '.join(args.baseline)}" if args.baseline and any(c.curve.startswith("alpha") for c in columns) else ""
    )
    look = f"{HUMANOID}, {frames.shape[1]} px, {drawn_by(args)}, {args.camera} camera"
    models = ", ".join(dict.fromkeys(c.model for c in columns))
    # wrapped to the figure's width (it was cut at the edge: "... paper camera; baseline: a humano"), above the plot
    header = textwrap.wrap(f"{models}; {look}" + (f"; {baseline}" if baseline else ""), int(fig_w * 15))
    head += 0.15 * (len(header) - 1)
    fig = plt.figure(figsize=(fig_w, head + row * len(names) + 1.0))
    fw, fh = fig.get_size_inches()
    bottom = 1.0 / fh
    ax = fig.add_axes([(name_w + thumb) / fw, bottom, width * len(columns) / fw, row * len(names) / fh])
    tx = fig.add_axes([name_w / fw, bottom, thumb / fw, row * len(names) / fh])
    size = frames.shape[1]
    top, bottom, left, right = thumbnail_box(size, args.camera)
    crop = frames[:, top:bottom, left:right]
    tx.imshow(np.concatenate(list(crop)), extent=(0, 1, len(names), 0), aspect="auto", interpolation="lanczos")
    tx.set(xticks=[], yticks=np.arange(len(names)) + 0.5, yticklabels=names, ylim=(len(names), 0))
    tx.tick_params(length=0, labelsize=9)
    # a flat column (e.g. a binary softmax reward that is 1 everywhere) ranks nothing: grey, not the colour of the worst
    flat = np.full(len(names), np.nan)
    scaled = np.stack([min_max_normalise(c.rewards) if np.ptp(c.rewards) > 0 else flat for c in columns], axis=1)
    cmap = plt.get_cmap("viridis").with_extremes(bad="lightgrey")
    ax.imshow(scaled, cmap=cmap, vmin=0, vmax=1, aspect="auto", extent=(0, len(columns), len(names), 0))
    for j, column in enumerate(columns):
        r = column.rewards
        ranks = 1 + (r[None, :] > r[:, None]).sum(1)
        gaps = r - r.max()
        gaps[np.argmax(r)] = r.max() - np.sort(r)[-2]  # the best: its margin over the second
        for i in range(len(names)):
            colour = "white" if scaled[i, j] <= 0.6 else "black"  # nan (a flat column): black on grey
            ax.text(j + 0.5, i + 0.42, str(ranks[i]), ha="center", va="center", color=colour, fontsize=10,
                    fontweight="bold" if ranks[i] == 1 else "normal")  # fmt: skip
            ax.text(j + 0.5, i + 0.8, f"{gaps[i]:+.2g}", ha="center", va="center", color=colour, fontsize=6)
        if expected.get(column.goal) is not None:
            i = expected[column.goal]
            ax.add_patch(plt.Rectangle((j + 0.04, i + 0.04), 0.92, 0.92, fill=False, edgecolor="red", linewidth=2.5))
    ax.set(xticks=np.arange(len(columns)) + 0.5, yticks=[], xlim=(0, len(columns)), ylim=(len(names), 0))
    ax.set_xticklabels([c.curve for c in columns], fontsize=8, rotation=90)
    ax.xaxis.tick_top()
    ax.tick_params(length=0)
    groups = {}  # consecutive columns of one model and goal share a header
    for j, column in enumerate(columns):
        groups.setdefault((column.model, column.goal), []).append(j)
    for (model, goal), js in groups.items():
        text = " + ".join(probed_prompts(args)[goal])
        text = "\n".join(textwrap.wrap(text, max(12, int(len(js) * width * 13)))[:4]) + (f"\n[{model}]" if several else "")
        ax.text((js[0] + js[-1] + 1) / 2, -0.75 - (0.35 if len(js) > 1 else 0.6), text, ha="center", va="bottom",
                fontsize=8, clip_on=False)  # fmt: skip
        if js[0] > 0:
            ax.axvline(js[0], color="white", linewidth=3)
    fig.text(0.01, 1 - 0.12 / fh, "\n".join(header), fontsize=8, va="top")
    note = "colour: the reward scaled within each column; number: the pose's rank in its column (1 = highest); below it: "
    note += "its reward minus the column's best (the best: its margin over the second)"
    note += "; red box: the pose --expect names" if expected else ""
    note += "; grey: every pose scores the same" if np.isnan(scaled).any() else ""
    note += ". Thumbnails: the middle of each frame CLIP scored (--save-frames writes them whole); poses.csv: every reward."
    lines = textwrap.wrap(note, int(fw * 17)) + ([warning] if warning else [])
    for k, line in enumerate(lines):
        red = warning is not None and k == len(lines) - 1
        fig.text(0.01, (0.15 * (len(lines) - k)) / fh, line, fontsize=8 if red else 7, color="red" if red else "black")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def probe_poses(args: Args, specs: list[ClipArgs], run_dir: Path, device: torch.device) -> Path:
    """Render the gallery, score it with every model x goal x curve, write poses.csv, poses.png and the verdicts."""
    expected = expectations(args)
    start = time.perf_counter()
    frames = render_poses(args.render_size, args.render_quality, args.camera, args.seed, args.renderer, args.supersample)
    print(
        f"run: {run_dir} on {device}; rendered {len(frames)} {HUMANOID} poses at {args.render_size} px "
        f"({drawn_by(args)}, {args.camera} camera) in {time.perf_counter() - start:.1f} s; "
        f"goal={args.goal}, prompts={args.prompts}, baseline={args.baseline}"
        + (f", negatives={args.negatives}" if SOFTMAX in args.reward_families else "")
    )
    columns = score_poses(args, specs, frames, device)
    names, several = list(POSES), len(specs) > 1
    files = {}  # written whole once all are made (a full disk leaves no half run); a refused run leaves no folder
    if args.save_frames:
        import imageio.v3 as iio

        for i, (name, frame) in enumerate(zip(names, frames)):
            files[f"frames/{i:02d}_{name}.png"] = iio.imwrite("<bytes>", frame, extension=".png")
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    writer.writerow(["pose", *(column_title(c, args, several) for c in columns)])
    writer.writerows([name, *(f"{c.rewards[i]:.8f}" for c in columns)] for i, name in enumerate(names))
    files["poses.csv"] = text.getvalue().encode()

    # what each prompt picks: its three best poses per curve
    print(f"\nthe poses each prompt rewards most ({len(names)} poses; the reward and its gap to the best)")
    for column in columns:
        order = np.argsort(-column.rewards, kind="stable")[:3]
        best = column.rewards[order[0]]
        top = "  ".join(
            f"{k + 1}. {names[i]} {column.rewards[i]:.4f}" + (f" (-{best - column.rewards[i]:.2g})" if k else "")
            for k, i in enumerate(order)
        )
        print(f"  {column_title(column, args, several)}\n      {top}")
    lines = [
        verdict(
            column, expected[column.goal], prompt_name(probed_prompts(args)[column.goal]), column.model if several else None
        )
        for column in columns
        if column.goal in expected
    ]
    if lines:
        print("\nverdict (--expect):\n" + "\n".join(f"  {line}" for line in lines))
        files["verdict.txt"] = ("\n".join(lines) + "\n").encode()
    random_weights = any(spec.clip_pretrained == "none" and spec.clip_checkpoint is None for spec in specs)
    warning = "RANDOM WEIGHTS (--clip-pretrained none): a test model, its rewards mean nothing" if random_weights else None
    png = io.BytesIO()
    plot_poses(png, frames, columns, expected, args, warning)
    files["poses.png"] = png.getvalue()
    write_folder(str(run_dir), files, "the run folder")
    print(
        (f"\nframes: {run_dir / 'frames'}" if args.save_frames else "")
        + f"\nplot: {run_dir / 'poses.png'}\ncsv: {run_dir / 'poses.csv'}"
        + (f"\nverdict: {run_dir / 'verdict.txt'}" if lines else "")
    )
    return run_dir


def main(args: Args) -> Path:
    if args.env_id in DEFAULT_PROMPTS:  # an unknown env is reported by check_args, in one sentence
        default_goal, default_baseline = DEFAULT_PROMPTS[args.env_id]
        args.goal = args.goal if args.goal is not None else (default_goal,)
        args.baseline = args.baseline if args.baseline is not None else (default_baseline,)
    specs = check_args(args)
    run_dir = Path("runs") / f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"  # made once scored
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    if args.env_id == HUMANOID:
        return probe_poses(args, specs, run_dir, device)

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
    cli(main, Args)
