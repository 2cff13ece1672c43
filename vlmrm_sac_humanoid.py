"""VLM-RM: SAC teaches a MuJoCo humanoid a task from one sentence, with a CLIP model as the reward.

Each frame is scored by CLIP against a goal sentence, optionally regularised towards a baseline sentence (goal-baseline
projection, strength alpha). Read top to bottom: flags, CLIP reward, environment, SAC networks and buffer, training loop.

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal, Optional

# MuJoCo picks its OpenGL backend at import time: headless EGL unless the user chose otherwise; PyOpenGL must agree
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
class Args:  # the help of each flag is the comment after it
    exp_name: str = os.path.basename(__file__)[: -len(".py")]  # the name of this experiment
    seed: int = 1  # seed of the experiment
    torch_deterministic: bool = True  # if toggled, `torch.backends.cudnn.deterministic=True`
    cuda: bool = True  # if toggled, CUDA (when available) runs SAC and the reward model
    torch_threads: Optional[int] = None  # torch CPU threads; default 1 on CPU (more fight the env workers); 0 = torch's own
    log_episodes: bool = False  # if toggled, print a line per finished episode, not only the progress line
    capture_video: bool = False  # if toggled, save an MP4 of a deterministic episode every --video-frequency steps
    video_frequency: int = 100_000  # environment steps between two evaluation videos (videos/<run_name>/)
    save_model: bool = False  # if toggled, save a checkpoint.pt every --checkpoint-frequency steps and at the end
    checkpoint_frequency: int = 500_000  # env steps between two checkpoints (fixed-length episodes: at the next episode end)
    save_buffer: bool = False  # if toggled, checkpoints include the replay buffer, so --resume continues exactly
    resume: Optional[str] = None  # a checkpoint.pt to continue until its --total-timesteps (stock episodes restart)
    evaluate: Optional[str] = None  # a checkpoint.pt: roll out its deterministic policy (video + frames) instead of training
    eval_episodes: int = 3  # number of episodes of an evaluation

    # Environment
    env_id: str = "Humanoid-v5"  # a Gymnasium MuJoCo task (Humanoid: the paper's camera and look) or MountainCarContinuous-v0
    episodes: Literal["auto", "fixed", "stock"] = "auto"  # auto: fixed with --reward clip, else stock; fixed: never terminated
    episode_length: Optional[int] = None  # fixed episode length; default: the paper's, 100 (200 for MountainCarContinuous-v0)
    render_size: int = 480  # square frame size: 480 = the paper's frames; 224 renders ~2x faster
    render_quality: Literal["fast", "high"] = "high"  # high: shadows and reflections (the paper's); fast: off, ~4x faster
    realistic: bool = True  # the realistic look CLIP rewards are better on (sky, slate floor, metal body; a car landscape)
    camera: Literal["paper", "tracking"] = "paper"  # Humanoid: the paper's fixed frontal camera, or following the torso

    # Reward
    reward: Literal["clip", "gt"] = "clip"  # learn from the CLIP reward, or from the environment's own (e.g. to check SAC)
    goal: tuple[str, ...] = ("a humanoid robot kneeling",)  # goal prompt(s); MountainCar: its own default
    baseline: tuple[str, ...] = ("a humanoid robot",)  # baseline prompt(s) of the goal-baseline projection
    alpha: float = 0.0  # regularisation strength in [0, 1]: 0 = plain cosine similarity, 1 = only the goal-baseline direction
    clip_model: str = "ViT-bigG-14"  # open_clip architecture name, or the path of an open_clip model config (.json)
    clip_pretrained: str = "laion2b_s39b_b160k"  # open_clip pretrained tag ("none" = random weights, for tests only)
    clip_checkpoint: Optional[str] = None  # local weights file for --clip-model (overrides --clip-pretrained)
    clip_cache_dir: Optional[str] = None  # where downloaded CLIP weights are cached (default: the Hugging Face cache)
    reward_batch_size: int = 256  # frames scored per CLIP forward pass
    reward_devices: tuple[str, ...] = ()  # e.g. `cuda:0 cuda:1`: one CLIP replica each, in parallel; default: --cuda's device
    reward_family: Literal["projection", "softmax"] = "projection"  # softmax: 1 if the goal beats --negatives, else 0
    negatives: Optional[tuple[str, ...]] = None  # softmax: prompts the goal is contrasted with (defaults for the default goal)
    temperature: float = 0.01  # softmax: temperature of the softmax over cosine similarities (0.01 = CLIP's logit scale)
    threshold: float = 0.5  # softmax: the reward is 1 when the goal's probability is above this, in (0, 1)
    soft: bool = False  # softmax: if toggled, the reward is the goal's probability itself instead of 0/1
    antialias: bool = False  # if toggled, antialias the bicubic squash of frames to CLIP's input (off in the paper's code)

    # SAC (the paper's humanoid settings)
    total_timesteps: int = 10_000_000  # total environment steps (summed over envs), rounded up to a multiple of --num-envs
    num_envs: int = 32  # the number of parallel environments (subprocesses)
    buffer_size: int = 1_000_000  # the replay memory buffer size
    gamma: float = 0.95  # the discount factor gamma
    tau: float = 0.005  # target smoothing coefficient
    batch_size: int = 512  # the batch size of sample from the replay memory
    learning_starts: int = 50_000  # random-action steps before learning starts
    policy_lr: float = 6e-4  # the learning rate of the policy network optimizer
    q_lr: float = 6e-4  # the learning rate of the Q network optimizer
    train_frequency: int = 100  # vector steps between two training phases
    gradient_steps: int = 100  # gradient steps per training phase
    ent_coef: float = 1.0  # entropy coefficient (SAC's alpha; its initial value when autotuned, 1.0 as in Stable-Baselines3)
    autotune: bool = True  # automatic tuning of the entropy coefficient towards entropy -|A| on the unit action box (as SB3)


class UserError(Exception):
    """Bad input or a missing resource: reported as one sentence and exit code 2, never a traceback."""


class NonFiniteError(Exception):
    """A NaN or infinite reward or loss: training stops (exit code 1) instead of poisoning the buffer."""


def check_args(args: Args) -> None:
    """Refuse bad flags, each in one sentence, before anything expensive (model download, env spawn) happens."""
    mountain_car = args.env_id == "MountainCarContinuous-v0"
    if args.episode_length is None:
        args.episode_length = 200 if mountain_car else 100
    if mountain_car and (args.goal, args.baseline) == (Args.goal, Args.baseline):  # the humanoid's prompts: use the car's
        args.goal, args.baseline = ("a car at the peak of the mountain, next to the yellow flag",), ("a car in the mountain",)
    positive = "total_timesteps num_envs buffer_size batch_size train_frequency gradient_steps episode_length eval_episodes"
    for name in (positive + " reward_batch_size video_frequency checkpoint_frequency policy_lr q_lr ent_coef").split():
        if not getattr(args, name) > 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}.")
    for name in "alpha gamma tau".split():
        if not 0 <= getattr(args, name) <= 1:
            raise UserError(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name)}.")
    if args.total_timesteps % args.num_envs:  # every vector step takes one step in each env
        rounded = -(-args.total_timesteps // args.num_envs) * args.num_envs
        print(f"note: --total-timesteps {args.total_timesteps} rounded up to {rounded}, a multiple of --num-envs")
        args.total_timesteps = rounded
    known = ["cpu", *(["cuda"] if torch.cuda.is_available() else []), *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
    unknown = [name for name in args.reward_devices if name not in known]
    entry_point = str(getattr(gym.registry.get(args.env_id), "entry_point", ""))  # "" when not registered
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
        (not 16 <= args.render_size <= 2048, f"--render-size must be between 16 and 2048 pixels, got {args.render_size}."),
        (not entry_point, f"--env-id {args.env_id} is not a Gymnasium environment; use e.g. Humanoid-v5 or Hopper-v5."),
        (
            "mujoco" not in entry_point and not mountain_car,
            f"--env-id {args.env_id} is no MuJoCo task or MountainCarContinuous-v0.",
        ),
        (args.env_id == "Humanoid-v4", "--env-id Humanoid-v4 takes neither our scene nor our camera; use Humanoid-v5."),
    ]:
        if failed:
            raise UserError(message)
    if args.reward_family == "softmax":
        args.negatives = resolve_negatives(args.goal, args.negatives, "--reward-family softmax")
    if args.evaluate is not None:  # the checks of --resume, then networks of this env
        saved = read_checkpoint(args.evaluate, "--evaluate")
        if "actor" not in saved or saved["args"].get("env_id", args.env_id) != args.env_id:
            raise UserError(
                f"--evaluate {args.evaluate} holds no networks trained on --env-id {args.env_id} "
                f"(its --env-id: {saved['args'].get('env_id', args.env_id)})."
            )
    check_writable("runs")
    if args.capture_video or args.evaluate is not None:
        check_writable("videos")
    if args.evaluate is None:  # a rollout allocates no replay buffer
        probe = gym.make(args.env_id)  # cheap: no rendering, just the spaces
        frame_shape = (400, 600, 3) if mountain_car else (args.render_size, args.render_size, 3)
        check_resources(args, probe.observation_space, probe.action_space, frame_shape)
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
# Environment: Humanoid-v5 with the paper's camera and a realistic look; physics untouched
# ----------------------------------------------------------------------------------------------
# The paper's frontal FREE camera: fixed in the world (only a tracking camera follows a body)
HUMANOID_CAMERA = {"distance": 3.5, "lookat": np.array([0.0, 0.0, 1.0]), "elevation": -10.0, "azimuth": 180.0}
# MuJoCo's skybox faces, measured: face pixel (a, b) in [-1, 1] looks along the world direction whose components are
# (a, b, 1)[|i| - 1] * sign(i) for the indices i below (x forward of the humanoid, z up, b grows downwards)
SKYBOX_AXES = dict(right=(3, 1, -2), left=(-3, -1, -2), back=(-1, 3, -2), front=(1, -3, -2), up=(1, -2, 3), down=(1, 2, -3))


def fractal_noise(rng: np.random.Generator, size: int, cells: int, octaves: int) -> np.ndarray:
    """Seamless smooth noise in [0, 1]: octaves of a random grid, bicubically upsampled from a 3x3 tiling (no seams)."""
    out = 0
    for o in range(octaves):
        grid = torch.from_numpy(rng.random((1, 1, cells * 2**o, cells * 2**o))).repeat(1, 1, 3, 3)
        up = F.interpolate(grid, scale_factor=size / (cells * 2**o), mode="bicubic")[0, 0, size:-size, size:-size]
        out = out + 0.5**o * up
    return ((out - out.min()) / (out.max() - out.min())).numpy()


def scene_textures() -> dict[str, np.ndarray]:
    """The paper's look, drawn at run time: a blue sky with white clouds, dark slate floor tiles, light brushed metal."""
    rng = np.random.default_rng(1234)  # slate: per-tile shade, layered grain, dark grout; mean grey ~54/255 as the paper's
    shade = 0.19 + 0.06 * rng.random((2, 2)).repeat(128, 0).repeat(128, 1)
    edge = np.minimum(*[np.minimum(c % 128, 127 - c % 128) for c in np.mgrid[0:256, 0:256]])  # pixels to the grout
    grey = np.where(edge < 2, 0.08, shade * (0.75 + 0.5 * fractal_noise(rng, 256, 8, 4)))
    images = {"slate": grey[..., None] * [0.7, 1.05, 1.2]}  # blue-grey
    rng = np.random.default_rng(99)  # metal: fine streaks along one direction
    streaks = 0.6 * fractal_noise(rng, 128, 4, 5).mean(1, keepdims=True) + 0.4 * rng.random((128, 1))
    images["metal"] = np.broadcast_to((0.72 + 0.16 * streaks)[..., None], (128, 128, 3))
    clouds = torch.from_numpy(fractal_noise(np.random.default_rng(4321), 1024, 6, 6))[None, None].float()
    a, b = np.meshgrid(*[(np.arange(256) + 0.5) / 256 * 2 - 1] * 2)
    for face, axes in SKYBOX_AXES.items():
        d = np.stack([np.sign(i) * (a, b, np.ones_like(a))[abs(i) - 1] for i in axes], -1)
        d /= np.linalg.norm(d, axis=-1, keepdims=True)
        up, elevation = d[..., 2], np.arcsin(np.clip(d[..., 2], -1, 1))
        t = np.clip(elevation / 0.6, 0, 1)[..., None]  # saturated blue, paler at the horizon
        sky = (1 - t) * np.array([0.10, 0.50, 0.92]) + t * np.array([0.04, 0.32, 0.80])
        # clouds: noise at (azimuth, elevation), one scale on both, the seam behind the camera, thinning to the zenith
        grid = torch.from_numpy(np.stack([np.arctan2(-d[..., 1], -d[..., 0]) / np.pi, elevation / np.pi - 1], -1))
        c = F.grid_sample(clouds, grid[None].float(), padding_mode="reflection", align_corners=False)[0, 0].numpy()
        density = (np.clip((c - 0.6) / 0.08, 0, 1) * np.clip(1.3 - 1.3 * up, 0, 1) * (up > -0.02))[..., None]
        sky = sky * (1 - density) + density * (0.78 + 0.22 * np.clip((c - 0.6) / 0.2, 0, 1))[..., None]  # grey undersides
        below = np.clip(-up / 0.05, 0, 1)[..., None]  # past the floor's edge: a distant blue-grey haze
        images[face] = sky * (1 - below) + np.array([0.35, 0.42, 0.5]) * below
    return images


