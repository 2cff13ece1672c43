"""VLM-RM evaluation: how close is a CLIP reward to human judgement? EPIC distance to labelled states.

The paper's quantitative evaluation (Fig. 4a): collect states of an environment, label them (by hand,
or with the ground truth where the environment has one), score every frame with each CLIP reward model
(model x alpha) and report the EPIC distance between the reward and the labels. For a state-only reward
on a fixed dataset of states EPIC reduces to sqrt((1 - rho) / 2), rho = Pearson correlation between the
reward and the labels: 0 = same ordering up to a positive affine map, 1 = opposite.
One file, three subcommands:

    # 1. states + frames, from random actions (or --policy: a DQN model.pt or a SAC checkpoint.pt of our scripts)
    python epic_eval.py collect --env-id CartPole-v1 --num-frames 200 --out data/cartpole
    # 2. label them in the browser at http://127.0.0.1:8765 (keys: 1 success, 0 failure, s skip, Backspace back)
    python epic_eval.py label --dataset data/cartpole
    # 3. EPIC (with a bootstrap interval), ROC AUC and PR AUC per model and alpha -> runs/<run_name>/
    python epic_eval.py score --dataset data/cartpole --clip-models RN50 ViT-L-14 --clip-pretrained openai \
        --alphas 0 0.5 1            # --labels gt uses the ground-truth column instead of your labels
    #    ...both reward families side by side: the projection per alpha and the thresholded softmax vs negatives
    python epic_eval.py score --dataset data/cartpole --reward-families projection softmax --negatives "pole lying flat next to the cart"

Dataset layout: <dataset>/frames/*.png, <dataset>/states.csv (frame, env_id, episode, step, state
columns, gt), <dataset>/labels.csv (frame, label, time; append-only, the last label of a frame wins).
"""

import csv
import datetime
import http.server
import json
import logging
import math
import os
import random
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame draws off-screen: no display needed
os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
# MuJoCo picks its OpenGL backend at import time: headless EGL (GPU or Mesa software) unless the user
# chose otherwise; PyOpenGL must agree with it, or the renderer fails to create a context.
os.environ.setdefault("MUJOCO_GL", "egl")
if os.environ["MUJOCO_GL"] in ("egl", "osmesa"):
    os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

import hashlib
import tempfile
import xml.etree.ElementTree as ET
from typing import Callable

import gymnasium as gym
import gymnasium.envs.mujoco  # noqa: F401  (makes gym.envs.mujoco, home of the stock XML, reachable)
import imageio.v2 as imageio
import mujoco
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro

