"""VLM-RM: SAC teaches a MuJoCo humanoid a task from one sentence, with a CLIP model as the reward.

Each frame is scored by CLIP against a goal sentence, optionally regularised towards a baseline sentence
(strength alpha). All that decides a run's numbers is here, top to bottom: flags, CLIP reward, what CLIP sees,
which frame scores each transition, SAC networks and buffer, the loop where frames become rewards.

    python vlmrm_sac_humanoid.py --goal "a humanoid robot kneeling"
"""

import copy
import hashlib
import math
import os
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal, Optional

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

mujoco = utils.import_mujoco()  # on headless EGL unless MUJOCO_GL says otherwise; gym.envs.mujoco with it


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
    """torch CPU threads; default 1 on CPU (more fight the env workers); 0 = torch's own"""
    log_episodes: bool = False
    """if toggled, print a line per finished episode, not only the progress line"""
    capture_video: bool = False
    """if toggled, save an MP4 of a deterministic episode every --video-frequency steps"""
    video_frequency: int = 100_000
    """environment steps between two evaluation videos (videos/<run_name>/)"""
    track: bool = False
    """if toggled, this experiment is tracked with Weights and Biases (synced from TensorBoard)"""
    wandb_project_name: str = "vlmrm"
    """the W&B project name"""
    wandb_entity: Optional[str] = None
    """the entity (team) of W&B's project"""
    save_model: bool = False
    """if toggled, checkpoint.pt (for --resume) and checkpoints/step-<N>.pt (all kept), see below"""
    checkpoint_frequency: int = 128_000
    """env steps between two checkpoints, the paper's (at the next episode end)"""
    save_buffer: bool = False
    """if toggled, checkpoints include the replay buffer, so --resume continues exactly"""
    resume: Optional[str] = None
    """a checkpoint.pt to continue until its --total-timesteps (stock episodes restart)"""
    evaluate: Optional[str] = None
    """a checkpoint.pt: roll out its deterministic policy (video + frames) instead of training"""
    eval_episodes: int = 3
    """number of episodes of an evaluation"""

    # Environment
    env_id: str = "Humanoid-v5"
    """a Gymnasium MuJoCo task (Humanoid: the paper's camera and look) or MountainCarContinuous-v0"""
    episodes: Literal["auto", "fixed", "stock"] = "auto"
    """auto: fixed with --reward clip, else stock; fixed: never terminated"""
    episode_length: Optional[int] = None
    """fixed episode length; default: the paper's, 100 (200 for MountainCarContinuous-v0)"""
    render_size: int = 480
    """square frame size: 480 = the paper's frames; 224 renders ~2x faster"""
    render_quality: Literal["fast", "high"] = "high"
    """high: shadows and reflections (the paper's); fast: off, ~4x faster"""
    realistic: bool = True
    """the realistic look CLIP rewards are better on (sky, slate floor, metal body; a car landscape)"""
    camera: Literal["paper", "tracking"] = "paper"
    """Humanoid: the paper's fixed frontal camera, or following the torso"""
    renderer: Literal["egl", "warp"] = "egl"
    """egl: OpenGL in each env process (the paper's); warp: MuJoCo Warp's ray tracer on the reward device"""
    supersample: int = 2
    """--renderer warp: rays per pixel per axis, averaged (1: the floor shows moire)"""

    # Reward
    reward: Literal["clip", "gt"] = "clip"
    """learn from the CLIP reward, or from the environment's own (e.g. to check SAC)"""
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
    """local weights file for --clip-model (overrides --clip-pretrained)"""
    clip_cache_dir: Optional[str] = None
    """where downloaded CLIP weights are cached (default: the Hugging Face cache)"""
    reward_batch_size: int = 256
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
    """softmax: the reward is 1 when the goal's probability is above this, in (0, 1)"""
    soft: bool = False
    """softmax: if toggled, the reward is the goal's probability itself instead of 0/1"""
    antialias: bool = False
    """if toggled, antialias the bicubic squash of frames to CLIP's input (off in the paper's code)"""

    # SAC (the paper's humanoid settings)
    total_timesteps: int = 10_000_000
    """total environment steps (summed over envs), rounded up to a multiple of --num-envs"""
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
    """random-action steps before learning starts"""
    policy_lr: float = 6e-4
    """the learning rate of the policy network optimizer"""
    q_lr: float = 6e-4
    """the learning rate of the Q network optimizer"""
    train_frequency: int = 100
    """vector steps between two training phases"""
    gradient_steps: int = 100
    """gradient steps per training phase"""
    ent_coef: float = 1.0
    """entropy coefficient (SAC's alpha; its initial value when autotuned, 1.0 as in Stable-Baselines3)"""
    autotune: bool = True
    """automatic tuning of the entropy coefficient towards entropy -|A| on the unit action box (as SB3)"""


