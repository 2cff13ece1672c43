"""VLM-RM: SAC teaches a MuJoCo humanoid a task from one sentence, with a CLIP model as the reward.

Every frame the (realistically textured) humanoid renders is scored by a pretrained CLIP model against a
goal sentence, optionally regularised towards a baseline sentence with strength alpha (goal-baseline
projection). One file, read top to bottom: flags, CLIP reward, environment, SAC networks, replay buffer,
training loop.

    python vlmrm_sac_humanoid.py --goal "a humanoid robot kneeling"
"""

import copy
import hashlib
import logging
import math
import os
import random
import signal
import sys
import tempfile
import time
import warnings
import xml.etree.ElementTree as ET
from collections import deque
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Literal, Optional

# MuJoCo picks its OpenGL backend at import time: headless EGL (GPU or Mesa software) unless the user
# chose otherwise; PyOpenGL must agree with it, or the renderer fails to create a context.
os.environ.setdefault("MUJOCO_GL", "egl")
if os.environ["MUJOCO_GL"] in ("egl", "osmesa"):
    os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

import gymnasium as gym
import gymnasium.envs.mujoco  # noqa: F401  (makes gym.envs.mujoco, home of the stock XML, reachable)
import imageio.v2 as imageio
import mujoco
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import tyro
from torch.utils.tensorboard import SummaryWriter


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """if toggled, CUDA (when available) runs SAC and the reward model"""
    torch_threads: Optional[int] = None
    """torch CPU threads; default: 1 when the networks run on CPU (small networks gain nothing from more, and more threads
    fight the env workers, renderer and other jobs for cores), untouched on GPU; 0 = torch's default (one per core)"""
    log_episodes: bool = False
    """if toggled, print one line per finished episode (always in TensorBoard) instead of only the progress line"""
    capture_video: bool = False
    """if toggled, save an MP4 of a deterministic episode every `--video-frequency` steps to `videos/<run_name>/`"""
    video_frequency: int = 100_000
    """environment steps between two evaluation videos"""
    save_model: bool = False
    """if toggled, save checkpoints to `runs/<run_name>/` every `--checkpoint-frequency` steps and at the end"""
    checkpoint_frequency: int = 500_000
    """environment steps between two checkpoints (taken at the next episode boundary)"""
    save_buffer: bool = False
    """if toggled, checkpoints include the replay buffer, so `--resume` continues exactly as if never stopped"""
    resume: Optional[str] = None
    """path to a `checkpoint.pt`: continue that run (its flags, step, TensorBoard folder) until its `--total-timesteps`"""
    evaluate: Optional[str] = None
    """path to a saved checkpoint: roll out its deterministic policy (video + frames) instead of training"""
    eval_episodes: int = 3
    """number of episodes of an evaluation"""

    # Environment
    env_id: str = "Humanoid-v5"
    """a Gymnasium MuJoCo task; Humanoid-v5 gets the paper's camera and textures"""
    episode_length: int = 100
    """fixed episode length: no early termination, so survival alone earns nothing"""
    render_size: Optional[int] = None
    """square frame size; default: the CLIP model's input size (480 reproduces the paper)"""
    render_quality: Literal["fast", "high"] = "fast"
    """fast: no shadows or reflections (~5x faster with software rendering); high: MuJoCo's defaults"""
    textured: bool = True
    """Humanoid only: sky, stone floor, light-grey metallic body (CLIP rewards are far better on it)"""

    # Reward
    reward: Literal["clip", "gt"] = "clip"
    """learn from the CLIP reward, or from the environment's own reward (e.g. to check SAC on Hopper)"""
    goal: tuple[str, ...] = ("a humanoid robot kneeling",)
    """goal prompt(s)"""
    baseline: tuple[str, ...] = ("a humanoid robot",)
    """baseline prompt(s) for the goal-baseline projection"""
    alpha: float = 0.0
    """regularisation strength in [0, 1]: 0 = plain cosine similarity, 1 = only the goal-baseline direction"""
    clip_model: str = "ViT-bigG-14"
    """open_clip architecture name, or the path of an open_clip model config (.json)"""
    clip_pretrained: str = "laion2b_s39b_b160k"
    """open_clip pretrained tag ("none" = random weights, for tests only)"""
    clip_checkpoint: Optional[str] = None
    """local weights file for `--clip-model` (overrides `--clip-pretrained`)"""
    clip_cache_dir: Optional[str] = None
    """where downloaded CLIP weights are cached (default: the Hugging Face cache)"""
    reward_batch_size: int = 256
    """frames scored per CLIP forward pass"""
    reward_family: Literal["projection", "softmax"] = "projection"
    """projection: the goal-baseline projection (--alpha); softmax: 1 if the goal beats --negatives in a softmax over cosines, else 0"""
    negatives: Optional[tuple[str, ...]] = None
    """softmax family: prompts the goal is contrasted with; default: our negatives for the default --goal (none for others)"""
    temperature: float = 0.01
    """softmax family: temperature tau of the softmax over cosine similarities (0.01 = CLIP's own logit scale 100)"""
    threshold: float = 0.5
    """softmax family: the reward is 1 when the goal's probability is above this, else 0; in (0, 1)"""
    soft: bool = False
    """softmax family: if toggled, the reward is the goal's probability itself instead of 0/1"""

    # SAC (the paper's humanoid settings)
    total_timesteps: int = 10_000_000
    """total environment steps (summed over envs)"""
    num_envs: int = 32
    """the number of parallel environments (subprocesses)"""
    buffer_size: int = 1_000_000
    """the replay memory buffer size"""
    gamma: float = 0.95
    """the discount factor gamma"""
    tau: float = 0.005
    """target smoothing coefficient"""
    batch_size: int = 512
    """the batch size of sample from the replay memory"""
    learning_starts: int = 50_000
    """environment steps of random actions before learning starts"""
    policy_lr: float = 6e-4
    """the learning rate of the policy network optimizer"""
    q_lr: float = 6e-4
    """the learning rate of the Q network optimizer"""
    train_frequency: int = 100
    """vector steps between two training phases"""
    gradient_steps: int = 100
    """gradient steps per training phase"""
    ent_coef: float = 0.2
    """entropy regularisation coefficient (SAC's alpha; the initial value when autotuned)"""
    autotune: bool = True
    """automatic tuning of the entropy coefficient towards entropy -|A|"""


class UserError(Exception):
    """Bad input or a missing resource: reported as one sentence and exit code 2, never a traceback."""


class NonFiniteError(Exception):
    """A NaN or infinite reward or loss: training stops (exit code 1) instead of poisoning the buffer."""