def textured_humanoid_xml() -> str:
    """Gymnasium's Humanoid-v5 model with only its look changed (textures, materials, light); returns the file's path.

    Bodies, joints, geom sizes, masses, contacts, actuators and options are untouched: the physics is identical.
    """
    stock = Path(gym.envs.mujoco.__file__).parent / "assets" / "humanoid.xml"
    key = hashlib.sha1(stock.read_bytes() + b"v5").hexdigest()[:10]  # bump "v5" when the look changes
    cache = os.path.join(tempfile.gettempdir(), f"vlmrm_humanoid_{key}")
    xml_path = os.path.join(cache, "humanoid_textured.xml")
    if os.path.exists(xml_path):
        return xml_path
    os.makedirs(cache, exist_ok=True)
    tmp = f".{os.getpid()}.tmp"  # written, then renamed: parallel env workers may build the same files at once
    for name, image in scene_textures().items():
        imageio.imwrite(f"{cache}/{name}{tmp}", (np.clip(image, 0, 1) * 255).astype(np.uint8), format="png")
        os.replace(f"{cache}/{name}{tmp}", f"{cache}/{name}.png")
    root = ET.parse(stock).getroot()
    root.find("default/geom").attrib.pop("rgba", None)  # colours come from the materials: no stock tan body, green floor
    root.find("worldbody/geom[@name='floor']").attrib.pop("rgba", None)
    root.find("asset").clear()
    root.find("asset").extend(
        ET.fromstring(
            f"""<asset><texture type="skybox" {" ".join(f'file{face}="{cache}/{face}.png"' for face in SKYBOX_AXES)}/>
            <texture name="texplane" type="2d" file="{cache}/slate.png"/>
            <texture name="texgeom" type="cube" file="{cache}/metal.png"/>
            <material name="MatPlane" texture="texplane" texrepeat="60 60" reflectance="0" shininess="0" specular="0"/>
            <material name="geom" texture="texgeom" texuniform="true" rgba="1 1 1 1" specular="1" shininess="1"/></asset>"""
        )
    )
    # one light from above, as in the paper; MuJoCo's default headlight stays (nothing brighter added)
    root.find("worldbody/light").attrib.update(diffuse="1 1 1", pos="0 0 1", dir="0 0 -1.5", specular="0.5 0.5 0.5")
    ET.ElementTree(root).write(xml_path + tmp)
    os.replace(xml_path + tmp, xml_path)
    return xml_path


