"""VLM-RM: DQN on CartPole-v1 / MountainCar-v0 with a CLIP model as the reward (no hand-written reward).

Every frame the environment renders is scored by a pretrained CLIP model against a goal sentence, optionally
regularised towards a baseline sentence with strength alpha (goal-baseline projection). One file, read top to
bottom: flags, CLIP reward, environments, Q-network and replay buffer, training loop. Based on CleanRL's
dqn.py.

    python vlmrm_dqn_classic.py --env-id CartPole-v1 --goal "pole vertically upright on top of the cart" \
        --baseline "pole and cart" --alpha 0.5
"""

import copy
import math
import os
import random
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Literal, Optional

os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame draws off-screen: no display needed
os.environ.setdefault("SDL_AUDIODRIVER", "dummy")

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

try:
    import vlmrm_utils as utils
except ModuleNotFoundError as e:  # the checkout that `pip install -e` pointed at moved or was deleted
    if e.name != "vlmrm_utils":
        raise
    print("error: vlmrm_utils is not importable: `pip install -e` the VLM-RM checkout.", file=sys.stderr)
    sys.exit(2)


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """if toggled, CUDA (when available) runs the Q-network and the reward model"""
    torch_threads: Optional[int] = None
    """torch CPU threads; default 1 on CPU (more fight the env workers); 0 = torch's own"""
    log_episodes: bool = False
    """if toggled, print a line per finished episode, not only the progress line"""
    capture_video: bool = False
    """if toggled, save an MP4 of a greedy episode every --video-frequency steps"""
    video_frequency: int = 25_000
    """environment steps between two evaluation videos"""
    track: bool = False
    """if toggled, this experiment is tracked with Weights and Biases (synced from TensorBoard)"""
    wandb_project_name: str = "vlmrm"
    """the W&B project name"""
    wandb_entity: Optional[str] = None
    """the entity (team) of W&B's project"""
    save_model: bool = False
    """if toggled, checkpoint.pt (for --resume) and checkpoints/step-<N>.pt (all kept), see below"""
    checkpoint_frequency: int = 100_000
    """env steps between two checkpoints (fixed-length episodes: at the next episode end)"""
    save_buffer: bool = False
    """if toggled, checkpoints include the replay buffer, so --resume continues exactly"""
    resume: Optional[str] = None
    """a checkpoint.pt to continue until its --total-timesteps (stock episodes restart)"""
    evaluate: Optional[str] = None
    """a checkpoint.pt: roll out its greedy policy (video + frames) instead of training"""
    eval_episodes: int = 10
    """number of episodes of an evaluation"""

    # Environment
    env_id: Literal["CartPole-v1", "MountainCar-v0"] = "CartPole-v1"
    """the environment"""
    episodes: Literal["auto", "fixed", "stock"] = "auto"
    """auto: fixed with --reward clip, else stock (Gymnasium's task)"""
    episode_length: int = 200
    """fixed episode length (`--episodes fixed` only)"""
    realistic: bool = False
    """MountainCar only: draw a landscape (sky, hills, flag, car) instead of Gymnasium's line art"""

    # Reward
    reward: Literal["clip", "gt"] = "clip"
    """learn from the CLIP reward, or the ground truth (upright; at the flag)"""
    goal: Optional[tuple[str, ...]] = None
    """goal prompt(s); default: the paper's for --env-id (DEFAULT_PROMPTS)"""
    baseline: Optional[tuple[str, ...]] = None
    """baseline prompt(s) of the goal-baseline projection; default: the paper's"""
    alpha: Optional[float] = None
    """goal-baseline strength in [0, 1] (0: cosine similarity); default 0, MountainCar 0.5"""
    clip_model: str = "ViT-bigG-14"
    """open_clip architecture name, or the path of an open_clip model config (.json)"""
    clip_pretrained: str = "laion2b_s39b_b160k"
    """open_clip pretrained tag ("none" = random weights, for tests only)"""
    clip_checkpoint: Optional[str] = None
    """local weights file for `--clip-model` (overrides `--clip-pretrained`)"""
    clip_cache_dir: Optional[str] = None
    """where downloaded CLIP weights are cached (default: the Hugging Face cache)"""
    reward_batch_size: int = 64
    """frames scored per CLIP forward pass"""
    clip_dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    """CUDA: the image tower, cast once; CPU: float32"""
    reward_devices: tuple[str, ...] = ()
    """e.g. `cuda:0 cuda:1`: one CLIP replica each, in parallel; default: --cuda's device"""
    reward_family: Literal["projection", "softmax"] = "projection"
    """softmax: 1 if the goal beats --negatives, else 0"""
    negatives: Optional[tuple[str, ...]] = None
    """softmax: prompts the goal is contrasted with (defaults for the default goal)"""
    temperature: float = 0.01
    """softmax: temperature of the softmax over cosine similarities (0.01 = CLIP's logit scale)"""
    threshold: float = 0.5
    """softmax family: the reward is 1 when the goal's probability is above this, else 0; in (0, 1)"""
    soft: bool = False
    """softmax family: if toggled, the reward is the goal's probability itself instead of 0/1"""
    antialias: bool = False
    """if toggled, antialias the bicubic squash of frames to CLIP's input (off in the paper's code)"""

    # DQN (CleanRL's dqn.py defaults, except where the comment says otherwise)
    total_timesteps: int = 500000
    """total environment steps (summed over envs), rounded up to a multiple of --num-envs"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 1
    """the number of parallel environments"""
    buffer_size: int = 10000
    """the replay memory buffer size"""
    gamma: float = 0.99
    """the discount factor gamma"""
    tau: float = 1.0
    """the target network update rate"""
    target_network_frequency: int = 500
    """the timesteps it takes to update the target network"""
    batch_size: int = 128
    """the batch size of sample from the replay memory"""
    start_e: float = 1.0
    """the starting epsilon for exploration"""
    end_e: float = 0.05
    """the ending epsilon for exploration"""
    exploration_fraction: float = 0.5
    """the fraction of `total_timesteps` it takes from start_e to end_e"""
    learning_starts: int = 10000
    """timestep to start learning (below --total-timesteps)"""
    train_frequency: int = 10
    """the frequency of training"""


def check_args(args: Args) -> None:
    """The defaults of --env-id, then bad flags refused, in one sentence each, before anything costly."""
    goal, baseline = DEFAULT_PROMPTS[args.env_id]
    args.goal = (goal,) if args.goal is None else args.goal
    args.baseline = (baseline,) if args.baseline is None else args.baseline
    if args.alpha is None:  # the authors: MountainCar cannot be solved without goal-baseline regularisation
        args.alpha = 0.5 if args.env_id == "MountainCar-v0" else 0.0
    if args.episodes == "auto":  # resolved once: a checkpoint keeps the resolved value
        args.episodes = "fixed" if args.reward == "clip" else "stock"
    positive = """total_timesteps num_envs buffer_size batch_size train_frequency target_network_frequency
    episode_length eval_episodes reward_batch_size video_frequency checkpoint_frequency learning_rate"""
    utils.check_common_args(args, positive, "alpha gamma tau start_e end_e exploration_fraction", "q_network")
    if softmax_problem(args.temperature, args.threshold) is not None:
        raise utils.UserError(softmax_problem(args.temperature, args.threshold) + ".")
    if args.reward_family == "softmax":
        flag = "--reward-family softmax"
        args.negatives = utils.resolve_negatives(args.goal, args.negatives, flag, DEFAULT_NEGATIVES)
    if args.reward == "clip":  # the flags first, then whether the run fits
        utils.check_clip_args(args)
    if args.evaluate is None:  # a rollout allocates no replay buffer
        probe = gym.make(args.env_id)  # cheap: no rendering, just the spaces
        # measured: a rendering pygame env, its surfaces (100 to 400 envs)
        env_bytes = 2.5e6 if args.reward == "clip" else 0
        # floats per sampled transition: an upper bound for the Q-network, forward and backward
        activations = 16 * 256
        spaces = (probe.observation_space, probe.action_space)
        utils.check_resources(args, *spaces, (400, 600, 3), env_bytes, activations)


# ----------------------------------------------------------------------------------------------
# CLIP reward
# ----------------------------------------------------------------------------------------------
DEFAULT_PROMPTS = {  # (goal, baseline) of each env: the paper's
    "CartPole-v1": ("pole vertically upright on top of the cart", "pole and cart"),
    "MountainCar-v0": ("a car at the peak of the mountain, next to the yellow flag", "a car in the mountain"),
    "Humanoid-v5": ("a humanoid robot kneeling", "a humanoid robot"),
}
DEFAULT_PROMPTS["MountainCarContinuous-v0"] = DEFAULT_PROMPTS["MountainCar-v0"]  # the same scene
# softmax family: our own negatives for the default goals (not the paper's), states the goal is not
DEFAULT_NEGATIVES = {
    ("pole vertically upright on top of the cart",): (
        "pole tilted to the side of the cart",
        "pole lying flat next to the cart",
    ),
    ("a car at the peak of the mountain, next to the yellow flag",): (
        "a car at the bottom of the valley",
        "a car on the slope, far from the yellow flag",
    ),  # fmt: skip
    ("a humanoid robot kneeling",): ("a humanoid robot standing", "a humanoid robot lying on the ground"),
}


def vlm_reward(image_embeddings, goal_embeddings, baseline_embeddings, alpha: float) -> torch.Tensor:
    """R(s) = 1 - 0.5 ||(s - g) P||^2, P = alpha d d^T / ||d||^2 + (1 - alpha) I, d = g - b: (N,) float32."""
    s = F.normalize(image_embeddings.float(), dim=-1)
    g = F.normalize(goal_embeddings.float(), dim=-1).mean(0)  # the means are deliberately not re-normalised
    b = F.normalize(baseline_embeddings.float(), dim=-1).mean(0)
    u = s - g
    if alpha != 0:
        # g = b: no direction (e.g. prompts cut at 77 tokens); real pairs are > 0.1 apart, round-off ~1e-6
        if (g - b).norm() < 1e-4:
            raise ValueError("goal and baseline have one embedding: d = g - b = 0, no direction for alpha")
        d = (g - b) / (g - b).norm()
        u = alpha * (u @ d)[:, None] * d + (1 - alpha) * u  # u P, without the D x D matrix
    return 1 - 0.5 * u.pow(2).sum(-1)


def softmax_problem(temperature: float, threshold: float) -> Optional[str]:
    """What is wrong with the softmax family's parameters, or None: one check, of flags and calls alike."""
    if not 0 < temperature < math.inf:
        return f"--temperature must be a positive number, got {temperature}"
    if not 0 < threshold < 1:
        return f"--threshold must be in (0, 1), got {threshold}"
    return None


