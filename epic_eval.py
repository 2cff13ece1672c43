"""VLM-RM evaluation: how close is a CLIP reward to human judgement? EPIC distance to labelled states.

The paper's quantitative evaluation (Fig. 4a): collect states of an environment, label them (by hand,
or with the ground truth where the environment has one), score every frame with each CLIP reward model
(model x alpha) and report the EPIC distance between the reward and the labels. For a state-only reward
on a fixed dataset of states EPIC reduces to sqrt((1 - rho) / 2), rho = Pearson correlation between the
reward and the labels: 0 = same ordering up to a positive affine map, 1 = opposite.
One file, three subcommands:

    # 1. states + frames, from random actions (or --policy: a checkpoint.pt of either training script)
    python epic_eval.py collect --env-id CartPole-v1 --num-frames 200 --out data/cartpole
    # 2. label them in the browser at http://127.0.0.1:8765 (keys: 1 success, 0 failure, s skip, Backspace back);
    #    the page is label_server.py's label_page.html, next to this script
    python epic_eval.py label --dataset data/cartpole
    # 3. EPIC (with a bootstrap interval), ROC AUC and PR AUC per model and alpha -> runs/<run_name>/
    python epic_eval.py score --dataset data/cartpole --clip-models RN50 ViT-L-14 --clip-pretrained openai \
        --alphas 0 0.5 1            # --labels gt uses the ground-truth column instead of your labels
    #    ...both reward families side by side: the projection per alpha and the thresholded softmax vs negatives
    python epic_eval.py score --dataset data/cartpole --reward-families projection softmax \
        --negatives "pole lying flat next to the cart"

Dataset layout: <dataset>/frames/*.png, <dataset>/states.csv (frame, env_id, episode, step, state
columns, gt), <dataset>/labels.csv (frame, label, time; append-only, the last label of a frame wins).
"""

import csv
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Callable, Literal, Optional, Union

os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame draws off-screen: no display needed
os.environ.setdefault("SDL_AUDIODRIVER", "dummy")

import gymnasium as gym
import imageio.v2 as imageio
import numpy as np
import torch
import tyro
from scipy.stats import mannwhitneyu, pearsonr

# The label page and labels.csv are label_server.py's, shared with success_eval.py.
from label_server import FRAMES, SKIP, is_number, is_plain_file_name, make_label_server, read_labels, serve

# One source of truth: rewards, environments and policies are the training scripts' own, as the agent sees them.
from vlmrm_dqn_classic import (
    DEFAULT_NEGATIVES,
    DEFAULT_PROMPTS,
    MOUNTAINCAR_GOAL,
    CLIPReward,
    QNetwork,  # noqa: F401 - the networks of --policy are its own script's (import_script): these are the originals
    make_env,
    softmax_reward,
    vlm_reward,
)
from vlmrm_sac_humanoid import Actor  # noqa: F401
from vlmrm_sac_humanoid import make_env as make_humanoid_env
from vlmrm_tools import (
    check_new_folder,
    drop_partial_folder,
    import_script,
    new_partial_folder,
    publish_folder,
    read_csv,
)
from vlmrm_utils import (
    UserError,
    all_finite,
    check_clip_args,
    check_intact,
    check_one_word_prompts,
    check_writable,
    cli,
    load_clip,
    resolve_negatives,
    same_prompts,
)

ENV_IDS = ("CartPole-v1", "MountainCar-v0", "MountainCarContinuous-v0", "Humanoid-v5")


@dataclass
class Collect:
    """Write a dataset of states: frames/*.png plus states.csv (with the ground-truth label where known)."""

    out: str
    """new dataset folder (refused if it exists and is not empty: a dataset is never overwritten)"""
    env_id: Optional[str] = None
    """the environment (default: the one the --policy was trained on, else CartPole-v1)"""
    num_frames: int = 200
    """number of frames (states) to save"""
    policy: Optional[str] = None
    """a `checkpoint.pt` of `vlmrm_dqn_classic.py --save-model` (greedy actions) or of
    `vlmrm_sac_humanoid.py --save-model` (deterministic actions); default: random actions"""
    epsilon: float = 0.0
    """with --policy: probability of a random action instead (mixes failures into a good policy's states)"""
    random_init: bool = False
    """CartPole/MountainCar: start each episode in a uniformly random state (covers the state space fast)"""
    every: int = 1
    """keep every n-th step's frame (consecutive frames are nearly identical)"""
    seed: int = 1
    """seed of the environment and of the random actions"""
    episode_length: int = 200
    """fixed episode length, as in the training scripts"""
    realistic: bool = False
    """MountainCar only: draw a landscape (sky, hills, flag, car) instead of Gymnasium's line art"""
    render_size: int = 224
    """Humanoid only: square frame size in pixels"""
    render_quality: Literal["high", "fast"] = "fast"
    """Humanoid only: "fast" switches shadows and reflections off"""
    renderer: Literal["egl", "warp"] = "egl"
    """Humanoid only: as vlmrm_sac_humanoid.py --renderer (warp: MuJoCo Warp's ray tracer)"""
    supersample: int = 2  # Humanoid with --renderer warp: rays per pixel along each axis
    cuda: bool = False
    """if toggled, CUDA (when available) runs the --policy network"""


@dataclass
class Label:
    """Serve a local page (127.0.0.1 only) to label a dataset's frames; every label is saved as it is given."""

    dataset: str
    """dataset folder written by `collect`"""
    port: int = 8765
    """port on 127.0.0.1 (0 = any free port)"""
    task: Optional[str] = None
    """the question shown above each frame (default: the environment's default goal prompt)"""