class Renderer(gym.Wrapper):
    """The frames the reward sees: quality "fast" turns shadows and reflections off; a tracking camera follows the torso."""

    def __init__(self, env: gym.Env, quality: str, tracking: bool = False) -> None:
        super().__init__(env)
        self.flags_set, self.tracking = quality == "high", tracking  # high keeps MuJoCo's defaults (both on)

    def render(self) -> np.ndarray:
        base = self.env.unwrapped
        if self.tracking:  # the paper camera's distance and angles, looking at the torso's centre of mass
            lookat = base.data.subtree_com[base.model.body("torso").id].copy()
            if base.mujoco_renderer.viewer is None:  # the first render() creates the viewer from this configuration
                base.mujoco_renderer.default_cam_config = {**HUMANOID_CAMERA, "lookat": lookat}
            else:
                base.mujoco_renderer.viewer.cam.lookat[:] = lookat
        frame = self.env.render()
        if not self.flags_set:  # the viewer exists only after the first render(): set its flags, then render again
            flags = base.mujoco_renderer.viewer.scn.flags
            flags[mujoco.mjtRndFlag.mjRND_SHADOW] = flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
            self.flags_set, frame = True, self.env.render()
        return frame


class NoEarlyTermination(gym.Wrapper):
    """Fixed-length episodes for any MuJoCo task: a fallen robot keeps being rendered and scored."""

    def step(self, action):
        obs, reward, _, truncated, info = self.env.step(action)
        return obs, reward, False, truncated, info