def check_args(args: Args) -> None:
    """The defaults of --env-id, then bad flags refused, in one sentence each, before anything costly."""
    mountain_car = args.env_id == "MountainCarContinuous-v0"
    entry_point = str(getattr(gym.registry.get(args.env_id), "entry_point", ""))  # "" when not registered
    size = args.render_size
    for failed, message in [
        (not 16 <= size <= 2048, f"--render-size must be between 16 and 2048 pixels, got {size}."),
        (not entry_point, f"--env-id {args.env_id} is not a Gymnasium environment; use e.g. Humanoid-v5."),
        (
            "mujoco" not in entry_point and not mountain_car,
            f"--env-id {args.env_id} is no MuJoCo task or MountainCarContinuous-v0.",
        ),
        (args.env_id == "Humanoid-v4", "--env-id Humanoid-v4 takes not our scene nor camera: Humanoid-v5."),
    ]:
        if failed:
            raise utils.UserError(message)
    if args.renderer == "warp":  # imported only with the flag: the EGL path never loads Warp
        import vlmrm_warp

        vlmrm_warp.check_available(args, draw_device(args.cuda, args.reward_devices))
    if args.episode_length is None:
        args.episode_length = 200 if mountain_car else 100
    goal, baseline = DEFAULT_PROMPTS.get(args.env_id, ("", ""))  # other MuJoCo tasks: --goal (or --reward gt)
    args.goal = (goal,) if args.goal is None else args.goal
    args.baseline = (baseline,) if args.baseline is None else args.baseline
    # the authors: MountainCar cannot be solved without goal-baseline regularisation; theirs is unpublished
    if args.alpha is None:  # 0.5: measured on a test CLIP's reward shape (docs/language_proof.md)
        args.alpha = 0.5 if mountain_car else 0.0
    if args.episodes == "auto":  # resolved once: a checkpoint keeps the resolved value
        args.episodes = "fixed" if args.reward == "clip" else "stock"
    positive = """total_timesteps num_envs buffer_size batch_size train_frequency gradient_steps
episode_length eval_episodes reward_batch_size video_frequency checkpoint_frequency policy_lr q_lr ent_coef"""
    utils.check_common_args(args, positive, "alpha gamma tau", "actor")
    if softmax_problem(args.temperature, args.threshold) is not None:
        raise utils.UserError(softmax_problem(args.temperature, args.threshold) + ".")
    if args.reward_family == "softmax":
        negatives = (args.goal, args.negatives, "--reward-family softmax", DEFAULT_NEGATIVES)
        args.negatives = utils.resolve_negatives(*negatives)
    if args.reward == "clip":  # the flags first, then whether the run fits
        utils.check_clip_args(args)
    if args.evaluate is None:  # a rollout allocates no replay buffer
        probe = gym.make(args.env_id)  # cheap: no rendering, just the spaces
        # measured per env: an EGL worker 180 MB (MuJoCo) or 40 MB (MountainCar), one sending its state to
        # the warp renderer 15 MB (13.5 PSS + 1.4 a world in the trainer's); in process (gt) 2.5 MB
        rendering = 15e6 if args.renderer == "warp" else 40e6 if mountain_car else 180e6
        env_bytes = rendering if args.reward == "clip" else 2.5e6
        activations = 16 * 256  # floats per sampled transition: ~16 layers of 256, forward and backward
        spaces = (probe.observation_space, probe.action_space)
        utils.check_resources(args, *spaces, frame_shape_of(args), env_bytes, activations)


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
# Environment: Humanoid-v5 with the paper's camera and a realistic look; physics untouched
# ----------------------------------------------------------------------------------------------
# The paper's frontal FREE camera: fixed in the world (only a tracking camera follows a body)
HUMANOID_CAMERA = {"distance": 3.5, "lookat": np.array([0.0, 0.0, 1.0]), "elevation": -10.0, "azimuth": 180.0}
# the paper's look: PNGs drawn once by assets/make_textures.py, found beside vlmrm_utils.py (by a copy too)
TEXTURES = Path(utils.__file__).parent / "assets"