@dataclass(kw_only=True)
class RewardFlags:
    """The CLIP reward model's flags, shared by `score` and reward_shape.py (their names as in the training scripts)."""

    clip_models: tuple[str, ...] = ("ViT-bigG-14",)
    """open_clip architecture names, or paths of open_clip model configs (.json); several = a model comparison"""
    clip_pretrained: tuple[str, ...] = ("laion2b_s39b_b160k",)
    """open_clip pretrained tag per --clip-models entry, or one tag for all ("none" = random weights, for tests only)"""
    clip_cache_dir: Optional[str] = None
    """where downloaded CLIP weights are cached (default: the Hugging Face cache)"""
    goal: Optional[tuple[str, ...]] = None
    """goal prompt(s); default: a description of the task's goal state"""
    baseline: Optional[tuple[str, ...]] = None
    """baseline prompt(s) for the goal-baseline projection; default: a description of the scene"""
    reward_families: tuple[Literal["projection", "softmax"], ...] = ("projection",)
    """reward families side by side: projection (one curve per --alphas), softmax (one curve: goal vs --negatives)"""
    negatives: Optional[tuple[str, ...]] = None
    """softmax family: prompts the goal is contrasted with; default: ours for the default --goal (none for others)"""
    temperature: float = 0.01
    """softmax family: temperature tau of the softmax over cosine similarities (0.01 = CLIP's own logit scale 100)"""
    threshold: float = 0.5
    """softmax family: the reward is 1 when the goal's probability is above this, else 0; in (0, 1)"""
    soft: bool = False
    """softmax family: if toggled, the reward is the goal's probability itself instead of 0/1"""
    antialias: bool = False
    """if toggled, antialias the bicubic squash of frames to CLIP's input (default off, as in the paper's code)"""
    reward_batch_size: int = 64
    """frames embedded per CLIP forward pass"""
    cuda: bool = True
    """if toggled, CUDA (when available) runs the reward model"""


@dataclass(kw_only=True)
class Score(RewardFlags):
    """EPIC distance, ROC AUC and PR AUC between each CLIP reward model (model x alpha) and the labels."""

    dataset: str
    """dataset folder written by `collect` (and labelled by `label` unless --labels gt)"""
    labels: Literal["human", "gt"] = "human"
    """human: the last label per frame in labels.csv (skipped frames left out); gt: the states.csv ground truth"""
    alphas: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99)
    """goal-baseline regularisation strengths to evaluate, each in [0, 1] (default: the paper's Fig. 4a grid)"""
    clip_checkpoints: Optional[tuple[str, ...]] = None
    """local weights file per model (overrides --clip-pretrained); "none" for a model without one"""
    bootstrap: int = 1000
    """bootstrap resamples for the EPIC confidence interval"""
    confidence: float = 0.95
    """confidence level of the interval"""
    seed: int = 1
    """seed of the bootstrap"""
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (outputs go to runs/<env>__<exp_name>__<seed>__<time>/)"""


@dataclass
class ClipArgs:
    """The CLIP flags of one model, in the shape the training scripts' `check_clip_args`/`load_clip` read."""

    clip_model: str
    clip_pretrained: str
    clip_checkpoint: Optional[str] = None
    clip_cache_dir: Optional[str] = None


# ----------------------------------------------------------------------------------------------
# Collect: frames + states.csv
# ----------------------------------------------------------------------------------------------
STATE_COLUMNS = {"CartPole-v1": ["x", "x_dot", "theta", "theta_dot"], **dict.fromkeys(ENV_IDS[1:3], ["position", "velocity"])}


def env_state(env: gym.Env) -> tuple[list[str], list[float], Optional[int]]:
    """(column names, values, ground-truth success label or None) of the state the env shows now."""
    base = env.unwrapped
    if base.spec.id.startswith("Humanoid"):  # the full physical state; no ground truth (human evaluation)
        qpos, qvel = base.data.qpos, base.data.qvel
        names = [f"qpos_{i}" for i in range(len(qpos))] + [f"qvel_{i}" for i in range(len(qvel))]
        return names, [float(v) for v in np.concatenate([qpos, qvel])], None
    state = [float(v) for v in base.state]
    if base.spec.id == "CartPole-v1":  # the same test as FixedLengthCartPole's reward
        success = abs(state[2]) < base.theta_threshold_radians and abs(state[0]) < base.x_threshold
    else:  # MountainCar: at the flag in this frame (FixedLengthMountainCar's per-step reward), in the state's precision
        success = np.asarray(base.state)[0] >= MOUNTAINCAR_GOAL  # float32(0.45), the clipped flag, is below 0.45
    return STATE_COLUMNS[base.spec.id], state, int(success)


def randomise_state(env: gym.Env, rng: np.random.Generator) -> np.ndarray:
    """Put a classic-control env in a uniformly random state; returns the matching observation."""
    base = env.unwrapped
    if base.spec.id == "CartPole-v1":  # x within the track, any pole angle, speeds up to 1
        base.state = rng.uniform(-1, 1, size=4) * np.array([base.x_threshold, 1.0, math.pi, 1.0])
    else:
        base.state = rng.uniform([base.min_position, -base.max_speed], [base.max_position, base.max_speed])
    return np.array(base.state, dtype=np.float32)


