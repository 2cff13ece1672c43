"""VLM-RM: DQN on CartPole-v1 / MountainCar-v0 with a CLIP model as the reward (no hand-written reward).

Every frame the environment renders is scored by a pretrained CLIP model against a goal sentence, optionally
regularised towards a baseline sentence with strength alpha (goal-baseline projection). One file, read top to
bottom: flags, CLIP reward, environments, Q-network and replay buffer, training loop. Based on CleanRL's dqn.py.

    python vlmrm_dqn_classic.py --env-id CartPole-v1 --goal "pole vertically upright on top of the cart" \
        --baseline "pole and cart" --alpha 0.5
"""

import copy
import logging
import math
import os
import random
import signal
import sys
import tempfile
import time
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal, Optional

os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame draws off-screen: no display needed
os.environ.setdefault("SDL_AUDIODRIVER", "dummy")

import gymnasium as gym
import imageio.v2 as imageio
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import tyro
from torch.utils.tensorboard import SummaryWriter


@dataclass
class Args:  # the help of each flag is the comment after it
    exp_name: str = os.path.basename(__file__)[: -len(".py")]  # the name of this experiment
    seed: int = 1  # seed of the experiment
    torch_deterministic: bool = True  # if toggled, `torch.backends.cudnn.deterministic=True`
    cuda: bool = True  # if toggled, CUDA (when available) runs the Q-network and the reward model
    torch_threads: Optional[int] = None  # torch CPU threads; default 1 on CPU (more fight the env workers); 0 = torch's own
    log_episodes: bool = False  # if toggled, print a line per finished episode, not only the progress line
    capture_video: bool = False  # if toggled, save an MP4 of a greedy episode every --video-frequency steps
    video_frequency: int = 25_000  # environment steps between two evaluation videos
    save_model: bool = False  # if toggled, save a checkpoint.pt every --checkpoint-frequency steps and at the end
    checkpoint_frequency: int = 100_000  # env steps between two checkpoints (fixed-length episodes: at the next episode end)
    save_buffer: bool = False  # if toggled, checkpoints include the replay buffer, so --resume continues exactly
    resume: Optional[str] = None  # a checkpoint.pt to continue until its --total-timesteps (stock episodes restart)
    evaluate: Optional[str] = None  # a checkpoint.pt: roll out its greedy policy (video + frames) instead of training
    eval_episodes: int = 10  # number of episodes of an evaluation

    # Environment
    env_id: Literal["CartPole-v1", "MountainCar-v0"] = "CartPole-v1"  # the environment
    episodes: Literal["auto", "fixed", "stock"] = "auto"  # auto: fixed with --reward clip, else stock (Gymnasium's task)
    episode_length: int = 200  # fixed episode length (`--episodes fixed` only)
    realistic: bool = False  # MountainCar only: draw a landscape (sky, hills, flag, car) instead of Gymnasium's line art

    # Reward
    reward: Literal["clip", "gt"] = "clip"  # learn from the CLIP reward, or the ground truth (upright; at the flag)
    goal: Optional[tuple[str, ...]] = None  # goal prompt(s); default: a description of the task's goal state
    baseline: Optional[tuple[str, ...]] = None  # baseline prompt(s) of the projection; default: a scene description
    alpha: float = 0.0  # regularisation strength in [0, 1]: 0 = plain cosine similarity, 1 = only the goal-baseline direction
    clip_model: str = "ViT-bigG-14"  # open_clip architecture name, or the path of an open_clip model config (.json)
    clip_pretrained: str = "laion2b_s39b_b160k"  # open_clip pretrained tag ("none" = random weights, for tests only)
    clip_checkpoint: Optional[str] = None  # local weights file for `--clip-model` (overrides `--clip-pretrained`)
    clip_cache_dir: Optional[str] = None  # where downloaded CLIP weights are cached (default: the Hugging Face cache)
    reward_batch_size: int = 64  # frames scored per CLIP forward pass
    reward_devices: tuple[str, ...] = ()  # e.g. `cuda:0 cuda:1`: one CLIP replica each, in parallel; default: --cuda's device
    reward_family: Literal["projection", "softmax"] = "projection"  # softmax: 1 if the goal beats --negatives, else 0
    negatives: Optional[tuple[str, ...]] = None  # softmax: prompts the goal is contrasted with (defaults for the default goal)
    temperature: float = 0.01  # softmax: temperature of the softmax over cosine similarities (0.01 = CLIP's logit scale)
    threshold: float = 0.5  # softmax family: the reward is 1 when the goal's probability is above this, else 0; in (0, 1)
    soft: bool = False  # softmax family: if toggled, the reward is the goal's probability itself instead of 0/1
    antialias: bool = False  # if toggled, antialias the bicubic squash of frames to CLIP's input (off in the paper's code)

    # DQN (CleanRL's dqn.py defaults, except where the comment says otherwise)
    total_timesteps: int = 500000  # total environment steps (summed over envs), rounded up to a multiple of --num-envs
    learning_rate: float = 2.5e-4  # the learning rate of the optimizer
    num_envs: int = 1  # the number of parallel environments
    buffer_size: int = 10000  # the replay memory buffer size
    gamma: float = 0.99  # the discount factor gamma
    tau: float = 1.0  # the target network update rate
    target_network_frequency: int = 500  # the timesteps it takes to update the target network
    batch_size: int = 128  # the batch size of sample from the replay memory
    start_e: float = 1.0  # the starting epsilon for exploration
    end_e: float = 0.05  # the ending epsilon for exploration
    exploration_fraction: float = 0.5  # the fraction of `total_timesteps` it takes from start_e to end_e
    learning_starts: int = 10000  # timestep to start learning (below --total-timesteps)
    train_frequency: int = 10  # the frequency of training


DEFAULT_PROMPTS = {  # (goal, baseline) from the paper
    "CartPole-v1": ("pole vertically upright on top of the cart", "pole and cart"),
    "MountainCar-v0": ("a car at the peak of the mountain, next to the yellow flag", "a car in the mountain"),
}


class UserError(Exception):
    """Bad input or a missing resource: reported as one sentence and exit code 2, never a traceback."""


class NonFiniteError(Exception):
    """A NaN or infinite reward or loss: training stops (exit code 1) instead of poisoning the buffer."""