def softmax_reward(image_embeddings, goal_embeddings, negative_embeddings, temperature, threshold,
                   soft=False):  # fmt: skip
    """R(s) = 1 if p > threshold else 0 (p if soft), p = the goal's softmax(cos(s, e_k) / temperature)."""
    problem = softmax_problem(temperature, threshold)
    problem = problem or ("no negative prompts" if len(negative_embeddings) == 0 else None)
    if problem is not None:
        raise ValueError(problem)
    s = F.normalize(image_embeddings.float(), dim=-1)
    # the goal prompts form one class
    g = F.normalize(F.normalize(goal_embeddings.float(), dim=-1).mean(0), dim=-1)
    # (1 + K, D), the goal first
    prompts = torch.cat([g[None], F.normalize(negative_embeddings.float(), dim=-1)])
    p = (s @ prompts.T / temperature).softmax(dim=-1)[:, 0]
    return p if soft else (p > threshold).float()


class CLIPReward(nn.Module):
    """Scores uint8 frames (N, H, W, 3) with `vlm_reward` (family "projection") or `softmax_reward`.

    Frames are preprocessed as the paper's code did (a tensor torchvision Resize of torch 2.0): squashed to
    the model's square input, bicubic, no antialiasing, no clamp; `antialias=True` smooths a large downscale
    (closer to PIL).
    """

    def __init__(self, model: nn.Module, tokenizer, goal: tuple, baseline: tuple, alpha: float,
                 batch_size: int, device, family="projection", negatives=(), temperature=0.01, threshold=0.5,
                 soft=False, antialias=False, replicas=(), dtype=torch.float32):  # fmt: skip
        super().__init__()
        import open_clip

        if family not in ("projection", "softmax") or (family == "softmax" and not negatives):
            raise ValueError(f"unknown reward family {family!r}, or softmax without negative prompts")
        self.model, self.device, self.batch_size, self.family = model, device, batch_size, family
        self.alpha, self.temperature, self.threshold, self.soft = alpha, temperature, threshold, soft
        self.antialias = antialias
        # (model, device) per reward device; the first embeds the prompts
        self.replicas = [(model, device), *replicas]
        # the model's own mean/std (the paper: OpenAI's for all, wrong only for ViT-L-14 laion2b, (0.5, 0.5))
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
        # the image tower's, cast once: prompts are embedded above and rewards computed in float32
        self.dtype = dtype
        for replica, _ in self.replicas:
            replica.visual.to(dtype)

    @torch.no_grad()
    def preprocess(self, frames: torch.Tensor, device: Optional[torch.device] = None) -> torch.Tensor:
        """uint8 (N, H, W, 3) -> the model's normalised input (N, 3, S, S); moved as uint8: 4x less data."""
        device = device or self.device
        x = frames.to(device, non_blocking=True)
        # CPU: numpy's cast is ~3x faster (torch's .float() page-faults a new batch in); same values, strides
        x = torch.from_numpy(x.numpy().astype(np.float32)) if x.device.type == "cpu" else x.float()
        x = x.permute(0, 3, 1, 2).div_(255)
        # bicubic overshoots [0, 1] a little near edges: the reference kept it (no clamp), and so do we
        size, antialias = self.image_size, self.antialias
        x = F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=antialias)
        return (x - self.mean.to(device)) / self.std.to(device)

    @torch.no_grad()
    def embed_images(self, frames: torch.Tensor, replica: int = 0) -> torch.Tensor:
        """uint8 (N, H, W, 3) -> raw image embeddings (N, D), on the device of `replicas[replica]`."""
        model, device = self.replicas[replica]
        return model.encode_image(self.preprocess(frames, device).to(self.dtype))

    def rewards(self, image_embeddings: torch.Tensor) -> torch.Tensor:
        """The chosen family's rewards (N,) of raw image embeddings (N, D)."""
        if self.family == "softmax":
            settings = (self.temperature, self.threshold, self.soft)
            return softmax_reward(image_embeddings, self.goal_embeddings, self.negative_embeddings, *settings)
        return vlm_reward(image_embeddings, self.goal_embeddings, self.baseline_embeddings, self.alpha)

    @torch.no_grad()
    def forward(self, frames) -> np.ndarray:  # uint8 (N, H, W, 3), numpy or torch (on the device: not copied)
        frames = frames if torch.is_tensor(frames) else torch.from_numpy(np.ascontiguousarray(frames))
        chunks = frames.split(self.batch_size)
        k = len(self.replicas)

        # replica i scores chunks i, i + k, ...: the batches one device would score
        def score(i: int) -> list[torch.Tensor]:
            return [self.rewards(self.embed_images(chunk, i).to(self.device)) for chunk in chunks[i::k]]

        if k == 1:
            return torch.cat(score(0)).cpu().numpy()
        # one thread per replica, in parallel: torch releases the GIL in its kernels
        with ThreadPoolExecutor(k) as pool:
            scored = list(pool.map(score, range(k)))
        return torch.cat([scored[j % k][j // k] for j in range(len(chunks))]).cpu().numpy()


def make_reward_model(args: Args, device: torch.device) -> CLIPReward:
    """The CLIP reward of the flags, on --reward-devices (one replica each) or else on `device`."""
    devices = [torch.device(name) for name in args.reward_devices] or [device]
    model, tokenizer = utils.load_clip(args, devices[0])
    utils.warn_long_prompts(tokenizer, args)
    # copies: the same weights (even random test ones)
    replicas = [(copy.deepcopy(model).to(d), d) for d in devices[1:]]
    scored = (args.goal, args.baseline, args.alpha, args.reward_batch_size, devices[0])
    family = (args.reward_family, args.negatives or (), args.temperature, args.threshold, args.soft)
    # CPUs gain nothing from half
    dtype = getattr(torch, args.clip_dtype) if devices[0].type == "cuda" else torch.float32
    reward_model = CLIPReward(model, tokenizer, *scored, *family, args.antialias, replicas, dtype)
    try:  # vlm_reward's rule, said in terms of the flags: different prompts can share one CLIP embedding
        reward_model.rewards(reward_model.goal_embeddings)
    except ValueError as e:
        raise utils.UserError(f"--goal and --baseline: {e}; change one or use --alpha 0.") from None
    return reward_model


# ----------------------------------------------------------------------------------------------
# Environments: fixed-length episodes; the env's own reward is the ground truth (logged, not learned from)
# ----------------------------------------------------------------------------------------------
class GymnasiumPixels(gym.Wrapper):
    """Gymnasium's own drawing of CartPole and MountainCar, its pixels read out as row-major RGB bytes: the
    frame its render returns, 2.4x faster than with its surfarray copy (benchmarks/bench_cpu_frames.py)."""

    def render(self) -> np.ndarray:
        import pygame

        env = self.env.unwrapped
        env.render_mode = "screen"  # unknown to gymnasium: it draws onto env.screen and returns nothing
        env.render()
        env.render_mode = "rgb_array"
        pixels = np.frombuffer(pygame.image.tobytes(env.screen, "RGB"), np.uint8)
        return pixels.reshape(env.screen_height, env.screen_width, 3).copy()  # writable


class FixedLengthCartPole(gym.Wrapper):
    """CartPole that never terminates: the pole angle wraps to [-pi, pi), the cart stops at the track ends.
    Reward = 1 while upright (|theta| < 12 deg and |x| < 2.4), else 0."""

    def step(self, action):
        _, _, _, truncated, info = self.env.step(action)
        cartpole = self.env.unwrapped
        x, x_dot, theta, theta_dot = cartpole.state
        theta = (theta + math.pi) % (2 * math.pi) - math.pi
        # the track ends are walls: stop there instead of leaving the screen
        if abs(x) > cartpole.x_threshold:
            x = math.copysign(cartpole.x_threshold, x)
            x_dot = 0.0
        cartpole.state = np.array([x, x_dot, theta, theta_dot])
        cartpole.steps_beyond_terminated = None  # we keep stepping on purpose: silence gym's warning
        upright = abs(theta) < cartpole.theta_threshold_radians and abs(x) < cartpole.x_threshold
        info["success"] = bool(upright)
        return cartpole.state.astype(np.float32), float(info["success"]), False, truncated, info


# the paper's flag (Gymnasium's MountainCar-v0 has 0.5): reward, success and drawing use it
MOUNTAINCAR_GOAL = 0.45


class FixedLengthMountainCar(gym.Wrapper):
    """MountainCar that never terminates: reward 1 while at the flag, else 0; `info["success"]`: reached this
    episode. After success x is clipped to the flag (the paper's env): CLIP never scores the car past it."""

    def reset(self, **kwargs):
        self.reached_goal = False
        return self.env.reset(**kwargs)

    def step(self, action):
        obs, _, _, truncated, info = self.env.step(action)
        # as the paper's env: a car that reached the flag stays there, never past it
        if obs[0] > MOUNTAINCAR_GOAL:
            # MountainCar-v0 keeps its state as a tuple, the continuous one as an array
            car = self.env.unwrapped
            car.state = np.array([MOUNTAINCAR_GOAL, car.state[1]], np.asarray(car.state).dtype)
            obs[0] = MOUNTAINCAR_GOAL
        at_goal = bool(obs[0] >= MOUNTAINCAR_GOAL)
        self.reached_goal = info["success"] = self.reached_goal or at_goal
        return obs, float(at_goal), False, truncated, info

    # Gymnasium draws its flag at goal_position: ours, for the drawing only (its own stays as it is)
    def render(self):
        car = self.env.unwrapped
        stock = car.goal_position
        car.goal_position = MOUNTAINCAR_GOAL
        frame = self.env.render()
        car.goal_position = stock
        return frame


class RealisticMountainCar(gym.Wrapper):
    """MountainCar as a landscape (sky, far ridge, grassy hill, road, yellow flag, red car on the slope): CLIP
    scores photo-like scenes far better than line art. Gymnasium's world-to-pixel mapping."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        import pygame

        self.min_x = env.unwrapped.min_position
        self.scale = 600 / (env.unwrapped.max_position - self.min_x)
        rows, cols = np.mgrid[:400, :600]
        depth = rows - self.pixel(self.min_x + cols / self.scale)[1]  # pixels below the road's centre line
        # fixed: every frame of every run looks the same
        noise = np.random.default_rng(0).normal(0, 12, (400, 600, 1))
        ridge = 170 + 35 * np.sin(cols / 57) + 20 * np.sin(cols / 23 + 1.3) + 8 * np.sin(cols / 7)
        # first match wins: road, earth, grass, far ridge, else a sky from deep blue to pale
        pixels = np.select(
            [c[..., None] for c in (abs(depth) <= 4, depth > 28, depth > 0, rows > ridge)],
            [[95, 95, 100], [110, 85, 55] + noise, [70, 140, 55] + noise, [120, 140, 165]],
            [70, 130, 210] + rows[..., None] / 399 * np.array([130, 95, 35]),
        )
        pixels = np.clip(pixels, 0, 255).astype(np.uint8).transpose(1, 0, 2)  # pygame's surfaces are (x, y)
        self.background = pygame.surfarray.make_surface(pixels)
        x, y = (int(v) for v in self.pixel(MOUNTAINCAR_GOAL))
        pygame.draw.line(self.background, (60, 60, 60), (x, y - 4), (x, y - 64), 3)
        flag = [(x + 2, y - 64), (x + 32, y - 54), (x + 2, y - 44)]
        pygame.draw.polygon(self.background, (250, 210, 20), flag)
        self.car = pygame.Surface((56, 34), pygame.SRCALPHA)  # red body, cabin, two windows, two wheels
        for color, rect in [((200, 30, 35), (0, 12, 56, 14)), ((175, 25, 30), (12, 2, 30, 14))]:
            pygame.draw.rect(self.car, color, rect, border_radius=5)
        for x in (16, 29):
            pygame.draw.rect(self.car, (170, 210, 235), (x, 5, 10, 8))
        for x in (12, 44):
            pygame.draw.circle(self.car, (25, 25, 25), (x, 27), 7)
            pygame.draw.circle(self.car, (160, 160, 160), (x, 27), 3)
        self.canvas = pygame.Surface((600, 400))

    # world x -> (column, row) of the road's surface, as Gymnasium draws the track 0.45 sin(3x) + 0.55
    def pixel(self, x):
        return (x - self.min_x) * self.scale, 400 - (0.45 * np.sin(3 * x) + 0.55) * self.scale

    def render(self) -> np.ndarray:
        import pygame

        x = float(self.env.unwrapped.state[0])
        slope = math.atan(1.35 * math.cos(3 * x))  # the road's angle (both axes share one scale)
        car = pygame.transform.rotozoom(self.car, math.degrees(slope), 1.0)
        column, row = self.pixel(x)  # the car's centre stands 10 px above the road, along its normal
        self.canvas.blit(self.background, (0, 0))
        centre = (column - 10 * math.sin(slope), row - 10 * math.cos(slope))
        self.canvas.blit(car, car.get_rect(center=centre))
        # row-major RGB bytes, 3x faster than surfarray.array3d(...).transpose(1, 0, 2) (copied: writable)
        return np.frombuffer(pygame.image.tobytes(self.canvas, "RGB"), np.uint8).reshape(400, 600, 3).copy()


class StockEpisodes(gym.Wrapper):
    """Gymnasium's own task (reward, termination, time limit) plus the ground truth `info["success"]` of the
    fixed-length envs: CartPole: this step is upright; MountainCar: the flag was reached during the
    episode."""

    def reset(self, **kwargs):
        self.reached_goal = False
        return self.env.reset(**kwargs)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        env = self.env.unwrapped
        if env.spec.id == "CartPole-v1":
            upright = abs(obs[2]) < env.theta_threshold_radians and abs(obs[0]) < env.x_threshold
            info["success"] = bool(upright)
        else:
            self.reached_goal = info["success"] = self.reached_goal or bool(obs[0] >= MOUNTAINCAR_GOAL)
        return obs, reward, terminated, truncated, info


class FrameAfterStep(gym.Wrapper):
    """Which frame scores which transition: the one rendered after its step (s_t+1), returned with the
    observation through the vector env's shared memory. A reset's frame is blank: no reset frame ever scores a
    transition. utils.frame_problem: a bad frame."""

    def __init__(self, env: gym.Env, frame_shape: tuple):
        super().__init__(env)
        self.observation_space = gym.spaces.Tuple((env.observation_space, utils.FrameSpace(frame_shape)))
        self.blank = np.zeros(frame_shape, np.uint8)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return (obs, self.blank), info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        start = time.perf_counter()
        frame = self.env.render()
        info["render_s"] = time.perf_counter() - start  # of the round trip the loop times, the rendering
        problem = utils.frame_problem(self.env, frame, self.blank.shape)
        if problem:  # said by the trainer (utils.FramesInInfo): raised here, gymnasium adds its traceback
            info["bad_frame"], frame = problem, self.blank
        return (obs, frame), reward, terminated, truncated, info


def env_settings(args: Args) -> dict:
    """make_env's keywords from a run's flags: the env it trained in, to roll out and to score alike."""
    fixed_length = args.episodes == "fixed"
    return dict(episode_length=args.episode_length, realistic=args.realistic, fixed_length=fixed_length)


def make_env(env_id: str, seed: int, idx: int, episode_length: int, realistic: bool, fixed_length=True,
             frame_shape=None):  # fmt: skip
    """CleanRL's thunk: fixed-length episodes (or the stock task's), rgb_array frames for the CLIP reward;
    `frame_shape`: the training envs, whose step returns the frame after it (FrameAfterStep)."""

    def thunk():
        # no early termination: the time limit is the only end, so survival alone earns nothing
        if fixed_length:
            env = GymnasiumPixels(gym.make(env_id, render_mode="rgb_array", max_episode_steps=episode_length))
            env = FixedLengthCartPole(env) if env_id == "CartPole-v1" else FixedLengthMountainCar(env)
        else:
            env = StockEpisodes(GymnasiumPixels(gym.make(env_id, render_mode="rgb_array")))
        env = RealisticMountainCar(env) if realistic and env_id == "MountainCar-v0" else env
        env.action_space.seed(seed + idx)
        return env if frame_shape is None else FrameAfterStep(env, frame_shape)

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
    """Transitions in host memory (a ring), sampled batches sent to the device; state_dict: exact resumes."""

    def __init__(self, size: int, obs_shape: tuple, action_shape: tuple, action_dtype: type, device):
        self.size = size
        self.device = device
        self.pos = 0
        self.full = False
        self.data = {
            "obs": np.zeros((size, *obs_shape), np.float32),
            "next_obs": np.zeros((size, *obs_shape), np.float32),
            "actions": np.zeros((size, *action_shape), action_dtype),
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
        filled = {k: torch.from_numpy(v[: len(self)]) for k, v in self.data.items()}
        return {"pos": self.pos, "full": self.full, **filled}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]
        self.full = state["full"]
        for k, v in self.data.items():
            v[: len(state[k])] = state[k]

    def sample(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        idx = np.random.randint(0, len(self), size=batch_size)
        keys = ("obs", "actions", "rewards", "next_obs", "terminations")
        return tuple(torch.from_numpy(self.data[k][idx]).to(self.device) for k in keys)


def greedy(q_network: QNetwork, device: torch.device):
    """The policy an evaluation rolls out (utils.evaluate): the greedy action."""
    return lambda obs: q_network(torch.as_tensor(obs, device=device)).argmax(dim=1).cpu().numpy()


def score(frames, reward_model: CLIPReward, timer) -> np.ndarray:
    """The CLIP rewards of a chunk's frames, in the scoring thread."""
    with timer("reward_model"):
        return reward_model(frames)


def evaluate_checkpoint(run: utils.Run, eval_envs: gym.vector.VectorEnv, seed: int) -> None:
    """--evaluate: the checkpoint's greedy policy, its episodes saved under videos/<run_name>/."""
    args, device = run.args, run.device
    reward_model = make_reward_model(args, device) if args.reward == "clip" else None
    q_network = QNetwork(eval_envs).to(device)
    q_network.load_state_dict(run.checkpoint["q_network"])
    episodes = utils.evaluate(greedy(q_network, device), eval_envs, reward_model, args.eval_episodes, seed)
    utils.save_episodes(episodes, run.name)


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
# what --evaluate takes from the checkpoint unless given: the env, the frames CLIP saw and the reward model
EVALUATE_AS_TRAINED = """env_id episodes episode_length realistic
reward goal baseline alpha clip_model clip_pretrained clip_checkpoint clip_cache_dir
reward_family negatives temperature threshold soft antialias"""


def main(args: Args) -> None:
    args, checkpoint = utils.run_flags(args, EVALUATE_AS_TRAINED)  # a resumed or evaluated run's own flags
    check_args(args)
    run = utils.Run(args, checkpoint)  # seeds, the device, CLIP's weights fetched before anything starts
    args, device = run.args, run.device
    env = partial(make_env, args.env_id, **env_settings(args))  # env(seed, idx): the env the flags describe
    eval_seed = args.seed + 10_000
    eval_envs = gym.vector.SyncVectorEnv([env(eval_seed, 0)])
    if run.checkpoint:  # its tensors fit networks built as below (on the CPU): one sentence before anything
        with torch.random.fork_rng(devices=[]):  # the run's random streams untouched (a random CLIP's too)
            q = QNetwork(eval_envs)
            optimizer = optim.Adam(q.parameters())
            fresh = dict(q_network=q, target_network=q, optimizer=optimizer, schedule_steps=0)
            run.check_fits(eval_envs, fresh)
    if args.evaluate is not None:  # roll the checkpoint's policy out
        return evaluate_checkpoint(run, eval_envs, eval_seed)

    # each env renders the frame after its step and returns it with the step (with the ground truth: nothing)
    clip = args.reward == "clip"
    frame_shape = (400, 600, 3)  # pygame's 600x400
    vector_env = gym.vector.SyncVectorEnv  # pygame draws in a few ms: env processes would cost more
    env_fns = [env(args.seed, i, frame_shape=frame_shape if clip else None) for i in range(args.num_envs)]
    # autoreset off: the loop resets finished envs, so no reset observation or frame forms a transition
    envs = utils.make_vector_env(vector_env, env_fns, gym.vector.AutoresetMode.DISABLED, frames=clip)
    scorer = ThreadPoolExecutor(1)  # CLIP scores a chunk of frames here while the envs step on
    with run.closing(envs, scorer):
        reward_model = make_reward_model(args, device) if clip else None  # CUDA: after the envs fork
        obs_shape = envs.single_observation_space.shape
        q_network = QNetwork(envs).to(device)
        optimizer = optim.Adam(q_network.parameters(), lr=args.learning_rate, fused=True)
        target_network = QNetwork(envs).to(device)
        target_network.load_state_dict(q_network.state_dict())
        rb = ReplayBuffer(args.buffer_size, obs_shape, (), np.int64, device)
        # everything a gradient step changes, by name: checkpointed and restored together
        learner = dict(q_network=q_network, target_network=target_network, optimizer=optimizer)
        networks = lambda: {k: learner[k].state_dict() for k in ("q_network",)}  # noqa: E731
        policy = greedy(q_network, device)  # its evaluation episodes: videos and the final report
        evaluation = partial(utils.evaluate, policy, eval_envs, reward_model, seed=eval_seed)
        # epsilon's schedule keeps the length of the run as first started, when --resume extends it
        schedule_steps = run.checkpoint["schedule_steps"] if run.checkpoint else args.total_timesteps
        # charts/gt_success: CartPole, the share of the time limit spent upright; MountainCar, the flag
        fixed = args.episodes == "fixed"
        time_limit = args.episode_length if fixed else gym.spec(args.env_id).max_episode_steps
        upright = lambda episode: episode["gt_return"] / time_limit  # noqa: E731
        gt_success = upright if args.env_id == "CartPole-v1" else (lambda episode: episode["success"])
        run.start(networks(), rb, reward_model, frame_shape, gt_success)
        chunk = args.reward_batch_size * max(1, len(args.reward_devices))  # frames CLIP scores at once
        waiting, scoring = [], deque()  # transitions without a reward; chunks being scored, oldest first
        recent = deque(maxlen=100)  # the paper ranks checkpoints by the mean CLIP return of the last 100
        components = []  # the env's own reward terms (e.g. reward_forward), logged as diagnostics

        obs, _ = envs.reset(seed=args.seed)
        if run.checkpoint:  # a resumed run as saved; its envs start new episodes from their saved generators
            obs = run.restore(learner, envs, rb, recent)
        for iteration in run.iterations():
            global_step = iteration * args.num_envs
            duration = args.exploration_fraction * schedule_steps
            epsilon = linear_schedule(args.start_e, args.end_e, duration, global_step)
            if random.random() < epsilon:  # random actions, from the seeded, checkpointed RNG
                actions = np.random.randint(envs.single_action_space.n, size=args.num_envs)
            else:
                with torch.no_grad():
                    actions = q_network(torch.from_numpy(obs).to(device)).argmax(dim=1)
                actions = actions.cpu().numpy()
            with run.timer("env"):
                next_obs, gt_rewards, terminations, truncations, infos = envs.step(actions)
            dones = terminations | truncations
            due = run.checkpoint_due(dones)
            components = components or sorted(k for k in infos if k.startswith("reward_"))
            reached = infos.get("success", np.zeros(args.num_envs))  # the env's success (the flag, upright)
            gt = np.stack([gt_rewards, reached] + [infos[k] for k in components], axis=1)
            train_now = global_step >= args.learning_starts and iteration % args.train_frequency == 0
            # the reward path: frames go to CLIP a chunk at a time, in the background; their rewards reach the
            # buffer oldest first, all of them before a gradient step, a checkpoint or the end
            transition = dict(obs=obs, next_obs=next_obs, actions=actions, terminations=terminations)
            transition.update(dones=dones, gt=gt)
            waiting.append({**transition, "frames": infos["frames"]} if clip else transition)
            wait = train_now or due or iteration == run.last_iteration
            if wait or len(waiting) * args.num_envs >= chunk:
                batch = {k: np.concatenate([t[k] for t in waiting]) for k in waiting[0]}
                future = scorer.submit(score, batch.pop("frames"), reward_model, run.timer) if clip else None
                scoring.append((batch, global_step, future))
                waiting = []
            with run.timer("reward_wait"):  # at most two chunks with CLIP: a slower CLIP holds the loop back
                while scoring and (wait or len(scoring) > 2 or not clip or scoring[0][2].done()):
                    batch, step, future = scoring.popleft()
                    clip_rewards = future.result() if clip else np.zeros(len(batch["gt"]), np.float32)
                    rewards = clip_rewards if clip else batch["gt"][:, 0]
                    run.check_rewards(rewards, step, networks)  # the NaN guard: never a NaN in the buffer
                    rb.add(batch["obs"], batch["next_obs"], batch["actions"], rewards, batch["terminations"])
                    ended = run.log_episodes(batch, step, rewards, clip_rewards, components)
                    recent.extend(episode["clip_return"] for episode in ended)
            if train_now:
                with run.timer("learning"):
                    run.snapshot(networks, 1)
                    b_obs, b_actions, b_rewards, b_next_obs, b_terminations = rb.sample(args.batch_size)
                    with torch.no_grad():
                        target_max, _ = target_network(b_next_obs).max(dim=1)
                        # time limits are truncations: bootstrapped (the paper's code stopped there)
                        td_target = b_rewards + args.gamma * target_max * (1 - b_terminations)
                    old_val = q_network(b_obs).gather(1, b_actions[:, None]).squeeze(1)
                    loss = F.mse_loss(td_target, old_val)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                losses = {"td_loss": loss, "q_values": old_val.mean(), "charts/epsilon": epsilon}
                run.log_losses(global_step, losses, torch.isfinite(loss), "--learning-rate")
            if global_step >= args.learning_starts and iteration % args.target_network_frequency == 0:
                for target_param, q_param in zip(target_network.parameters(), q_network.parameters()):
                    target_param.data.copy_(args.tau * q_param.data + (1.0 - args.tau) * target_param.data)

            run.video(evaluation)
            # the best checkpoint has the highest mean CLIP return of the last 100 episodes
            clip_return = np.mean(recent) if recent and due else math.nan
            if due and run.save(learner, envs, rb, networks, recent, clip_return,
                                schedule_steps=schedule_steps):  # fmt: skip
                break  # Ctrl-C or SIGTERM: saved, stopped
            if dones.any():  # reset finished envs: the reset observations start episodes, never a transition
                reset_obs, _ = envs.reset(options={"reset_mask": dones})
                next_obs = np.where(dones[:, None], reset_obs, next_obs)
            obs = next_obs
        run.finish(networks, np.mean(recent) if recent else math.nan, evaluation)  # --save-model: evaluated


if __name__ == "__main__":
    utils.cli(main, Args)