# MountainCarContinuous-v0, the paper's MountainCar (trained with SAC): copied from vlmrm_dqn_classic.py
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


def make_env(env_id, seed, idx, episode_length, render_size, render_quality, realistic, camera="paper", fixed_length=True):
    """CleanRL-style thunk: fixed-length episodes (or the stock task's), rgb_array frames for the CLIP reward."""

    def thunk() -> gym.Env:
        limit = {"max_episode_steps": episode_length} if fixed_length else {}  # gym.make's TimeLimit; stock: the task's
        if env_id == "MountainCarContinuous-v0":  # its own 600x400 frames, squashed by the reward model
            env = gym.make(env_id, render_mode="rgb_array", **limit)
            env = FixedLengthMountainCar(env) if fixed_length else env
            env = RealisticMountainCar(env) if realistic else env
        else:
            humanoid = env_id.startswith("Humanoid-")  # not HumanoidStandup: its own model and arguments
            kwargs = dict(render_mode="rgb_array", width=render_size, height=render_size, **limit)
            if humanoid:  # fixed length: a fallen humanoid keeps being rendered and rewarded until the end
                kwargs.update(terminate_when_unhealthy=not fixed_length, default_camera_config=HUMANOID_CAMERA)
                kwargs.update({"xml_file": textured_humanoid_xml()} if realistic else {})
            env = gym.make(env_id, **kwargs)
            env = NoEarlyTermination(env) if fixed_length and not humanoid else env
            env = Renderer(env, render_quality, tracking=humanoid and camera == "tracking")
            env.observation_space.seed(seed + idx)
        env.action_space.seed(seed + idx)
        return env

    return thunk


# ----------------------------------------------------------------------------------------------
# SAC
# ----------------------------------------------------------------------------------------------
class SoftQNetwork(nn.Module):
    def __init__(self, env):
        super().__init__()
        obs_dim, action_dim = np.prod(env.single_observation_space.shape), np.prod(env.single_action_space.shape)
        self.network = nn.Sequential(
            nn.Linear(obs_dim + action_dim, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)
        )

    def forward(self, x, a):
        return self.network(torch.cat([x, a], 1))


LOG_STD_MAX = 2  # SB3's hard clamp of the actor's log-std (CleanRL soft-clips to [-5, 2] with a tanh)
LOG_STD_MIN = -20