def check_args(args: Args) -> None:
    """Reject bad flags before anything expensive (model download, env spawn) happens."""
    if not 0.0 <= args.alpha <= 1.0:
        raise UserError(f"--alpha must be in [0, 1], got {args.alpha}.")
    if not args.goal or any(not g.strip() for g in args.goal):
        raise UserError('--goal needs at least one non-empty prompt, e.g. --goal "a humanoid robot kneeling".')
    if args.alpha > 0 and (not args.baseline or any(not b.strip() for b in args.baseline)):
        raise UserError("--baseline needs at least one non-empty prompt when --alpha > 0.")
    if args.alpha > 0 and sorted(set(args.goal)) == sorted(set(args.baseline)):
        raise UserError(f"--goal and --baseline are the same prompts, so the goal-baseline direction is zero; change one or use --alpha 0 (got --alpha {args.alpha}).")
    if not 0 < args.temperature < float("inf"):  # also rejects nan
        raise UserError(f"--temperature must be a positive number, got {args.temperature}.")
    if not 0 < args.threshold < 1:
        raise UserError(f"--threshold must be in (0, 1), got {args.threshold}.")
    if args.reward_family == "softmax":
        args.negatives = resolve_negatives(args.goal, args.negatives, "--reward-family softmax")
    for name in ["total_timesteps", "num_envs", "buffer_size", "batch_size", "train_frequency", "gradient_steps",
                 "episode_length", "reward_batch_size", "eval_episodes", "video_frequency", "checkpoint_frequency"]:
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}.")
    for name, low, high in [("gamma", 0, 1), ("tau", 0, 1)]:
        if not low <= getattr(args, name) <= high:
            raise UserError(f"--{name.replace('_', '-')} must be in [{low}, {high}], got {getattr(args, name)}.")
    for name in ["policy_lr", "q_lr", "ent_coef"]:
        if not getattr(args, name) > 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}.")
    if args.total_timesteps % args.num_envs:
        raise UserError(f"--total-timesteps {args.total_timesteps} must be a multiple of --num-envs {args.num_envs} (every vector step takes one step in each env).")
    if args.learning_starts >= args.total_timesteps:
        raise UserError(f"--learning-starts {args.learning_starts} must be below --total-timesteps {args.total_timesteps}, or no gradient step is ever taken.")
    if args.batch_size > args.buffer_size:
        raise UserError(f"--batch-size {args.batch_size} cannot exceed --buffer-size {args.buffer_size}.")
    if args.render_size is not None and not 16 <= args.render_size <= 2048:
        raise UserError(f"--render-size must be between 16 and 2048 pixels, got {args.render_size}.")
    try:
        entry_point = str(gym.spec(args.env_id).entry_point)
    except gym.error.Error:
        raise UserError(f"--env-id {args.env_id} is not a registered Gymnasium environment; use e.g. Humanoid-v5, Hopper-v5 or InvertedPendulum-v5.") from None
    if "mujoco" not in entry_point:
        raise UserError(f"--env-id {args.env_id} is not a Gymnasium MuJoCo task; this script renders MuJoCo scenes (e.g. Humanoid-v5, Hopper-v5).")
    if args.evaluate is not None and not os.path.isfile(args.evaluate):
        raise UserError(f"--evaluate {args.evaluate}: no such file; pass a checkpoint.pt written by --save-model.")
    if args.torch_threads is not None and args.torch_threads < 0:
        raise UserError(f"--torch-threads must be 0 (torch's default) or a positive number, got {args.torch_threads}.")
    check_writable("runs")
    if args.capture_video or args.evaluate is not None:
        check_writable("videos")
    size = args.render_size or 224
    probe = gym.make(args.env_id)  # cheap: no rendering, just the spaces
    if args.evaluate is None:  # a rollout allocates no replay buffer
        check_resources(args, probe.observation_space, probe.action_space, (size, size, 3))
    if args.reward == "clip" or args.evaluate is not None:
        check_clip_args(args)


def check_writable(folder: str) -> None:
    """Outputs must be writable before hours of training produce them (the folder itself may not exist yet)."""
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        raise UserError(f"cannot write outputs to {os.path.abspath(folder)}/ ({existing} is not a writable folder); run from a folder you can write to.")


def check_resources(args: Args, observation_space: gym.Space, action_space: gym.Space, frame_shape: tuple) -> None:
    """Estimate host memory (replay buffer + frames waiting for their reward) and refuse what cannot fit."""
    action_bytes = 8 if isinstance(action_space, gym.spaces.Discrete) else 4 * int(np.prod(action_space.shape))
    buffer_bytes = args.buffer_size * (2 * 4 * int(np.prod(observation_space.shape)) + action_bytes + 4 + 4)  # obs, next_obs, action, reward, done
    frame_bytes = (args.reward_batch_size + args.num_envs) * int(np.prod(frame_shape)) if args.reward == "clip" else 0
    available = available_memory()
    print(f"memory: replay buffer {buffer_bytes / 2**30:.2f} GiB + pending frames {frame_bytes / 2**30:.2f} GiB"
          + (f" (available: {available / 2**30:.1f} GiB)" if available else ""))
    if available and buffer_bytes + frame_bytes > 0.9 * available:
        raise UserError(f"--buffer-size {args.buffer_size} needs {(buffer_bytes + frame_bytes) / 2**30:.1f} GiB of memory but only "
                        f"{available / 2**30:.1f} GiB is available; lower --buffer-size or --reward-batch-size.")


def available_memory() -> int:
    """Bytes of memory available to a new allocation (Linux MemAvailable), 0 when unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 0


def read_checkpoint(path: str) -> dict:
    """A resumable checkpoint of this script, or a one-sentence error."""
    if not os.path.isfile(path):
        raise UserError(f"--resume {path}: no such file; pass the checkpoint.pt of the run to continue.")
    try:
        # our own file with RNG states and arrays: weights_only=False, so only resume checkpoints you trust
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise UserError(f"--resume {path} is not a readable checkpoint ({type(e).__name__}); pass the checkpoint.pt written by this script.") from None
    if not isinstance(checkpoint, dict) or "iteration" not in checkpoint or "rng" not in checkpoint:
        raise UserError(f"--resume {path} holds no resumable training state (a model.pt, or networks saved when training stopped on a non-finite value); pass a checkpoint.pt saved at an episode boundary.")
    if not set(checkpoint["args"]) <= {f.name for f in fields(Args)}:
        raise UserError(f"--resume {path} was written by another script; pass a checkpoint.pt of {os.path.basename(__file__)}.")
    return checkpoint


def check_clip_args(args: Args) -> None:
    import open_clip

    if args.clip_model.endswith(".json"):
        if not os.path.isfile(args.clip_model):
            raise UserError(f"--clip-model {args.clip_model}: no such model config file.")
        return
    if args.clip_model not in open_clip.list_models():
        raise UserError(f"--clip-model {args.clip_model} is not an open_clip architecture; run `python -c \"import open_clip; print(open_clip.list_models())\"` to see them (e.g. ViT-bigG-14, ViT-L-14, RN50).")
    if args.clip_checkpoint is not None:
        if not os.path.isfile(args.clip_checkpoint):
            raise UserError(f"--clip-checkpoint {args.clip_checkpoint}: no such file; pass the path of a downloaded open_clip weights file.")
        return
    tags = open_clip.list_pretrained_tags_by_model(args.clip_model)
    if args.clip_pretrained != "none" and args.clip_pretrained not in tags:
        raise UserError(f"--clip-pretrained {args.clip_pretrained} is not a pretrained tag of {args.clip_model}; its tags are: {', '.join(tags) or 'none'}.")


# ----------------------------------------------------------------------------------------------
# CLIP reward
# ----------------------------------------------------------------------------------------------
def vlm_reward(image_embeddings: torch.Tensor, goal_embeddings: torch.Tensor,
               baseline_embeddings: torch.Tensor, alpha: float) -> torch.Tensor:
    """R(s) = 1 - 0.5 * ||(s - g) P||^2 with P = alpha * d d^T / ||d||^2 + (1 - alpha) I, d = g - b.

    Takes raw (N, D) image and (G, D) / (B, D) prompt embeddings; returns (N,) rewards in float32.
    """
    s = F.normalize(image_embeddings.float(), dim=-1)
    g = F.normalize(goal_embeddings.float(), dim=-1).mean(0)  # the mean is deliberately not re-normalised
    b = F.normalize(baseline_embeddings.float(), dim=-1).mean(0)
    u = s - g
    if alpha == 0:
        return 1 - 0.5 * u.pow(2).sum(-1)
    d = g - b
    d_norm = d.norm()
    if d_norm == 0:
        raise ValueError("goal and baseline embeddings are equal: the projection direction is undefined for alpha > 0")
    direction = d / d_norm
    # u P = alpha * (u . d^) d^ + (1 - alpha) u: O(N D), no D x D matrix
    projected = alpha * (u @ direction)[:, None] * direction + (1 - alpha) * u
    return 1 - 0.5 * projected.pow(2).sum(-1)


DEFAULT_NEGATIVES = {  # softmax family: our own negatives for the default goals (not the paper's), states the goal is not
    ("pole vertically upright on top of the cart",): ("pole tilted to the side of the cart", "pole lying flat next to the cart"),
    ("a car at the peak of the mountain, next to the yellow flag",): ("a car at the bottom of the valley", "a car on the slope, far from the yellow flag"),
    ("a humanoid robot kneeling",): ("a humanoid robot standing", "a humanoid robot lying on the ground"),
}


def softmax_reward(image_embeddings: torch.Tensor, goal_embeddings: torch.Tensor, negative_embeddings: torch.Tensor,
                   temperature: float, threshold: float, soft: bool = False) -> torch.Tensor:
    """R(s) = 1 if p > threshold else 0, p = softmax_k(cos(s, e_k) / temperature)[goal] over the goal and each negative.

    Takes raw (N, D) image, (G, D) goal and (K, D) negative embeddings. Several goal prompts form one class: the mean
    of the normalised goal embeddings, re-normalised (the cosine needs a direction); every negative prompt is a class
    of its own. Returns (N,) float32: 0 or 1, or with soft=True the probability p itself.
    """
    if negative_embeddings.shape[0] == 0:
        raise ValueError("softmax_reward needs at least one negative prompt embedding")
    if not 0 < temperature < float("inf"):  # also rejects nan
        raise ValueError(f"temperature must be positive and finite, got {temperature}")
    if not 0 < threshold < 1:
        raise ValueError(f"threshold must be in (0, 1), got {threshold}")
    s = F.normalize(image_embeddings.float(), dim=-1)
    g = F.normalize(F.normalize(goal_embeddings.float(), dim=-1).mean(0), dim=-1)
    prompts = torch.cat([g[None], F.normalize(negative_embeddings.float(), dim=-1)])  # (1 + K, D), the goal first
    p = (s @ prompts.T / temperature).softmax(dim=-1)[:, 0]
    return p if soft else (p > threshold).float()


def resolve_negatives(goal: tuple[str, ...], negatives: Optional[tuple[str, ...]], flag: str) -> tuple[str, ...]:
    """The softmax family's negative prompts: --negatives, else the defaults of the default goal; one-sentence errors."""
    negatives = DEFAULT_NEGATIVES.get(tuple(goal), ()) if negatives is None else tuple(negatives)
    if not negatives or any(not n.strip() for n in negatives):
        raise UserError(f"{flag} needs at least one non-empty --negatives prompt describing what the goal is not (default negatives go with the default --goal only).")
    shared = sorted(set(negatives) & set(goal))
    if shared:
        raise UserError(f"--negatives and --goal share the prompt {shared[0]!r}; a negative must describe something the goal is not.")
    return negatives