def check_args(args: Args) -> None:
    """Refuse bad flags, each in one sentence, before anything expensive (model download, env spawn) happens."""
    positive = "total_timesteps num_envs buffer_size batch_size train_frequency target_network_frequency episode_length"
    for name in (positive + " eval_episodes reward_batch_size video_frequency checkpoint_frequency learning_rate").split():
        if not getattr(args, name) > 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}.")
    for name in "alpha gamma tau start_e end_e exploration_fraction".split():
        if not 0 <= getattr(args, name) <= 1:
            raise UserError(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name)}.")
    if args.total_timesteps % args.num_envs:  # every vector step takes one step in each env
        rounded = -(-args.total_timesteps // args.num_envs) * args.num_envs
        print(f"note: --total-timesteps {args.total_timesteps} rounded up to {rounded}, a multiple of --num-envs")
        args.total_timesteps = rounded
    known = ["cpu", *(["cuda"] if torch.cuda.is_available() else []), *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
    unknown = [name for name in args.reward_devices if name not in known]
    for failed, message in [
        (not args.goal or not all(p.strip() for p in args.goal), "--goal needs at least one non-empty prompt."),
        (args.alpha > 0 and not all(p.strip() for p in args.baseline or [""]), "--baseline needs a prompt when --alpha > 0."),
        (
            args.alpha > 0 and same_prompts(args.goal, args.baseline or ()),
            "--goal and --baseline are the same prompts (up to case and spaces); change one or use --alpha 0.",
        ),
        (not 0 < args.temperature < math.inf, f"--temperature must be a positive number, got {args.temperature}."),
        (not 0 < args.threshold < 1, f"--threshold must be in (0, 1), got {args.threshold}."),
        (
            args.learning_starts >= args.total_timesteps,
            f"--learning-starts {args.learning_starts} is not below --total-timesteps {args.total_timesteps}; "
            f"lower it, e.g. to a quarter of the run: --learning-starts {args.total_timesteps // 4}.",
        ),
        (args.batch_size > args.buffer_size, f"--batch-size {args.batch_size} exceeds --buffer-size {args.buffer_size}."),
        (args.torch_threads is not None and args.torch_threads < 0, "--torch-threads must be 0 (torch's default) or more."),
        (bool(unknown), f"--reward-devices {' '.join(unknown)} is not a device of this machine: {', '.join(known)}."),
    ]:
        if failed:
            raise UserError(message)
    if args.reward_family == "softmax":
        args.negatives = resolve_negatives(args.goal, args.negatives, "--reward-family softmax")
    if args.evaluate is not None:  # the checks of --resume, then networks of this env
        saved = read_checkpoint(args.evaluate, "--evaluate")
        if "q_network" not in saved or saved["args"].get("env_id", args.env_id) != args.env_id:
            raise UserError(
                f"--evaluate {args.evaluate} holds no networks trained on --env-id {args.env_id} "
                f"(its --env-id: {saved['args'].get('env_id', args.env_id)})."
            )
    check_writable("runs")
    if args.capture_video or args.evaluate is not None:
        check_writable("videos")
    if args.evaluate is None:  # a rollout allocates no replay buffer
        probe = gym.make(args.env_id)  # cheap: no rendering, just the spaces
        check_resources(args, probe.observation_space, probe.action_space, (400, 600, 3))
    if args.reward == "clip":
        check_clip_args(args)


# ----------------------------------------------------------------------------------------------
# CLIP reward
# ----------------------------------------------------------------------------------------------
def vlm_reward(
    image_embeddings: torch.Tensor, goal_embeddings: torch.Tensor, baseline_embeddings: torch.Tensor, alpha: float
) -> torch.Tensor:
    """R(s) = 1 - 0.5 * ||(s - g) P||^2, P = alpha * d d^T / ||d||^2 + (1 - alpha) I, d = g - b; (N,) float32 rewards."""
    s = F.normalize(image_embeddings.float(), dim=-1)
    g = F.normalize(goal_embeddings.float(), dim=-1).mean(0)  # the means are deliberately not re-normalised
    b = F.normalize(baseline_embeddings.float(), dim=-1).mean(0)
    u = s - g
    if alpha != 0:
        if (g - b).norm() == 0:
            raise ValueError("goal and baseline embeddings are equal: the projection direction is undefined for alpha > 0")
        d = (g - b) / (g - b).norm()
        u = alpha * (u @ d)[:, None] * d + (1 - alpha) * u  # u P, without the D x D matrix
    return 1 - 0.5 * u.pow(2).sum(-1)


DEFAULT_NEGATIVES = {  # softmax family: our own negatives for the default goals (not the paper's), states the goal is not
    ("pole vertically upright on top of the cart",): (
        "pole tilted to the side of the cart",
        "pole lying flat next to the cart",
    ),
    ("a car at the peak of the mountain, next to the yellow flag",): (
        "a car at the bottom of the valley",
        "a car on the slope, far from the yellow flag",
    ),
    ("a humanoid robot kneeling",): ("a humanoid robot standing", "a humanoid robot lying on the ground"),
}


def softmax_reward(
    image_embeddings: torch.Tensor,
    goal_embeddings: torch.Tensor,
    negative_embeddings: torch.Tensor,
    temperature: float,
    threshold: float,
    soft: bool = False,
) -> torch.Tensor:
    """R(s) = 1 if p > threshold else 0 (p itself if soft), p = the goal's softmax(cos(s, e_k) / temperature) vs negatives."""
    if len(negative_embeddings) == 0 or not 0 < temperature < math.inf or not 0 < threshold < 1:
        raise ValueError(
            f"need negatives, 0 < temperature < inf, 0 < threshold < 1: {len(negative_embeddings)}, {temperature}, {threshold}"
        )
    s = F.normalize(image_embeddings.float(), dim=-1)
    g = F.normalize(F.normalize(goal_embeddings.float(), dim=-1).mean(0), dim=-1)  # the goal prompts form one class
    prompts = torch.cat([g[None], F.normalize(negative_embeddings.float(), dim=-1)])  # (1 + K, D), the goal first
    p = (s @ prompts.T / temperature).softmax(dim=-1)[:, 0]
    return p if soft else (p > threshold).float()


class CLIPReward(nn.Module):
    """Scores uint8 frames (N, H, W, 3) with `vlm_reward` (family "projection") or `softmax_reward` ("softmax").

    Frames are preprocessed as the paper's code did (a tensor torchvision Resize of torch 2.0): squashed to the model's
    square input, bicubic, no antialiasing, no clamp; `antialias=True` smooths a large downscale (closer to PIL).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        goal: tuple[str, ...],
        baseline: tuple[str, ...],
        alpha: float,
        batch_size: int,
        device: torch.device,
        family: str = "projection",
        negatives: tuple[str, ...] = (),
        temperature: float = 0.01,
        threshold: float = 0.5,
        soft: bool = False,
        antialias: bool = False,
        replicas: tuple = (),
    ):
        super().__init__()
        import open_clip

        if family not in ("projection", "softmax") or (family == "softmax" and not negatives):
            raise ValueError(f"unknown reward family {family!r}, or the softmax family without negative prompts")
        self.model, self.alpha, self.batch_size, self.device, self.family = model, alpha, batch_size, device, family
        self.temperature, self.threshold, self.soft, self.antialias = temperature, threshold, soft, antialias
        self.replicas = [(model, device), *replicas]  # (model, device) per reward device; the first embeds the prompts
        # the model's own mean/std: the paper used OpenAI's for every model, wrong only for ViT-L-14 laion2b (0.5, 0.5)
        cfg = open_clip.get_model_preprocess_cfg(model)
        self.image_size = (cfg["size"],) * 2 if isinstance(cfg["size"], int) else tuple(cfg["size"])
        self.register_buffer("mean", torch.tensor(cfg["mean"], device=device).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(cfg["std"], device=device).view(1, 3, 1, 1))

        @torch.no_grad()
        def embed(prompts: tuple[str, ...]) -> torch.Tensor:
            return model.encode_text(tokenizer(list(prompts)).to(device)).float()

        self.register_buffer("goal_embeddings", embed(goal))
        self.register_buffer("baseline_embeddings", embed(baseline or goal))
        self.register_buffer("negative_embeddings", embed(negatives) if negatives else embed(goal)[:0])

    @torch.no_grad()
    def preprocess(self, frames: torch.Tensor, device: Optional[torch.device] = None) -> torch.Tensor:
        """uint8 (N, H, W, 3) -> the model's normalised input (N, 3, S, S); frames travel as uint8 (4x less than float)."""
        device = device or self.device
        x = frames.to(device, non_blocking=True).permute(0, 3, 1, 2).float().div_(255)
        # bicubic overshoots [0, 1] a little near edges: the reference kept it (no clamp), and so do we
        x = F.interpolate(x, size=self.image_size, mode="bicubic", align_corners=False, antialias=self.antialias)
        return (x - self.mean.to(device)) / self.std.to(device)

    @torch.no_grad()
    def embed_images(self, frames: torch.Tensor, replica: int = 0) -> torch.Tensor:
        """uint8 (N, H, W, 3) -> raw image embeddings (N, D), on the device of `replicas[replica]`."""
        model, device = self.replicas[replica]
        x = self.preprocess(frames, device)
        with torch.autocast(device_type=device.type, dtype=torch.float16, enabled=device.type == "cuda"):
            return model.encode_image(x)

    def rewards(self, image_embeddings: torch.Tensor) -> torch.Tensor:
        """The chosen family's rewards (N,) of raw image embeddings (N, D)."""
        if self.family == "softmax":
            return softmax_reward(
                image_embeddings, self.goal_embeddings, self.negative_embeddings, self.temperature, self.threshold, self.soft
            )
        return vlm_reward(image_embeddings, self.goal_embeddings, self.baseline_embeddings, self.alpha)

    @torch.no_grad()
    def forward(self, frames: np.ndarray) -> np.ndarray:
        chunks, k = torch.from_numpy(np.ascontiguousarray(frames)).split(self.batch_size), len(self.replicas)

        def score(i: int) -> list[torch.Tensor]:  # replica i scores chunks i, i + k, ...: the batches one device would score
            return [self.rewards(self.embed_images(chunk, i).to(self.device)) for chunk in chunks[i::k]]

        if k == 1:
            return torch.cat(score(0)).cpu().numpy()
        with ThreadPoolExecutor(k) as pool:  # one thread per replica, in parallel: torch releases the GIL in its kernels
            scored = list(pool.map(score, range(k)))
        return torch.cat([scored[j % k][j // k] for j in range(len(chunks))]).cpu().numpy()


def make_reward_model(args: Args, device: torch.device) -> CLIPReward:
    """The CLIP reward of the flags, on --reward-devices (one replica each) or else on `device`."""
    devices = [torch.device(name) for name in args.reward_devices] or [device]
    model, tokenizer = load_clip(args, devices[0])
    replicas = [(copy.deepcopy(model).to(d), d) for d in devices[1:]]  # copies: the same weights (even random test ones)
    family = [args.reward_family, args.negatives or (), args.temperature, args.threshold, args.soft, args.antialias]
    reward_model = CLIPReward(
        model, tokenizer, args.goal, args.baseline, args.alpha, args.reward_batch_size, devices[0], *family, replicas
    )
    if args.reward_family == "projection":
        check_goal_direction(reward_model.goal_embeddings, reward_model.baseline_embeddings, args.alpha)
    return reward_model


# ----------------------------------------------------------------------------------------------
# Environments: fixed-length episodes; the env's own reward is the ground truth (logged, not learned from)
# ----------------------------------------------------------------------------------------------
class FixedLengthCartPole(gym.Wrapper):
    """CartPole that never terminates: the pole angle wraps to [-pi, pi), the cart stops at the track ends.
    Reward = 1 while upright (|theta| < 12 deg and |x| < 2.4), else 0."""

    def step(self, action):
        _, _, _, truncated, info = self.env.step(action)
        cartpole = self.env.unwrapped
        x, x_dot, theta, theta_dot = cartpole.state
        theta = (theta + math.pi) % (2 * math.pi) - math.pi
        if abs(x) > cartpole.x_threshold:  # the track ends are walls: stop there instead of leaving the screen
            x, x_dot = math.copysign(cartpole.x_threshold, x), 0.0
        cartpole.state = np.array([x, x_dot, theta, theta_dot])
        cartpole.steps_beyond_terminated = None  # we keep stepping on purpose: silence gym's warning
        info["success"] = bool(abs(theta) < cartpole.theta_threshold_radians and abs(x) < cartpole.x_threshold)
        return cartpole.state.astype(np.float32), float(info["success"]), False, truncated, info


MOUNTAINCAR_GOAL = 0.45  # the paper's flag (Gymnasium's MountainCar-v0 has 0.5): reward, success and drawing use it


class FixedLengthMountainCar(gym.Wrapper):
    """MountainCar that never terminates: reward 1 while at the flag, else 0; `info["success"]`: reached this episode.
    After success x is clipped to the flag, as in the paper's env, so CLIP never scores the car past it."""

    def reset(self, **kwargs):
        self.reached_goal = False
        return self.env.reset(**kwargs)

    def step(self, action):
        obs, _, _, truncated, info = self.env.step(action)
        if obs[0] > MOUNTAINCAR_GOAL:  # as the paper's env: a car that reached the flag stays there, never past it
            car = self.env.unwrapped  # MountainCar-v0 keeps its state as a tuple, the continuous one as an array
            car.state, obs[0] = np.array([MOUNTAINCAR_GOAL, car.state[1]], np.asarray(car.state).dtype), MOUNTAINCAR_GOAL
        at_goal = bool(obs[0] >= MOUNTAINCAR_GOAL)
        self.reached_goal = info["success"] = self.reached_goal or at_goal
        return obs, float(at_goal), False, truncated, info

    def render(self):  # Gymnasium draws its flag at goal_position: ours, for the drawing only (its own stays as it is)
        car = self.env.unwrapped
        car.goal_position, stock = MOUNTAINCAR_GOAL, car.goal_position
        frame = self.env.render()
        car.goal_position = stock
        return frame


class RealisticMountainCar(gym.Wrapper):
    """MountainCar drawn as a landscape (sky, far ridge, grassy hill, road, yellow flag, red car on the slope): CLIP
    scores photo-like scenes far better than line art. Gymnasium's world-to-pixel mapping; the background is drawn once."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        import pygame

        self.min_x, self.scale = env.unwrapped.min_position, 600 / (env.unwrapped.max_position - env.unwrapped.min_position)
        rows, cols = np.mgrid[:400, :600]
        depth = rows - self.pixel(self.min_x + cols / self.scale)[1]  # pixels below the road's centre line
        noise = np.random.default_rng(0).normal(0, 12, (400, 600, 1))  # fixed: every frame of every run looks the same
        ridge = 170 + 35 * np.sin(cols / 57) + 20 * np.sin(cols / 23 + 1.3) + 8 * np.sin(cols / 7)
        pixels = np.select(  # first match wins: road, earth, grass, far ridge, else a sky from deep blue to pale
            [c[..., None] for c in (abs(depth) <= 4, depth > 28, depth > 0, rows > ridge)],
            [[95, 95, 100], [110, 85, 55] + noise, [70, 140, 55] + noise, [120, 140, 165]],
            [70, 130, 210] + rows[..., None] / 399 * np.array([130, 95, 35]),
        )
        self.background = pygame.surfarray.make_surface(np.clip(pixels, 0, 255).astype(np.uint8).transpose(1, 0, 2))
        x, y = (int(v) for v in self.pixel(MOUNTAINCAR_GOAL))
        pygame.draw.line(self.background, (60, 60, 60), (x, y - 4), (x, y - 64), 3)
        pygame.draw.polygon(self.background, (250, 210, 20), [(x + 2, y - 64), (x + 32, y - 54), (x + 2, y - 44)])
        self.car = pygame.Surface((56, 34), pygame.SRCALPHA)  # red body, cabin, two windows, two wheels
        for color, rect in [((200, 30, 35), (0, 12, 56, 14)), ((175, 25, 30), (12, 2, 30, 14))]:
            pygame.draw.rect(self.car, color, rect, border_radius=5)
        for x in (16, 29):
            pygame.draw.rect(self.car, (170, 210, 235), (x, 5, 10, 8))
        for x in (12, 44):
            pygame.draw.circle(self.car, (25, 25, 25), (x, 27), 7)
            pygame.draw.circle(self.car, (160, 160, 160), (x, 27), 3)
        self.canvas = pygame.Surface((600, 400))

    def pixel(self, x):  # world x -> (column, row) of the road's surface, as Gymnasium draws the track 0.45 sin(3x) + 0.55
        return (x - self.min_x) * self.scale, 400 - (0.45 * np.sin(3 * x) + 0.55) * self.scale

    def render(self) -> np.ndarray:
        import pygame

        x = float(self.env.unwrapped.state[0])
        slope = math.atan(1.35 * math.cos(3 * x))  # the road's angle (both axes share one scale)
        car = pygame.transform.rotozoom(self.car, math.degrees(slope), 1.0)
        column, row = self.pixel(x)  # the car's centre stands 10 px above the road, along its normal
        self.canvas.blit(self.background, (0, 0))
        self.canvas.blit(car, car.get_rect(center=(column - 10 * math.sin(slope), row - 10 * math.cos(slope))))
        return pygame.surfarray.array3d(self.canvas).transpose(1, 0, 2)


class StockEpisodes(gym.Wrapper):
    """Gymnasium's own task (reward, termination, time limit) plus the ground truth `info["success"]` of the
    fixed-length envs: CartPole: this step is upright; MountainCar: the flag was reached during the episode."""

    def reset(self, **kwargs):
        self.reached_goal = False
        return self.env.reset(**kwargs)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        env = self.env.unwrapped
        if env.spec.id == "CartPole-v1":
            info["success"] = bool(abs(obs[2]) < env.theta_threshold_radians and abs(obs[0]) < env.x_threshold)
        else:
            self.reached_goal = info["success"] = self.reached_goal or bool(obs[0] >= MOUNTAINCAR_GOAL)
        return obs, reward, terminated, truncated, info


def make_env(env_id: str, seed: int, idx: int, episode_length: int, realistic: bool, fixed_length: bool = True):
    def thunk():
        if fixed_length:  # no early termination: the time limit is the only end, so survival alone earns nothing
            env = gym.make(env_id, render_mode="rgb_array", max_episode_steps=episode_length)
            env = FixedLengthCartPole(env) if env_id == "CartPole-v1" else FixedLengthMountainCar(env)
        else:
            env = StockEpisodes(gym.make(env_id, render_mode="rgb_array"))
        env = RealisticMountainCar(env) if realistic and env_id == "MountainCar-v0" else env
        env.action_space.seed(seed + idx)
        return env

    return thunk


# ----------------------------------------------------------------------------------------------
# DQN
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


def linear_schedule(start_e: float, end_e: float, duration: float, t: int) -> float:
    # --exploration-fraction 0 (duration 0): no exploration phase
    return end_e if duration <= 0 else max((end_e - start_e) / duration * t + start_e, end_e)


class ReplayBuffer:
    """Plain ring buffer of transitions on the host; its state_dict (the filled part) makes a resume exact."""

    def __init__(self, size: int, obs_shape: tuple, device: torch.device):
        self.size, self.device, self.pos, self.full = size, device, 0, False
        self.data = {
            "obs": np.zeros((size, *obs_shape), np.float32),
            "next_obs": np.zeros((size, *obs_shape), np.float32),
            "actions": np.zeros(size, np.int64),
            "rewards": np.zeros(size, np.float32),
            "terminations": np.zeros(size, np.float32),
        }

    def add(self, obs, next_obs, actions, rewards, terminations) -> None:
        idx = (self.pos + np.arange(len(obs))) % self.size  # one vectorised write, wrapping around the end
        for array, values in zip(self.data.values(), (obs, next_obs, actions, rewards, terminations)):
            array[idx] = values
        self.full = self.full or self.pos + len(obs) >= self.size
        self.pos = (self.pos + len(obs)) % self.size

    def __len__(self) -> int:
        return self.size if self.full else self.pos

    def state_dict(self) -> dict:
        return {"pos": self.pos, "full": self.full, **{k: torch.from_numpy(v[: len(self)]) for k, v in self.data.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.pos, self.full = state["pos"], state["full"]
        for k, v in self.data.items():
            v[: len(state[k])] = state[k]

    def sample(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        idx = np.random.randint(0, len(self), size=batch_size)
        keys = ("obs", "actions", "rewards", "next_obs", "terminations")
        return tuple(torch.from_numpy(self.data[k][idx]).to(self.device) for k in keys)


def evaluate(q_network: QNetwork, eval_envs: gym.vector.VectorEnv, device, reward_model, episodes: int, seed: int) -> list:
    """Greedy episodes of the Q-network: frames, ground-truth return and CLIP return of each."""
    results = []
    for episode in range(episodes):
        obs, _ = eval_envs.reset(seed=seed + episode)
        frames, gt_return, done = [eval_envs.call("render")[0]], 0.0, False
        while not done:  # fixed length: --episode-length steps; stock: until the env terminates or truncates
            with torch.no_grad():
                actions = q_network(torch.as_tensor(obs, device=device)).argmax(dim=1).cpu().numpy()
            obs, gt_rewards, terminations, truncations, _ = eval_envs.step(actions)
            done, gt_return = bool(terminations[0] or truncations[0]), gt_return + float(gt_rewards[0])
            frames.append(eval_envs.call("render")[0])
        # the reset frame scores no transition: the reward of step t is the score of frame t + 1
        clip_return = float(reward_model(np.stack(frames[1:])).sum()) if reward_model is not None else float("nan")
        results.append({"frames": frames, "gt_return": gt_return, "clip_return": clip_return})
    return results


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
def main(args: Args) -> None:
    checkpoint = None
    if args.resume is not None:  # continue the same run: its flags, step, TensorBoard folder and random streams
        checkpoint = read_checkpoint(args.resume)
        args = resumed_args(args, checkpoint)
    args.goal = (DEFAULT_PROMPTS[args.env_id][0],) if args.goal is None else args.goal
    args.baseline = (DEFAULT_PROMPTS[args.env_id][1],) if args.baseline is None else args.baseline
    check_args(args)
    if args.episodes == "auto":  # resolved once: a checkpoint keeps the resolved value
        args.episodes = "fixed" if args.reward == "clip" else "stock"
    run_name = checkpoint["run_name"] if checkpoint else f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    set_torch_threads(args, device)
    eval_seed = args.seed + 10_000
    make_eval_envs = lambda: gym.vector.SyncVectorEnv(  # noqa: E731
        [make_env(args.env_id, eval_seed, 0, args.episode_length, args.realistic, args.episodes == "fixed")]
    )
    # the reward model first: a failed download or an unusable prompt is one sentence before anything starts
    reward_model = make_reward_model(args, device) if args.reward == "clip" else None

    if args.evaluate is not None:
        eval_envs = make_eval_envs()
        q_network = QNetwork(eval_envs).to(device)
        q_network.load_state_dict(torch.load(args.evaluate, map_location=device, weights_only=False)["q_network"])
        for i, result in enumerate(evaluate(q_network, eval_envs, device, reward_model, args.eval_episodes, eval_seed)):
            folder = f"videos/{run_name}/eval-episode-{i}"
            save_video(result["frames"], folder + ".mp4")
            os.makedirs(folder, exist_ok=True)
            for t, frame in enumerate(result["frames"]):
                imageio.imwrite(f"{folder}/frame-{t:04d}.png", frame)
            print(
                f"eval episode {i}: clip_return={result['clip_return']:.2f} gt_return={result['gt_return']:.1f}"
                f" -> {folder}.mp4"
            )
        return

    # We reset finished envs ourselves (autoreset off): no reset step, so no reset frame or reset
    # observation can ever be stored as a transition, and episode boundaries are explicit for checkpoints.
    envs = gym.vector.SyncVectorEnv(
        [
            make_env(args.env_id, args.seed, i, args.episode_length, args.realistic, args.episodes == "fixed")
            for i in range(args.num_envs)
        ],
        autoreset_mode=gym.vector.AutoresetMode.DISABLED,
    )
    if reward_model is not None:
        warn_if_slow_on_cpu(reward_model, args, (400, 600, 3))  # the pygame frames are 600x400
    eval_envs = make_eval_envs() if args.capture_video else None
    num_iterations = args.total_timesteps // args.num_envs
    start_iteration = checkpoint["iteration"] if checkpoint else 0
    run_name = run_name if checkpoint else make_run_folder(run_name)
    # purge_step drops whatever a crashed run logged after its checkpoint, so the curves continue cleanly: from the first
    # step still pending in the checkpoint (the episodes ending there were logged only after it was saved)
    purge_step = (start_iteration - len(checkpoint["pending"]["obs"])) * args.num_envs if checkpoint else None
    writer = SummaryWriter(f"runs/{run_name}", purge_step=purge_step)
    if checkpoint is None:
        table = "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items())
        writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    print(
        f"run: runs/{run_name} on {device}, reward: {args.reward}"
        + (f", goal={args.goal}, baseline={args.baseline}, alpha={args.alpha}" if args.reward == "clip" else "")
        + (f", resumed at step {start_iteration * args.num_envs}" if checkpoint else "")
    )

    q_network = QNetwork(envs).to(device)
    optimizer = optim.Adam(q_network.parameters(), lr=args.learning_rate, fused=True)  # one kernel per step
    target_network = QNetwork(envs).to(device)
    target_network.load_state_dict(q_network.state_dict())
    rb = ReplayBuffer(args.buffer_size, envs.single_observation_space.shape, device)
    # everything a gradient step changes, by name: checkpointed and restored together
    learner = {"q_network": q_network, "target_network": target_network, "optimizer": optimizer}
    networks = lambda: {"q_network": q_network.state_dict(), "args": asdict(args), "run_name": run_name}  # noqa: E731

    # Transitions wait here until their frames are scored in one batch; they reach the replay buffer
    # before the next gradient step, so training never samples a transition without its reward.
    pending: dict[str, list] = {k: [] for k in ("obs", "next_obs", "actions", "terminations", "dones", "gt", "frames")}
    episode = {k: np.zeros(args.num_envs) for k in ("return", "gt_return", "clip_return", "length", "success")}
    render = args.reward == "clip"
    timing = {"env": 0.0, "render": 0.0, "reward_model": 0.0, "learning": 0.0}

    obs, _ = envs.reset(seed=args.seed)
    if checkpoint is not None:
        for name, module in learner.items():
            module.load_state_dict(checkpoint[name])
        if checkpoint["replay_buffer"] is not None:
            rb.load_state_dict(checkpoint["replay_buffer"])
            checkpoint["replay_buffer"] = None  # frees the loaded copy (counted by the memory check)
        pending, episode = checkpoint["pending"], checkpoint["episode"]
        if args.episodes == "stock":  # saved mid-episode: the episodes in flight restart below, so drop their partial sums
            episode = {k: np.zeros_like(v) for k, v in episode.items()}
        # fixed-length checkpoints are taken at an episode boundary, just before the reset: redo it with the same env RNGs
        envs.set_attr("np_random", checkpoint["rng"]["envs"])
        obs, _ = envs.reset(options={"reset_mask": np.ones(args.num_envs, dtype=bool)})
        random.setstate(checkpoint["rng"]["python"])
        np.random.set_state(checkpoint["rng"]["numpy"])
        torch.set_rng_state(checkpoint["rng"]["torch"])
        if checkpoint["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(checkpoint["rng"]["cuda"])
    stop = install_stop_handlers()
    start_time = time.time()
    time_limit = args.episode_length if args.episodes == "fixed" else gym.spec(args.env_id).max_episode_steps
    progress = Progress(args.total_timesteps, start_iteration * args.num_envs, args.reward == "clip", max(10, args.num_envs))
    iteration, dones = start_iteration - 1, np.ones(args.num_envs, dtype=bool)  # as they stay if no steps are left
    try:
        for iteration in range(start_iteration, num_iterations):
            global_step = iteration * args.num_envs
            epsilon = linear_schedule(args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, global_step)
            if random.random() < epsilon:
                actions = np.random.randint(envs.single_action_space.n, size=args.num_envs)  # seeded, checkpointed RNG
            else:
                with torch.no_grad():
                    actions = q_network(torch.from_numpy(obs).to(device)).argmax(dim=1).cpu().numpy()

            t0 = time.perf_counter()
            next_obs, gt_rewards, terminations, truncations, infos = envs.step(actions)
            t1 = time.perf_counter()
            frames = np.stack(envs.call("render")) if render else None  # the frame *after* the step scores it
            timing["env"] += t1 - t0
            timing["render"] += time.perf_counter() - t1
            dones = terminations | truncations
            # fixed-length episodes end together: the one point where the whole run state is small. Stock episodes end
            # at different steps: their checkpoint is taken when due, and a resume restarts the episodes in flight.
            next_step = global_step + args.num_envs
            stopping = stop["requested"]  # read once: a signal arriving after this is handled at the next step
            boundary = dones.all() or args.episodes == "stock"
            periodic = args.save_model and global_step // args.checkpoint_frequency != next_step // args.checkpoint_frequency
            save_now = boundary and (stopping or periodic or (args.save_model and iteration == num_iterations - 1))

            gt = np.stack([gt_rewards, infos["success"]], axis=1)
            for key, value in zip(pending, (obs, next_obs, actions, terminations, dones, gt, frames)):
                if value is not None:  # frames: only when rendered
                    pending[key].append(value)

            train_now = global_step >= args.learning_starts and iteration % args.train_frequency == 0
            # scored before a gradient step, once one --reward-batch-size chunk per reward device waits (every device
            # has work), and at the end; a stock-episode checkpoint holds none (their episodes restart on resume)
            num_pending = len(pending["obs"]) * args.num_envs
            full = num_pending >= args.reward_batch_size * max(1, len(args.reward_devices))
            if train_now or full or iteration == num_iterations - 1 or (save_now and args.episodes == "stock"):
                t0 = time.perf_counter()
                batch = {k: np.concatenate(v) for k, v in pending.items() if v}
                gt = batch["gt"]
                clip_rewards = reward_model(batch["frames"]) if args.reward == "clip" else np.zeros(len(gt))
                timing["reward_model"] += time.perf_counter() - t0
                rewards = clip_rewards if args.reward == "clip" else gt[:, 0]
                if not np.all(np.isfinite(rewards)):  # never let a NaN into the buffer: it would poison every Q-value
                    saved = save_nonfinite(run_name, networks())
                    raise NonFiniteError(
                        f"the {args.reward} reward is not finite for {np.sum(~np.isfinite(rewards))} of {len(rewards)} "
                        f"frames at step {global_step}; {saved}."
                    )
                rb.add(batch["obs"], batch["next_obs"], batch["actions"], rewards, batch["terminations"])
                # episode bookkeeping, in step order (rows are step-major: env i of step t is row t * num_envs + i)
                for k in range(len(rewards)):
                    i = k % args.num_envs
                    episode["return"][i] += rewards[k]
                    episode["gt_return"][i] += gt[k, 0]
                    episode["clip_return"][i] += clip_rewards[k]
                    episode["length"][i] += 1
                    episode["success"][i] = gt[k, 1]  # MountainCar: latched by the env, cleared at its reset
                    if not batch["dones"][k]:
                        continue
                    step = global_step - (len(pending["obs"]) - 1 - k // args.num_envs) * args.num_envs  # when it ended
                    ep = {key: value[i] for key, value in episode.items()}
                    # CartPole: share of the time limit's steps spent upright (a stock episode ends when the pole falls);
                    # MountainCar: 1 if the flag was reached
                    success = ep["gt_return"] / time_limit if args.env_id == "CartPole-v1" else ep["success"]
                    progress.episode(ep["gt_return"], ep["clip_return"])
                    if args.log_episodes:
                        print(f"global_step={step}, episodic_return={ep['return']:.2f}, gt_return={ep['gt_return']:.0f}")
                    writer.add_scalar("charts/episodic_return", ep["return"], step)
                    writer.add_scalar("charts/episodic_length", ep["length"], step)
                    writer.add_scalar("charts/gt_return", ep["gt_return"], step)
                    writer.add_scalar("charts/gt_success", success, step)
                    if args.reward == "clip":
                        writer.add_scalar("charts/clip_return", ep["clip_return"], step)
                        writer.add_scalar("charts/clip_reward_mean", ep["clip_return"] / ep["length"], step)
                    for value in episode.values():
                        value[i] = 0
                pending = {k: [] for k in pending}

            if global_step >= args.learning_starts:
                t0 = time.perf_counter()
                if train_now:
                    b_obs, b_actions, b_rewards, b_next_obs, b_terminations = rb.sample(args.batch_size)
                    with torch.no_grad():
                        target_max, _ = target_network(b_next_obs).max(dim=1)
                        # time limits are truncations: we bootstrap through them (the reference treated them as terminal)
                        td_target = b_rewards + args.gamma * target_max * (1 - b_terminations)
                    old_val = q_network(b_obs).gather(1, b_actions[:, None]).squeeze(1)
                    loss = F.mse_loss(td_target, old_val)
                    if not torch.isfinite(loss):  # checked before the update: the saved networks are the last finite ones
                        saved = save_nonfinite(run_name, networks())
                        raise NonFiniteError(
                            f"losses/td_loss is {loss.item()} at step {global_step}; {saved}; "
                            "lower --learning-rate or check the rewards."
                        )
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    if iteration % (100 * args.train_frequency) == 0:
                        sps = int((global_step - start_iteration * args.num_envs) / (time.time() - start_time))
                        writer.add_scalar("losses/td_loss", loss.item(), global_step)
                        writer.add_scalar("losses/q_values", old_val.mean().item(), global_step)
                        writer.add_scalar("charts/SPS", sps, global_step)
                        writer.add_scalar("charts/epsilon", epsilon, global_step)
                        for k, v in timing.items():
                            writer.add_scalar(f"time/{k}_s", v, global_step)
                if iteration % args.target_network_frequency == 0:
                    for target_param, q_param in zip(target_network.parameters(), q_network.parameters()):
                        target_param.data.copy_(args.tau * q_param.data + (1.0 - args.tau) * target_param.data)
                timing["learning"] += time.perf_counter() - t0

            if args.capture_video and (
                global_step // args.video_frequency != next_step // args.video_frequency or iteration == num_iterations - 1
            ):
                (result,) = evaluate(q_network, eval_envs, device, reward_model, 1, eval_seed)
                save_video(result["frames"], f"videos/{run_name}/step-{next_step}.mp4")
                writer.add_scalar("eval/gt_return", result["gt_return"], next_step)
                if reward_model is not None:
                    writer.add_scalar("eval/clip_return", result["clip_return"], next_step)
            if boundary:
                if save_now:
                    save_checkpoint(
                        f"runs/{run_name}/checkpoint.pt",
                        {
                            "run_name": run_name,
                            "iteration": iteration + 1,
                            "global_step": next_step,
                            "args": asdict(args),
                            **{name: module.state_dict() for name, module in learner.items()},
                            "rng": rng_state(envs),
                            "pending": pending,
                            "episode": episode,
                            "replay_buffer": rb.state_dict() if args.save_buffer else None,
                        },
                    )
                    print(
                        f"checkpoint saved at step {next_step}: runs/{run_name}/checkpoint.pt"
                        + ("" if args.save_buffer else " (without the replay buffer: pass --save-buffer for an exact resume)")
                    )
                if stopping:
                    print(
                        f"stopped; continue with: python {os.path.basename(__file__)} --resume runs/{run_name}/checkpoint.pt"
                    )
                    break
            if dones.any():  # reset finished envs: their reset observations start the next episodes, never a transition
                reset_obs, _ = envs.reset(options={"reset_mask": dones})
                next_obs = np.where(dones[:, None], reset_obs, next_obs)
            obs = next_obs
            progress.update(next_step)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        writer.close()  # flushes TensorBoard, also on an error or a second Ctrl-C
        envs.close()

    final_step = (iteration + 1) * args.num_envs
    progress.update(final_step, final=True)
    elapsed = time.time() - start_time
    steps = final_step - start_iteration * args.num_envs
    print(
        f"done: {steps} steps in {elapsed:.0f} s ({int(steps / max(elapsed, 1e-9))} SPS); time in "
        + ", ".join(f"{k} {v:.2f} s" for k, v in timing.items())
    )
    if args.save_model and not stop["requested"]:
        if args.episodes == "fixed" and not dones.all():  # ended mid-episode: the final networks, to evaluate, not resume
            save_checkpoint(f"runs/{run_name}/checkpoint.pt", networks())
        # the final Q-network's greedy episodes are the run's evaluation: eval/gt_return at its last step
        results = evaluate(q_network, make_eval_envs(), device, reward_model, args.eval_episodes, eval_seed)
        with SummaryWriter(f"runs/{run_name}") as eval_writer:
            for i, result in enumerate(results):
                print(f"eval episode {i}: clip_return={result['clip_return']:.2f} gt_return={result['gt_return']:.1f}")
                eval_writer.add_scalar("eval/gt_return", result["gt_return"], final_step)
        print(f"roll the policy out with: python {os.path.basename(__file__)} --evaluate runs/{run_name}/checkpoint.pt")


# ----------------------------------------------------------------------------------------------
# Infrastructure: input checks, weights download, checkpoints, progress line (used by the loop above)
# ----------------------------------------------------------------------------------------------
def check_writable(folder: str) -> None:
    """Outputs must be writable before hours of training produce them (the folder itself may not exist yet)."""
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        raise UserError(f"cannot write to {os.path.abspath(folder)}/ ({existing} is not a writable folder); run from another.")


def check_resources(args: Args, observation_space: gym.Space, action_space: gym.Space, frame_shape: tuple) -> None:
    """Refuse a run whose replay buffer, pending frames and sampled batch do not fit in the available memory."""
    action_bytes = 8 if isinstance(action_space, gym.spaces.Discrete) else 4 * int(np.prod(action_space.shape))
    transition = 2 * 4 * int(np.prod(observation_space.shape)) + action_bytes + 4 + 4  # obs, next_obs, action, reward, done
    frames = args.reward_batch_size * max(1, len(args.reward_devices)) + args.num_envs  # awaiting their reward
    needs = {  # --resume loads the saved buffer before copying it in: a run saving it must fit it twice
        "--buffer-size": args.buffer_size * transition * (2 if args.save_buffer and args.resume is None else 1),
        "--reward-batch-size": frames * int(np.prod(frame_shape)) if args.reward == "clip" else 0,
        "--batch-size": args.batch_size * (transition + 16 * 256 * 4),  # with the activations of ~16 layers of 256 floats
    }
    total, available, gib = sum(needs.values()), available_memory(), 2**30
    print(f"memory: {total / gib:.2f} GiB (" + ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in needs.items()) + ")", end="")
    print(f", {available / gib:.1f} GiB available" if available else "")
    if available and total > 0.9 * available:
        flag = max(needs, key=needs.get)
        raise UserError(
            f"{flag} {getattr(args, flag[2:].replace('-', '_'))} makes the run need {total / gib:.1f} GiB of memory, "
            f"but {available / gib:.1f} GiB is available; lower {flag}."
        )


def available_memory() -> int:
    """Bytes of memory available to a new allocation (Linux MemAvailable), 0 when unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 0


def read_checkpoint(path: str, flag: str = "--resume") -> dict:
    """A checkpoint of this script (resumable for --resume), or a one-sentence error."""
    try:  # our own file with RNG states and arrays: weights_only=False, so only load checkpoints you trust
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - a missing, truncated or foreign file
        raise UserError(f"{flag} {path} is not a readable checkpoint ({type(e).__name__}); pass a checkpoint.pt.") from None
    saved = checkpoint.get("args") if isinstance(checkpoint, dict) else None
    if not isinstance(saved, dict) or not set(saved) <= {f.name for f in fields(Args)}:
        raise UserError(f"{flag} {path} was written by another script; pass a checkpoint.pt of {os.path.basename(__file__)}.")
    if flag == "--resume" and not {"iteration", "rng"} <= set(checkpoint):
        raise UserError(f"--resume {path} holds no resumable training state; pass a checkpoint.pt saved during training.")
    return checkpoint


def resumed_args(args: Args, checkpoint: dict) -> Args:
    """The run's own flags; a flag given next to --resume that would change them is refused, never silently ignored."""
    saved, default = checkpoint["args"], vars(Args())
    changed = [k for k, v in vars(args).items() if k != "resume" and default[k] != v != saved.get(k, default[k])]
    if changed:
        flags = ", ".join("--" + k.replace("_", "-") for k in changed)
        raise UserError(f"--resume continues a run with its own flags; drop {flags} (or start a new run).")
    return Args(**{"episodes": "fixed", **saved, "resume": args.resume})  # checkpoints older than --episodes: fixed


def check_clip_args(args: Args) -> None:
    """Refuse an unknown CLIP architecture, pretrained tag, config file or weights file before anything is loaded."""
    import json

    import open_clip

    if args.clip_model.endswith(".json"):
        if not os.path.isfile(args.clip_model):
            raise UserError(f"--clip-model {args.clip_model}: no such model config file.")
        try:
            with open(args.clip_model, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
            raise UserError(f"--clip-model {args.clip_model} is not a readable JSON file ({type(e).__name__}).") from None
        required = {"embed_dim": int, "vision_cfg": dict, "text_cfg": dict}  # open_clip skips a config without them, silently
        if not isinstance(config, dict) or not all(isinstance(config.get(k), t) for k, t in required.items()):
            raise UserError(
                f"--clip-model {args.clip_model} is not an open_clip model config (it needs an integer embed_dim, "
                "vision_cfg and text_cfg, as in tests/vlmrm-tiny-test.json)."
            )
    elif args.clip_model not in open_clip.list_models():
        raise UserError(f"--clip-model {args.clip_model} is not an open_clip architecture (see open_clip.list_models()).")
    elif args.clip_checkpoint is None:
        tags = ["none", *open_clip.list_pretrained_tags_by_model(args.clip_model)]
        if args.clip_pretrained not in tags:
            raise UserError(
                f"--clip-pretrained {args.clip_pretrained} is not a pretrained tag of {args.clip_model}: {', '.join(tags)}."
            )
    if args.clip_checkpoint is not None and not os.path.isfile(args.clip_checkpoint):
        raise UserError(f"--clip-checkpoint {args.clip_checkpoint}: no such file.")


def same_prompts(goal: tuple[str, ...], baseline: tuple[str, ...]) -> bool:
    """Prompts that CLIP cannot tell apart: its tokenizer ignores case and extra spaces."""
    return {" ".join(p.lower().split()) for p in goal} == {" ".join(p.lower().split()) for p in baseline}


def resolve_negatives(goal: tuple[str, ...], negatives: Optional[tuple[str, ...]], flag: str) -> tuple[str, ...]:
    """The softmax family's negative prompts: --negatives, else the defaults of the default goal; one-sentence errors."""
    negatives = DEFAULT_NEGATIVES.get(tuple(goal), ()) if negatives is None else tuple(negatives)
    if not negatives or not all(n.strip() for n in negatives):
        raise UserError(f"{flag} needs at least one non-empty --negatives prompt (only the default --goal has defaults).")
    shared = sorted(set(negatives) & set(goal))
    if shared:
        raise UserError(f"--negatives and --goal share the prompt {shared[0]!r}; a negative is what the goal is not.")
    return negatives


def check_goal_direction(
    goal_embeddings: torch.Tensor, baseline_embeddings: torch.Tensor, alpha: float, flag: str = "--alpha"
) -> None:
    """d = g - b must not vanish when alpha > 0: different strings can have one embedding (e.g. past CLIP's 77 tokens)."""
    g = F.normalize(goal_embeddings.float(), dim=-1).mean(0)
    b = F.normalize(baseline_embeddings.float(), dim=-1).mean(0)
    if alpha > 0 and (g - b).norm() < 1e-4:  # real prompt pairs are > 0.1 apart; float32 round-off is ~1e-6
        raise UserError(f"--goal and --baseline have the same CLIP embedding, so d = g - b is 0; change one or use {flag} 0.")


def load_clip(args: Args, device: torch.device) -> tuple[nn.Module, object]:
    """The open_clip model and tokenizer of --clip-model/--clip-pretrained/--clip-checkpoint, or one sentence why not."""
    import huggingface_hub.constants as hub
    import open_clip

    name = Path(args.clip_model).stem  # an architecture, or a config file such as the tiny test model in tests/
    if args.clip_model.endswith(".json"):
        open_clip.add_model_config(args.clip_model)
    pretrained = args.clip_checkpoint or (None if args.clip_pretrained == "none" else args.clip_pretrained)
    cached = fetch_clip_weights(args)  # says what it fetches; a download that cannot happen fails here, in seconds
    offline, hub.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE or cached  # cached weights: no hub requests
    logging.disable(logging.ERROR)  # open_clip logs multi-line errors: we say it in one sentence
    try:
        model = open_clip.create_model(name, pretrained=pretrained, device=device, cache_dir=args.clip_cache_dir)
    except Exception as e:  # noqa: BLE001 - whatever open_clip raised, the fixes are these
        detail = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
        raise UserError(
            f"could not build {name} with {pretrained or 'random'} weights ({detail}); check --clip-model (a name or a config "
            "file), --clip-pretrained and --clip-checkpoint."
        ) from None
    finally:
        logging.disable(logging.NOTSET)
        hub.HF_HUB_OFFLINE = offline
    if pretrained is None:
        print(f"note: {name} has random weights (--clip-pretrained none): its rewards are meaningless outside tests")
    return model.eval(), open_clip.get_tokenizer(name)


def fetch_clip_weights(args: Args) -> bool:
    """Download the --clip-pretrained weights into the cache unless there, saying so first; True when cached."""
    import huggingface_hub.constants as hub
    import open_clip

    name, cache = Path(args.clip_model).stem, args.clip_cache_dir
    cfg = open_clip.get_pretrained_cfg(name, args.clip_pretrained)
    if args.clip_checkpoint is not None or not cfg:
        return False  # a weights file, random weights, or a tag that create_model refuses
    offline, hub.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE, True
    try:
        open_clip.download_pretrained(cfg, cache_dir=cache)  # offline: from the cache, or an error at once
        return True
    except Exception:  # noqa: BLE001 - not in the cache
        pass
    finally:
        hub.HF_HUB_OFFLINE = offline
    logging.disable(logging.WARNING)  # the model counted here has random weights, as open_clip would warn
    try:  # counted on the meta device: no memory, well under a second even for ViT-bigG-14
        with torch.device("meta"):
            params = sum(p.numel() for p in open_clip.create_model(name, device="meta").parameters())
        size = f" ({params / 1e6:,.0f}M parameters, about {params * 4 / 1e9:.1f} GB as float32)"
    except Exception:  # noqa: BLE001 - the size is a courtesy
        size = ""
    finally:
        logging.disable(logging.NOTSET)
    where = cache or "the Hugging Face cache"
    print(f"fetching the {name}/{args.clip_pretrained} CLIP weights{size} from {hub.ENDPOINT} into {where}", flush=True)
    why = "HF_HUB_OFFLINE is set and they are not in the cache" if offline else can_reach(hub.ENDPOINT)
    if why is None:
        try:
            open_clip.download_pretrained(cfg, cache_dir=cache)
            return True
        except Exception as e:  # noqa: BLE001 - every failure here has the same fixes
            why = (str(e).splitlines() or [type(e).__name__])[0][:160]
    raise UserError(
        f"could not download the {name}/{args.clip_pretrained} CLIP weights ({why}); check the network connection, "
        "point --clip-cache-dir at a folder that holds them, or pass a weights file with --clip-checkpoint."
    )


def can_reach(url: str, timeout: float = 5.0) -> Optional[str]:
    """None when the URL's host (or the HTTPS proxy in use) accepts a connection within seconds, else why not."""
    import socket
    import urllib.request
    from urllib.parse import urlparse

    proxy = urllib.request.getproxies().get("https")
    target = urlparse(proxy if proxy and not urllib.request.proxy_bypass(urlparse(url).hostname) else url)
    try:
        socket.create_connection((target.hostname, target.port or (443 if target.scheme == "https" else 80)), timeout).close()
    except OSError as e:  # a minute of open_clip's retries, said in 5 s
        return f"{target.hostname} cannot be reached: {e.strerror or type(e).__name__}"
    return None


def warn_if_slow_on_cpu(reward_model: CLIPReward, args: Args, frame_shape: tuple[int, int, int]) -> None:
    """A real-size CLIP on CPU takes seconds per frame: time it once and say what to do instead."""
    if reward_model.device.type != "cpu":
        return
    frames = np.zeros((8, *frame_shape), dtype=np.uint8)
    reward_model(frames[:1])  # warm-up: the first call pays one-off allocation costs
    start = time.perf_counter()
    reward_model(frames)
    seconds = (time.perf_counter() - start) / len(frames)
    advice = (
        "; use a GPU or --clip-model RN50 --clip-pretrained openai" if seconds > 0.05 and args.clip_model != "RN50" else ""
    )
    print(
        f"note: scoring a frame with {Path(args.clip_model).stem} on CPU takes {seconds * 1000:.0f} ms, so this run will "
        f"spend about {format_duration(seconds * args.total_timesteps)} in the reward model{advice}"
    )


def save_video(frames: list[np.ndarray], path: str, fps: int = 50) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    imageio.mimwrite(path, frames, fps=fps, macro_block_size=8)


def save_checkpoint(path: str, state: dict) -> None:
    """Atomic and durable: a crash, power cut or full disk mid-write never replaces a good checkpoint with half of one."""
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")  # own temp file per write
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the rename makes it the checkpoint
        os.replace(tmp, path)
    except BaseException as e:
        os.unlink(tmp)
        if isinstance(e, OSError):
            raise UserError(f"could not write {path} ({e.strerror or e}); the previous file there is intact.") from None
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    os.fsync(dir_fd)  # the rename itself survives a power cut
    os.close(dir_fd)


def make_run_folder(run_name: str) -> str:
    """Create runs/<run_name>/ exclusively: two runs started in the same second get different folders."""
    for name in [run_name, *(f"{run_name}-{i}" for i in range(1, 1000))]:
        try:
            os.makedirs(f"runs/{name}")
            return name
        except FileExistsError:
            pass
    raise UserError(f"runs/{run_name} and 999 variants of it exist already; remove old runs or change --exp-name.")


def rng_state(envs: gym.vector.VectorEnv) -> dict:
    """Every random number generator the run draws from, so a resumed run continues the same streams."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "envs": list(envs.get_attr("np_random")),
    }


def save_nonfinite(run_name: str, networks: dict) -> str:
    """Saves the networks of a run stopped on a NaN beside (never over) its checkpoint; says where both are."""
    path, checkpoint = f"runs/{run_name}/nonfinite_networks.pt", f"runs/{run_name}/checkpoint.pt"
    save_checkpoint(path, networks)
    kept = f" and the last resumable checkpoint {checkpoint} is kept" if os.path.exists(checkpoint) else ""
    return f"finite networks from before it were saved to {path}{kept}"


def install_stop_handlers() -> dict:
    """First Ctrl-C or SIGTERM: finish the current episodes, save a checkpoint, exit cleanly. Second: quit at once."""
    stop = {"requested": False}

    def handler(signum: int, frame) -> None:
        if stop["requested"]:
            raise KeyboardInterrupt
        stop["requested"] = True
        print(f"\n{signal.Signals(signum).name} received: checkpoint after the current episodes (again: quit now)", flush=True)

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
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """One progress line: redrawn in place on a terminal, else printed every `interval` seconds (logs stay small)."""

    def __init__(self, total_steps: int, start_step: int, clip: bool, recent: int, interval: float = 10.0):
        self.total, self.start_step, self.clip, self.tty = total_steps, start_step, clip, sys.stdout.isatty()
        self.interval, self.start = 0.5 if self.tty else interval, time.time()
        self.last, self.printed = self.start, None  # printed: the step of the last line in a log, not repeated at the end
        self.returns = deque(maxlen=recent)  # (gt_return, clip_return) of the last episodes

    def episode(self, gt_return: float, clip_return: float) -> None:
        self.returns.append((gt_return, clip_return))

    def update(self, step: int, final: bool = False) -> None:
        now = time.time()
        if (not final and now - self.last < self.interval) or (final and not self.tty and self.printed == step):
            return
        elapsed, self.last = now - self.start, now
        sps = (step - self.start_step) / max(elapsed, 1e-9)
        left = format_duration((self.total - step) / sps if sps > 0 else math.inf)
        line = f"step {step}/{self.total} ({100 * step / self.total:.0f}%) | {sps:.0f} steps/s"
        line += f" | elapsed {format_duration(elapsed)} | left {left}"
        if self.returns:
            gt_return, clip_return = np.mean(self.returns, axis=0)
            line += f" | last {len(self.returns)} episodes: gt_return {gt_return:.1f}"
            line += f", clip_return {clip_return:.2f}" if self.clip else ""
        if self.tty:  # back to the line start: the next update, or any other message, overwrites it
            print("\r\x1b[K" + line, end="\n" if final else "\r", flush=True)
        else:
            print(line, flush=True)
            self.printed = step


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message=".*No pretrained weights.*")
    try:
        main(tyro.cli(Args))
    except (UserError, NonFiniteError, OSError) as e:  # OSError: the machine, not the input (a full disk, a folder removed)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, UserError) else 1)
    except KeyboardInterrupt:
        print("interrupted without saving a checkpoint", file=sys.stderr)
        sys.exit(130)