class Actor(nn.Module):
    def __init__(self, env):
        super().__init__()
        obs_dim, action_dim = np.prod(env.single_observation_space.shape), np.prod(env.single_action_space.shape)
        self.trunk = nn.Sequential(nn.Linear(obs_dim, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
        self.fc_mean = nn.Linear(256, action_dim)
        self.fc_logstd = nn.Linear(256, action_dim)
        # actions live on the tanh-squashed unit box (replay buffer and critics see them there, as in Stable-Baselines3)
        low, high = env.single_action_space.low, env.single_action_space.high
        self.register_buffer("action_scale", torch.tensor((high - low) / 2.0, dtype=torch.float32))
        self.register_buffer("action_bias", torch.tensor((high + low) / 2.0, dtype=torch.float32))

    def forward(self, x):
        h = self.trunk(x)
        return self.fc_mean(h), torch.clamp(self.fc_logstd(h), LOG_STD_MIN, LOG_STD_MAX)

    def to_env(self, y):
        """Unit-box action -> the env's bounds."""
        return y * self.action_scale + self.action_bias

    def get_action(self, x):
        """(sampled unit-box action, its log-probability on the unit box, the deterministic action in env units)."""
        mean, log_std = self(x)
        normal = torch.distributions.Normal(mean, log_std.exp(), validate_args=False)  # a NaN is caught by the loop's check
        x_t = normal.rsample()  # reparameterisation trick
        y_t = torch.tanh(x_t)
        # change of variables through tanh only: the paper's (SB3's) entropy scale, whatever the env's bounds
        log_prob = normal.log_prob(x_t) - torch.log(1 - y_t.pow(2) + 1e-6)
        return y_t, log_prob.sum(1, keepdim=True), self.to_env(torch.tanh(mean))


class ReplayBuffer:
    """Ring buffer of transitions in host memory; a batch goes to the device when sampled."""

    names = ("obs", "next_obs", "actions", "rewards", "terminations")

    def __init__(self, size, obs_shape, action_shape, device):
        self.size, self.device, self.pos, self.full = size, device, 0, False
        for name, shape in zip(self.names, (obs_shape, obs_shape, action_shape, (), ())):
            setattr(self, name, np.zeros((size, *shape), dtype=np.float32))

    def add(self, obs, next_obs, actions, rewards, terminations):
        idx = (self.pos + np.arange(len(obs))) % self.size  # one vectorised write, wrapping around the end
        for name, values in zip(self.names, (obs, next_obs, actions, rewards, terminations)):
            getattr(self, name)[idx] = values
        self.full = self.full or self.pos + len(obs) >= self.size
        self.pos = (self.pos + len(obs)) % self.size

    def __len__(self):
        return self.size if self.full else self.pos

    def state_dict(self):
        return {"pos": self.pos, "full": self.full, **{n: torch.from_numpy(getattr(self, n)[: len(self)]) for n in self.names}}

    def load_state_dict(self, state):
        self.pos, self.full = state["pos"], state["full"]
        for name in self.names:
            getattr(self, name)[: len(state[name])] = state[name]

    def sample(self, batch_size):
        idx = np.random.randint(0, len(self), size=batch_size)
        names = ("obs", "actions", "rewards", "next_obs", "terminations")
        return tuple(torch.from_numpy(getattr(self, name)[idx]).to(self.device) for name in names)


def evaluate(actor, eval_envs, device, reward_model, episodes, seed):
    """Deterministic episodes of the policy: the frames, ground-truth return and CLIP return of each."""
    results = []
    for episode in range(episodes):
        obs, _ = eval_envs.reset(seed=seed + episode)
        frames, gt_return, done = [eval_envs.call("render")[0]], 0.0, False
        while not done:  # fixed length: --episode-length steps; stock: until the env terminates or truncates
            with torch.no_grad():
                actions = actor.get_action(torch.as_tensor(obs, dtype=torch.float32, device=device))[2].cpu().numpy()
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
    opts = (args.episode_length, args.render_size, args.render_quality, args.realistic, args.camera, args.episodes == "fixed")
    eval_env_fns = [make_env(args.env_id, args.seed + 10_000, 0, *opts)]

    if args.evaluate is not None:
        eval_envs = gym.vector.SyncVectorEnv(eval_env_fns)
        actor = Actor(eval_envs).to(device)
        actor.load_state_dict(torch.load(args.evaluate, map_location=device, weights_only=False)["actor"])
        reward_model = make_reward_model(args, device) if args.reward == "clip" else None  # gt: no CLIP weights needed
        for i, result in enumerate(evaluate(actor, eval_envs, device, reward_model, args.eval_episodes, args.seed + 10_000)):
            folder = f"videos/{run_name}/eval-episode-{i}"
            save_video(result["frames"], folder + ".mp4")
            os.makedirs(folder, exist_ok=True)
            for t, frame in enumerate(result["frames"]):
                imageio.imwrite(f"{folder}/frame-{t:04d}.png", frame)
            returns = f"clip_return={result['clip_return']:.2f} gt_return={result['gt_return']:.1f}"
            print(f"eval episode {i}: {returns} -> {folder}.mp4")
        return

    # the reward model first (a bad download or prompt fails before anything starts); on CUDA after the env processes fork
    reward_model = None
    if args.reward == "clip" and (device.type == "cuda" or any(d.startswith("cuda") for d in args.reward_devices)):
        fetch_clip_weights(args)
    elif args.reward == "clip":
        reward_model = make_reward_model(args, device)
    # autoreset off: we reset finished envs ourselves, so no reset frame or observation is ever stored as a transition;
    # the env processes ignore Ctrl-C and SIGTERM, so that the main process decides when to stop
    handlers = signal.signal(signal.SIGINT, signal.SIG_IGN), signal.signal(signal.SIGTERM, signal.SIG_IGN)
    vector_env = gym.vector.SyncVectorEnv if args.reward == "gt" else gym.vector.AsyncVectorEnv  # gt renders nothing
    env_fns = [make_env(args.env_id, args.seed, i, *opts) for i in range(args.num_envs)]
    envs = vector_env(env_fns, autoreset_mode=gym.vector.AutoresetMode.DISABLED)
    signal.signal(signal.SIGINT, handlers[0])
    signal.signal(signal.SIGTERM, handlers[1])
    writer = None
    try:  # every exit closes the env processes: they ignore SIGTERM, so a process exiting under them would hang
        if args.reward == "clip" and reward_model is None:  # on CUDA: built after the env processes were forked
            reward_model = make_reward_model(args, device)
        if reward_model is not None:
            warn_if_slow_on_cpu(reward_model, args, (args.render_size, args.render_size, 3))
        eval_envs = gym.vector.SyncVectorEnv(eval_env_fns) if args.capture_video else None
        num_iterations, start_iteration = args.total_timesteps // args.num_envs, checkpoint["iteration"] if checkpoint else 0
        run_name = run_name if checkpoint else make_run_folder(run_name)
        # purge_step drops what a crashed run logged after its checkpoint: from the first step still pending in it
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

        actor = Actor(envs).to(device)
        qf1, qf2, qf1_target, qf2_target = (SoftQNetwork(envs).to(device) for _ in range(4))
        qf1_target.load_state_dict(qf1.state_dict())
        qf2_target.load_state_dict(qf2.state_dict())
        q_params, target_params = [*qf1.parameters(), *qf2.parameters()], [*qf1_target.parameters(), *qf2_target.parameters()]
        q_optimizer = optim.Adam(q_params, lr=args.q_lr, fused=True)  # fused: one kernel per step, not one per tensor
        actor_optimizer = optim.Adam(actor.parameters(), lr=args.policy_lr, fused=True)
        target_entropy = -float(np.prod(envs.single_action_space.shape))
        log_ent_coef = torch.tensor([math.log(args.ent_coef)], device=device, requires_grad=args.autotune)
        ent_coef_optimizer = optim.Adam([log_ent_coef], lr=args.q_lr, fused=True) if args.autotune else None
        rb = ReplayBuffer(args.buffer_size, envs.single_observation_space.shape, envs.single_action_space.shape, device)
        # everything a gradient step changes, by name: checkpointed, and snapshotted as the last finite state
        learner = dict(actor=actor, qf1=qf1, qf2=qf2, qf1_target=qf1_target, qf2_target=qf2_target)
        learner.update(actor_optimizer=actor_optimizer, q_optimizer=q_optimizer)
        if args.autotune:
            learner["ent_coef_optimizer"] = ent_coef_optimizer
        low, high = envs.single_action_space.low, envs.single_action_space.high
        action_scale, action_bias = (high - low) / 2.0, (high + low) / 2.0  # as the actor's, on the host: no device sync

        # transitions wait here until their frames are scored in one batch, always before the next gradient step
        pending = {k: [] for k in ("obs", "next_obs", "actions", "terminations", "dones", "gt", "frames")}
        components: list[str] = []  # the env's own reward terms (e.g. reward_forward), logged as diagnostics
        episode = {k: np.zeros(args.num_envs) for k in ("return", "gt_return", "clip_return", "length", "success")}
        render = args.reward == "clip"
        timing = {"env": 0.0, "render": 0.0, "reward_model": 0.0, "learning": 0.0}

        obs, _ = envs.reset(seed=args.seed)
        if checkpoint is not None:
            for name, module in learner.items():
                module.load_state_dict(checkpoint[name])
            log_ent_coef.data.copy_(checkpoint["log_ent_coef"])
            if checkpoint["replay_buffer"] is not None:
                rb.load_state_dict(checkpoint["replay_buffer"])
                checkpoint["replay_buffer"] = None  # frees the loaded copy (counted by the memory check)
            pending, episode, components = checkpoint["pending"], checkpoint["episode"], checkpoint["components"]
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
        ent_coef = log_ent_coef.exp().detach()  # a tensor: no host-device sync per gradient step
        last_finite, steps_since_snapshot = None, math.inf
        stop = install_stop_handlers()
        start_time = time.time()
        progress = Progress(args.total_timesteps, start_iteration * args.num_envs, render, max(10, args.num_envs))
        iteration, dones = start_iteration - 1, np.ones(args.num_envs, dtype=bool)  # as they stay when no steps are left
        for iteration in range(start_iteration, num_iterations):
            global_step, next_step = iteration * args.num_envs, (iteration + 1) * args.num_envs
            if global_step < args.learning_starts:  # unit-box actions (stored so), from the seeded, checkpointed RNG
                actions = np.random.uniform(-1, 1, size=(args.num_envs, *envs.single_action_space.shape)).astype(np.float32)
            else:
                with torch.no_grad():
                    actions = actor.get_action(torch.as_tensor(obs, dtype=torch.float32, device=device))[0].cpu().numpy()

            env_actions = (actions * action_scale + action_bias).astype(np.float32)
            t0 = time.perf_counter()
            next_obs, gt_rewards, terminations, truncations, infos = envs.step(env_actions)
            t1 = time.perf_counter()
            frames = np.stack(envs.call("render")) if render else None  # the frame *after* the step scores it
            timing["env"] += t1 - t0
            timing["render"] += time.perf_counter() - t1
            dones = terminations | truncations
            # checkpoints where fixed-length episodes all end (a small run state); stock ones when due (episodes restart)
            stopping = stop["requested"]  # read once: a signal arriving after this is handled at the next step
            boundary = dones.all() or args.episodes == "stock"
            periodic = args.save_model and global_step // args.checkpoint_frequency != next_step // args.checkpoint_frequency
            save_now = boundary and (stopping or periodic or (args.save_model and iteration == num_iterations - 1))

            components = components or sorted(k for k in infos if k.startswith("reward_"))
            success = infos.get("success", np.zeros(args.num_envs))  # MountainCar: the flag reached in this episode so far
            gt = np.stack([gt_rewards, success] + [infos[k] for k in components], axis=1)
            for k, value in zip(pending, (obs, next_obs, actions, terminations, dones, gt, frames)):
                if value is not None:  # no frames without the CLIP reward
                    pending[k].append(value)

            train_now = global_step >= args.learning_starts and iteration % args.train_frequency == 0
            # scored for training, when each reward device has a full chunk, at the end, before a stock-episode checkpoint
            full = len(pending["obs"]) * args.num_envs >= args.reward_batch_size * max(1, len(args.reward_devices))
            if train_now or full or iteration == num_iterations - 1 or (save_now and args.episodes == "stock"):
                t0 = time.perf_counter()
                flat = {k: np.concatenate(v) for k, v in pending.items() if v}
                clip_rewards = reward_model(flat["frames"]) if render else np.zeros(len(flat["gt"]))
                timing["reward_model"] += time.perf_counter() - t0
                rewards = clip_rewards if render else flat["gt"][:, 0]
                if not np.all(np.isfinite(rewards)):  # never let a NaN into the buffer: it would poison every Q-value
                    saved = save_nonfinite(run_name, {"actor": actor.state_dict(), "args": asdict(args), "run_name": run_name})
                    raise NonFiniteError(
                        f"the {args.reward} reward is not finite for {np.sum(~np.isfinite(rewards))} of {len(rewards)} "
                        f"frames at step {global_step}; {saved}."
                    )
                rb.add(flat["obs"], flat["next_obs"], flat["actions"], rewards, flat["terminations"])
                # episode sums in step order (rows are step-major: env i of step t is row t * num_envs + i)
                for k, row in enumerate(flat["gt"]):
                    i = k % args.num_envs
                    episode["return"][i] += rewards[k]
                    episode["gt_return"][i] += row[0]
                    episode["clip_return"][i] += clip_rewards[k]
                    episode["length"][i] += 1
                    episode["success"][i] = row[1]  # latched by the env, cleared at its reset
                    for c, name in enumerate(components):
                        episode.setdefault(name, np.zeros(args.num_envs))[i] += row[2 + c]
                    if flat["dones"][k]:
                        step = global_step - (len(rewards) - 1 - k) // args.num_envs * args.num_envs  # the step it ended at
                        ep = {key: v[i] for key, v in episode.items()}
                        progress.episode(ep["gt_return"], ep["clip_return"])
                        if args.log_episodes:
                            print(f"global_step={step}, episodic_return={ep['return']:.2f}, gt_return={ep['gt_return']:.1f}")
                        scalars = {"charts/episodic_return": ep["return"], "charts/episodic_length": ep["length"]}
                        scalars.update({"charts/gt_return": ep["gt_return"], **{f"gt/{n}": ep[n] for n in components}})
                        if args.env_id == "MountainCarContinuous-v0":
                            scalars["charts/gt_success"] = ep["success"]
                        if render:
                            scalars["charts/clip_return"] = ep["clip_return"]
                            scalars["charts/clip_reward_mean"] = ep["clip_return"] / ep["length"]
                        for tag, value in scalars.items():
                            writer.add_scalar(tag, value, step)
                        for v in episode.values():
                            v[i] = 0
                pending = {k: [] for k in pending}

            if train_now:
                t0 = time.perf_counter()
                # a finite copy of the learner, saved if a phase produces a NaN: every ~100 gradient steps, as copies cost time
                if steps_since_snapshot >= 100:
                    snapshot = {name: copy.deepcopy(module.state_dict()) for name, module in learner.items()}
                    snapshot["log_ent_coef"] = log_ent_coef.detach().clone()
                    if all_finite(snapshot):  # the last update of a phase has no loss that checks it: check the copy
                        last_finite, steps_since_snapshot = snapshot, 0
                steps_since_snapshot += args.gradient_steps
                finite = torch.ones((), dtype=torch.bool, device=device)  # checked once per phase: no per-step sync
                for _ in range(args.gradient_steps):
                    b_obs, b_actions, b_rewards, b_next_obs, b_terminations = rb.sample(args.batch_size)
                    with torch.no_grad():
                        next_actions, next_log_pi, _ = actor.get_action(b_next_obs)
                        qf_next_target = torch.min(qf1_target(b_next_obs, next_actions), qf2_target(b_next_obs, next_actions))
                        min_qf_next_target = qf_next_target - ent_coef * next_log_pi
                        # time limits are truncations: we bootstrap through them (the reference treated them as terminal)
                        next_q_value = b_rewards + (1 - b_terminations) * args.gamma * min_qf_next_target.view(-1)
                    qf1_a_values, qf2_a_values = qf1(b_obs, b_actions).view(-1), qf2(b_obs, b_actions).view(-1)
                    qf1_loss, qf2_loss = F.mse_loss(qf1_a_values, next_q_value), F.mse_loss(qf2_a_values, next_q_value)
                    qf_loss = 0.5 * (qf1_loss + qf2_loss)  # SB3's scale (CleanRL sums them: twice the critic step)
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
                        # SB3's loss: the gradient flows through log alpha itself (CleanRL's exp() halves the decay rate)
                        ent_coef_loss = -(log_ent_coef * (log_pi.detach() + target_entropy)).mean()
                        ent_coef_optimizer.zero_grad()
                        ent_coef_loss.backward()
                        ent_coef_optimizer.step()
                        ent_coef = log_ent_coef.exp().detach()

                    with torch.no_grad():
                        for param, target_param in zip(q_params, target_params):
                            target_param.lerp_(param, args.tau)
                if not finite:  # e.g. a resumed checkpoint that was not finite already
                    saved = "the networks were not finite already when training started"
                    if last_finite:
                        saved = save_nonfinite(run_name, {**last_finite, "args": asdict(args), "run_name": run_name})
                    raise NonFiniteError(
                        f"a SAC loss (qf_loss {qf_loss.item()}, actor_loss {actor_loss.item()}) is not finite in the training "
                        f"phase at step {global_step}; {saved}; lower --q-lr / --policy-lr or check the rewards."
                    )
                timing["learning"] += time.perf_counter() - t0

                if iteration % (10 * args.train_frequency) == 0:
                    scalars = {"losses/qf1_values": qf1_a_values.mean(), "losses/qf2_values": qf2_a_values.mean()}
                    scalars.update({"losses/qf1_loss": qf1_loss, "losses/qf2_loss": qf2_loss, "losses/qf_loss": qf_loss})
                    scalars.update({"losses/actor_loss": actor_loss, "losses/ent_coef": ent_coef})
                    scalars.update({"losses/ent_coef_loss": ent_coef_loss} if args.autotune else {})
                    scalars["charts/SPS"] = int((global_step - start_iteration * args.num_envs) / (time.time() - start_time))
                    scalars.update({f"time/{k}_s": v for k, v in timing.items()})
                    for tag, value in scalars.items():
                        writer.add_scalar(tag, value.item() if torch.is_tensor(value) else value, global_step)

            last = iteration == num_iterations - 1
            if args.capture_video and (global_step // args.video_frequency != next_step // args.video_frequency or last):
                (result,) = evaluate(actor, eval_envs, device, reward_model, 1, args.seed + 10_000)
                save_video(result["frames"], f"videos/{run_name}/step-{next_step}.mp4")
                writer.add_scalar("eval/gt_return", result["gt_return"], next_step)
                if reward_model is not None:
                    writer.add_scalar("eval/clip_return", result["clip_return"], next_step)
            if save_now:
                state = {name: module.state_dict() for name, module in learner.items()}
                state.update(run_name=run_name, iteration=iteration + 1, global_step=next_step, args=asdict(args))
                state.update(log_ent_coef=log_ent_coef.detach().cpu(), rng=rng_state(envs), pending=pending, episode=episode)
                state.update(components=components, replay_buffer=rb.state_dict() if args.save_buffer else None)
                save_checkpoint(f"runs/{run_name}/checkpoint.pt", state)
                print(
                    f"checkpoint saved at step {next_step}: runs/{run_name}/checkpoint.pt"
                    + ("" if args.save_buffer else " (without the replay buffer: pass --save-buffer for an exact resume)")
                )
            if boundary and stopping:
                print(f"stopped; continue with: python {os.path.basename(__file__)} --resume runs/{run_name}/checkpoint.pt")
                break
            if dones.any():  # reset finished envs: their reset observations start the next episodes, never a transition
                reset_obs, _ = envs.reset(options={"reset_mask": dones})
                next_obs = np.where(dones[:, None], reset_obs, next_obs)
            obs = next_obs
            progress.update(next_step)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if writer is not None:
            writer.close()  # flushes TensorBoard, also on an error or a second Ctrl-C
        envs.close()

    progress.update((iteration + 1) * args.num_envs, final=True)
    elapsed, steps = time.time() - start_time, (iteration + 1 - start_iteration) * args.num_envs
    times = ", ".join(f"{k} {v:.2f} s" for k, v in timing.items())
    print(f"done: {steps} steps in {elapsed:.0f} s ({int(steps / max(elapsed, 1e-9))} SPS); time in {times}")
    if args.save_model and not stop["requested"]:
        if args.episodes == "fixed" and not dones.all():  # ended mid-episode: the final networks, to evaluate, not resume
            state = {name: module.state_dict() for name, module in learner.items()}
            save_checkpoint(f"runs/{run_name}/checkpoint.pt", {**state, "args": asdict(args), "run_name": run_name})
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


def save_video(frames: list[np.ndarray], path: str, fps: int = 30) -> None:
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


def all_finite(state) -> bool:
    """True when every floating-point tensor of a (nested) state dict is finite."""
    if isinstance(state, (dict, list, tuple)):
        return all(map(all_finite, state.values() if isinstance(state, dict) else state))
    return not (torch.is_tensor(state) and state.is_floating_point()) or bool(torch.isfinite(state).all())


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