def textured_humanoid_xml() -> str:
    """The path of Gymnasium's Humanoid-v5 model with only its look changed (textures, materials, light):
    bodies, joints, geom sizes, masses, contacts, actuators and options untouched, so identical physics."""
    stock = Path(gym.envs.mujoco.__file__).parent / "assets" / "humanoid.xml"
    key = hashlib.sha1(stock.read_bytes() + bytes(TEXTURES) + b"v7").hexdigest()[:10]  # bump on a new look
    cache = os.path.join(tempfile.gettempdir(), f"vlmrm_humanoid_{key}")
    xml_path = os.path.join(cache, "humanoid_textured.xml")
    if os.path.exists(xml_path):
        return xml_path
    os.makedirs(cache, exist_ok=True)
    tmp = f".{os.getpid()}.tmp"  # written, then renamed: parallel env workers may build the file at once
    root = ET.parse(stock).getroot()
    # colours come from the materials: no stock tan body, green floor
    root.find("default/geom").attrib.pop("rgba", None)
    root.find("worldbody/geom[@name='floor']").attrib.pop("rgba", None)
    skybox = " ".join(f'file{f}="{TEXTURES}/{f}.png"' for f in "right left back front up down".split())
    look = f"""<asset><texture type="skybox" {skybox}/>
            <texture name="texplane" type="2d" file="{TEXTURES}/slate.png"/>
            <texture name="texgeom" type="cube" file="{TEXTURES}/metal.png"/>
            <material name="MatPlane" texture="texplane" texrepeat="60 60"
                      reflectance="0" shininess="0" specular="0"/>
            <material name="geom" texture="texgeom" texuniform="true" rgba="1 1 1 1"
                      specular="1" shininess="1"/>
            </asset>"""
    root.find("asset").clear()
    root.find("asset").extend(ET.fromstring(look))
    # one light from above, as in the paper; MuJoCo's default headlight stays (nothing brighter added)
    light = dict(diffuse="1 1 1", pos="0 0 1", dir="0 0 -1.5", specular="0.5 0.5 0.5")
    root.find("worldbody/light").attrib.update(light)
    ET.ElementTree(root).write(xml_path + tmp)
    os.replace(xml_path + tmp, xml_path)
    return xml_path


def warp_renderer(realistic, size, supersample, worlds, device, camera="paper", quality="high"):
    """--renderer warp: this scene drawn by MuJoCo Warp on `device`, `worlds` states per launch, through the
    paper's camera as model cameras (the ray tracer draws only those): fixed, or following the torso
    ("tracking"); quality "high" casts shadows (the scene has no reflections)."""
    import vlmrm_warp

    stock = Path(gym.envs.mujoco.__file__).parent / "assets" / "humanoid.xml"
    spec = mujoco.MjSpec.from_file(textured_humanoid_xml() if realistic else str(stock))
    model = vlmrm_warp.free_cameras(spec, HUMANOID_CAMERA, "torso")
    shadows = quality == "high"
    return vlmrm_warp.WarpRenderer(model, camera, size, supersample, worlds, device, shadows=shadows)


