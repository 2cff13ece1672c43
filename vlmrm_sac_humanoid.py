"""VLM-RM: SAC teaches a MuJoCo humanoid a task from one sentence, with a CLIP model as the reward.

Each frame is scored by CLIP against a goal sentence, optionally regularised towards a baseline sentence (goal-baseline
projection, strength alpha). Read top to bottom: flags, CLIP reward, environment, SAC networks and buffer, training loop.

    python vlmrm_sac_humanoid.py --goal "a humanoid robot kneeling"
"""

import copy
import hashlib
import math
import os
import random
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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

import vlmrm_utils as utils

mujoco.set_mju_user_warning(utils.mujoco_warning)  # not MUJOCO_LOG.TXT, which MuJoCo leaves in the working directory


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
    track: bool = False  # if toggled, this experiment is tracked with Weights and Biases (synced from TensorBoard)
    wandb_project_name: str = "vlmrm"  # the W&B project name
    wandb_entity: Optional[str] = None  # the entity (team) of W&B's project
    save_model: bool = False  # if toggled, checkpoint.pt (for --resume) and checkpoints/step-<N>.pt (all kept), see below
    checkpoint_frequency: int = 128_000  # env steps between two checkpoints, the paper's (at the next episode end)
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
    alpha: Optional[float] = None  # goal-baseline strength in [0, 1] (0: cosine similarity); default 0, MountainCar 0.5
    clip_model: str = "ViT-bigG-14"  # open_clip architecture name, or the path of an open_clip model config (.json)
    clip_pretrained: str = "laion2b_s39b_b160k"  # open_clip pretrained tag ("none" = random weights, for tests only)
    clip_checkpoint: Optional[str] = None  # local weights file for --clip-model (overrides --clip-pretrained)
    clip_cache_dir: Optional[str] = None  # where downloaded CLIP weights are cached (default: the Hugging Face cache)
    reward_batch_size: int = 256  # frames scored per CLIP forward pass
    clip_dtype: Literal["float16", "bfloat16", "float32"] = "float16"  # CUDA: the image tower, cast once; CPU: float32
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


def check_args(args: Args) -> None:
    """Refuse bad flags, each in one sentence, before anything expensive (model download, env spawn) happens."""
    mountain_car = args.env_id == "MountainCarContinuous-v0"
    if args.episode_length is None:
        args.episode_length = 200 if mountain_car else 100
    if mountain_car and (args.goal, args.baseline) == (Args.goal, Args.baseline):  # the humanoid's prompts: use the car's
        args.goal, args.baseline = ("a car at the peak of the mountain, next to the yellow flag",), ("a car in the mountain",)
    if args.alpha is None:  # the authors: MountainCar cannot be solved without goal-baseline regularisation; 0.5: measured
        # on a test CLIP's reward shape (docs/language_proof.md), the paper's own value is not published
        args.alpha = 0.5 if mountain_car else 0.0
    positive = "total_timesteps num_envs buffer_size batch_size train_frequency gradient_steps episode_length eval_episodes"
    positive += " reward_batch_size video_frequency checkpoint_frequency policy_lr q_lr ent_coef"
    utils.check_common_args(args, positive, "alpha gamma tau", "actor", DEFAULT_NEGATIVES)
    entry_point = str(getattr(gym.registry.get(args.env_id), "entry_point", ""))  # "" when not registered
    for failed, message in [
        (not 16 <= args.render_size <= 2048, f"--render-size must be between 16 and 2048 pixels, got {args.render_size}."),
        (not entry_point, f"--env-id {args.env_id} is not a Gymnasium environment; use e.g. Humanoid-v5 or Hopper-v5."),
        (
            "mujoco" not in entry_point and not mountain_car,
            f"--env-id {args.env_id} is no MuJoCo task or MountainCarContinuous-v0.",
        ),
        (args.env_id == "Humanoid-v4", "--env-id Humanoid-v4 takes neither our scene nor our camera; use Humanoid-v5."),
    ]:
        if failed:
            raise utils.UserError(message)
    if args.reward == "clip":  # the flags first, then whether the run fits
        utils.check_clip_args(args)
    if args.evaluate is None:  # a rollout allocates no replay buffer
        probe = gym.make(args.env_id)  # cheap: no rendering, just the spaces
        frame_shape = (400, 600, 3) if mountain_car else (args.render_size, args.render_size, 3)
        # measured (2 and 6 envs, Mesa's software EGL): a MuJoCo worker process that renders 180 MB (224 or 480 pixels),
        # a MountainCar one 40 MB; without rendering (gt) the envs live in this process, 2.5 MB each
        env_bytes = (40e6 if mountain_car else 180e6) if args.reward == "clip" else 2.5e6
        utils.check_resources(args, probe.observation_space, probe.action_space, frame_shape, env_bytes)


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
    ),  # fmt: skip
    ("a humanoid robot kneeling",): ("a humanoid robot standing", "a humanoid robot lying on the ground"),
}