def load_clip(args: Args, device: torch.device) -> tuple[nn.Module, object]:
    """The open_clip model and tokenizer named by the flags, with one-sentence errors."""
    import open_clip

    model_name = args.clip_model
    if model_name.endswith(".json"):  # a custom architecture, e.g. the tiny test model in tests/
        open_clip.add_model_config(model_name)
        model_name = Path(model_name).stem
    pretrained = args.clip_checkpoint or (None if args.clip_pretrained == "none" else args.clip_pretrained)
    logging.disable(logging.ERROR)  # open_clip logs its own multi-line errors; we say it in one sentence
    try:
        model = open_clip.create_model(model_name, pretrained=pretrained, device=device, cache_dir=args.clip_cache_dir)
    except Exception as e:  # noqa: BLE001 - every failure here has the same fixes
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        detail = detail if len(detail) <= 160 else detail[:157] + "..."
        if args.clip_checkpoint is not None:
            raise UserError(f"could not load --clip-checkpoint {args.clip_checkpoint} into {model_name} ({type(e).__name__}: {detail}); check that the file holds open_clip weights for that architecture.") from None
        raise UserError(f"could not download or find the {model_name}/{pretrained} CLIP weights ({detail}); check the network connection, point --clip-cache-dir at a folder that already holds them, or pass a local weights file with --clip-checkpoint.") from None
    finally:
        logging.disable(logging.NOTSET)
    if pretrained is None:
        print(f"note: {model_name} has random weights (--clip-pretrained none): its rewards are meaningless outside tests")
    return model.eval(), open_clip.get_tokenizer(model_name)


class CLIPReward(nn.Module):
    """Scores uint8 frames (N, H, W, 3) with `vlm_reward` (family "projection") or `softmax_reward` ("softmax").

    Prompt embeddings (goal, baseline, negatives) are computed once.
    """

    def __init__(self, model: nn.Module, tokenizer, goal: tuple[str, ...], baseline: tuple[str, ...],
                 alpha: float, batch_size: int, device: torch.device, family: str = "projection",
                 negatives: tuple[str, ...] = (), temperature: float = 0.01, threshold: float = 0.5, soft: bool = False):
        super().__init__()
        import open_clip

        if family not in ("projection", "softmax"):
            raise ValueError(f"unknown reward family {family!r}: use 'projection' or 'softmax'")
        if family == "softmax" and not negatives:
            raise ValueError("the softmax reward family needs at least one negative prompt")
        self.model, self.alpha, self.batch_size, self.device = model, alpha, batch_size, device
        self.family, self.temperature, self.threshold, self.soft = family, temperature, threshold, soft
        preprocess_cfg = open_clip.get_model_preprocess_cfg(model)
        self.image_size = tuple(preprocess_cfg["size"]) if not isinstance(preprocess_cfg["size"], int) else (preprocess_cfg["size"],) * 2
        self.register_buffer("mean", torch.tensor(preprocess_cfg["mean"], device=device).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(preprocess_cfg["std"], device=device).view(1, 3, 1, 1))
        with torch.no_grad():
            self.register_buffer("goal_embeddings", model.encode_text(tokenizer(list(goal)).to(device)).float())
            self.register_buffer("baseline_embeddings", model.encode_text(tokenizer(list(baseline or goal)).to(device)).float())
            self.register_buffer("negative_embeddings", model.encode_text(tokenizer(list(negatives)).to(device)).float() if negatives
                                 else self.goal_embeddings.new_zeros(0, self.goal_embeddings.shape[1]))

    @torch.no_grad()
    def embed_images(self, frames: torch.Tensor) -> torch.Tensor:
        """uint8 (N, H, W, 3) -> raw image embeddings (N, D); frames travel to the device as uint8 (4x less)."""
        x = frames.to(self.device, non_blocking=True).permute(0, 3, 1, 2).float().div_(255)
        # squash to the model's square input, like the reference; antialias matches PIL's bicubic downscale
        x = F.interpolate(x, size=self.image_size, mode="bicubic", align_corners=False, antialias=True).clamp_(0, 1)
        x = (x - self.mean) / self.std
        with torch.autocast(device_type=self.device.type, dtype=torch.float16, enabled=self.device.type == "cuda"):
            return self.model.encode_image(x)

    def rewards(self, image_embeddings: torch.Tensor) -> torch.Tensor:
        """The chosen family's rewards (N,) of raw image embeddings (N, D)."""
        if self.family == "softmax":
            return softmax_reward(image_embeddings, self.goal_embeddings, self.negative_embeddings,
                                  self.temperature, self.threshold, self.soft)
        return vlm_reward(image_embeddings, self.goal_embeddings, self.baseline_embeddings, self.alpha)

    @torch.no_grad()
    def forward(self, frames: np.ndarray) -> np.ndarray:
        frames = torch.from_numpy(np.ascontiguousarray(frames))
        rewards = [self.rewards(self.embed_images(chunk)) for chunk in frames.split(self.batch_size)]
        return torch.cat(rewards).cpu().numpy()


def make_reward_model(args: Args, device: torch.device) -> CLIPReward:
    model, tokenizer = load_clip(args, device)
    return CLIPReward(model, tokenizer, args.goal, args.baseline, args.alpha, args.reward_batch_size, device,
                      args.reward_family, args.negatives or (), args.temperature, args.threshold, args.soft)