ENV_IDS = ("CartPole-v1", "MountainCar-v0", "MountainCarContinuous-v0", "Humanoid-v5")  # checked in check_collect_args


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
    """a `model.pt` of `vlmrm_dqn_classic.py --save-model` (greedy actions) or a `checkpoint.pt` of
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


@dataclass
class Score:
    """EPIC distance, ROC AUC and PR AUC between each CLIP reward model (model x alpha) and the labels."""

    dataset: str
    """dataset folder written by `collect` (and labelled by `label` unless --labels gt)"""
    labels: Literal["human", "gt"] = "human"
    """human: the last label per frame in labels.csv (skipped frames left out); gt: the states.csv ground truth"""
    clip_models: tuple[str, ...] = ("ViT-bigG-14",)
    """open_clip architecture names, or paths of open_clip model configs (.json): one line each in the plot"""
    clip_pretrained: tuple[str, ...] = ("laion2b_s39b_b160k",)
    """pretrained tag per model, or one tag for all ("none" = random weights, for tests only)"""
    clip_checkpoints: Optional[tuple[str, ...]] = None
    """local weights file per model (overrides --clip-pretrained); "none" for a model without one"""
    clip_cache_dir: Optional[str] = None
    """where downloaded CLIP weights are cached (default: the Hugging Face cache)"""
    alphas: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99)
    """goal-baseline regularisation strengths to evaluate, each in [0, 1] (default: the paper's Fig. 4a grid)"""
    goal: Optional[tuple[str, ...]] = None
    """goal prompt(s); default: a description of the task's goal state"""
    baseline: Optional[tuple[str, ...]] = None
    """baseline prompt(s); default: a description of the scene"""
    reward_families: tuple[Literal["projection", "softmax"], ...] = ("projection",)
    """reward families to compare side by side: projection (one row per --alphas), softmax (one row: goal vs --negatives)"""
    negatives: Optional[tuple[str, ...]] = None
    """softmax family: prompts the goal is contrasted with; default: our negatives for the default --goal (none for others)"""
    temperature: float = 0.01
    """softmax family: temperature tau of the softmax over cosine similarities (0.01 = CLIP's own logit scale 100)"""
    threshold: float = 0.5
    """softmax family: the reward is 1 when the goal's probability is above this, else 0; in (0, 1)"""
    soft: bool = False
    """softmax family: if toggled, the reward is the goal's probability itself instead of 0/1"""
    bootstrap: int = 1000
    """bootstrap resamples for the EPIC confidence interval"""
    confidence: float = 0.95
    """confidence level of the interval"""
    seed: int = 1
    """seed of the bootstrap"""
    reward_batch_size: int = 64
    """frames embedded per CLIP forward pass"""
    cuda: bool = True
    """if toggled, CUDA (when available) runs the reward model"""
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (outputs go to runs/<env>__<exp_name>__<seed>__<time>/)"""


@dataclass
class ClipArgs:
    """The CLIP flags of one model, in the shape the training scripts' `check_clip_args`/`load_clip` read."""

    clip_model: str
    clip_pretrained: str
    clip_checkpoint: Optional[str] = None
    clip_cache_dir: Optional[str] = None


DEFAULT_PROMPTS = {  # (goal, baseline) from the paper
    "CartPole-v1": ("pole vertically upright on top of the cart", "pole and cart"),
    "MountainCar-v0": ("a car at the peak of the mountain, next to the yellow flag", "a car in the mountain"),
    "MountainCarContinuous-v0": ("a car at the peak of the mountain, next to the yellow flag", "a car in the mountain"),
    "Humanoid-v5": ("a humanoid robot kneeling", "a humanoid robot"),
}


class UserError(Exception):
    """Bad input or a missing resource: reported as one sentence and exit code 2, never a traceback."""


def check_clip_args(args: ClipArgs) -> None:
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


def load_clip(args: ClipArgs, device: torch.device) -> tuple[nn.Module, object]:
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


# ----------------------------------------------------------------------------------------------
# Environments: fixed-length episodes; the env's own reward is the ground truth (logged, not learned from)
# ----------------------------------------------------------------------------------------------
class FixedLengthCartPole(gym.Wrapper):
    """CartPole that never terminates: the pole angle wraps to [-pi, pi) and the cart stops at the track ends.

    Reward = 1 when the step is upright (|theta| < 12 deg and |x| < 2.4), else 0.
    """

    def step(self, action):
        _, _, _, truncated, info = self.env.step(action)
        cartpole = self.env.unwrapped
        x, x_dot, theta, theta_dot = cartpole.state
        theta = (theta + math.pi) % (2 * math.pi) - math.pi
        if abs(x) > cartpole.x_threshold:  # the track ends are walls: stop there instead of leaving the screen
            x, x_dot = math.copysign(cartpole.x_threshold, x), 0.0
        cartpole.state = np.array([x, x_dot, theta, theta_dot], dtype=np.float64)
        cartpole.steps_beyond_terminated = None  # we keep stepping on purpose: silence gym's warning
        upright = bool(abs(theta) < cartpole.theta_threshold_radians and abs(x) < cartpole.x_threshold)
        info["success"] = upright
        return np.array(cartpole.state, dtype=np.float32), float(upright), False, truncated, info


MOUNTAINCAR_GOAL = 0.45  # the paper's flag position (Gymnasium's MountainCar-v0 uses 0.5)


class FixedLengthMountainCar(gym.Wrapper):
    """MountainCar that never terminates. Reward = 1 while at the flag (x >= 0.45), else 0.

    `info["success"]` says whether the flag was reached at any point of the current episode.
    """

    def reset(self, **kwargs):
        self.reached_goal = False
        return self.env.reset(**kwargs)

    def step(self, action):
        obs, _, _, truncated, info = self.env.step(action)
        at_goal = bool(obs[0] >= MOUNTAINCAR_GOAL)
        self.reached_goal |= at_goal
        info["success"] = self.reached_goal
        return obs, float(at_goal), False, truncated, info


class RealisticMountainCar(gym.Wrapper):
    """Draws MountainCar as a landscape (sky, hills, road, yellow flag, a car tilted to the slope).

    CLIP scores photos-like scenes far better than line art. Same world-to-pixel mapping as Gymnasium's
    renderer; the static background is drawn once, only the car is drawn per frame.
    """

    width, height = 600, 400

    def __init__(self, env: gym.Env):
        super().__init__(env)
        import pygame

        car = env.unwrapped
        self.min_x, self.max_x = car.min_position, car.max_position
        self.scale = self.width / (self.max_x - self.min_x)
        rng = np.random.default_rng(0)  # fixed texture noise: every frame of every run looks the same
        # sky: vertical gradient from deep blue to a pale horizon
        t = np.linspace(0, 1, self.height)[:, None, None]
        pixels = (1 - t) * np.array([70, 130, 210]) + t * np.array([200, 225, 245])
        pixels = np.broadcast_to(pixels, (self.height, self.width, 3)).copy()
        cols = np.arange(self.width)
        # distant mountains: a hazy blue-grey ridge
        ridge = 170 + 35 * np.sin(cols / 57.0) + 20 * np.sin(cols / 23.0 + 1.3) + 8 * np.sin(cols / 7.0)
        far = np.arange(self.height)[:, None] > ridge[None, :]
        pixels[far] = [120, 140, 165]
        # the hill: grass below the track curve, with a darker earth layer and speckle noise
        surface = self.height - self._pixel_height(self.min_x + cols / self.scale)
        depth = np.arange(self.height)[:, None] - surface[None, :]
        grass = (depth > 0)[..., None] * np.array([70, 140, 55])
        earth = (depth > 28)[..., None] * (np.array([110, 85, 55]) - np.array([70, 140, 55]))
        ground = depth > 0
        noise = rng.normal(0, 12, (self.height, self.width, 1))
        pixels[ground] = (grass + earth + noise)[ground]
        road = (depth > -4) & (depth <= 4)  # a grey road along the curve the car drives on
        pixels[road] = [95, 95, 100]
        background = pygame.surfarray.make_surface(np.clip(pixels, 0, 255).astype(np.uint8).transpose(1, 0, 2))
        # the yellow flag at the goal position
        flag_x = int((MOUNTAINCAR_GOAL - self.min_x) * self.scale)
        flag_y = self.height - int(self._pixel_height(MOUNTAINCAR_GOAL)) - 4
        pygame.draw.line(background, (60, 60, 60), (flag_x, flag_y), (flag_x, flag_y - 60), 3)
        pygame.draw.polygon(background, (250, 210, 20), [(flag_x + 2, flag_y - 60), (flag_x + 32, flag_y - 50), (flag_x + 2, flag_y - 40)])
        self.background = background
        # the car sprite, drawn once and rotated per frame: red body, cabin with windows, two wheels
        sprite = pygame.Surface((56, 34), pygame.SRCALPHA)
        pygame.draw.rect(sprite, (200, 30, 35), (0, 12, 56, 14), border_radius=5)
        pygame.draw.rect(sprite, (175, 25, 30), (12, 2, 30, 14), border_radius=4)
        pygame.draw.rect(sprite, (170, 210, 235), (16, 5, 10, 8))
        pygame.draw.rect(sprite, (170, 210, 235), (29, 5, 10, 8))
        for wheel_x in (12, 44):
            pygame.draw.circle(sprite, (25, 25, 25), (wheel_x, 27), 7)
            pygame.draw.circle(sprite, (160, 160, 160), (wheel_x, 27), 3)
        self.sprite = sprite
        self.canvas = pygame.Surface((self.width, self.height))

    def _pixel_height(self, x):
        return (0.45 * np.sin(3 * np.asarray(x)) + 0.55) * self.scale

    def render(self) -> np.ndarray:
        import pygame

        x = float(self.env.unwrapped.state[0])
        slope = math.degrees(math.atan(0.45 * 3 * math.cos(3 * x)))  # same scale on both axes
        car = pygame.transform.rotozoom(self.sprite, slope, 1.0)
        # stand the car on the road: centre of the sprite 10 px above the surface, along the normal
        normal = math.radians(slope)
        cx = (x - self.min_x) * self.scale - 10 * math.sin(normal)
        cy = self.height - self._pixel_height(x) - 10 * math.cos(normal)
        self.canvas.blit(self.background, (0, 0))
        self.canvas.blit(car, car.get_rect(center=(cx, cy)))
        return np.array(pygame.surfarray.pixels3d(self.canvas)).transpose(1, 0, 2)


def make_env(env_id: str, seed: int, idx: int, episode_length: int, realistic: bool):
    def thunk():
        env = gym.make(env_id, render_mode="rgb_array", max_episode_steps=episode_length)
        if env_id == "CartPole-v1":
            env = FixedLengthCartPole(env)
        else:
            env = FixedLengthMountainCar(env)
            if realistic:
                env = RealisticMountainCar(env)
        env.action_space.seed(seed + idx)
        return env

    return thunk


# Humanoid: the textured scene and frontal camera of the SAC script (make_env there is make_humanoid_env here)
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


def make_humanoid_env(
    env_id: str,
    seed: int,
    idx: int,
    episode_length: int,
    render_size: int,
    render_quality: str = "fast",
    textured: bool = True,
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
            env = gym.make(env_id, **common)
        if hasattr(env.unwrapped, "mujoco_renderer"):
            env = RenderQuality(env, render_quality)
        env.action_space.seed(seed)  # idx is kept for CleanRL parity (e.g. video capture on env 0)
        env.observation_space.seed(seed)
        return env

    return thunk


# ----------------------------------------------------------------------------------------------
# Policies to collect states with: the Q-network of vlmrm_dqn_classic.py (its model.pt) and the
# actor of vlmrm_sac_humanoid.py (its checkpoint.pt), as those scripts define them
# ----------------------------------------------------------------------------------------------
class QNetwork(nn.Module):
    def __init__(self, envs: gym.vector.VectorEnv):
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(np.array(envs.single_observation_space.shape).prod(), 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, envs.single_action_space.n),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)


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


# ----------------------------------------------------------------------------------------------
# Collect: frames + states.csv
# ----------------------------------------------------------------------------------------------
STATE_COLUMNS = {
    "CartPole-v1": ["x", "x_dot", "theta", "theta_dot"],
    "MountainCar-v0": ["position", "velocity"],
    "MountainCarContinuous-v0": ["position", "velocity"],
}


def env_state(env: gym.Env) -> tuple[list[str], list[float], Optional[int]]:
    """(column names, values, ground-truth success label or None) of the state the env shows now."""
    base = env.unwrapped
    if base.spec.id.startswith("Humanoid"):  # the full physical state; no ground truth (human evaluation)
        qpos, qvel = base.data.qpos, base.data.qvel
        names = [f"qpos_{i}" for i in range(len(qpos))] + [f"qvel_{i}" for i in range(len(qvel))]
        return names, [float(v) for v in np.concatenate([qpos, qvel])], None
    state = [float(v) for v in base.state]
    if base.spec.id == "CartPole-v1":  # the same test as FixedLengthCartPole's reward
        x, _, theta, _ = state
        success = abs(theta) < base.theta_threshold_radians and abs(x) < base.x_threshold
    else:  # MountainCar: at the flag in this frame (FixedLengthMountainCar's per-step reward)
        success = state[0] >= MOUNTAINCAR_GOAL
    return STATE_COLUMNS[base.spec.id], state, int(success)


def randomise_state(env: gym.Env, rng: np.random.Generator) -> np.ndarray:
    """Put a classic-control env in a uniformly random state; returns the matching observation."""
    base = env.unwrapped
    if base.spec.id == "CartPole-v1":
        base.state = np.array([rng.uniform(-base.x_threshold, base.x_threshold), rng.uniform(-1, 1),
                               rng.uniform(-math.pi, math.pi), rng.uniform(-1, 1)])
    else:
        base.state = np.array([rng.uniform(base.min_position, base.max_position), rng.uniform(-base.max_speed, base.max_speed)])
    return np.array(base.state, dtype=np.float32)


def check_collect_args(args: Collect) -> Optional[dict]:
    """Validate the flags; returns the loaded --policy checkpoint (or None) and sets args.env_id."""
    for name in ["num_frames", "every", "episode_length", "render_size"]:
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}.")
    if not 0.0 <= args.epsilon <= 1.0:
        raise UserError(f"--epsilon must be in [0, 1], got {args.epsilon}.")
    if args.env_id is not None and args.env_id not in ENV_IDS:
        raise UserError(f"--env-id {args.env_id} is not supported; choose one of: {', '.join(ENV_IDS)}.")
    if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        raise UserError(f"--out {args.out} already exists and is not empty; choose a new folder (a dataset and its labels are never overwritten).")
    checkpoint = None
    if args.policy is not None:
        which = "the model.pt of vlmrm_dqn_classic.py --save-model or the checkpoint.pt of vlmrm_sac_humanoid.py --save-model"
        if not os.path.isfile(args.policy):
            raise UserError(f"--policy {args.policy}: no such file; pass {which}.")
        try:  # a SAC checkpoint.pt also holds RNG states and arrays: load only files you trust
            checkpoint = torch.load(args.policy, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - any unreadable file gets the same advice
            raise UserError(f"--policy {args.policy} could not be read ({type(e).__name__}); pass {which}.") from None
        if not isinstance(checkpoint, dict) or not ({"q_network", "actor"} & checkpoint.keys()) or "args" not in checkpoint:
            raise UserError(f"--policy {args.policy} holds no policy (no 'q_network' or 'actor', or no 'args'); pass {which}.")
        trained_on = checkpoint["args"].get("env_id")
        if args.env_id is not None and args.env_id != trained_on:
            raise UserError(f"--policy {args.policy} was trained on {trained_on}, not --env-id {args.env_id}.")
        supported = ("CartPole-v1", "MountainCar-v0") if "q_network" in checkpoint else ("Humanoid-v5",)
        if trained_on not in supported:
            raise UserError(f"--policy {args.policy} was trained on {trained_on}; collect supports its policies on {', '.join(supported)} only.")
        args.env_id = trained_on
    args.env_id = args.env_id or "CartPole-v1"
    if args.random_init and args.env_id.startswith("Humanoid"):
        raise UserError("--random-init is for CartPole and MountainCar; Humanoid states come from its own resets.")
    if args.realistic and not args.env_id.startswith("MountainCar"):
        raise UserError("--realistic only changes how MountainCar is drawn.")
    return checkpoint


def collect(args: Collect) -> None:
    checkpoint = check_collect_args(args)
    random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    if args.env_id.startswith("Humanoid"):
        thunk = make_humanoid_env(args.env_id, args.seed, 0, args.episode_length, args.render_size, args.render_quality)
    else:
        thunk = make_env(args.env_id, args.seed, 0, args.episode_length, args.realistic)
    # a one-env vector env, as in the training scripts' evaluate(): QNetwork reads its single_* spaces
    envs = gym.vector.SyncVectorEnv([thunk])
    env = envs.envs[0]
    policy: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # observations -> actions, on the device
    if checkpoint is not None:
        name, network = ("q_network", QNetwork(envs)) if "q_network" in checkpoint else ("actor", Actor(envs))
        try:
            network.to(device).load_state_dict(checkpoint[name])
        except (RuntimeError, TypeError, AttributeError) as e:  # wrong shapes or keys: another env or version
            envs.close()
            reason = " ".join(str(e).split())[:200]  # torch's message spans lines
            raise UserError(f"--policy {args.policy}: its {name} does not fit {args.env_id} ({reason}); "
                            "pass a policy saved by this version of the training scripts.") from None
        # greedy for the Q-network; the actor's deterministic action, as in evaluation
        policy = (lambda x: network(x).argmax(dim=1)) if name == "q_network" else (lambda x: network.get_action(x)[2])

    frames_dir = os.path.join(args.out, "frames")
    os.makedirs(frames_dir, exist_ok=True)
    rows: list[list] = []
    header: list[str] = []
    episode = 0
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
            imageio.imwrite(os.path.join(frames_dir, frame_name), envs.call("render")[0])
            names, values, success = env_state(env)
            header = ["frame", "env_id", "episode", "step", *names, "gt"]
            rows.append([frame_name, args.env_id, episode, step, *values, "" if success is None else success])
            if len(rows) == args.num_frames:
                break
        episode += 1
    envs.close()
    # states.csv appears complete or not at all: a killed collect never leaves a half-written table
    states_path = os.path.join(args.out, "states.csv")
    with open(states_path + ".tmp", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    os.replace(states_path + ".tmp", states_path)
    gt = [r[-1] for r in rows if r[-1] != ""]
    source = f"policy {args.policy} (epsilon {args.epsilon})" if args.policy else "random actions"
    print(f"wrote {len(rows)} frames of {args.env_id} ({episode} episodes, {source}) to {args.out}")
    if gt:
        print(f"ground truth: {sum(gt)} of {len(gt)} frames are successes")
        if len(set(gt)) == 1:
            print("warning: every ground-truth label is the same, so `score --labels gt` will refuse this dataset "
                  "(correlation undefined); collect more frames, use --random-init, or a trained --policy")


# ----------------------------------------------------------------------------------------------
# Dataset: loading and checking (one sentence per problem)
# ----------------------------------------------------------------------------------------------
LABELS_HEADER = ["frame", "label", "time"]
SKIP = "skip"  # a frame the labeller could not judge: kept in labels.csv, left out of every metric


def load_states(dataset: str) -> list[dict]:
    """Rows of states.csv, after checking that the dataset exists, is not empty and has all its frames."""
    states_path = os.path.join(dataset, "states.csv")
    if not os.path.isdir(dataset):
        raise UserError(f"--dataset {dataset}: no such folder; create one with `python epic_eval.py collect --out {dataset}`.")
    if not os.path.isfile(states_path):
        raise UserError(f"--dataset {dataset} has no states.csv, so it is not a dataset; create one with `python epic_eval.py collect`.")
    with open(states_path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        fields = reader.fieldnames or []
    if "frame" not in fields or "env_id" not in fields:
        raise UserError(f"{states_path} must have 'frame' and 'env_id' columns (found: {', '.join(fields) or 'none'}).")
    if not rows:
        raise UserError(f"{states_path} lists no frames: the dataset is empty.")
    names = [r["frame"] for r in rows]
    if len(set(names)) != len(names):
        raise UserError(f"{states_path} lists a frame more than once (e.g. {next(n for n in names if names.count(n) > 1)}).")
    missing = [n for n in names if not os.path.isfile(os.path.join(dataset, "frames", n))]
    if missing:
        raise UserError(f"{len(missing)} of the {len(rows)} frames in {states_path} have no image file in {os.path.join(dataset, 'frames')} (first: {missing[0]}).")
    env_ids = {r["env_id"] for r in rows}
    if len(env_ids) > 1:
        raise UserError(f"{states_path} mixes environments ({', '.join(sorted(env_ids))}); keep one environment per dataset.")
    return rows


def read_labels(dataset: str, frames: set[str]) -> dict[str, str]:
    """The last label given to each frame in labels.csv (raw strings: numbers or 'skip'); {} if none yet."""
    path = os.path.join(dataset, "labels.csv")
    if not os.path.isfile(path):
        return {}
    with open(path, newline="") as f:
        text = f.read()
    lines = text.splitlines()
    if not lines:
        return {}
    if next(csv.reader(lines[:1])) != LABELS_HEADER:
        raise UserError(f"{path} does not start with the header {','.join(LABELS_HEADER)}; it was not written by `epic_eval.py label`.")
    labels: dict[str, str] = {}
    for line_number, row in enumerate(csv.reader(lines[1:]), start=2):
        if len(row) < 3 or not row[2]:  # a write cut short by a crash before the time: never acknowledged
            print(f"warning: ignoring the incomplete line {line_number} of {path}: {','.join(row)!r}")
            continue
        if row[0] not in frames:
            raise UserError(f"{path} line {line_number} names frame {row[0]!r}, which is not in states.csv.")
        labels[row[0]] = row[1].strip()
    return labels


def label_values(dataset: str, source: str) -> tuple[list[str], np.ndarray]:
    """(frames, numeric labels) to score: human labels from labels.csv (skips left out) or the gt column."""
    rows = load_states(dataset)
    if source == "gt":
        if "gt" not in rows[0] or all(r["gt"] == "" for r in rows):
            raise UserError(f"{dataset}/states.csv has no ground-truth labels ({rows[0]['env_id']} has none); label the frames with `python epic_eval.py label --dataset {dataset}` and use --labels human.")
        raw = {r["frame"]: r["gt"] for r in rows if r["gt"] != ""}
        where = "the gt column of states.csv"
    else:
        raw = {k: v for k, v in read_labels(dataset, {r["frame"] for r in rows}).items() if v != SKIP}
        where = "labels.csv"
        if not raw:
            raise UserError(f"{dataset} has no labelled frames yet; label some with `python epic_eval.py label --dataset {dataset}`, or use --labels gt for CartPole/MountainCar.")
    frames = [r["frame"] for r in rows if r["frame"] in raw]  # states.csv order
    values = []
    for frame in frames:
        try:
            value = float(raw[frame])
        except ValueError:
            value = float("nan")
        if not math.isfinite(value):
            raise UserError(f"label {raw[frame]!r} of frame {frame} in {where} is not a number; labels must be numbers (1 success, 0 failure) or '{SKIP}'.")
        values.append(value)
    return frames, np.array(values)


def read_frames(dataset: str, frames: list[str]) -> np.ndarray:
    """uint8 (N, H, W, 3) images, exactly as the env rendered them (PNG is lossless)."""
    images = []
    for frame in frames:
        image = imageio.imread(os.path.join(dataset, "frames", frame))
        if image.ndim == 2:
            image = np.stack([image] * 3, axis=-1)
        images.append(image[..., :3])
    if len({image.shape for image in images}) > 1:
        raise UserError(f"the frames of {dataset} have different sizes; keep one environment and render size per dataset.")
    return np.stack(images)


# ----------------------------------------------------------------------------------------------
# Label page: a local web server, standard library only; labels.csv is append-only
# ----------------------------------------------------------------------------------------------
def append_label(path: str, frame: str, label: str) -> None:
    """Append one label and fsync before answering: a label the page shows as saved survives a kill."""
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a+b") as f:  # append mode: existing labels are never rewritten or truncated
        if not new:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":  # an earlier write was cut short: keep it on a line of its own
                f.write(b"\n")
        line = (",".join(LABELS_HEADER) + "\n" if new else "")
        line += f"{frame},{label},{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}\n"
        f.write(line.encode())
        f.flush()
        os.fsync(f.fileno())
    if new:  # make the new file's directory entry durable too
        dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


LABEL_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>label frames</title>
<style>
 body { font-family: sans-serif; background: #1e1e1e; color: #eee; margin: 1em; }
 #frame { display: block; max-width: 95vw; max-height: 68vh; border: 6px solid #555; margin: .5em 0; }
 #frame.l1 { border-color: #2b2; } #frame.l0 { border-color: #d33; } #frame.lskip { border-color: #999; }
 #status.error { color: #f66; font-weight: bold; }
 button { font-size: 1em; margin-right: .4em; }
 kbd { background: #444; border-radius: 3px; padding: 0 .3em; }
</style></head>
<body>
<h2>Success? <span id="task"></span></h2>
<div id="progress"></div>
<img id="frame" alt="frame">
<div>frame <span id="name"></span>: <span id="current"></span></div>
<p><kbd>1</kbd> success &nbsp; <kbd>0</kbd> failure &nbsp; <kbd>s</kbd> skip &nbsp;
   <kbd>Backspace</kbd>/<kbd>&larr;</kbd> back &nbsp; <kbd>&rarr;</kbd> next without labelling</p>
<div><button data-key="1">1 success</button><button data-key="0">0 failure</button>
     <button data-key="s">s skip</button><button data-key="Backspace">&larr; back</button></div>
<p id="status"></p>
<script>
"use strict";
let frames = [], labels = {}, index = 0, queue = Promise.resolve();
const NAMES = {"1": "success", "0": "failure", "skip": "skipped"};
const $ = id => document.getElementById(id);

function setStatus(text, error) { $("status").textContent = text; $("status").className = error ? "error" : ""; }

function show() {
  const done = index >= frames.length;
  const values = Object.values(labels);
  const count = v => values.filter(x => x === v).length;
  $("progress").textContent = `${values.length} of ${frames.length} frames labelled (${count("1")} success, ` +
    `${count("0")} failure, ${count("skip")} skipped)` + (done ? " - all done, you can close this page" : "");
  $("frame").style.visibility = done ? "hidden" : "visible";
  if (done) { $("name").textContent = "-"; $("current").textContent = ""; return; }
  const frame = frames[index];
  $("frame").src = "frames/" + encodeURIComponent(frame);
  $("frame").className = frame in labels ? "l" + labels[frame] : "";
  $("name").textContent = `${frame} (${index + 1}/${frames.length})`;
  $("current").textContent = frame in labels ? "labelled " + NAMES[labels[frame]] : "not labelled";
  if (index + 1 < frames.length) new Image().src = "frames/" + encodeURIComponent(frames[index + 1]);
}

async function save(label) {
  if (index >= frames.length) return;
  const frame = frames[index];
  const response = await fetch("api/label", {method: "POST", headers: {"Content-Type": "application/json"},
                                             body: JSON.stringify({frame: frame, label: label})});
  if (!response.ok) throw new Error(await response.text());
  labels[frame] = label;  // only after the server has it on disk
  setStatus(`saved: ${frame} = ${NAMES[label]}`, false);
  index += 1;
  show();
}

function move(step) { index = Math.max(0, Math.min(frames.length, index + step)); show(); }

function handle(key) {
  const actions = {"1": () => save("1"), "0": () => save("0"), "s": () => save("skip"), "S": () => save("skip"),
                   "Backspace": () => move(-1), "ArrowLeft": () => move(-1), "ArrowRight": () => move(1)};
  if (!(key in actions)) return false;
  // one at a time, in key order: a fast typist never races two saves
  queue = queue.then(actions[key]).catch(e => setStatus("NOT saved: " + e.message + " (is the server still running?)", true));
  return true;
}

document.addEventListener("keydown", e => {
  if (e.ctrlKey || e.metaKey || e.altKey || e.repeat) return;
  if (handle(e.key)) e.preventDefault();
});
document.querySelectorAll("button").forEach(b => b.addEventListener("click", () => { handle(b.dataset.key); b.blur(); }));

fetch("api/state").then(r => r.json()).then(state => {
  frames = state.frames; labels = state.labels;
  $("task").textContent = state.task;
  index = frames.findIndex(f => !(f in labels));  // resume at the first frame without a label
  if (index < 0) index = frames.length;
  show();
  document.body.dataset.ready = "1";
}).catch(e => setStatus("could not load the dataset: " + e.message, true));
</script>
</body></html>
"""


def make_label_server(dataset: str, port: int, task: str) -> http.server.ThreadingHTTPServer:
    """A server for the label page, bound to 127.0.0.1; `port` 0 picks a free one (see server.server_port)."""
    rows = load_states(dataset)
    frames = [r["frame"] for r in rows]
    frame_set = set(frames)
    labels_path = os.path.join(dataset, "labels.csv")
    read_labels(dataset, frame_set)  # refuse to append to a labels.csv we could not read back
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep the terminal for our own messages
            pass

        def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def _local(self) -> bool:
            # only pages served from here may talk to us: a foreign Host (DNS rebinding) is refused
            port_ = self.server.server_port
            if self.headers.get("Host") not in (f"127.0.0.1:{port_}", f"localhost:{port_}"):
                self._send(403, b"forbidden host\n")
                return False
            return True

        def do_GET(self) -> None:
            if not self._local():
                return
            path = self.path.split("?")[0]
            if path == "/":
                self._send(200, LABEL_PAGE.encode(), "text/html; charset=utf-8")
            elif path == "/api/state":
                with lock:
                    state = {"frames": frames, "labels": read_labels(dataset, frame_set), "task": task}
                self._send(200, json.dumps(state).encode(), "application/json")
            elif path.startswith("/frames/") and path[len("/frames/"):] in frame_set:  # no other file is served
                with open(os.path.join(dataset, "frames", path[len("/frames/"):]), "rb") as f:
                    self._send(200, f.read(), "image/png")
            else:
                self._send(404, b"not found\n")

        def do_POST(self) -> None:
            if not self._local():
                return
            if self.path != "/api/label":
                self._send(404, b"not found\n")
                return
            # JSON only: a cross-site form cannot send it without a CORS preflight, which we never answer
            if self.headers.get("Content-Type", "").split(";")[0].strip() != "application/json":
                self._send(415, b"send application/json\n")
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                frame, label = body["frame"], body["label"]
            except (ValueError, KeyError, TypeError):
                self._send(400, b"expected {\"frame\": ..., \"label\": ...}\n")
                return
            if frame not in frame_set or label not in ("1", "0", SKIP):
                self._send(400, f"unknown frame or label (labels: 1, 0, {SKIP})\n".encode())
                return
            with lock:
                append_label(labels_path, frame, label)
            self._send(200, b'{"saved": true}', "application/json")

    try:
        return http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    except OSError as e:
        raise UserError(f"cannot listen on 127.0.0.1:{port} ({e.strerror}); pass another --port, or --port 0 for any free one.") from None


def label(args: Label) -> None:
    rows = load_states(args.dataset)
    env_id = rows[0]["env_id"]
    task = args.task or DEFAULT_PROMPTS.get(env_id, (env_id,))[0]
    server = make_label_server(args.dataset, args.port, task)
    done = len(read_labels(args.dataset, {r["frame"] for r in rows}))
    print(f"labelling {len(rows)} frames of {args.dataset} ({done} already labelled); open "
          f"http://127.0.0.1:{server.server_port}/ - keys: 1 success, 0 failure, s skip, Backspace back. "
          "Every label is on disk when the page says saved; stop with Ctrl-C at any time.")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print(f"\nstopped; labels are in {os.path.join(args.dataset, 'labels.csv')}")
    finally:
        server.server_close()


# ----------------------------------------------------------------------------------------------
# Metrics: EPIC distance, bootstrap interval, ROC AUC, PR AUC (numpy only)
# ----------------------------------------------------------------------------------------------
def is_constant(x: np.ndarray) -> bool:
    """Constant up to float32 round-off (relative), where a correlation would only measure noise."""
    x = np.asarray(x, dtype=np.float64)
    return bool(np.ptp(x) <= 1e-6 * np.abs(x).max()) if len(x) else True


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
    r, h = r - r.mean(), h - h.mean()
    rho = float(np.clip((r @ h) / math.sqrt((r @ r) * (h @ h)), -1.0, 1.0))
    return math.sqrt((1.0 - rho) / 2.0)


def bootstrap_epic(rewards: np.ndarray, labels: np.ndarray, samples: int, confidence: float,
                   rng: np.random.Generator) -> tuple[float, float]:
    """Percentile interval of EPIC over resamples of the states (with replacement).

    Resamples in which the labels or rewards happen to be constant (EPIC undefined) are left out.
    """
    r, h = np.asarray(rewards, dtype=np.float64), np.asarray(labels, dtype=np.float64)
    n, values = len(r), []
    for start in range(0, samples, 256):  # chunks keep memory at 256 x n
        idx = rng.integers(0, n, size=(min(256, samples - start), n))
        rs, hs = r[idx], h[idx]
        defined = (np.ptp(rs, axis=1) > 1e-6 * np.abs(r).max()) & (np.ptp(hs, axis=1) > 1e-6 * np.abs(h).max())
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
    # Mann-Whitney U from average ranks (tied scores share their mean rank)
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores))
    boundaries = np.flatnonzero(np.diff(sorted_scores)) + 1
    for group in np.split(np.arange(len(scores)), boundaries):
        ranks[order[group]] = group.mean() + 1
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


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
# Score: every CLIP model x alpha against the labels
# ----------------------------------------------------------------------------------------------
SOFTMAX = "softmax"  # the thresholded-softmax family's entry among the alphas of a score run


def check_score_args(args: Score) -> list[ClipArgs]:
    """Reject bad flags before any model is loaded; returns one ClipArgs per model."""
    if not args.reward_families:
        raise UserError("--reward-families needs at least one of: projection, softmax.")
    projection = "projection" in args.reward_families
    if projection and not args.alphas:
        raise UserError("--alphas needs at least one value in [0, 1].")
    for alpha in args.alphas if projection else ():
        if not 0.0 <= alpha <= 1.0:
            raise UserError(f"--alphas must be in [0, 1], got {alpha}.")
    if not args.goal or any(not g.strip() for g in args.goal):
        raise UserError('--goal needs at least one non-empty prompt, e.g. --goal "pole vertically upright on top of the cart".')
    if projection and max(args.alphas) > 0 and (not args.baseline or any(not b.strip() for b in args.baseline)):
        raise UserError("--baseline needs at least one non-empty prompt when an alpha is > 0.")
    if projection and max(args.alphas) > 0 and sorted(set(args.goal)) == sorted(set(args.baseline)):
        raise UserError(f"--goal and --baseline are the same prompts, so the goal-baseline direction is zero; change one or use only --alphas 0 (got {max(args.alphas)}).")
    if not 0 < args.temperature < float("inf"):  # also rejects nan
        raise UserError(f"--temperature must be a positive number, got {args.temperature}.")
    if not 0 < args.threshold < 1:
        raise UserError(f"--threshold must be in (0, 1), got {args.threshold}.")
    if "softmax" in args.reward_families:
        args.negatives = resolve_negatives(args.goal, args.negatives, "--reward-families softmax")
    if args.bootstrap < 1 or args.reward_batch_size < 1:
        raise UserError("--bootstrap and --reward-batch-size must be positive integers.")
    if not 0.0 < args.confidence < 1.0:
        raise UserError(f"--confidence must be in (0, 1), got {args.confidence}.")
    if not args.clip_models:
        raise UserError("--clip-models needs at least one model.")
    n = len(args.clip_models)
    if len(args.clip_pretrained) not in (1, n):
        raise UserError(f"--clip-pretrained needs one tag, or one per model ({n}), got {len(args.clip_pretrained)}.")
    if args.clip_checkpoints is not None and len(args.clip_checkpoints) != n:
        raise UserError(f"--clip-checkpoints needs one entry per model ({n}; 'none' for a model without one), got {len(args.clip_checkpoints)}.")
    clip_args = []
    for i, model in enumerate(args.clip_models):
        checkpoint = args.clip_checkpoints[i] if args.clip_checkpoints else None
        clip_args.append(ClipArgs(model, args.clip_pretrained[i % len(args.clip_pretrained)],
                                  None if checkpoint in (None, "none") else checkpoint, args.clip_cache_dir))
        check_clip_args(clip_args[-1])
    return clip_args


def model_label(clip: ClipArgs) -> str:
    name = Path(clip.clip_model).stem if clip.clip_model.endswith(".json") else clip.clip_model
    return f"{name}/{Path(clip.clip_checkpoint).name if clip.clip_checkpoint else clip.clip_pretrained}"


def plot_epic(table: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, model in enumerate(dict.fromkeys(row["model"] for row in table)):  # one colour per model, in flag order
        colour = colours[i % len(colours)]
        rows = [row for row in table if row["model"] == model and row["family"] == "projection"]
        if rows:  # projection family: EPIC against alpha
            alphas = [row["alpha"] for row in rows]
            ax.plot(alphas, [row["epic"] for row in rows], marker="o", color=colour, label=f"{model}, projection")
            ax.fill_between(alphas, [row["epic_low"] for row in rows], [row["epic_high"] for row in rows],
                            color=colour, alpha=0.2, linewidth=0)
        for row in (row for row in table if row["model"] == model and row["family"] == "softmax"):
            if math.isfinite(row["epic"]):  # softmax family: no alpha, a dashed level across the plot
                ax.axhline(row["epic"], color=colour, linestyle="--", label=f"{model}, {row['curve']}")
            if math.isfinite(row["epic_low"]) and math.isfinite(row["epic_high"]):
                ax.axhspan(row["epic_low"], row["epic_high"], color=colour, alpha=0.08, linewidth=0)
    if not any(row["family"] == "projection" for row in table):
        ax.set_xlim(0, 1)
    ax.set_xlabel("alpha (goal-baseline regularisation; the softmax family is dashed)")
    ax.set_ylabel("EPIC distance to labels (lower is better)")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # nothing to list when every EPIC is undefined
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def score(args: Score) -> str:
    """Writes runs/<run_name>/{epic.csv, epic.png, rewards.csv, args.json}; returns the run folder."""
    frames, labels = label_values(args.dataset, args.labels)  # dataset problems first: they are cheapest
    env_id = load_states(args.dataset)[0]["env_id"]
    default_goal, default_baseline = DEFAULT_PROMPTS.get(env_id, (None, None))
    args.goal = args.goal if args.goal is not None else ((default_goal,) if default_goal else None)
    args.baseline = args.baseline if args.baseline is not None else ((default_baseline,) if default_baseline else None)
    clip_args = check_score_args(args)
    if is_constant(labels):
        raise UserError(f"all {len(labels)} labels ({args.labels}) of {args.dataset} are {labels[0]:g}, so the correlation (and EPIC) is undefined; label both successes and failures.")
    binary = bool(np.isin(labels, (0.0, 1.0)).all())
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    run_name = f"{env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = os.path.join("runs", run_name)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "args.json"), "w") as f:
        json.dump(asdict(args), f, indent=2)
    print(f"run: {run_dir}; {len(frames)} frames of {env_id} with {args.labels} labels "
          f"({int((labels == 1).sum())} successes), goal={args.goal}, baseline={args.baseline}"
          + (f", negatives={args.negatives}" if "softmax" in args.reward_families else "") + f", on {device}")
    curves: list = list(args.alphas) if "projection" in args.reward_families else []  # an alpha, or SOFTMAX
    if "softmax" in args.reward_families:
        curves.append(SOFTMAX)
    softmax_curve = "softmax-p" if args.soft else "softmax"  # its name in the tables and the plot

    table, undefined, reward_columns = [], [], {}
    for clip in clip_args:
        name = model_label(clip)
        torch.manual_seed(args.seed)  # a random-weight (test) model is then the same in every run
        model, tokenizer = load_clip(clip, device)
        reward_model = CLIPReward(model, tokenizer, args.goal, args.baseline, 0.0, args.reward_batch_size, device,
                                  "softmax" if SOFTMAX in curves else "projection", args.negatives or (),
                                  args.temperature, args.threshold, args.soft)
        # image embeddings once per model, from disk in batches; every alpha (and the softmax family) reuses them
        start = time.perf_counter()
        embeddings = torch.cat([reward_model.embed_images(torch.from_numpy(read_frames(args.dataset, frames[i:i + args.reward_batch_size]))).float().cpu()
                                for i in range(0, len(frames), args.reward_batch_size)])
        print(f"{name}: embedded {len(frames)} frames in {time.perf_counter() - start:.1f} s")
        for alpha in curves:
            if alpha == SOFTMAX:
                curve, family, alpha = softmax_curve, "softmax", ""
                rewards = softmax_reward(embeddings, reward_model.goal_embeddings.cpu(), reward_model.negative_embeddings.cpu(),
                                         args.temperature, args.threshold, args.soft).numpy()
            else:
                curve, family = f"alpha={alpha:g}", "projection"
                try:
                    rewards = vlm_reward(embeddings, reward_model.goal_embeddings.cpu(), reward_model.baseline_embeddings.cpu(), alpha).numpy()
                except ValueError:
                    raise UserError(f"{name} embeds --goal and --baseline identically, so the goal-baseline direction is zero; use different prompts or only --alphas 0.") from None
            reward_columns[f"{name}@{curve}"] = rewards
            rng = np.random.default_rng(args.seed)  # same resamples for every model and curve: comparable intervals
            row = {"model": name, "family": family, "alpha": alpha, "curve": curve, "n": len(labels),
                   "n_success": int((labels == 1).sum()) if binary else ""}
            if is_constant(rewards):
                undefined.append(f"{name} {curve}")
                row.update(epic=float("nan"), epic_low=float("nan"), epic_high=float("nan"), pearson=float("nan"),
                           roc_auc=float("nan"), pr_auc=float("nan"))
            else:
                epic = epic_distance(rewards, labels)
                low, high = bootstrap_epic(rewards, labels, args.bootstrap, args.confidence, rng)
                row.update(epic=epic, epic_low=low, epic_high=high, pearson=1.0 - 2.0 * epic**2,
                           roc_auc=roc_auc(rewards, labels) if binary else float("nan"),
                           pr_auc=average_precision(rewards, labels) if binary else float("nan"))
            table.append(row)
            print(f"  {curve:<11} EPIC={row['epic']:.4f} [{row['epic_low']:.4f}, {row['epic_high']:.4f}]  "
                  f"pearson={row['pearson']:+.4f}  ROC AUC={row['roc_auc']:.4f}  PR AUC={row['pr_auc']:.4f}")
        del model, reward_model  # one model in memory at a time: the large ones take many GB
        if device.type == "cuda":
            torch.cuda.empty_cache()

    columns = ["model", "family", "alpha", "epic", "epic_low", "epic_high", "pearson", "roc_auc", "pr_auc", "n", "n_success"]
    with open(os.path.join(run_dir, "epic.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows({k: (f"{v:.6f}" if isinstance(v, float) and k != "alpha" else v) for k, v in row.items() if k in columns}
                         for row in table)
    with open(os.path.join(run_dir, "rewards.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["frame", "label", *reward_columns])
        for i, frame in enumerate(frames):
            writer.writerow([frame, f"{labels[i]:g}", *(f"{v[i]:.9g}" for v in reward_columns.values())])
    plot_epic(table, os.path.join(run_dir, "epic.png"),
              f"{env_id}, {len(labels)} frames, {args.labels} labels; {int(args.confidence * 100)}% bootstrap interval")
    print(f"wrote {run_dir}/epic.csv, epic.png, rewards.csv")
    if undefined:
        hint = " (a binary softmax reward that never or always crosses --threshold: try another --threshold or --soft)" if any(softmax_curve in u for u in undefined) and not args.soft else ""
        raise UserError(f"the rewards of {', '.join(undefined)} are the same for every frame{hint}, so their correlation with the labels (and EPIC) is undefined; the other results are in {run_dir}/epic.csv.")
    return run_dir


Commands = Union[
    Annotated[Collect, tyro.conf.subcommand("collect")],
    Annotated[Label, tyro.conf.subcommand("label")],
    Annotated[Score, tyro.conf.subcommand("score")],
]


def main(args: Union[Collect, Label, Score]) -> None:
    if isinstance(args, Collect):
        collect(args)
    elif isinstance(args, Label):
        label(args)
    else:
        score(args)


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message=".*No pretrained weights.*")
    try:
        main(tyro.cli(Commands))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