def check_collect_args(args: Collect) -> Optional[dict]:
    """Validate the flags; returns the loaded --policy checkpoint (or None) and sets args.env_id."""
    for name in ["num_frames", "every", "episode_length", "render_size"]:
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}.")
    if not 16 <= args.render_size <= 2048:  # the training scripts' bounds: MuJoCo cannot draw much larger frames
        raise UserError(f"--render-size must be between 16 and 2048 pixels, got {args.render_size}.")
    if not 0.0 <= args.epsilon <= 1.0:
        raise UserError(f"--epsilon must be in [0, 1], got {args.epsilon}.")
    if args.env_id is not None and args.env_id not in ENV_IDS:
        raise UserError(f"--env-id {args.env_id} is not supported; choose one of: {', '.join(ENV_IDS)}.")
    if not os.path.isfile(args.out) and not os.path.islink(args.out):  # first: names --out when a folder above is a file
        check_writable(args.out, "--out", "choose another path")
    # absent, an empty folder or an empty file (e.g. made by mktemp: replaced), in a writable folder
    check_new_folder(args.out, "--out", "a dataset and its labels are never overwritten")
    checkpoint = None
    if args.policy is not None:
        which = "the checkpoint.pt of vlmrm_dqn_classic.py or vlmrm_sac_humanoid.py --save-model"
        if not os.path.isfile(args.policy):
            raise UserError(f"--policy {args.policy}: no such file; pass {which}.")
        check_intact(args.policy, f"--policy {args.policy}", f"pass another copy, or {which}")
        try:  # a checkpoint.pt also holds RNG states and arrays: load only files you trust
            checkpoint = torch.load(args.policy, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - any unreadable file gets the same advice
            raise UserError(f"--policy {args.policy} could not be read ({type(e).__name__}); pass {which}.") from None
        if not isinstance(checkpoint, dict) or not ({"q_network", "actor"} & checkpoint.keys()) or "args" not in checkpoint:
            raise UserError(f"--policy {args.policy} holds no policy (no 'q_network' or 'actor', or no 'args'); pass {which}.")
        name = "q_network" if "q_network" in checkpoint else "actor"
        if not all_finite(checkpoint[name]):  # NaN actions: NaN states in states.csv, or argmax 0 every step
            raise UserError(
                f"--policy {args.policy}: its {name} holds NaN or infinite weights, so it cannot act; pass a checkpoint "
                "saved before its run diverged."
            )
        import_script(checkpoint, f"--policy {args.policy}", args.policy)  # its networks: the script that wrote it
        trained_on = checkpoint["args"].get("env_id")
        if args.env_id is not None and args.env_id != trained_on:
            raise UserError(f"--policy {args.policy} was trained on {trained_on}, not --env-id {args.env_id}.")
        supported = ENV_IDS[:2] if "q_network" in checkpoint else ("Humanoid-v5", "MountainCarContinuous-v0")
        if trained_on not in supported:
            raise UserError(
                f"--policy {args.policy} was trained on {trained_on}; "
                f"collect supports its policies on {', '.join(supported)} only."
            )
        args.env_id = trained_on
    args.env_id = args.env_id or "CartPole-v1"
    if args.random_init and args.env_id.startswith("Humanoid"):
        raise UserError("--random-init is for CartPole and MountainCar; Humanoid states come from its own resets.")
    if args.realistic and not args.env_id.startswith("MountainCar"):
        raise UserError("--realistic only changes how MountainCar is drawn.")
    if args.renderer == "warp":  # imported only with the flag
        import vlmrm_warp

        vlmrm_warp.check_available(args)  # drawn by make_env's default: CUDA when there is one
    return checkpoint


def load_policy(checkpoint: dict, envs: gym.vector.VectorEnv, args: Collect, device: torch.device) -> Callable:
    """observations -> actions on the device: greedy for the Q-network, the actor's deterministic action (as in evaluation)."""
    script = import_script(checkpoint, f"--policy {args.policy}", args.policy)  # a copy of a training script: its own networks
    name, network = ("q_network", script.QNetwork(envs)) if "q_network" in checkpoint else ("actor", script.Actor(envs))
    try:
        network.to(device).load_state_dict(checkpoint[name])
    except (RuntimeError, TypeError, AttributeError) as e:  # wrong shapes or keys: another env or version
        reason = " ".join(str(e).split())[:200]  # torch's message spans lines
        raise UserError(
            f"--policy {args.policy}: its {name} does not fit {args.env_id} ({reason}); "
            "pass a policy saved by this version of the training scripts."
        ) from None
    return (lambda x: network(x).argmax(dim=1)) if name == "q_network" else (lambda x: network.get_action(x)[2])


def collect(args: Collect) -> None:
    checkpoint = check_collect_args(args)
    random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    if args.env_id.startswith("Humanoid"):
        look = (args.render_size, args.render_quality, True, "paper", True, args.renderer, args.supersample)
        thunk = make_humanoid_env(args.env_id, args.seed, 0, args.episode_length, *look)
    else:
        thunk = make_env(args.env_id, args.seed, 0, args.episode_length, args.realistic)
    # a one-env vector env, as in utils.evaluate(): QNetwork reads its single_* spaces
    envs = gym.vector.SyncVectorEnv([thunk])
    env = envs.envs[0]
    try:
        policy = load_policy(checkpoint, envs, args, device) if checkpoint is not None else None
    except UserError:
        envs.close()
        raise

    # the dataset is made in a hidden folder beside --out and renamed into place once complete: an error or Ctrl-C
    # part-way never leaves a half-made dataset (which would also block the same --out)
    partial = new_partial_folder(args.out)
    rows, header, episode = [], [], 0
    try:
        os.makedirs(os.path.join(partial, "frames"))
        while len(rows) < args.num_frames:
            obs, _ = envs.reset(seed=args.seed + episode)
            if args.random_init:
                obs = randomise_state(env, rng)[None]
            for step in range(1, args.episode_length + 1):  # never past the time limit: no autoreset step
                if policy is not None and random.random() >= args.epsilon:
                    with torch.no_grad():
                        actions = policy(torch.from_numpy(obs).float().to(device)).cpu().numpy()
                else:
                    actions = np.array([envs.single_action_space.sample()])
                obs, _, _, _, _ = envs.step(actions)
                if step % args.every:
                    continue
                # the frame after the step: the one that scores this transition in training
                frame_name = f"{len(rows):06d}.png"
                imageio.imwrite(os.path.join(partial, "frames", frame_name), envs.call("render")[0])
                names, values, success = env_state(env)
                header = ["frame", "env_id", "episode", "step", *names, "gt"]
                rows.append([frame_name, args.env_id, episode, step, *values, "" if success is None else success])
                if len(rows) == args.num_frames:
                    break
            episode += 1
        with open(os.path.join(partial, "states.csv"), "w", newline="") as f:
            csv.writer(f).writerows([header, *rows])
    except BaseException as e:
        drop_partial_folder(partial)
        if isinstance(e, OSError):  # e.g. the disk filled up
            raise UserError(f"could not write the dataset ({e.strerror or e}); nothing was written to {args.out}.") from None
        raise
    finally:
        envs.close()
    publish_folder(partial, args.out, "--out")  # atomic; also replaces an empty --out folder or file, nothing else
    gt = [r[-1] for r in rows if r[-1] != ""]
    source = f"policy {args.policy} (epsilon {args.epsilon})" if args.policy else "random actions"
    print(f"wrote {len(rows)} frames of {args.env_id} ({episode} episodes, {source}) to {args.out}")
    if gt:
        print(f"ground truth: {sum(gt)} of {len(gt)} frames are successes")
        if len(set(gt)) == 1:
            print(
                "warning: every ground-truth label is the same, so `score --labels gt` will refuse this dataset "
                "(correlation undefined); collect more frames, use --random-init, or a trained --policy"
            )


# ----------------------------------------------------------------------------------------------
# Dataset: loading and checking (one sentence per problem)
# ----------------------------------------------------------------------------------------------
def load_states(dataset: str) -> list[dict]:
    """Rows of states.csv, after checking that the dataset exists, is not empty and has all its frames."""
    states_path = os.path.join(dataset, "states.csv")
    if not os.path.isdir(dataset):
        raise UserError(f"--dataset {dataset}: no such folder; create one with `python epic_eval.py collect --out {dataset}`.")
    if not os.path.isfile(states_path):
        raise UserError(
            f"--dataset {dataset} has no states.csv, so it is not a dataset; create one with `python epic_eval.py collect`."
        )
    rows = [row for _, row in read_csv(states_path, ["frame", "env_id"])]  # one sentence naming a bad line
    if not rows:
        raise UserError(f"{states_path} lists no frames: the dataset is empty.")
    names = [r["frame"] for r in rows]
    bad = next((n for n in names if not is_plain_file_name(n)), None)
    if bad is not None:  # a crafted states.csv must not reach files outside frames/ (the label page serves them)
        raise UserError(
            f"{states_path} names the frame {bad!r}, which is not a plain file name in "
            f"{os.path.join(dataset, 'frames')}; frame names must have no folder separators, no '..' "
            "and no control characters."
        )
    if len(set(names)) != len(names):
        raise UserError(f"{states_path} lists a frame more than once (e.g. {next(n for n in names if names.count(n) > 1)}).")
    missing = [n for n in names if not os.path.isfile(os.path.join(dataset, "frames", n))]
    if missing:
        raise UserError(
            f"{len(missing)} of the {len(rows)} frames in {states_path} have no image file in "
            f"{os.path.join(dataset, 'frames')} (first: {missing[0]})."
        )
    env_ids = {r["env_id"] for r in rows}
    if len(env_ids) > 1:
        raise UserError(f"{states_path} mixes environments ({', '.join(sorted(env_ids))}); keep one environment per dataset.")
    return rows


def label_values(dataset: str, source: str) -> tuple[list[str], np.ndarray]:
    """(frames, numeric labels) to score: human labels from labels.csv (skips left out) or the gt column."""
    rows = load_states(dataset)
    if source == "gt":
        if "gt" not in rows[0] or all(r["gt"] == "" for r in rows):
            raise UserError(
                f"{dataset}/states.csv has no ground-truth labels ({rows[0]['env_id']} has none); label the frames with "
                f"`python epic_eval.py label --dataset {dataset}` and use --labels human."
            )
        raw = {r["frame"]: r["gt"] for r in rows if r["gt"] != ""}
        where = "the gt column of states.csv"
    else:
        raw = {k: v for k, v in read_labels(dataset, {r["frame"] for r in rows}, FRAMES, graded=True).items() if v != SKIP}
        where = "labels.csv"
        if not raw:
            raise UserError(
                f"{dataset} has no labelled frames yet; label some with `python epic_eval.py label --dataset {dataset}`, "
                "or use --labels gt for CartPole/MountainCar."
            )
    frames = [r["frame"] for r in rows if r["frame"] in raw]  # states.csv order
    bad = next((f for f in frames if not is_number(raw[f])), None)
    if bad is not None:
        raise UserError(
            f"label {raw[bad]!r} of frame {bad} in {where} is not a number; "
            f"labels must be numbers (1 success, 0 failure) or '{SKIP}'."
        )
    return frames, np.array([float(raw[f]) for f in frames])


def unreadable_frame(dataset: str, frame: str, error: Exception) -> UserError:
    reason = " ".join(f"{type(error).__name__}: {error}".split())[:160]
    return UserError(
        f"frame {frame} of {dataset} is not a readable image ({reason}); collect the dataset again, "
        "or remove that frame's row from states.csv."
    )


def check_images(dataset: str, frames: list[str]) -> None:
    """Every frame opens as an image and all have one size; reads headers and checksums only (~0.3 ms a frame),
    so a corrupt or truncated file is reported before any model is loaded or anything is written."""
    from PIL import Image

    first_of_size: dict[tuple[int, int], str] = {}
    for frame in frames:
        try:
            with Image.open(os.path.join(dataset, "frames", frame)) as image:
                size = image.size
                image.verify()
        except Exception as e:  # noqa: BLE001 - truncated, corrupt, or not an image at all: the same advice
            raise unreadable_frame(dataset, frame, e) from None
        first_of_size.setdefault(size, frame)
    if len(first_of_size) > 1:
        (a, size_a), (b, size_b) = [(frame, size) for size, frame in first_of_size.items()][:2]
        raise UserError(
            f"the frames of {dataset} have different sizes ({a} is {size_a[0]}x{size_a[1]}, {b} is "
            f"{size_b[0]}x{size_b[1]}); keep one environment and render size per dataset."
        )


def read_frames(dataset: str, frames: list[str]) -> np.ndarray:
    """uint8 (N, H, W, 3) images, exactly as the env rendered them (PNG is lossless)."""
    images = []
    for frame in frames:
        try:  # check_images has passed them, but a file can change (or hide a fault) between the two reads
            images.append(imageio.imread(os.path.join(dataset, "frames", frame), mode="RGB"))  # grey or RGBA: RGB
        except Exception as e:  # noqa: BLE001
            raise unreadable_frame(dataset, frame, e) from None
    if len({image.shape for image in images}) > 1:
        raise UserError(f"the frames of {dataset} have different sizes; keep one environment and render size per dataset.")
    return np.stack(images)


# ----------------------------------------------------------------------------------------------
# Label page: label_server.py's, over the dataset's frames
# ----------------------------------------------------------------------------------------------
def make_frame_server(dataset: str, port: int, task: Optional[str] = None):
    """label_server's page and server over a dataset: its frames, its labels.csv."""
    rows = load_states(dataset)
    env_id = rows[0]["env_id"]
    task = task or DEFAULT_PROMPTS.get(env_id, (env_id,))[0]
    return make_label_server(dataset, port, task, [r["frame"] for r in rows], FRAMES)


def label(args: Label) -> None:
    server = make_frame_server(args.dataset, args.port, args.task)
    rows = load_states(args.dataset)
    done = len(read_labels(args.dataset, {r["frame"] for r in rows}, FRAMES, graded=True))
    serve(server, args.dataset, f"labelling {len(rows)} frames of {args.dataset} ({done} already labelled)")


# ----------------------------------------------------------------------------------------------
# Metrics: EPIC distance and its bootstrap interval (hand-written: no package has them), ROC AUC (scipy), PR AUC
# ----------------------------------------------------------------------------------------------
def unit_scaled(x: np.ndarray) -> np.ndarray:
    """x / max|x|, in [-1, 1]: a correlation ignores the scale, and graded labels may be any finite numbers, whose
    squares (1e200) or differences (-1.7e308 and 1.7e308) overflow, or (1e-310) underflow to 0."""
    x = np.asarray(x, dtype=np.float64)
    top = np.abs(x).max() if len(x) else 0.0
    return x / top if 0 < top < math.inf else x


def is_constant(x: np.ndarray) -> bool:
    """Constant up to float32 round-off (relative), where a correlation would only measure noise."""
    return bool(np.ptp(unit_scaled(x)) <= 1e-6) if len(x) else True


def epic_distance(rewards: np.ndarray, labels: np.ndarray) -> float:
    """EPIC distance of a state-only reward to labels on the same states: sqrt((1 - rho) / 2), rho = Pearson.

    On a fixed dataset of states EPIC's canonicalisation only shifts a state-only reward by a constant,
    so the distance depends on the Pearson correlation alone: 0 = equal up to a positive affine map,
    sqrt(1/2) = uncorrelated, 1 = negated. Undefined (ValueError) when either side is constant.
    """
    r, h = np.asarray(rewards, dtype=np.float64), np.asarray(labels, dtype=np.float64)
    if r.shape != h.shape or r.ndim != 1:
        raise ValueError(f"rewards and labels must be 1-d arrays of the same length, got shapes {r.shape} and {h.shape}")
    if len(r) < 2 or not (np.isfinite(r).all() and np.isfinite(h).all()):
        raise ValueError("EPIC needs at least 2 finite rewards and labels")
    if is_constant(h):
        raise ValueError("the labels are all the same, so their correlation with the reward (and EPIC) is undefined")
    if is_constant(r):
        raise ValueError("the rewards are all the same, so their correlation with the labels (and EPIC) is undefined")
    rho = float(np.clip(pearsonr(unit_scaled(r), unit_scaled(h)).statistic, -1.0, 1.0))
    return math.sqrt((1.0 - rho) / 2.0)


def bootstrap_epic(
    rewards: np.ndarray, labels: np.ndarray, samples: int, confidence: float, rng: np.random.Generator
) -> tuple[float, float]:
    """Percentile interval of EPIC over resamples of the states (with replacement).

    Resamples in which the labels or rewards happen to be constant (EPIC undefined) are left out; (nan, nan) when
    most are, and for fewer than 3 states (any 2 points correlate +1 or -1).
    """
    r, h = unit_scaled(rewards), unit_scaled(labels)
    n, values = len(r), []
    if n < 3:  # every resample of 2 states correlates +1, -1 or not at all: no interval to speak of
        return float("nan"), float("nan")
    for start in range(0, samples, 256):  # chunks keep memory at 256 x n
        idx = rng.integers(0, n, size=(min(256, samples - start), n))
        rs, hs = r[idx], h[idx]
        defined = (np.ptp(rs, axis=1) > 1e-6) & (np.ptp(hs, axis=1) > 1e-6)  # as is_constant: r and h are unit-scaled
        rs, hs = rs - rs.mean(1, keepdims=True), hs - hs.mean(1, keepdims=True)
        rho = (rs * hs).sum(1)[defined] / np.sqrt((rs * rs).sum(1) * (hs * hs).sum(1))[defined]
        values.append(np.sqrt((1.0 - np.clip(rho, -1.0, 1.0)) / 2.0))
    values = np.concatenate(values)
    if len(values) < samples / 2:
        return float("nan"), float("nan")  # too few labelled positives (or negatives) to resample from
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(values, [tail, 1.0 - tail])
    return float(low), float(high)


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve = P(score of a random positive > score of a random negative), ties count 1/2."""
    scores, positive = np.asarray(scores, dtype=np.float64), np.asarray(labels) == 1
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    # the Mann-Whitney U of the positives' scores over the negatives' (ties count 1/2), normalised
    return float(mannwhitneyu(scores[positive], scores[~positive]).statistic / (n_pos * n_neg))


def average_precision(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the precision-recall curve as a step sum: sum_k (R_k - R_{k-1}) P_k over score thresholds."""
    scores, positive = np.asarray(scores, dtype=np.float64), np.asarray(labels) == 1
    n_pos = int(positive.sum())
    if n_pos == 0:
        return float("nan")
    order = np.argsort(-scores, kind="mergesort")
    scores, positive = scores[order], positive[order]
    last_of_threshold = np.r_[np.flatnonzero(np.diff(scores)), len(scores) - 1]  # tied scores are one threshold
    true_pos = np.cumsum(positive)[last_of_threshold]
    precision = true_pos / (last_of_threshold + 1)
    recall = true_pos / n_pos
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


# ----------------------------------------------------------------------------------------------
# Reward models from flags (reward_shape.py uses these too): checks, CLIPReward, one curve per alpha or softmax
# ----------------------------------------------------------------------------------------------
SOFTMAX = "softmax"  # the key of the thresholded-softmax curve; the projection curves are keyed by their alpha


def check_reward_args(args: RewardFlags) -> None:
    """The prompt and reward-family flags (shared by score and reward_shape.py), checked before any model is loaded."""
    if not args.reward_families:
        raise UserError("--reward-families needs at least one of: projection, softmax.")
    alphas = args.alphas if "projection" in args.reward_families else ()
    if "projection" in args.reward_families and not alphas:
        raise UserError("--alphas needs at least one value in [0, 1], e.g. --alphas 0 0.5 1.")
    if not all(0.0 <= alpha <= 1.0 for alpha in alphas):  # also rejects nan
        raise UserError(f"--alphas must all be in [0, 1], got {next(a for a in alphas if not 0.0 <= a <= 1.0)}.")
    if not args.goal or any(not g.strip() for g in args.goal):
        example = DEFAULT_PROMPTS.get(getattr(args, "env_id", None) or "CartPole-v1", DEFAULT_PROMPTS["CartPole-v1"])[0]
        raise UserError(f'--goal needs at least one non-empty prompt, e.g. --goal "{example}".')
    if alphas and max(alphas) > 0 and (not args.baseline or any(not b.strip() for b in args.baseline)):
        raise UserError("--baseline needs at least one non-empty prompt when an alpha is > 0.")
    check_one_word_prompts(args.goal, "--goal")
    check_one_word_prompts(args.baseline if alphas and max(alphas) > 0 else (), "--baseline")
    if alphas and max(alphas) > 0 and same_prompts(args.goal, args.baseline):
        raise UserError(
            "--goal and --baseline are the same prompts (ignoring case and spaces), so the goal-baseline direction is "
            f"zero; change one or use only --alphas 0 (got alpha {max(alphas)})."
        )
    if not 0 < args.temperature < float("inf"):  # also rejects nan
        raise UserError(f"--temperature must be a positive number, got {args.temperature}.")
    if not 0 < args.threshold < 1:
        raise UserError(f"--threshold must be in (0, 1), got {args.threshold}.")
    if SOFTMAX in args.reward_families:
        args.negatives = resolve_negatives(args.goal, args.negatives, "--reward-families softmax", DEFAULT_NEGATIVES)


def model_label(clip: ClipArgs) -> str:
    """A readable name for a model in the tables and plots: "<architecture>/<weights>"."""
    name = Path(clip.clip_model).stem if clip.clip_model.endswith(".json") else clip.clip_model
    return f"{name}/{Path(clip.clip_checkpoint).name if clip.clip_checkpoint else clip.clip_pretrained}"


def clip_args_list(
    models: tuple[str, ...], pretrained: tuple[str, ...], checkpoints, cache_dir, checkpoint_flag: str
) -> list[ClipArgs]:
    """One ClipArgs per --clip-models entry (one --clip-pretrained tag for all, or one each), all checked up front."""
    if not models:
        raise UserError("--clip-models needs at least one model, e.g. --clip-models ViT-bigG-14.")
    if len(pretrained) not in (1, len(models)):
        raise UserError(
            f"--clip-pretrained needs one tag, or one per --clip-models entry ({len(models)}), got {len(pretrained)}."
        )
    clips = [
        ClipArgs(model, pretrained[i % len(pretrained)], None if checkpoint in (None, "none") else checkpoint, cache_dir)
        for i, (model, checkpoint) in enumerate(zip(models, checkpoints))
    ]
    labels = [model_label(clip) for clip in clips]
    if len(set(labels)) != len(labels):
        raise UserError(f"--clip-models/--clip-pretrained name the same model twice ({', '.join(labels)}); list each once.")
    for clip in clips:  # every model is checked before the first one is loaded
        check_clip_args(clip, "--clip-models", checkpoint_flag)
    return clips


def flags_reward_model(args: RewardFlags, model, tokenizer, device: torch.device) -> CLIPReward:
    """The training scripts' CLIPReward for these flags, embeddings only: score_curves applies every alpha to them."""
    family = "softmax" if SOFTMAX in args.reward_families else "projection"  # the softmax family needs its negatives
    flags = dict(
        negatives=args.negatives or (), **{k: getattr(args, k) for k in ("temperature", "threshold", "soft", "antialias")}
    )
    reward_model = CLIPReward(model, tokenizer, args.goal, args.baseline, 0.0, args.reward_batch_size, device, family, **flags)
    alphas = args.alphas if "projection" in args.reward_families else ()
    try:  # the training script's rule (vlm_reward): prompts that differ only where CLIP cannot see have d = 0
        embeddings = reward_model.goal_embeddings, reward_model.goal_embeddings, reward_model.baseline_embeddings
        vlm_reward(*embeddings, max(alphas, default=0.0))
    except ValueError:
        raise UserError(
            "--goal and --baseline have the same CLIP embedding, so d = g - b is 0; change one or use only --alphas 0."
        ) from None
    return reward_model


@torch.no_grad()
def score_curves(
    reward_model: CLIPReward, embeddings: torch.Tensor, alphas: tuple[float, ...], softmax: bool
) -> dict[Union[float, str], np.ndarray]:
    """Rewards of embedded frames: one curve per alpha and, with softmax, the reward model's thresholded softmax
    (its negatives, temperature, threshold and soft setting) under SOFTMAX. Embedding is the costly part: done once."""
    m = reward_model
    g, b, n = (e.to(embeddings.device) for e in (m.goal_embeddings, m.baseline_embeddings, m.negative_embeddings))
    curves = {alpha: vlm_reward(embeddings, g, b, alpha).cpu().numpy() for alpha in alphas}
    if softmax:
        curves[SOFTMAX] = softmax_reward(embeddings, g, n, m.temperature, m.threshold, m.soft).cpu().numpy()
    return curves


def curve_name(key: Union[float, str], soft: bool) -> str:
    """A curve's name in the tables: alpha=<alpha>, softmax (0/1) or softmax-p (--soft)."""
    return f"alpha={key:g}" if key != SOFTMAX else ("softmax-p" if soft else "softmax")


# ----------------------------------------------------------------------------------------------
# Score: every CLIP model x curve against the labels
# ----------------------------------------------------------------------------------------------
def check_score_args(args: Score) -> list[ClipArgs]:
    """Reject bad flags before any model is loaded; returns one ClipArgs per model."""
    check_reward_args(args)
    if args.bootstrap < 1 or args.reward_batch_size < 1:
        raise UserError("--bootstrap and --reward-batch-size must be positive integers.")
    if not 0.0 < args.confidence < 1.0:
        raise UserError(f"--confidence must be in (0, 1), got {args.confidence}.")
    n = len(args.clip_models)
    if args.clip_checkpoints is not None and len(args.clip_checkpoints) != n:
        raise UserError(
            f"--clip-checkpoints needs one entry per model ({n}; 'none' for a model without one), "
            f"got {len(args.clip_checkpoints)}."
        )
    checkpoints = args.clip_checkpoints or (None,) * n
    return clip_args_list(args.clip_models, args.clip_pretrained, checkpoints, args.clip_cache_dir, "--clip-checkpoints")


def plot_epic(table: list[dict], path: str, title: str) -> None:
    """EPIC against alpha per model (projection, with its interval); the softmax family is a dashed level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, model in enumerate(dict.fromkeys(row["model"] for row in table)):  # one colour per model, in flag order
        colour = colours[i % len(colours)]
        rows = [row for row in table if row["model"] == model and row["family"] == "projection"]
        if rows:
            alphas = [row["alpha"] for row in rows]
            ax.plot(alphas, [row["epic"] for row in rows], marker="o", color=colour, label=f"{model}, projection")
            low, high = [row["epic_low"] for row in rows], [row["epic_high"] for row in rows]
            ax.fill_between(alphas, low, high, color=colour, alpha=0.2, linewidth=0)
        for row in (row for row in table if row["model"] == model and row["family"] == SOFTMAX):
            if math.isfinite(row["epic"]):
                ax.axhline(row["epic"], color=colour, linestyle="--", label=f"{model}, {row['curve']}")
            if math.isfinite(row["epic_low"]) and math.isfinite(row["epic_high"]):
                ax.axhspan(row["epic_low"], row["epic_high"], color=colour, alpha=0.08, linewidth=0)
    if not any(row["family"] == "projection" for row in table):
        ax.set_xlim(0, 1)
    ax.set(xlabel="alpha (goal-baseline regularisation; the softmax family is dashed)", ylim=(0, 1))
    ax.set(ylabel="EPIC distance to labels (lower is better)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # nothing to list when every EPIC is undefined
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def metrics_row(rewards: np.ndarray, labels: np.ndarray, binary: bool, args: Score) -> dict:
    """EPIC with its bootstrap interval, Pearson, ROC AUC and PR AUC (the last two for 0/1 labels); nan when undefined."""
    if is_constant(rewards):
        return dict.fromkeys(["epic", "epic_low", "epic_high", "pearson", "roc_auc", "pr_auc"], float("nan"))
    epic = epic_distance(rewards, labels)
    rng = np.random.default_rng(args.seed)  # same resamples for every model and curve: comparable intervals
    low, high = bootstrap_epic(rewards, labels, args.bootstrap, args.confidence, rng)
    nan = float("nan")
    auc, ap = (roc_auc(rewards, labels), average_precision(rewards, labels)) if binary else (nan, nan)
    return dict(epic=epic, epic_low=low, epic_high=high, pearson=1.0 - 2.0 * epic**2, roc_auc=auc, pr_auc=ap)


def score(args: Score) -> str:
    """Writes runs/<run_name>/{epic.csv, epic.png, rewards.csv, args.json}; returns the run folder."""
    frames, labels = label_values(args.dataset, args.labels)  # dataset problems first: they are cheapest
    env_id = load_states(args.dataset)[0]["env_id"]
    default_goal, default_baseline = DEFAULT_PROMPTS.get(env_id, (None, None))  # another env: give --goal, --baseline
    args.goal = args.goal if args.goal is not None else ((default_goal,) if default_goal else None)
    args.baseline = args.baseline if args.baseline is not None else ((default_baseline,) if default_baseline else None)
    clip_args = check_score_args(args)
    if is_constant(labels):
        raise UserError(
            f"all {len(labels)} labels ({args.labels}) of {args.dataset} are {labels[0]:g}, so the correlation (and EPIC) "
            "is undefined; label both successes and failures."
        )
    check_images(args.dataset, frames)
    check_writable("runs", "the output folder", "move it away or run from another folder")
    binary = bool(np.isin(labels, (0.0, 1.0)).all())
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    run_dir = os.path.join("runs", f"{env_id}__{args.exp_name}__{args.seed}__{int(time.time())}")  # made at the end
    if len(labels) == 2:
        print(
            "warning: only 2 labelled frames: the correlation of two points is always +1 or -1, so EPIC is 0 or 1 "
            "and its bootstrap interval is undefined (reported as nan); label more frames for a meaningful distance"
        )
    negatives = f", negatives={args.negatives}" if SOFTMAX in args.reward_families else ""
    print(
        f"run: {run_dir}; {len(frames)} frames of {env_id} with {args.labels} labels ({int((labels == 1).sum())} "
        f"successes), goal={args.goal}, baseline={args.baseline}{negatives}, on {device}"
    )
    table, undefined, reward_columns = [], [], {}
    for clip in clip_args:
        name = model_label(clip)
        torch.manual_seed(args.seed)  # a random-weight (test) model is then the same in every run
        model, tokenizer = load_clip(clip, device)
        reward_model = flags_reward_model(args, model, tokenizer, device)
        # image embeddings once per model, from disk in batches; every curve reuses them
        start, batch = time.perf_counter(), args.reward_batch_size
        chunks = [torch.from_numpy(read_frames(args.dataset, frames[i : i + batch])) for i in range(0, len(frames), batch)]
        embeddings = torch.cat([reward_model.embed_images(chunk).float().cpu() for chunk in chunks])
        print(f"{name}: embedded {len(frames)} frames in {time.perf_counter() - start:.1f} s")
        alphas = args.alphas if "projection" in args.reward_families else ()
        for key, rewards in score_curves(reward_model, embeddings, alphas, SOFTMAX in args.reward_families).items():
            curve = curve_name(key, args.soft)
            reward_columns[f"{name}@{curve}"] = rewards
            family, alpha = (SOFTMAX, "") if key == SOFTMAX else ("projection", key)
            row = dict(model=name, family=family, alpha=alpha, curve=curve, n=len(labels))
            row.update(n_success=int((labels == 1).sum()) if binary else "", **metrics_row(rewards, labels, binary, args))
            undefined += [f"{name} {curve}"] if is_constant(rewards) else []
            table.append(row)
            print(
                f"  {curve:<11} EPIC={row['epic']:.4f} [{row['epic_low']:.4f}, {row['epic_high']:.4f}]  "
                f"pearson={row['pearson']:+.4f}  ROC AUC={row['roc_auc']:.4f}  PR AUC={row['pr_auc']:.4f}"
            )
        del model, reward_model  # one model in memory at a time: the large ones take many GB
        if device.type == "cuda":
            torch.cuda.empty_cache()

    columns = ["model", "family", "alpha", "epic", "epic_low", "epic_high", "pearson", "roc_auc", "pr_auc", "n", "n_success"]
    partial = new_partial_folder(run_dir)  # renamed to run_dir once complete: never half a run folder
    try:
        with open(os.path.join(partial, "args.json"), "w") as f:
            json.dump(asdict(args), f, indent=2)
        with open(os.path.join(partial, "epic.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(
                {k: f"{v:.6f}" if isinstance(v, float) and k != "alpha" else v for k, v in r.items()} for r in table
            )
        with open(os.path.join(partial, "rewards.csv"), "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["frame", "label", *reward_columns])
            for i, frame in enumerate(frames):
                writer.writerow([frame, f"{labels[i]:g}", *(f"{v[i]:.9g}" for v in reward_columns.values())])
        title = f"{env_id}, {len(labels)} frames, {args.labels} labels; {int(args.confidence * 100)}% bootstrap interval"
        plot_epic(table, os.path.join(partial, "epic.png"), title)
    except BaseException as e:
        drop_partial_folder(partial)
        if isinstance(e, OSError):  # e.g. the disk filled up
            raise UserError(f"could not write the results ({e.strerror or e}); nothing was written to {run_dir}.") from None
        raise
    publish_folder(partial, run_dir, "the run folder")
    print(f"wrote {run_dir}/epic.csv, epic.png, rewards.csv")
    if undefined:
        binary_softmax = any(u.endswith(" softmax") for u in undefined)
        hint = " (a binary softmax reward that never or always crosses --threshold: try another --threshold or --soft)"
        raise UserError(
            f"the rewards of {', '.join(undefined)} are the same for every frame{hint if binary_softmax else ''}, so their "
            "correlation with the "
            f"labels (and EPIC) is undefined; the other results are in {run_dir}/epic.csv."
        )
    return run_dir


Commands = Union[
    Annotated[Collect, tyro.conf.subcommand("collect")],
    Annotated[Label, tyro.conf.subcommand("label")],
    Annotated[Score, tyro.conf.subcommand("score")],
]


def main(args: Union[Collect, Label, Score]) -> None:
    {Collect: collect, Label: label, Score: score}[type(args)](args)


if __name__ == "__main__":  # Ctrl-C: what was being written is removed (written whole or not at all)
    cli(main, Commands, interrupted="stopped by Ctrl-C; nothing was written.")