def warn_if_slow_on_cpu(reward_model: CLIPReward, args: Args, frame_shape: tuple[int, int, int]) -> None:
    """A real-size CLIP on CPU takes seconds per frame: measure it once and say what to do instead."""
    if reward_model.device.type != "cpu":
        return
    frames = np.zeros((8, *frame_shape), dtype=np.uint8)
    reward_model(frames[:1])  # warm-up: the first call pays one-off allocation costs
    start = time.perf_counter()
    reward_model(frames)
    seconds = (time.perf_counter() - start) / len(frames)
    total = seconds * args.total_timesteps
    duration = f"{total / 3600:.1f} h" if total >= 3600 else f"{total / 60:.0f} min"
    print(f"note: scoring a frame with {Path(args.clip_model).stem} on CPU takes {seconds * 1000:.0f} ms, so this run "
          f"will spend about {duration} in the reward model" + ("; use a GPU, or a smaller model such as "
          "--clip-model RN50 --clip-pretrained openai" if seconds > 0.05 and args.clip_model != "RN50" else ""))


# ----------------------------------------------------------------------------------------------
# Environment: Humanoid-v5 with the paper's camera and a realistic look; physics untouched
# ----------------------------------------------------------------------------------------------
# The paper's frontal free camera. A FREE camera keeps its lookat/distance/angles fixed in the world
# (only a TRACKING camera follows a body), so the humanoid can walk out of the picture.
HUMANOID_CAMERA = {
    "distance": 3.5,
    "lookat": np.array([0.0, 0.0, 1.0]),
    "elevation": -10.0,
    "azimuth": 180.0,
}
_ASSET_VERSION = "v3"  # bump when the look changes, so stale cached files are not reused


def _tileable_noise(rng: np.random.Generator, size: int, cells: int) -> np.ndarray:
    """Smooth value noise in [0, 1] on a periodic grid, so the texture repeats without seams."""
    grid = rng.random((cells, cells))
    coords = np.arange(size) * cells / size
    i0 = np.floor(coords).astype(int)
    t = coords - i0
    t = t * t * (3 - 2 * t)  # smoothstep: no visible grid creases
    i1 = (i0 + 1) % cells
    rows = grid[i0] * (1 - t)[:, None] + grid[i1] * t[:, None]
    return rows[:, i0] * (1 - t)[None, :] + rows[:, i1] * t[None, :]


def _fractal_noise(rng: np.random.Generator, size: int, base_cells: int, octaves: int) -> np.ndarray:
    out = np.zeros((size, size))
    amp, total = 1.0, 0.0
    for o in range(octaves):
        out += amp * _tileable_noise(rng, size, min(base_cells * 2**o, size))
        total += amp
        amp *= 0.5
    return out / total


def _stone_floor_png(path: str, size: int = 512, tiles: int = 4) -> None:
    """Grey-beige stone tiles with dark grout, per-tile tint and grain (fixed seed: same look everywhere)."""
    rng = np.random.default_rng(1234)
    tile_px = size // tiles
    yy, xx = np.mgrid[0:size, 0:size]
    ty, tx = yy // tile_px, xx // tile_px
    # Per-tile base colour: warm light greys, each slab slightly different, like natural stone.
    base = 0.58 + 0.10 * rng.random((tiles, tiles))
    tint = np.stack([np.full((tiles, tiles), 1.0), 0.97 + 0.02 * rng.random((tiles, tiles)),
                     0.90 + 0.04 * rng.random((tiles, tiles))], axis=-1)
    color = (base[..., None] * tint)[ty, tx]
    grain = _fractal_noise(rng, size, 8, 5)
    speckle = rng.random((size, size))
    color = color * (0.80 + 0.35 * grain)[..., None] * (0.94 + 0.06 * speckle)[..., None]
    # Grout lines plus a soft darkening towards slab edges (worn bevel).
    dx = np.minimum(xx % tile_px, tile_px - 1 - xx % tile_px)
    dy = np.minimum(yy % tile_px, tile_px - 1 - yy % tile_px)
    edge = np.minimum(dx, dy)
    color = color * (0.85 + 0.15 * np.clip(edge / 8.0, 0, 1))[..., None]
    grout = edge < 2
    color[grout] = np.array([0.40, 0.39, 0.36]) * (0.8 + 0.4 * grain[grout])[:, None]
    imageio.imwrite(path, (np.clip(color, 0, 1) * 255).astype(np.uint8))