def draw_device(cuda: bool, reward_devices: tuple[str, ...]) -> torch.device:
    """--renderer warp: where the trainer and the evaluation env draw: the reward model's device (no copy)."""
    cuda = "cuda" if cuda and torch.cuda.is_available() else "cpu"
    return torch.device(reward_devices[0] if reward_devices else cuda)


# MountainCarContinuous-v0, the paper's MountainCar (trained with SAC): copied from vlmrm_dqn_classic.py
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


class NoEarlyTermination(gym.Wrapper):
    """Fixed-length episodes for any MuJoCo task: a fallen robot keeps being rendered and scored."""

    def step(self, action):
        obs, reward, _, truncated, info = self.env.step(action)
        return obs, reward, False, truncated, info


class MujocoRenderer(gym.Wrapper):
    """A MuJoCo env's frames as CLIP sees them: quality "fast" turns shadows and reflections off; `tracking`
    (a free camera, a body): that camera's distance and angles, looking at the body's centre of mass."""

    def __init__(self, env: gym.Env, quality: str, tracking: Optional[tuple[dict, str]] = None) -> None:
        super().__init__(env)
        self.flags_set = quality == "high"  # high keeps MuJoCo's defaults (both on)
        self.tracking = tracking

    def render(self) -> np.ndarray:
        base = self.env.unwrapped
        if self.tracking:
            camera, body = self.tracking
            lookat = base.data.subtree_com[base.model.body(body).id].copy()
            # the first render() creates the viewer from this configuration
            if base.mujoco_renderer.viewer is None:
                base.mujoco_renderer.default_cam_config = {**camera, "lookat": lookat}
            else:
                base.mujoco_renderer.viewer.cam.lookat[:] = lookat
        frame = self.env.render()
        # the viewer exists only after the first render(): set its flags, then render again
        if not self.flags_set:
            flags = base.mujoco_renderer.viewer.scn.flags
            flags[mujoco.mjtRndFlag.mjRND_SHADOW] = flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
            self.flags_set = True
            frame = self.env.render()
        return frame


class FrameAfterStep(gym.Wrapper):
    """Which frame scores which transition: the one rendered after its step (s_t+1), returned with the
    observation through the vector env's shared memory. A reset's frame is blank: no reset frame ever scores a
    transition. --renderer warp: the state the trainer draws it from. utils.frame_problem: a bad frame."""

    def __init__(self, env: gym.Env, frame_shape: tuple):
        super().__init__(env)
        self.drawn_later = hasattr(env, "state_shape")  # vlmrm_warp.WarpFrames
        frame_shape, dtype = (env.state_shape, np.float64) if self.drawn_later else (frame_shape, np.uint8)
        frames = utils.FrameSpace(frame_shape, dtype)
        self.observation_space = gym.spaces.Tuple((env.observation_space, frames))
        self.blank = np.zeros(frame_shape, dtype)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return (obs, self.blank), info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        start = time.perf_counter()
        frame = self.env.state() if self.drawn_later else self.env.render()
        info["render_s"] = time.perf_counter() - start  # of the round trip the loop times, the rendering
        problem = None if self.drawn_later else utils.frame_problem(self.env, frame, self.blank.shape)
        if problem:  # said by the trainer (utils.FramesInInfo): raised here, gymnasium adds its traceback
            info["bad_frame"], frame = problem, self.blank
        return (obs, frame), reward, terminated, truncated, info