def softmax_reward(image_embeddings, goal_embeddings, negative_embeddings, temperature: float, threshold: float, soft=False):
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

    def __init__(self, model: nn.Module, tokenizer, goal: tuple, baseline: tuple, alpha: float, batch_size: int, device,
                 family="projection", negatives=(), temperature=0.01, threshold=0.5, soft=False, antialias=False,
                 replicas=(), dtype=torch.float32):  # fmt: skip
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
        self.dtype = dtype  # the image tower's, cast once: prompts are embedded above and rewards computed in float32
        for replica, _ in self.replicas:
            replica.visual.to(dtype)

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
        return model.encode_image(self.preprocess(frames, device).to(self.dtype))

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
    model, tokenizer = utils.load_clip(args, devices[0])
    utils.warn_long_prompts(tokenizer, args)
    replicas = [(copy.deepcopy(model).to(d), d) for d in devices[1:]]  # copies: the same weights (even random test ones)
    family = [args.reward_family, args.negatives or (), args.temperature, args.threshold, args.soft, args.antialias]
    dtype = getattr(torch, args.clip_dtype) if devices[0].type == "cuda" else torch.float32  # CPUs gain nothing from half
    reward_model = CLIPReward(
        model, tokenizer, args.goal, args.baseline, args.alpha, args.reward_batch_size, devices[0], *family, replicas, dtype
    )
    if args.reward_family == "projection":
        utils.check_goal_direction(reward_model.goal_embeddings, reward_model.baseline_embeddings, args.alpha)
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
    """The paper's look, drawn at run time: a blue sky with white clouds, dark grey slate tiles, light brushed metal."""
    rng = np.random.default_rng(1234)  # slate: per-tile shade, layered grain, dark grout; mean grey ~54/255 as the paper's
    shade = 0.19 + 0.06 * rng.random((2, 2)).repeat(128, 0).repeat(128, 1)
    edge = np.minimum(*[np.minimum(c % 128, 127 - c % 128) for c in np.mgrid[0:256, 0:256]])  # pixels to the grout
    grey = np.where(edge < 2, 0.08, shade * (0.75 + 0.5 * fractal_noise(rng, 256, 8, 4)))
    images = {"slate": np.repeat(grey[..., None], 3, -1)}  # neutral grey, as the paper's frame
    rng = np.random.default_rng(99)  # metal: fine streaks along one direction
    streaks = 0.6 * fractal_noise(rng, 128, 4, 5).mean(1, keepdims=True) + 0.4 * rng.random((128, 1))
    images["metal"] = np.broadcast_to((0.72 + 0.16 * streaks)[..., None], (128, 128, 3))
    clouds = torch.from_numpy(fractal_noise(np.random.default_rng(4321), 1024, 6, 6))[None, None].float()
    a, b = np.meshgrid(*[(np.arange(256) + 0.5) / 256 * 2 - 1] * 2)
    for face, axes in SKYBOX_AXES.items():
        d = np.stack([np.sign(i) * (a, b, np.ones_like(a))[abs(i) - 1] for i in axes], -1)
        d /= np.linalg.norm(d, axis=-1, keepdims=True)
        up, elevation = d[..., 2], np.arcsin(np.clip(d[..., 2], -1, 1))
        # saturated blue, lighter at the horizon; below it (past the floor's edge) the horizon's blue goes on: no haze band
        t = np.clip(elevation / 0.6, 0, 1)[..., None]
        sky = (1 - t) * np.array([0.04, 0.58, 0.88]) + t * np.array([0.04, 0.40, 0.82])
        # clouds (grey undersides): noise at (azimuth, elevation), one scale on both, the seam behind the camera, thinning up
        grid = torch.from_numpy(np.stack([np.arctan2(-d[..., 1], -d[..., 0]) / np.pi, elevation / np.pi - 1], -1))
        c = F.grid_sample(clouds, grid[None].float(), padding_mode="reflection", align_corners=False)[0, 0].numpy()
        density = (np.clip((c - 0.6) / 0.08, 0, 1) * np.clip(1.3 - 1.3 * up, 0, 1) * (up > -0.02))[..., None]
        images[face] = sky * (1 - density) + density * (0.78 + 0.22 * np.clip((c - 0.6) / 0.2, 0, 1))[..., None]
    return images