def _sample_periodic(noise: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Bilinear lookup of a periodic noise image at continuous (x, y) pixel coordinates."""
    n = noise.shape[0]
    x0, y0 = np.floor(x).astype(int), np.floor(y).astype(int)
    tx, ty = x - x0, y - y0
    x0, y0 = x0 % n, y0 % n
    x1, y1 = (x0 + 1) % n, (y0 + 1) % n
    top = noise[y0, x0] * (1 - tx) + noise[y0, x1] * tx
    bottom = noise[y1, x0] * (1 - tx) + noise[y1, x1] * tx
    return top * (1 - ty) + bottom * ty


# Measured MuJoCo skybox convention: face pixel (a, b) in [-1, 1] (b grows downwards) looks along
# this world direction (x forward of the humanoid, z up).
_SKY_FACES = {
    "right": lambda a, b: (np.ones_like(a), a, -b),   # +x
    "left": lambda a, b: (-np.ones_like(a), -a, -b),  # -x (what the paper camera looks at)
    "back": lambda a, b: (-a, np.ones_like(a), -b),   # +y
    "front": lambda a, b: (a, -np.ones_like(a), -b),  # -y
    "up": lambda a, b: (a, -b, np.ones_like(a)),      # +z
    "down": lambda a, b: (a, b, -np.ones_like(a)),    # -z
}


def _sky_pngs(folder: str, suffix: str, size: int = 512) -> dict[str, str]:
    """Six skybox faces: blue sky paling towards a hazy horizon, with soft cumulus-like clouds."""
    rng = np.random.default_rng(4321)
    clouds = _fractal_noise(rng, 256, 4, 6)
    zenith, horizon = np.array([0.20, 0.42, 0.78]), np.array([0.78, 0.86, 0.95])
    ground_haze = np.array([0.70, 0.72, 0.72])
    a = (np.arange(size) + 0.5) / size * 2 - 1
    a, b = np.meshgrid(a, a)
    paths = {}
    for face, direction in _SKY_FACES.items():
        d = np.stack(np.broadcast_arrays(*direction(a, b)), axis=-1).astype(float)
        d /= np.linalg.norm(d, axis=-1, keepdims=True)
        up = d[..., 2]
        # Sky brightens exponentially towards the horizon (more air to look through).
        haze = np.exp(-np.clip(up, 0, None) / 0.18)[..., None]
        color = zenith * (1 - haze) + horizon * haze
        # Clouds live on a flat layer overhead: project the view ray onto it (perspective for free).
        height = np.clip(up, 0.02, None)
        cx, cy = d[..., 0] / height * 60, d[..., 1] / height * 60
        density = _sample_periodic(clouds, cx, cy)
        density = np.clip((density - 0.52) / 0.18, 0, 1) ** 1.5
        density *= np.clip((up - 0.03) / 0.15, 0, 1)  # fade into the haze where they would alias
        shade = 0.86 + 0.14 * _sample_periodic(clouds, cx * 2 + 37, cy * 2 + 11)  # grey undersides
        color = color * (1 - density[..., None]) + (shade * density)[..., None]  # white-grey clouds
        # Below the horizon (past the floor's edge): blend into a neutral distant-ground haze.
        below = np.clip(-up / 0.08, 0, 1)[..., None]
        color = color * (1 - below) + ground_haze * below
        path = os.path.join(folder, f"sky_{face}.png")
        imageio.imwrite(path + suffix, (np.clip(color, 0, 1) * 255).astype(np.uint8))
        os.replace(path + suffix, path)
        paths[face] = path
    return paths


def textured_humanoid_xml() -> str:
    """Write Gymnasium's Humanoid-v5 model with only its look changed; return the file's path.

    Only textures, materials, colours, the light and the headlight are edited: bodies, joints, geom
    sizes, masses, contact parameters, actuators and options are untouched, so the physics is identical.
    """
    stock = os.path.join(os.path.dirname(gym.envs.mujoco.__file__), "assets", "humanoid.xml")
    with open(stock, "rb") as f:
        stock_bytes = f.read()
    key = hashlib.sha1(stock_bytes + _ASSET_VERSION.encode()).hexdigest()[:10]
    cache = os.path.join(tempfile.gettempdir(), f"vlmrm_humanoid_{key}")
    xml_path = os.path.join(cache, "humanoid_textured.xml")
    if os.path.exists(xml_path):
        return xml_path
    os.makedirs(cache, exist_ok=True)
    # Unique temporary names + os.replace: parallel env workers may build the files at the same time.
    tmp_suffix = f".{os.getpid()}.tmp"
    floor_png = os.path.join(cache, "stone_floor.png")
    _stone_floor_png(floor_png + tmp_suffix + ".png")
    os.replace(floor_png + tmp_suffix + ".png", floor_png)

    root = ET.fromstring(stock_bytes)
    # Colours come from materials from now on: drop the stock tan default rgba and the floor's green
    # tint (a geom rgba different from MuJoCo's default overrides its material's colour).
    root.find("default/geom").attrib.pop("rgba", None)
    floor = root.find("worldbody/geom[@name='floor']")
    floor.attrib.pop("rgba", None)

    asset = root.find("asset")
    for child in list(asset):
        asset.remove(child)
    # Sky: procedural blue sky with clouds, one PNG per cube face.
    sky = _sky_pngs(cache, tmp_suffix + ".png")
    ET.SubElement(asset, "texture", type="skybox", **{f"file{face}": path for face, path in sky.items()})
    ET.SubElement(asset, "texture", name="texplane", type="2d", file=floor_png)
    # Stone is matte: no mirror reflection (reflectance 0), little specular highlight.
    ET.SubElement(asset, "material", name="MatPlane", texture="texplane", texrepeat="20 20",
                  reflectance="0", specular="0.15", shininess="0.1")
    # Light grey brushed metal: strong, fairly tight highlights on a pale grey base.
    ET.SubElement(asset, "material", name="geom", rgba="0.78 0.79 0.82 1", specular="0.9",
                  shininess="0.7", reflectance="0")

    # Bright light straight from above, as in the paper.
    light = root.find("worldbody/light")
    light.set("diffuse", "1 1 1")
    light.set("dir", "0 0 -1.5")
    light.set("specular", "0.4 0.4 0.4")
    # A little ambient fill so shadowed sides of the robot are not black.
    visual = root.find("visual")
    ET.SubElement(visual, "headlight", ambient="0.25 0.25 0.25", diffuse="0.35 0.35 0.35",
                  specular="0.1 0.1 0.1")

    ET.ElementTree(root).write(xml_path + tmp_suffix)
    os.replace(xml_path + tmp_suffix, xml_path)
    return xml_path


class RenderQuality(gym.Wrapper):
    """Switches MuJoCo's shadows and reflections off (several times faster with software rendering).

    Gymnasium creates the offscreen viewer lazily on the first render(), so the scene flags can only be
    set once it exists: the first call renders, sets the flags, and renders again.
    """

    def __init__(self, env: gym.Env, quality: str) -> None:
        super().__init__(env)
        assert quality in ("high", "fast"), quality
        self.quality = quality
        self._flags_set = quality == "high"  # "high" keeps MuJoCo's defaults (both on)

    def render(self) -> np.ndarray:
        frame = self.env.render()
        if not self._flags_set:
            scene = self.env.unwrapped.mujoco_renderer.viewer.scn
            scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
            scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
            self._flags_set = True
            frame = self.env.render()
        return frame


class NoEarlyTermination(gym.Wrapper):
    """Fixed-length episodes for any MuJoCo task: a fallen robot keeps being rendered and scored."""

    def step(self, action):
        obs, reward, _, truncated, info = self.env.step(action)
        return obs, reward, False, truncated, info


def make_env(
    env_id: str,
    seed: int,
    idx: int,
    episode_length: int,
    render_size: int,
    render_quality: str,
    textured: bool,
) -> Callable[[], gym.Env]:
    """CleanRL-style thunk: fixed-length episodes, square rgb_array rendering for the CLIP reward."""

    def thunk() -> gym.Env:
        # max_episode_steps makes gym.make wrap the env in TimeLimit(episode_length).
        common = dict(render_mode="rgb_array", width=render_size, height=render_size,
                      max_episode_steps=episode_length)
        if env_id.startswith("Humanoid-"):  # not HumanoidStandup: its own model and arguments
            # No early termination: a fallen humanoid keeps being rendered and rewarded until the end.
            env = gym.make(env_id, terminate_when_unhealthy=False, default_camera_config=HUMANOID_CAMERA,
                           **({"xml_file": textured_humanoid_xml()} if textured else {}), **common)
        else:
            env = NoEarlyTermination(gym.make(env_id, **common))
        if hasattr(env.unwrapped, "mujoco_renderer"):
            env = RenderQuality(env, render_quality)
        env.action_space.seed(seed + idx)
        env.observation_space.seed(seed + idx)
        return env

    return thunk


# ----------------------------------------------------------------------------------------------
# SAC
# ----------------------------------------------------------------------------------------------
class SoftQNetwork(nn.Module):
    def __init__(self, envs: gym.vector.VectorEnv):
        super().__init__()
        obs_dim = np.array(envs.single_observation_space.shape).prod()
        action_dim = np.prod(envs.single_action_space.shape)
        self.network = nn.Sequential(nn.Linear(obs_dim + action_dim, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return self.network(torch.cat([x, a], 1))


LOG_STD_MAX = 2
LOG_STD_MIN = -5


class Actor(nn.Module):
    def __init__(self, envs: gym.vector.VectorEnv):
        super().__init__()
        obs_dim = np.array(envs.single_observation_space.shape).prod()
        action_dim = np.prod(envs.single_action_space.shape)
        self.trunk = nn.Sequential(nn.Linear(obs_dim, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
        self.fc_mean = nn.Linear(256, action_dim)
        self.fc_logstd = nn.Linear(256, action_dim)
        # actions are squashed to (-1, 1) by tanh, then rescaled to the action space
        low, high = envs.single_action_space.low, envs.single_action_space.high
        self.register_buffer("action_scale", torch.tensor((high - low) / 2.0, dtype=torch.float32))
        self.register_buffer("action_bias", torch.tensor((high + low) / 2.0, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        log_std = torch.tanh(self.fc_logstd(h))
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)  # soft clip to [min, max]
        return self.fc_mean(h), log_std

    def get_action(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sampled action, its log-probability, the deterministic action)."""
        mean, log_std = self(x)
        normal = torch.distributions.Normal(mean, log_std.exp(), validate_args=False)  # NaNs surface in our own check, with a message
        x_t = normal.rsample()  # reparameterisation trick
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        # change of variables through tanh and the rescaling
        log_prob = normal.log_prob(x_t) - torch.log(self.action_scale * (1 - y_t.pow(2)) + 1e-6)
        return action, log_prob.sum(1, keepdim=True), torch.tanh(mean) * self.action_scale + self.action_bias


class ReplayBuffer:
    """Plain ring buffer of (obs, action, reward, next_obs, terminated) on the host."""

    def __init__(self, size: int, obs_shape: tuple, action_shape: tuple, device: torch.device):
        self.size, self.device, self.pos, self.full = size, device, 0, False
        self.obs = np.zeros((size, *obs_shape), dtype=np.float32)
        self.next_obs = np.zeros((size, *obs_shape), dtype=np.float32)
        self.actions = np.zeros((size, *action_shape), dtype=np.float32)
        self.rewards = np.zeros((size,), dtype=np.float32)
        self.terminations = np.zeros((size,), dtype=np.float32)

    def add(self, obs: np.ndarray, next_obs: np.ndarray, actions: np.ndarray, rewards: np.ndarray, terminations: np.ndarray) -> None:
        idx = (self.pos + np.arange(len(obs))) % self.size  # one vectorised write, wrapping around the end
        self.obs[idx], self.next_obs[idx], self.actions[idx] = obs, next_obs, actions
        self.rewards[idx], self.terminations[idx] = rewards, terminations
        self.full = self.full or self.pos + len(obs) >= self.size
        self.pos = (self.pos + len(obs)) % self.size

    def __len__(self) -> int:
        return self.size if self.full else self.pos

    def state_dict(self) -> dict:
        n = len(self)
        return {"pos": self.pos, "full": self.full, "obs": self.obs[:n], "next_obs": self.next_obs[:n], "actions": self.actions[:n],
                "rewards": self.rewards[:n], "terminations": self.terminations[:n]}

    def load_state_dict(self, state: dict) -> None:
        self.pos, self.full = state["pos"], state["full"]
        for name in ("obs", "next_obs", "actions", "rewards", "terminations"):
            getattr(self, name)[: len(state[name])] = state[name]

    def sample(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        idx = np.random.randint(0, len(self), size=batch_size)
        return tuple(torch.from_numpy(a[idx]).to(self.device) for a in
                     (self.obs, self.actions, self.rewards, self.next_obs, self.terminations))


def save_video(frames: list[np.ndarray], path: str, fps: int = 30) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    imageio.mimwrite(path, frames, fps=fps, macro_block_size=8)


def save_checkpoint(path: str, state: dict) -> None:
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # atomic: a crash mid-write never replaces a good checkpoint with half of one


def rng_state(envs: gym.vector.VectorEnv) -> dict:
    """Every random number generator the run draws from, so a resumed run continues the same stream."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "envs": list(envs.get_attr("np_random"))}


def install_stop_handlers() -> dict:
    """First Ctrl-C or SIGTERM: finish the current episodes, save a checkpoint, exit cleanly. Second: quit at once."""
    stop = {"requested": False}

    def handler(signum: int, frame) -> None:
        if stop["requested"]:
            raise KeyboardInterrupt
        stop["requested"] = True
        print(f"\n{signal.Signals(signum).name} received: saving a checkpoint at the end of the current episodes (send it again to quit without saving)", flush=True)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stop


def set_torch_threads(args: Args, device: torch.device) -> None:
    """One torch thread on CPU unless asked otherwise: measured 8-12x faster for these small networks on a shared CPU."""
    if args.torch_threads is None and device.type == "cpu":
        torch.set_num_threads(1)
    elif args.torch_threads:
        torch.set_num_threads(args.torch_threads)


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    """One compact progress line: redrawn in place on a terminal, else printed every `interval` s (logs stay small)."""

    def __init__(self, total_steps: int, start_step: int, clip: bool, recent: int, interval: float = 10.0):
        self.total, self.start_step, self.clip = total_steps, start_step, clip
        self.tty = sys.stdout.isatty()
        self.interval = 0.5 if self.tty else interval
        self.start = self.last = time.time()
        self.gt_returns, self.clip_returns = deque(maxlen=recent), deque(maxlen=recent)

    def episode(self, gt_return: float, clip_return: float) -> None:
        self.gt_returns.append(gt_return)
        self.clip_returns.append(clip_return)

    def update(self, step: int, final: bool = False) -> None:
        now = time.time()
        if not final and now - self.last < self.interval:
            return
        self.last, elapsed = now, now - self.start
        sps = (step - self.start_step) / max(elapsed, 1e-9)
        left = (self.total - step) / sps if sps > 0 else math.inf
        line = (f"step {step}/{self.total} ({100 * step / self.total:.0f}%) | {sps:.0f} steps/s"
                f" | elapsed {format_duration(elapsed)} | left {format_duration(left)}")
        if self.gt_returns:
            line += f" | last {len(self.gt_returns)} episodes: gt_return {np.mean(self.gt_returns):.1f}"
            line += f", clip_return {np.mean(self.clip_returns):.2f}" if self.clip else ""
        if self.tty:  # cursor back to the line start: the next update, or any other message, overwrites it
            sys.stdout.write("\r\x1b[K" + line + ("\n" if final else "\r"))
            sys.stdout.flush()
        else:
            print(line, flush=True)


def evaluate(actor: Actor, eval_envs: gym.vector.VectorEnv, args: Args, device: torch.device,
             reward_model: Optional[CLIPReward], episodes: int, seed: int) -> list[dict]:
    """Deterministic episodes of the policy: frames, ground-truth return and CLIP return of each."""
    results = []
    for episode in range(episodes):
        obs, _ = eval_envs.reset(seed=seed + episode)
        frames = [eval_envs.call("render")[0]]
        gt_return = 0.0
        for _ in range(args.episode_length):
            with torch.no_grad():
                _, _, actions = actor.get_action(torch.as_tensor(obs, dtype=torch.float32, device=device))
            obs, gt_rewards, _, _, _ = eval_envs.step(actions.cpu().numpy())
            gt_return += float(gt_rewards[0])
            frames.append(eval_envs.call("render")[0])
        # the reset frame scores no transition: the reward of step t is the score of frame t + 1
        clip_return = float(reward_model(np.stack(frames[1:])).sum()) if reward_model is not None else float("nan")
        results.append({"frames": frames, "gt_return": gt_return, "clip_return": clip_return})
    return results


def clip_image_size(args: Args) -> int:
    """The CLIP input size, read from the architecture's config without loading any weights."""
    import open_clip

    if args.clip_model.endswith(".json"):
        open_clip.add_model_config(args.clip_model)
    size = open_clip.get_model_config(Path(args.clip_model).stem if args.clip_model.endswith(".json") else args.clip_model)["vision_cfg"]["image_size"]
    return size if isinstance(size, int) else size[0]


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
def main(args: Args) -> None:
    checkpoint = None
    if args.resume is not None:  # continue the same run: its flags, step, TensorBoard folder and random streams
        checkpoint = read_checkpoint(args.resume)
        args = Args(**{**checkpoint["args"], "resume": args.resume})
    check_args(args)
    run_name = checkpoint["run_name"] if checkpoint else f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
    if args.render_size is None:
        args.render_size = clip_image_size(args) if args.reward == "clip" or args.evaluate is not None else 224

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    set_torch_threads(args, device)
    make_eval_envs = lambda: gym.vector.SyncVectorEnv([make_env(args.env_id, args.seed + 10_000, 0, args.episode_length, args.render_size, args.render_quality, args.textured)])  # noqa: E731

    if args.evaluate is not None:
        eval_envs = make_eval_envs()
        actor = Actor(eval_envs).to(device)
        actor.load_state_dict(torch.load(args.evaluate, map_location=device, weights_only=False)["actor"])
        results = evaluate(actor, eval_envs, args, device, make_reward_model(args, device), args.eval_episodes, args.seed + 10_000)
        for episode, result in enumerate(results):
            folder = f"videos/{run_name}/eval-episode-{episode}"
            save_video(result["frames"], folder + ".mp4")
            os.makedirs(folder, exist_ok=True)
            for t, frame in enumerate(result["frames"]):
                imageio.imwrite(f"{folder}/frame-{t:04d}.png", frame)
            print(f"eval episode {episode}: clip_return={result['clip_return']:.2f} gt_return={result['gt_return']:.1f} -> {folder}.mp4")
        return

    # We reset finished envs ourselves (autoreset off): no reset step, so no reset frame or reset
    # observation can ever be stored as a transition, and episode boundaries are explicit for checkpoints.
    # The subprocesses are forked before CUDA starts (reward model) and ignore Ctrl-C / SIGTERM: the main
    # process decides when to stop, so a signal never kills an env mid-step.
    handlers = signal.signal(signal.SIGINT, signal.SIG_IGN), signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # nothing to render with --reward gt: stepping in-process beats the pipe round trips to subprocesses
    vector_env = gym.vector.SyncVectorEnv if args.reward == "gt" else gym.vector.AsyncVectorEnv
    envs = vector_env([make_env(args.env_id, args.seed, i, args.episode_length, args.render_size, args.render_quality, args.textured) for i in range(args.num_envs)],
                                     autoreset_mode=gym.vector.AutoresetMode.DISABLED)
    signal.signal(signal.SIGINT, handlers[0])
    signal.signal(signal.SIGTERM, handlers[1])
    try:
        reward_model = make_reward_model(args, device) if args.reward == "clip" else None
    except UserError:
        envs.close()  # env subprocesses would print tracebacks when we exit under them
        raise
    if reward_model is not None:
        warn_if_slow_on_cpu(reward_model, args, (args.render_size, args.render_size, 3))
    eval_envs = make_eval_envs() if args.capture_video else None
    num_iterations = args.total_timesteps // args.num_envs
    start_iteration = checkpoint["iteration"] if checkpoint else 0
    # purge_step drops whatever a crashed run logged after its checkpoint, so the curves continue cleanly
    writer = SummaryWriter(f"runs/{run_name}", purge_step=start_iteration * args.num_envs if checkpoint else None)
    if checkpoint is None:
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n%s" % "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items()))
    print(f"run: runs/{run_name} on {device}, reward: {args.reward}" + (f", goal={args.goal}, baseline={args.baseline}, alpha={args.alpha}" if args.reward == "clip" else "")
          + (f", resumed at step {start_iteration * args.num_envs}" if checkpoint else ""))

    actor = Actor(envs).to(device)
    qf1, qf2 = SoftQNetwork(envs).to(device), SoftQNetwork(envs).to(device)
    qf1_target, qf2_target = SoftQNetwork(envs).to(device), SoftQNetwork(envs).to(device)
    qf1_target.load_state_dict(qf1.state_dict())
    qf2_target.load_state_dict(qf2.state_dict())
    # fused: one kernel per optimiser step instead of a loop over parameter tensors
    q_optimizer = optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=args.q_lr, fused=True)
    actor_optimizer = optim.Adam(actor.parameters(), lr=args.policy_lr, fused=True)
    target_entropy = -float(np.prod(envs.single_action_space.shape))
    log_ent_coef = torch.tensor([math.log(args.ent_coef)], device=device, requires_grad=args.autotune)
    ent_coef_optimizer = optim.Adam([log_ent_coef], lr=args.q_lr, fused=True) if args.autotune else None
    rb = ReplayBuffer(args.buffer_size, envs.single_observation_space.shape, envs.single_action_space.shape, device)
    # everything a gradient step changes, by name: checkpointed, and snapshotted as the last finite state
    learner = {"actor": actor, "qf1": qf1, "qf2": qf2, "qf1_target": qf1_target, "qf2_target": qf2_target,
               "actor_optimizer": actor_optimizer, "q_optimizer": q_optimizer}
    if args.autotune:
        learner["ent_coef_optimizer"] = ent_coef_optimizer

    # Transitions wait here until their frames are scored in one batch; they reach the replay buffer
    # before the next gradient step, so training never samples a transition without its reward.
    pending: dict[str, list] = {k: [] for k in ("obs", "next_obs", "actions", "terminations", "dones", "gt", "frames")}
    components: list[str] = []  # the env's own reward terms (e.g. reward_forward), logged as diagnostics
    episode = {k: np.zeros(args.num_envs) for k in ("return", "gt_return", "clip_return", "length")}
    render = args.reward == "clip"
    timing = {"env": 0.0, "render": 0.0, "reward_model": 0.0, "learning": 0.0}

    obs, _ = envs.reset(seed=args.seed)
    if checkpoint is not None:
        for name, module in learner.items():
            module.load_state_dict(checkpoint[name])
        with torch.no_grad():
            log_ent_coef.copy_(checkpoint["log_ent_coef"])
        if checkpoint["replay_buffer"] is not None:
            rb.load_state_dict(checkpoint["replay_buffer"])
        pending, episode, components = checkpoint["pending"], checkpoint["episode"], checkpoint["components"]
        # checkpoints are taken at an episode boundary, just before the reset: redo that reset with the same env RNGs
        envs.set_attr("np_random", checkpoint["rng"]["envs"])
        obs, _ = envs.reset(options={"reset_mask": np.ones(args.num_envs, dtype=bool)})
        random.setstate(checkpoint["rng"]["python"])
        np.random.set_state(checkpoint["rng"]["numpy"])
        torch.set_rng_state(checkpoint["rng"]["torch"])
        if checkpoint["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(checkpoint["rng"]["cuda"])
    ent_coef = log_ent_coef.exp().detach()  # kept as a tensor: no host-device sync per gradient step
    stop = install_stop_handlers()
    start_time = time.time()
    progress = Progress(args.total_timesteps, start_iteration * args.num_envs, args.reward == "clip", max(10, args.num_envs))
    iteration, dones = start_iteration - 1, np.ones(args.num_envs, dtype=bool)  # as they stay when a resumed run has no steps left
    try:
        for iteration in range(start_iteration, num_iterations):
            global_step = iteration * args.num_envs
            if global_step < args.learning_starts:  # seeded, checkpointed RNG (not the action space's own)
                low, high = envs.single_action_space.low, envs.single_action_space.high
                actions = np.random.uniform(low, high, size=(args.num_envs, *low.shape)).astype(np.float32)
            else:
                with torch.no_grad():
                    actions, _, _ = actor.get_action(torch.as_tensor(obs, dtype=torch.float32, device=device))
                actions = actions.cpu().numpy()

            t0 = time.perf_counter()
            next_obs, gt_rewards, terminations, truncations, infos = envs.step(actions)
            t1 = time.perf_counter()
            frames = np.stack(envs.call("render")) if render else None  # the frame *after* the step scores it
            timing["env"] += t1 - t0
            timing["render"] += time.perf_counter() - t1
            dones = terminations | truncations

            if not components:
                components = sorted(k for k in infos if k.startswith("reward_"))
            pending["obs"].append(obs)
            pending["next_obs"].append(next_obs)
            pending["actions"].append(actions)
            pending["terminations"].append(terminations)
            pending["dones"].append(dones)
            pending["gt"].append(np.stack([gt_rewards] + [infos[k] for k in components], axis=1))
            if render:
                pending["frames"].append(frames)

            train_now = global_step >= args.learning_starts and iteration % args.train_frequency == 0
            num_pending = len(pending["obs"]) * args.num_envs
            if train_now or num_pending >= args.reward_batch_size or iteration == num_iterations - 1:
                t0 = time.perf_counter()
                gt = np.concatenate(pending["gt"])
                clip_rewards = reward_model(np.concatenate(pending["frames"])) if args.reward == "clip" else np.zeros(len(gt))
                timing["reward_model"] += time.perf_counter() - t0
                rewards = clip_rewards if args.reward == "clip" else gt[:, 0]
                if not np.all(np.isfinite(rewards)):  # never let a NaN into the buffer: it would poison every Q-value
                    save_checkpoint(f"runs/{run_name}/checkpoint.pt", {"actor": actor.state_dict(), "args": asdict(args), "run_name": run_name})
                    raise NonFiniteError(f"the {args.reward} reward is not finite for {np.sum(~np.isfinite(rewards))} of {len(rewards)} frames at step {global_step}; the networks (still finite) were saved to runs/{run_name}/checkpoint.pt.")
                dones_flat = np.concatenate(pending["dones"])
                rb.add(np.concatenate(pending["obs"]), np.concatenate(pending["next_obs"]), np.concatenate(pending["actions"]),
                       rewards, np.concatenate(pending["terminations"]))
                # episode bookkeeping, in step order (rows are step-major: env i of step t is row t * num_envs + i)
                for k in range(len(rewards)):
                    env_i = k % args.num_envs
                    episode["return"][env_i] += rewards[k]
                    episode["gt_return"][env_i] += gt[k, 0]
                    episode["clip_return"][env_i] += clip_rewards[k]
                    episode["length"][env_i] += 1
                    for c, name in enumerate(components):
                        episode.setdefault(name, np.zeros(args.num_envs))[env_i] += gt[k, 1 + c]
                    if dones_flat[k]:
                        step = global_step - (len(pending["obs"]) - 1 - k // args.num_envs) * args.num_envs  # the step it ended at
                        length = episode["length"][env_i]
                        progress.episode(episode["gt_return"][env_i], episode["clip_return"][env_i])
                        if args.log_episodes:
                            print(f"global_step={step}, episodic_return={episode['return'][env_i]:.2f}, "
                                  f"gt_return={episode['gt_return'][env_i]:.1f}")
                        writer.add_scalar("charts/episodic_return", episode["return"][env_i], step)
                        writer.add_scalar("charts/episodic_length", length, step)
                        writer.add_scalar("charts/gt_return", episode["gt_return"][env_i], step)
                        for name in components:
                            writer.add_scalar(f"gt/{name}", episode[name][env_i], step)
                        if args.reward == "clip":
                            writer.add_scalar("charts/clip_return", episode["clip_return"][env_i], step)
                            writer.add_scalar("charts/clip_reward_mean", episode["clip_return"][env_i] / length, step)
                        for v in episode.values():
                            v[env_i] = 0
                pending = {k: [] for k in pending}

            if train_now:
                t0 = time.perf_counter()
                # the last finite state, kept on the device (a cheap copy): saved if this phase produces a NaN
                last_finite = {name: copy.deepcopy(module.state_dict()) for name, module in learner.items()}
                last_finite["log_ent_coef"] = log_ent_coef.detach().clone()
                finite = torch.ones((), dtype=torch.bool, device=device)  # checked once per phase: no per-step sync
                for _ in range(args.gradient_steps):
                    b_obs, b_actions, b_rewards, b_next_obs, b_terminations = rb.sample(args.batch_size)
                    with torch.no_grad():
                        next_actions, next_log_pi, _ = actor.get_action(b_next_obs)
                        min_qf_next_target = torch.min(qf1_target(b_next_obs, next_actions), qf2_target(b_next_obs, next_actions)) - ent_coef * next_log_pi
                        # time limits are truncations: we bootstrap through them (the reference treated them as terminal)
                        next_q_value = b_rewards + (1 - b_terminations) * args.gamma * min_qf_next_target.view(-1)
                    qf1_a_values = qf1(b_obs, b_actions).view(-1)
                    qf2_a_values = qf2(b_obs, b_actions).view(-1)
                    qf1_loss = F.mse_loss(qf1_a_values, next_q_value)
                    qf2_loss = F.mse_loss(qf2_a_values, next_q_value)
                    qf_loss = qf1_loss + qf2_loss
                    q_optimizer.zero_grad()
                    qf_loss.backward()
                    q_optimizer.step()

                    qf1.requires_grad_(False)  # the actor loss needs no critic weight gradients: skip computing them
                    qf2.requires_grad_(False)
                    pi, log_pi, _ = actor.get_action(b_obs)
                    min_qf_pi = torch.min(qf1(b_obs, pi), qf2(b_obs, pi))
                    qf1.requires_grad_(True)
                    qf2.requires_grad_(True)
                    actor_loss = (ent_coef * log_pi - min_qf_pi).mean()
                    actor_optimizer.zero_grad()
                    actor_loss.backward()
                    actor_optimizer.step()
                    finite &= torch.isfinite(qf_loss) & torch.isfinite(actor_loss)

                    if args.autotune:
                        ent_coef_loss = (-log_ent_coef.exp() * (log_pi.detach() + target_entropy)).mean()
                        ent_coef_optimizer.zero_grad()
                        ent_coef_loss.backward()
                        ent_coef_optimizer.step()
                        ent_coef = log_ent_coef.exp().detach()

                    with torch.no_grad():
                        for param, target_param in zip(qf1.parameters(), qf1_target.parameters()):
                            target_param.lerp_(param, args.tau)
                        for param, target_param in zip(qf2.parameters(), qf2_target.parameters()):
                            target_param.lerp_(param, args.tau)
                if not finite:
                    save_checkpoint(f"runs/{run_name}/checkpoint.pt", {**last_finite, "args": asdict(args), "run_name": run_name})
                    raise NonFiniteError(f"a SAC loss (qf_loss {qf_loss.item()}, actor_loss {actor_loss.item()}) is not finite in the training phase at step {global_step}; "
                                         f"the networks before that phase were saved to runs/{run_name}/checkpoint.pt; lower --q-lr / --policy-lr or check the rewards.")
                timing["learning"] += time.perf_counter() - t0

                if iteration % (10 * args.train_frequency) == 0:
                    writer.add_scalar("losses/qf1_values", qf1_a_values.mean().item(), global_step)
                    writer.add_scalar("losses/qf2_values", qf2_a_values.mean().item(), global_step)
                    writer.add_scalar("losses/qf1_loss", qf1_loss.item(), global_step)
                    writer.add_scalar("losses/qf2_loss", qf2_loss.item(), global_step)
                    writer.add_scalar("losses/qf_loss", qf_loss.item() / 2.0, global_step)
                    writer.add_scalar("losses/actor_loss", actor_loss.item(), global_step)
                    writer.add_scalar("losses/ent_coef", ent_coef.item(), global_step)
                    if args.autotune:
                        writer.add_scalar("losses/ent_coef_loss", ent_coef_loss.item(), global_step)
                    writer.add_scalar("charts/SPS", int((global_step - start_iteration * args.num_envs) / (time.time() - start_time)), global_step)
                    for k, v in timing.items():
                        writer.add_scalar(f"time/{k}_s", v, global_step)

            next_step = global_step + args.num_envs
            if args.capture_video and (global_step // args.video_frequency != next_step // args.video_frequency or iteration == num_iterations - 1):
                (result,) = evaluate(actor, eval_envs, args, device, reward_model, 1, args.seed + 10_000)
                save_video(result["frames"], f"videos/{run_name}/step-{next_step}.mp4")
                writer.add_scalar("eval/gt_return", result["gt_return"], next_step)
                if reward_model is not None:
                    writer.add_scalar("eval/clip_return", result["clip_return"], next_step)
            if dones.all():  # fixed-length episodes end together: the one point where the whole run state is small
                periodic = args.save_model and global_step // args.checkpoint_frequency != next_step // args.checkpoint_frequency
                if stop["requested"] or periodic or (args.save_model and iteration == num_iterations - 1):
                    save_checkpoint(f"runs/{run_name}/checkpoint.pt", {
                        "run_name": run_name, "iteration": iteration + 1, "global_step": next_step, "args": asdict(args),
                        **{name: module.state_dict() for name, module in learner.items()}, "log_ent_coef": log_ent_coef.detach().cpu(),
                        "rng": rng_state(envs), "pending": pending, "episode": episode, "components": components,
                        "replay_buffer": rb.state_dict() if args.save_buffer else None})
                    print(f"checkpoint saved at step {next_step}: runs/{run_name}/checkpoint.pt" + ("" if args.save_buffer else " (without the replay buffer: pass --save-buffer for an exact resume)"))
                if stop["requested"]:
                    print(f"stopped; continue with: python {os.path.basename(__file__)} --resume runs/{run_name}/checkpoint.pt")
                    break
            if dones.any():  # reset finished envs: their reset observations start the next episodes, never a transition
                reset_obs, _ = envs.reset(options={"reset_mask": dones})
                next_obs = np.where(dones[:, None], reset_obs, next_obs)
            obs = next_obs
            progress.update(global_step + args.num_envs)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        writer.close()  # flushes TensorBoard, also on an error or a second Ctrl-C
        envs.close()

    progress.update((iteration + 1) * args.num_envs, final=True)
    elapsed = time.time() - start_time
    steps = (iteration + 1 - start_iteration) * args.num_envs
    print(f"done: {steps} steps in {elapsed:.0f} s ({int(steps / max(elapsed, 1e-9))} SPS); time in "
          + ", ".join(f"{k} {v:.2f} s" for k, v in timing.items()))
    if args.save_model and not stop["requested"]:
        if not dones.all():  # the run ended mid-episode: keep the final networks (to evaluate, not to resume)
            save_checkpoint(f"runs/{run_name}/checkpoint.pt", {**{name: module.state_dict() for name, module in learner.items()}, "args": asdict(args), "run_name": run_name})
        print(f"roll the policy out with: python {os.path.basename(__file__)} --evaluate runs/{run_name}/checkpoint.pt")


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message=".*No pretrained weights.*")
    try:
        main(tyro.cli(Args))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted without saving a checkpoint", file=sys.stderr)
        sys.exit(130)