def env_settings(args: Args) -> dict:
    """make_env's keywords from a run's flags: the env it trained in, to roll out and to score alike."""
    look = dict(render_size=args.render_size, render_quality=args.render_quality, realistic=args.realistic)
    look.update(camera=args.camera, renderer=args.renderer, supersample=args.supersample)
    look.update(cuda=args.cuda, reward_devices=args.reward_devices)  # warp: where the eval env draws
    return dict(episode_length=args.episode_length, fixed_length=args.episodes == "fixed", **look)


def frame_shape_of(args: Args) -> tuple[int, int, int]:
    """The frames CLIP scores: MountainCar draws its own 600x400, MuJoCo renders --render-size squares."""
    return (400, 600, 3) if args.env_id == "MountainCarContinuous-v0" else (*(args.render_size,) * 2, 3)


def make_env(env_id, seed, idx, episode_length, render_size, render_quality, realistic, camera="paper",
             fixed_length=True, renderer="egl", supersample=2, cuda=True, reward_devices=(),
             frame_shape=None):  # fmt: skip
    """CleanRL's thunk: fixed-length episodes (or the stock task's), rgb_array frames for the CLIP reward;
    `frame_shape`: the training envs, whose step returns the frame after it (FrameAfterStep)."""

    def thunk() -> gym.Env:
        # gym.make's TimeLimit; stock: the task's
        limit = {"max_episode_steps": episode_length} if fixed_length else {}
        if env_id == "MountainCarContinuous-v0":  # its own 600x400 frames, squashed by the reward model
            env = gym.make(env_id, render_mode="rgb_array", **limit)
            env = FixedLengthMountainCar(env) if fixed_length else env
            env = RealisticMountainCar(env) if realistic else env
        else:
            humanoid = env_id.startswith("Humanoid-")  # not HumanoidStandup: its own model and arguments
            kwargs = dict(render_mode="rgb_array", width=render_size, height=render_size, **limit)
            if humanoid:  # fixed length: a fallen humanoid keeps being rendered and rewarded until the end
                kwargs.update(default_camera_config=HUMANOID_CAMERA)
                kwargs.update(terminate_when_unhealthy=not fixed_length)
                kwargs.update({"xml_file": textured_humanoid_xml()} if realistic else {})
            env = gym.make(env_id, **kwargs)
            env = NoEarlyTermination(env) if fixed_length and not humanoid else env
            if renderer == "warp":
                import vlmrm_warp

                def one_world():  # made at the first render() (evaluation, videos), where the reward scores
                    look = (realistic, render_size, supersample, 1, draw_device(cuda, reward_devices))
                    return warp_renderer(*look, camera, render_quality)

                env = vlmrm_warp.WarpFrames(env, one_world)
            else:
                tracking = (HUMANOID_CAMERA, "torso") if humanoid and camera == "tracking" else None
                env = MujocoRenderer(env, render_quality, tracking)
            env.observation_space.seed(seed + idx)
        env.action_space.seed(seed + idx)
        return env if frame_shape is None else FrameAfterStep(env, frame_shape)

    return thunk