def textured_humanoid_xml() -> str:
    """Gymnasium's Humanoid-v5 model with only its look changed (textures, materials, light); returns the file's path.

    Bodies, joints, geom sizes, masses, contacts, actuators and options are untouched: the physics is identical.
    """
    stock = Path(gym.envs.mujoco.__file__).parent / "assets" / "humanoid.xml"
    key = hashlib.sha1(stock.read_bytes() + b"v6").hexdigest()[:10]  # bump "v6" when the look changes
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
    """Ring buffer of transitions in host memory; a batch goes to the device when sampled; its state_dict (the filled
    part) makes a resume exact."""

    def __init__(self, size: int, obs_shape: tuple, action_shape: tuple, action_dtype: type, device: torch.device):
        self.size, self.device, self.pos, self.full = size, device, 0, False
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
        return {"pos": self.pos, "full": self.full, **{k: torch.from_numpy(v[: len(self)]) for k, v in self.data.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.pos, self.full = state["pos"], state["full"]
        for k, v in self.data.items():
            v[: len(state[k])] = state[k]

    def sample(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        idx = np.random.randint(0, len(self), size=batch_size)
        keys = ("obs", "actions", "rewards", "next_obs", "terminations")
        return tuple(torch.from_numpy(self.data[k][idx]).to(self.device) for k in keys)


class RewardQueue:
    """Transitions wait here for the CLIP score of their frame (the one rendered after their step). A full chunk per
    reward device is scored in a background thread while the envs step on (torch's kernels release the GIL, CUDA's run
    asynchronously); `scored(wait)` hands chunks back oldest first, every one when `wait` is set (before a gradient
    step, a checkpoint, the end), so the replay buffer receives what the serial loop gave it, in the same order."""

    def __init__(self, reward_model, chunk: int, in_flight: int = 2):
        self.reward_model, self.chunk, self.in_flight = reward_model, chunk, in_flight  # in flight: bounds memory
        self.pending = {k: [] for k in ("obs", "next_obs", "actions", "terminations", "dones", "gt", "frames")}
        self.scoring: deque = deque()  # (transitions, step, future of their CLIP rewards), oldest first
        self.pool = ThreadPoolExecutor(1) if reward_model is not None else None
        self.busy = self.waited = 0.0  # seconds the reward model worked (overlapped) and the loop waited for it

    def add(self, step: int, wait: bool, **transition) -> list[tuple[dict, np.ndarray]]:
        for k, v in transition.items():
            self.pending[k].append(v)
        if wait or len(self.pending["obs"]) * len(transition["obs"]) >= self.chunk:
            batch = {k: np.concatenate(v) for k, v in self.pending.items() if v}
            frames = batch.pop("frames", None)
            self.scoring.append((batch, step, self.pool.submit(self.score, frames) if self.pool else None))
            self.pending = {k: [] for k in self.pending}
        return self.scored(wait)

    def score(self, frames: np.ndarray) -> np.ndarray:  # in the scoring thread
        start = time.perf_counter()
        rewards = self.reward_model(frames)
        self.busy += time.perf_counter() - start
        return rewards

    def scored(self, wait: bool) -> list[tuple[dict, np.ndarray]]:
        """The chunks whose rewards are ready, oldest first: all when `wait`, else the done ones and any past in_flight."""
        out, start = [], time.perf_counter()
        while self.scoring and (wait or len(self.scoring) > self.in_flight or not self.pool or self.scoring[0][2].done()):
            batch, step, future = self.scoring.popleft()
            clip_rewards = future.result() if future else np.zeros(len(batch["gt"]), np.float32)
            out.append(({**batch, "step": step}, clip_rewards))
        self.waited += time.perf_counter() - start
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


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
        checkpoint = utils.read_checkpoint(args.resume, Args)
        args = utils.resumed_args(args, checkpoint)
    if args.evaluate is not None:  # the run's own env, CLIP model and frames, unless a flag says otherwise
        args = utils.evaluated_args(args)
    check_args(args)
    if args.episodes == "auto":  # resolved once: a checkpoint keeps the resolved value
        args.episodes = "fixed" if args.reward == "clip" else "stock"
    run_name = checkpoint["run_name"] if checkpoint else f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    device = utils.set_torch_threads(args, torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu"))
    opts = (args.episode_length, args.render_size, args.render_quality, args.realistic, args.camera, args.episodes == "fixed")
    eval_env_fns = [make_env(args.env_id, args.seed + 10_000, 0, *opts)]

    if args.evaluate is not None:  # gt: no CLIP weights needed
        eval_envs = gym.vector.SyncVectorEnv(eval_env_fns)
        reward_model, actor = make_reward_model(args, device) if args.reward == "clip" else None, Actor(eval_envs).to(device)
        saved = utils.read_checkpoint(args.evaluate, Args, "--evaluate")
        actor.load_state_dict(saved["actor"])
        results = evaluate(actor, eval_envs, device, reward_model, args.eval_episodes, args.seed + 10_000)
        return utils.save_episodes(results, saved.get("run_name", run_name), fps=30)  # the trained run's videos/ folder

    reward_model = utils.reward_model_before_envs(args, device, make_reward_model)
    # autoreset off: we reset finished envs ourselves, so no reset frame or observation is ever stored as a transition
    vector_env = gym.vector.SyncVectorEnv if args.reward == "gt" else gym.vector.AsyncVectorEnv  # gt renders nothing
    frame_shape = (400, 600, 3) if args.env_id == "MountainCarContinuous-v0" else (args.render_size, args.render_size, 3)
    env_fns = [make_env(args.env_id, args.seed, i, *opts) for i in range(args.num_envs)]
    envs = utils.make_vector_env(vector_env, env_fns, frame_shape if args.reward == "clip" else None)
    writer = queue = None
    try:  # every exit closes the env processes: they ignore SIGTERM, so a process exiting under them would hang
        if args.reward == "clip" and reward_model is None:  # on CUDA: built after the env processes were forked
            reward_model = make_reward_model(args, device)
        if reward_model is not None:
            utils.say_reward_model_cost(reward_model, args, frame_shape)
        eval_envs = gym.vector.SyncVectorEnv(eval_env_fns) if args.capture_video else None
        num_iterations, start_iteration = args.total_timesteps // args.num_envs, checkpoint["iteration"] if checkpoint else 0

        actor = Actor(envs).to(device)
        qf1, qf2, qf1_target, qf2_target = (SoftQNetwork(envs).to(device) for _ in range(4))
        qf1_target.load_state_dict(qf1.state_dict()), qf2_target.load_state_dict(qf2.state_dict())
        q_params, target_params = [*qf1.parameters(), *qf2.parameters()], [*qf1_target.parameters(), *qf2_target.parameters()]
        q_optimizer = optim.Adam(q_params, lr=args.q_lr, fused=True)  # fused: one kernel per step, not one per tensor
        actor_optimizer = optim.Adam(actor.parameters(), lr=args.policy_lr, fused=True)
        target_entropy = -float(np.prod(envs.single_action_space.shape))
        log_ent_coef = torch.tensor([math.log(args.ent_coef)], device=device, requires_grad=args.autotune)
        ent_coef_optimizer = optim.Adam([log_ent_coef], lr=args.q_lr, fused=True) if args.autotune else None
        obs_shape, action_shape = envs.single_observation_space.shape, envs.single_action_space.shape
        rb = ReplayBuffer(args.buffer_size, obs_shape, action_shape, np.float32, device)
        # everything a gradient step changes, by name: checkpointed, and snapshotted as the last finite state
        learner = dict(actor=actor, qf1=qf1, qf2=qf2, qf1_target=qf1_target, qf2_target=qf2_target, q_optimizer=q_optimizer)
        learner.update(actor_optimizer=actor_optimizer, ent_coef_optimizer=ent_coef_optimizer)
        networks = lambda: dict(actor=actor.state_dict(), qf1=qf1.state_dict(), qf2=qf2.state_dict())  # noqa: E731
        utils.check_checkpoint_disk(args, networks(), rb)  # before the run folder: a refused run leaves none
        run_name, writer = utils.start_run(args, run_name, checkpoint, device)
        low, high = envs.single_action_space.low, envs.single_action_space.high
        action_scale, action_bias = (high - low) / 2.0, (high + low) / 2.0  # as the actor's, on the host: no device sync

        # transitions wait for their frames' CLIP scores, which go to the buffer before the next gradient step
        queue = RewardQueue(reward_model, args.reward_batch_size * max(1, len(args.reward_devices)))
        components: list[str] = []  # the env's own reward terms (e.g. reward_forward), logged as diagnostics
        success = "flag" if args.env_id == "MountainCarContinuous-v0" else None  # charts/gt_success: the flag reached
        episodes = utils.EpisodeLog(args.num_envs, checkpoint["episodes"] if checkpoint else None, success)
        render = args.reward == "clip"
        timing = {"env": 0.0, "render": 0.0, "reward_model": 0.0, "reward_wait": 0.0, "learning": 0.0}

        obs, _ = envs.reset(seed=args.seed)
        if checkpoint is not None:
            obs = utils.restore_run(checkpoint, learner, envs, rb)
            log_ent_coef.data.copy_(checkpoint["log_ent_coef"])
            components = checkpoint["components"]
            if args.episodes == "stock":  # saved mid-episode: the episodes in flight restarted, so drop their partial sums
                episodes.restart()
        ent_coef = log_ent_coef.exp().detach()  # a tensor: no host-device sync per gradient step
        last_finite, stop = utils.LastFinite(run_name, args), utils.install_stop_handlers()
        last_save = start_iteration * args.num_envs  # the step of the last checkpoint
        progress = utils.Progress(args.total_timesteps, start_iteration * args.num_envs, render, max(10, args.num_envs))
        iteration, dones = start_iteration - 1, np.ones(args.num_envs, dtype=bool)  # as they stay when no steps are left
        for iteration in range(start_iteration, num_iterations):
            global_step, next_step = iteration * args.num_envs, (iteration + 1) * args.num_envs
            if global_step < args.learning_starts:  # unit-box actions (stored so), from the seeded, checkpointed RNG
                actions = np.random.uniform(-1, 1, size=(args.num_envs, *envs.single_action_space.shape)).astype(np.float32)
            else:
                with torch.no_grad():
                    actions = actor.get_action(torch.as_tensor(obs, dtype=torch.float32, device=device))[0].cpu().numpy()

            t0 = time.perf_counter()
            env_actions = (actions * action_scale + action_bias).astype(np.float32)
            next_obs, gt_rewards, terminations, truncations, infos = envs.step(env_actions)
            frames = infos.get("frames")  # rendered in the env processes *after* the step: it scores the transition
            render_s = infos["render_s"] if render else 0.0  # of the step's round trip (envs in processes render in parallel)
            timing["env"], timing["render"] = timing["env"] + time.perf_counter() - t0 - render_s, timing["render"] + render_s
            dones = terminations | truncations
            # checkpoints where fixed-length episodes all end (a small run state); stock ones when due (episodes restart)
            stopping = stop["requested"]  # read once: a signal arriving after this is handled at the next step
            boundary = dones.all() or args.episodes == "stock"
            periodic = args.save_model and next_step // args.checkpoint_frequency > last_save // args.checkpoint_frequency
            save_now = boundary and (stopping or periodic or (args.save_model and iteration == num_iterations - 1))

            components = components or sorted(k for k in infos if k.startswith("reward_"))
            success = infos.get("success", np.zeros(args.num_envs))  # MountainCar: the flag reached in this episode so far
            gt = np.stack([gt_rewards, success] + [infos[k] for k in components], axis=1)
            train_now = global_step >= args.learning_starts and iteration % args.train_frequency == 0
            # rewards are needed before a gradient step, at the end and before a checkpoint (its CLIP return)
            wait = train_now or iteration == num_iterations - 1 or save_now
            transition = dict(obs=obs, next_obs=next_obs, actions=actions, terminations=terminations, dones=dones, gt=gt)
            for batch, clip_rewards in queue.add(global_step, wait, **transition, **({"frames": frames} if render else {})):
                rewards = clip_rewards if render else batch["gt"][:, 0]
                if not np.all(np.isfinite(rewards)):  # never let a NaN into the buffer: it would poison every Q-value
                    bad = f"{np.sum(~np.isfinite(rewards))} of {len(rewards)} frames at step {batch['step']}"
                    hint = "; on a GPU, --clip-dtype bfloat16 has float32's range" if args.reward == "clip" else ""
                    last_finite.stop(f"the {args.reward} reward is not finite for {bad}", networks(), hint)
                rb.add(batch["obs"], batch["next_obs"], batch["actions"], rewards, batch["terminations"])
                episodes.log(args, writer, progress, batch, rewards, clip_rewards, batch["step"], components)
            timing["reward_model"], timing["reward_wait"] = queue.busy, queue.waited

            if train_now:
                t0 = time.perf_counter()
                last_finite.snapshot(networks, args.gradient_steps)  # every ~100 gradient steps: copies cost time
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

                    qf1.requires_grad_(False), qf2.requires_grad_(False)  # the actor loss needs no critic weight gradients
                    pi, log_pi, _ = actor.get_action(b_obs)
                    min_qf_pi = torch.min(qf1(b_obs, pi), qf2(b_obs, pi))
                    qf1.requires_grad_(True), qf2.requires_grad_(True)
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
                    losses = f"qf_loss {qf_loss.item()}, actor_loss {actor_loss.item()}"
                    last_finite.stop(f"a SAC loss ({losses}) is not finite in the training phase at step {global_step}",
                                     hint="; lower --q-lr / --policy-lr / --ent-coef or check the rewards")  # fmt: skip
                timing["learning"] += time.perf_counter() - t0

                if iteration % (10 * args.train_frequency) == 0:
                    losses = dict(qf1_values=qf1_a_values.mean(), qf2_values=qf2_a_values.mean(), qf1_loss=qf1_loss)
                    losses.update(qf2_loss=qf2_loss, qf_loss=qf_loss, actor_loss=actor_loss, ent_coef=ent_coef)
                    losses.update(dict(ent_coef_loss=ent_coef_loss) if args.autotune else {})
                    utils.log_losses(writer, global_step, losses, progress, timing)

            last = iteration == num_iterations - 1
            if args.capture_video and (global_step // args.video_frequency != next_step // args.video_frequency or last):
                (result,) = evaluate(actor, eval_envs, device, reward_model, 1, args.seed + 10_000)
                utils.record_video(writer, run_name, next_step, result, fps=30)
            if save_now:  # the whole run state; with periodic, also the paper's checkpoints/step-<N>.pt (networks, all kept)
                state, kept = dict(log_ent_coef=log_ent_coef.detach().cpu(), components=components), periodic and networks()
                utils.save_run(args, run_name, learner, envs, rb, episodes, queue.pending, iteration + 1, kept or None, state)
                last_save = next_step
            if boundary and stopping:
                print(f"stopped; continue with: python {os.path.basename(__file__)} --resume runs/{run_name}/checkpoint.pt")
                break
            if dones.any():  # reset finished envs: their reset observations start the next episodes, never a transition
                reset_obs, _ = envs.reset(options={"reset_mask": dones})
                next_obs = np.where(dones[:, None], reset_obs, next_obs)
            obs = next_obs
            progress.update(next_step)
    finally:
        queue = queue and queue.close()
        utils.close_run(writer, envs)  # flushes TensorBoard, also on an error or a second Ctrl-C

    # a run that ended mid-episode (fixed-length episodes) keeps no resumable state: only its final networks, to evaluate
    final = {**networks(), "clip_return": episodes.clip_return()} if args.episodes == "fixed" and not dones.all() else None
    utils.finish_run(args, run_name, progress, (iteration + 1) * args.num_envs, timing, stop["requested"], __file__, final)


if __name__ == "__main__":
    utils.cli(main, Args)