# ----------------------------------------------------------------------------------------------
# SAC
# ----------------------------------------------------------------------------------------------
class SoftQNetwork(nn.Module):
    def __init__(self, env):
        super().__init__()
        obs_dim = np.prod(env.single_observation_space.shape)
        action_dim = np.prod(env.single_action_space.shape)
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
        obs_dim = np.prod(env.single_observation_space.shape)
        action_dim = np.prod(env.single_action_space.shape)
        self.trunk = nn.Sequential(nn.Linear(obs_dim, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
        self.fc_mean = nn.Linear(256, action_dim)
        self.fc_logstd = nn.Linear(256, action_dim)
        # actions live on the tanh-squashed unit box, where the buffer and critics see them (as in SB3)
        low = env.single_action_space.low
        high = env.single_action_space.high
        self.register_buffer("action_scale", torch.tensor((high - low) / 2.0, dtype=torch.float32))
        self.register_buffer("action_bias", torch.tensor((high + low) / 2.0, dtype=torch.float32))

    def forward(self, x):
        h = self.trunk(x)
        return self.fc_mean(h), torch.clamp(self.fc_logstd(h), LOG_STD_MIN, LOG_STD_MAX)

    def to_env(self, y):
        """Unit-box action -> the env's bounds."""
        return y * self.action_scale + self.action_bias

    def get_action(self, x):
        """(sampled unit-box action, its log-probability there, the deterministic action in env units)."""
        mean, log_std = self(x)
        normal = torch.distributions.Normal(mean, log_std.exp(), validate_args=False)  # NaN: the loop's check
        x_t = normal.rsample()  # reparameterisation trick
        y_t = torch.tanh(x_t)
        # change of variables through tanh only: the paper's (SB3's) entropy scale, whatever the env's bounds
        log_prob = normal.log_prob(x_t) - torch.log(1 - y_t.pow(2) + 1e-6)
        return y_t, log_prob.sum(1, keepdim=True), self.to_env(torch.tanh(mean))


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


def make_learner(envs, args, device) -> dict:
    """Everything a gradient step changes, by name: checkpointed and restored together."""
    actor = Actor(envs).to(device)
    qf1, qf2, qf1_target, qf2_target = (SoftQNetwork(envs).to(device) for _ in range(4))
    qf1_target.load_state_dict(qf1.state_dict())
    qf2_target.load_state_dict(qf2.state_dict())
    log_ent_coef = torch.tensor([math.log(args.ent_coef)], device=device, requires_grad=args.autotune)
    adam = partial(optim.Adam, fused=True)  # fused: one kernel per step
    learner = dict(actor=actor, qf1=qf1, qf2=qf2, qf1_target=qf1_target, qf2_target=qf2_target)
    learner["q_optimizer"] = adam([*qf1.parameters(), *qf2.parameters()], lr=args.q_lr)
    learner["actor_optimizer"] = adam(actor.parameters(), lr=args.policy_lr)
    learner["ent_coef_optimizer"] = adam([log_ent_coef], lr=args.q_lr) if args.autotune else None
    learner["log_ent_coef"] = log_ent_coef
    return learner


def deterministic(actor: Actor, device: torch.device):
    """The policy an evaluation rolls out (utils.evaluate): the mean action, in env units."""
    return lambda x: actor.get_action(torch.as_tensor(x, dtype=torch.float32, device=device))[2].cpu().numpy()


def score(frames, reward_model: CLIPReward, draw, timer) -> np.ndarray:
    """A chunk's CLIP rewards, in the scoring thread (--renderer warp: `draw` makes its frames first)."""
    if draw is not None:
        with timer("draw"):
            frames = draw(frames)
    with timer("reward_model"):
        return reward_model(frames)


def evaluate_checkpoint(run: utils.Run, eval_envs: gym.vector.VectorEnv, seed: int) -> None:
    """--evaluate: the checkpoint's deterministic policy, its episodes saved under videos/<run_name>/."""
    args, device = run.args, run.device
    reward_model = make_reward_model(args, device) if args.reward == "clip" else None
    actor = Actor(eval_envs).to(device)
    actor.load_state_dict(run.checkpoint["actor"])
    episodes = utils.evaluate(deterministic(actor, device), eval_envs, reward_model, args.eval_episodes, seed)
    utils.save_episodes(episodes, run.name)


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
# what --evaluate takes from the checkpoint unless given: the env, the frames CLIP saw and the reward model
EVALUATE_AS_TRAINED = """env_id episodes episode_length render_size render_quality realistic camera renderer
supersample reward goal baseline alpha clip_model clip_pretrained clip_checkpoint clip_cache_dir
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
            run.check_fits(eval_envs, make_learner(eval_envs, args, torch.device("cpu")))
    if args.evaluate is not None:  # roll the checkpoint's policy out
        return evaluate_checkpoint(run, eval_envs, eval_seed)

    # each env renders the frame after its step and returns it with the step (with the ground truth: nothing)
    clip = args.reward == "clip"
    frame_shape = frame_shape_of(args)
    vector_env = gym.vector.AsyncVectorEnv if clip else gym.vector.SyncVectorEnv
    env_fns = [env(args.seed, i, frame_shape=frame_shape if clip else None) for i in range(args.num_envs)]
    # autoreset off: the loop resets finished envs, so no reset observation or frame forms a transition
    envs = utils.make_vector_env(vector_env, env_fns, gym.vector.AutoresetMode.DISABLED, frames=clip)
    scorer = ThreadPoolExecutor(1)  # CLIP scores a chunk of frames here while the envs step on
    with run.closing(envs, scorer):
        reward_model = make_reward_model(args, device) if clip else None  # CUDA: after the envs fork
        learner = make_learner(envs, args, device)
        actor, qf1, qf2, qf1_target = learner["actor"], learner["qf1"], learner["qf2"], learner["qf1_target"]
        qf2_target, log_ent_coef = learner["qf2_target"], learner["log_ent_coef"]
        q_optimizer, actor_optimizer = learner["q_optimizer"], learner["actor_optimizer"]
        q_params = [*qf1.parameters(), *qf2.parameters()]
        target_params = [*qf1_target.parameters(), *qf2_target.parameters()]
        space = envs.single_action_space
        target_entropy = -float(np.prod(space.shape))
        rb = ReplayBuffer(args.buffer_size, envs.observation_space.shape[1:], space.shape, np.float32, device)
        networks = lambda: {k: learner[k].state_dict() for k in ("actor", "qf1", "qf2")}  # noqa: E731
        policy = deterministic(actor, device)  # its evaluation episodes: videos and the final report
        evaluation = partial(utils.evaluate, policy, eval_envs, reward_model, seed=eval_seed)
        action_scale, action_bias = (space.high - space.low) / 2, (space.high + space.low) / 2  # on the host
        gt_success = (lambda ep: ep["success"]) if args.env_id == "MountainCarContinuous-v0" else None
        run.start(networks(), rb, reward_model, frame_shape, gt_success)
        draw = None  # --renderer warp: the envs return states, drawn on the reward's device before CLIP
        if args.renderer == "warp" and clip:
            look = (args.realistic, args.render_size, args.supersample, args.num_envs)
            look += (draw_device(args.cuda, args.reward_devices), args.camera, args.render_quality)
            draw = warp_renderer(*look).draw
        chunk = args.reward_batch_size * max(1, len(args.reward_devices))  # frames CLIP scores at once
        waiting, scoring = [], deque()  # transitions without a reward; chunks being scored, oldest first
        recent = deque(maxlen=100)  # the paper ranks checkpoints by the mean CLIP return of the last 100
        components = []  # the env's own reward terms (e.g. reward_forward), logged as diagnostics

        obs, _ = envs.reset(seed=args.seed)
        if run.checkpoint:  # a resumed run as saved; its envs start new episodes from their saved generators
            obs = run.restore(learner, envs, rb, recent)
        ent_coef = log_ent_coef.exp().detach()  # a tensor: no host-device sync per gradient step
        for iteration in run.iterations():
            global_step = iteration * args.num_envs
            if global_step < args.learning_starts:  # unit-box actions, from the seeded, checkpointed RNG
                actions = np.random.uniform(-1, 1, size=(args.num_envs, *space.shape)).astype(np.float32)
            else:
                with torch.no_grad():
                    actions = actor.get_action(torch.as_tensor(obs, dtype=torch.float32, device=device))[0]
                actions = actions.cpu().numpy()
            with run.timer("env"):
                env_actions = (actions * action_scale + action_bias).astype(np.float32)
                next_obs, gt_rewards, terminations, truncations, infos = envs.step(env_actions)
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
                frames = batch.pop("frames", None)
                future = scorer.submit(score, frames, reward_model, draw, run.timer) if clip else None
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
                    run.snapshot(networks, args.gradient_steps)
                    finite = torch.ones((), dtype=torch.bool, device=device)  # read once per phase
                    for _ in range(args.gradient_steps):
                        b_obs, b_actions, b_rewards, b_next_obs, b_terminations = rb.sample(args.batch_size)
                        with torch.no_grad():
                            next_actions, next_log_pi, _ = actor.get_action(b_next_obs)
                            qf1_next_target = qf1_target(b_next_obs, next_actions)
                            qf2_next_target = qf2_target(b_next_obs, next_actions)
                            min_q_next = torch.min(qf1_next_target, qf2_next_target) - ent_coef * next_log_pi
                            # time limits are truncations: bootstrapped (the paper's code stopped there)
                            next_q_value = b_rewards + (1 - b_terminations) * args.gamma * min_q_next.view(-1)
                        qf1_a_values = qf1(b_obs, b_actions).view(-1)
                        qf2_a_values = qf2(b_obs, b_actions).view(-1)
                        qf1_loss = F.mse_loss(qf1_a_values, next_q_value)
                        qf2_loss = F.mse_loss(qf2_a_values, next_q_value)
                        qf_loss = 0.5 * (qf1_loss + qf2_loss)  # SB3's scale (CleanRL's sum: twice the step)
                        q_optimizer.zero_grad()
                        qf_loss.backward()
                        q_optimizer.step()

                        pi, log_pi, _ = actor.get_action(b_obs)
                        qf1.requires_grad_(False)  # the actor's loss needs no critic weight gradients
                        qf2.requires_grad_(False)
                        min_qf_pi = torch.min(qf1(b_obs, pi), qf2(b_obs, pi))
                        qf1.requires_grad_(True)
                        qf2.requires_grad_(True)
                        actor_loss = (ent_coef * log_pi - min_qf_pi).mean()
                        actor_optimizer.zero_grad()
                        actor_loss.backward()
                        actor_optimizer.step()
                        finite &= torch.isfinite(qf_loss) & torch.isfinite(actor_loss)

                        if args.autotune:  # SB3's loss: the gradient flows through log alpha itself
                            ent_coef_loss = -(log_ent_coef * (log_pi.detach() + target_entropy)).mean()
                            learner["ent_coef_optimizer"].zero_grad()
                            ent_coef_loss.backward()
                            learner["ent_coef_optimizer"].step()
                            ent_coef = log_ent_coef.exp().detach()

                        with torch.no_grad():
                            for param, target_param in zip(q_params, target_params):
                                target_param.lerp_(param, args.tau)
                losses = dict(qf1_values=qf1_a_values.mean(), qf2_values=qf2_a_values.mean())
                losses.update(qf1_loss=qf1_loss, qf2_loss=qf2_loss, qf_loss=qf_loss, actor_loss=actor_loss)
                losses.update(ent_coef=ent_coef)
                losses.update({"ent_coef_loss": ent_coef_loss} if args.autotune else {})
                run.log_losses(global_step, losses, finite, "--q-lr / --policy-lr / --ent-coef")

            run.video(evaluation)
            # the best checkpoint has the highest mean CLIP return of the last 100 episodes
            if due and run.save(learner, envs, rb, networks, recent, np.mean(recent) if recent else math.nan):
                break  # Ctrl-C or SIGTERM: saved, stopped
            if dones.any():  # reset finished envs: the reset observations start episodes, never a transition
                reset_obs, _ = envs.reset(options={"reset_mask": dones})
                next_obs = np.where(dones[:, None], reset_obs, next_obs)
            obs = next_obs
        run.finish(networks, np.mean(recent) if recent else math.nan, evaluation)  # --save-model: evaluated


if __name__ == "__main__":
    utils.cli(main, Args)
