"""Test fixture, not a product feature: small CLIPs trained on captioned CartPole or MountainCar frames, used as a
user's local model.

Pretrained CLIP weights cannot be downloaded in CI, so the tests that show a *sentence* teaching behaviour need a CLIP
that knows what an upright pole (a car at the flag) looks like. This trains one per task, on frames rendered by the
project's own env at states set directly (CartPole: `vlmrm_dqn_classic.make_env`, pole angle over the whole circle, cart
anywhere on the track; MountainCar: `vlmrm_sac_humanoid.make_env` of MountainCarContinuous-v0, realistic look, the car
anywhere on the road), each captioned from its state in several phrasings per state class. Model: open_clip's own
(`create_model` of the task's config, registered with `add_model_config`), open_clip's own `ClipLoss`, images through
open_clip's standard PIL transform (`image_transform`, resize mode "squash": the scripts squash the 3:2 frames to the
square input, as the paper's code did). The saved file is a plain state dict, loaded by the scripts through
`--clip-model tests/vlmrm-<task>.json --clip-checkpoint <file>` like any local open_clip weights.

The RL prompts are not training captions (the language-proof tests check words and embeddings), but they are
in-vocabulary paraphrases: their words are the captions' words. Such a model proves the pipeline text -> reward ->
behaviour, not the zero-shot quality of a web-scale CLIP.

    python tests/clip_trainer.py /tmp/cartpole-clip.pt                  # ~70 s of one idle CPU core
    python tests/clip_trainer.py /tmp/mountaincar-clip.pt mountaincar
"""

import hashlib
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "tests" / "vlmrm-cartpole.json"  # CartPole's (the MountainCar task has its own, same architecture)
sys.path.insert(0, str(ROOT))
os.environ.setdefault("SDL_VIDEODRIVER", "dummy")

SEED = 0
NUM_FRAMES = 1024
STEPS = 200
BATCH_SIZE = 128
LEARNING_RATE = 2e-3

# state classes by |theta| in degrees (upper bounds), each with several phrasings; {side} is "left" or "right"
CLASSES = [
    (
        5,
        [
            "the pole is vertically upright on top of the cart",
            "a cart with its pole standing straight up",
            "the pole is balanced upright above the cart",
            "an upright pole on a cart, perfectly vertical",
        ],
    ),
    (
        20,
        [
            "the pole is slightly tilted to the {side}",
            "the pole leans a little to the {side} of the cart",
            "a nearly upright pole, tipping slightly {side}",
        ],
    ),
    (
        55,
        [
            "the pole is tilted far to the {side}",
            "the pole leans steeply to the {side} of the cart",
            "a strongly tilted pole, leaning {side}",
        ],
    ),
    (
        115,
        [
            "the pole has fallen flat to the {side}",
            "the pole lies horizontal on the {side} side of the cart",
            "a fallen pole lying flat, pointing {side}",
        ],
    ),
    (
        181,
        [
            "the pole hangs upside down below the cart",
            "the pole points down underneath the cart",
            "an inverted pole hanging under the track",
        ],
    ),
]
CART = [
    (-1.0, "the cart is at the left end of the track"),
    (1.0, "the cart is in the middle of the track"),
    (2.5, "the cart is at the right end of the track"),
]  # x upper bounds (track: +-2.4)


def caption(theta: float, x: float, rng: random.Random) -> str:
    """A caption of a CartPole state: one phrasing of its pole-angle class, sometimes with the cart's place.

    theta > 0 draws the pole leaning right (Gymnasium's renderer), so theta > 0 is "right".
    """
    degrees = abs(math.degrees(theta))
    phrasings = next(p for bound, p in CLASSES if degrees < bound)
    text = rng.choice(phrasings).format(side="right" if theta > 0 else "left")
    if rng.random() < 0.5:
        text += ", " + next(t for bound, t in CART if x < bound)
    return text


def all_captions() -> set[str]:
    """Every caption the trainer can write (for the test that the RL prompts are not among them)."""
    out = set()
    for _, phrasings in CLASSES:
        for p in phrasings:
            for side in ("left", "right"):
                out |= {p.format(side=side)} | {p.format(side=side) + ", " + t for _, t in CART}
    return out


def render_dataset(num_frames: int, seed: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """CartPole: uint8 frames (N, 400, 600, 3), states (N, 2) = (x, theta) and captions, from the training script's own env."""
    from vlmrm_dqn_classic import make_env

    rng = random.Random(seed)
    env = make_env("CartPole-v1", seed, 0, 200, False)()
    env.reset(seed=seed)  # the env renders only after a reset
    frames, states, captions = [], [], []
    for i in range(num_frames):
        # half the states near the top (the classes RL cares about are narrow there), half anywhere on the circle
        theta = rng.uniform(-math.pi / 3, math.pi / 3) if i % 2 else rng.uniform(-math.pi, math.pi)
        x = rng.uniform(-2.4, 2.4)
        env.unwrapped.state = np.array([x, 0.0, theta, 0.0])
        frames.append(env.render())
        states.append((x, theta))
        captions.append(caption(theta, x, rng))
    env.close()
    return np.stack(frames), np.array(states), captions


# ---------------------------------------------------------------------------- MountainCarContinuous-v0
# state classes by the car's x (upper bounds; the road is 0.45 sin(3x) + 0.55 on [-1.2, 0.6], the valley's floor at
# x = -0.52, the paper's flag at 0.45), each with several phrasings
MOUNTAINCAR_CLASSES = [
    (
        -1.0,
        [
            "the car is high up near the top of the left hill, far from the flag",
            "a red car high on the left slope, far from the yellow flag",
            "the car climbs high up the left side of the valley",
        ],
    ),
    (
        -0.75,
        [
            "the car is halfway up the left slope",
            "a red car on the left hillside, far from the flag",
            "the car rolls down the left side towards the valley",
        ],
    ),
    (
        -0.3,
        [
            "the car is down in the valley",
            "a red car low in the valley between two hills",
            "the car sits at the bottom of the valley, far from the flag",
        ],
    ),
    (
        0.0,
        [
            "the car is low on the right slope, far from the flag",
            "a red car starting up the right hill",
            "the car is at the foot of the right hillside",
        ],
    ),
    (
        0.25,
        [
            "the car is halfway up the right slope",
            "a red car climbing the right hill towards the yellow flag",
            "the car is high on the right hillside, below the flag",
        ],
    ),
    (
        0.42,
        [
            "the car is high up near the top of the right hill, close to the flag",
            "a red car almost at the yellow flag",
            "the car is just below the peak of the right hill",
        ],
    ),
    (
        math.inf,
        [
            "the car has reached the yellow flag on the hilltop",
            "a red car at the summit beside the flag",
            "the car stands next to the flag at the peak of the right hill",
            "a red car parked on the highest point, by the yellow flag",
        ],
    ),
]
MOUNTAINCAR_PLACES = ["on a mountain road", "in the mountains"]  # appended to half the captions, any state


def mountaincar_caption(x: float, rng: random.Random) -> str:
    """A caption of a MountainCar state: one phrasing of its position class, sometimes with the scene."""
    text = rng.choice(next(p for bound, p in MOUNTAINCAR_CLASSES if x < bound))
    return text + ", " + rng.choice(MOUNTAINCAR_PLACES) if rng.random() < 0.5 else text


def mountaincar_all_captions() -> set[str]:
    phrasings = [p for _, ps in MOUNTAINCAR_CLASSES for p in ps]
    return set(phrasings) | {p + ", " + place for p in phrasings for place in MOUNTAINCAR_PLACES}


def mountaincar_render_dataset(num_frames: int, seed: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """MountainCar: uint8 frames (N, 400, 600, 3), states (N, 1) = x and captions, from the SAC script's own env."""
    from vlmrm_sac_humanoid import make_env

    rng = random.Random(seed)
    env = make_env("MountainCarContinuous-v0", seed, 0, 200, 64, "fast", True)()  # realistic look, the flag at 0.45
    env.reset(seed=seed)  # the env renders only after a reset
    frames, states, captions = [], [], []
    for i in range(num_frames):
        # half the states anywhere on the road, half on the right slope (the classes RL cares about are narrow there)
        x = rng.uniform(0.0, 0.5) if i % 2 else rng.uniform(-1.2, 0.5)
        env.unwrapped.state = np.array([x, 0.0])
        frames.append(env.render())
        states.append((x,))
        captions.append(mountaincar_caption(x, rng))
    env.close()
    return np.stack(frames), np.array(states), captions


# ---------------------------------------------------------------------------- training, for either task
@dataclass(frozen=True)
class Task:
    name: str
    config: Path  # the open_clip model config (--clip-model)
    render_dataset: Callable[[int, int], tuple[np.ndarray, np.ndarray, list[str]]]
    all_captions: Callable[[], set[str]]
    env_source: Path  # the script whose make_env renders the frames: part of the cache key


CARTPOLE = Task("cartpole", CONFIG, render_dataset, all_captions, ROOT / "vlmrm_dqn_classic.py")
MOUNTAINCAR = Task(
    "mountaincar",
    ROOT / "tests" / "vlmrm-mountaincar.json",
    mountaincar_render_dataset,
    mountaincar_all_captions,
    ROOT / "vlmrm_sac_humanoid.py",
)
TASKS = {task.name: task for task in (CARTPOLE, MOUNTAINCAR)}


def model_and_transform(config: Path = CONFIG):
    """open_clip's model of `config` (random init) and its standard PIL transform, squash mode."""
    import open_clip

    open_clip.add_model_config(str(config))
    model = open_clip.create_model(config.stem, pretrained=None)
    cfg = open_clip.get_model_preprocess_cfg(model)
    transform = open_clip.image_transform(
        cfg["size"], is_train=False, mean=cfg["mean"], std=cfg["std"], resize_mode="squash", interpolation="bicubic"
    )
    return model, transform, open_clip.get_tokenizer(config.stem)


def train(
    path: str, task: Task = CARTPOLE, num_frames: int = NUM_FRAMES, steps: int = STEPS, seed: int = SEED, verbose: bool = True
) -> str:
    """Train the task's model and save its state dict to `path`; returns `path`."""
    from PIL import Image

    start = time.perf_counter()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    frames, _, captions = task.render_dataset(num_frames, seed)
    model, transform, tokenizer = model_and_transform(task.config)
    images = torch.stack([transform(Image.fromarray(f)) for f in frames])  # preprocessed once: no augmentation
    texts = tokenizer(captions)
    del frames
    if verbose:
        print(f"dataset: {len(images)} frames, {len(set(captions))} distinct captions, {time.perf_counter() - start:.0f} s")

    return fit(model, images, texts, steps, seed, path, start, every=50 if verbose else 0)


def fit(model, images: torch.Tensor, texts: torch.Tensor, steps: int, seed: int, path: str, start: float, every: int) -> str:
    """open_clip's contrastive loss, AdamW on a one-cycle schedule, seeded batches; saves the state dict to `path`.

    Shared with experiments/humanoid_clip.py: one training recipe for every small CLIP trained here."""
    import open_clip

    loss_fn = open_clip.ClipLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, LEARNING_RATE, total_steps=steps, pct_start=0.1)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for step in range(steps):
        batch = torch.randperm(len(images), generator=generator)[:BATCH_SIZE]
        image_features, text_features, logit_scale = model(images[batch], texts[batch])
        loss = loss_fn(image_features, text_features, logit_scale)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        if every and (step % every == every - 1 or step == steps - 1):
            print(f"clip step {step + 1}: loss {loss.item():.3f}, {time.perf_counter() - start:.0f} s")
    model.eval()
    torch.save(model.state_dict(), path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


def cache_key(task: Task = CARTPOLE) -> str:
    """Hash of everything that determines the weights: this file, the config, the env code, torch and open_clip."""
    import open_clip

    h = hashlib.sha256()
    for f in (Path(__file__), task.config, task.env_source):
        h.update(f.read_bytes())
    h.update(f"{torch.__version__} {open_clip.__version__}".encode())
    return h.hexdigest()[:16]


def cached_checkpoint(folder: str | None = None, task: Task = CARTPOLE) -> str:
    """The task's trained checkpoint, trained once per cache key (under ~/.cache/vlmrm-tests unless `folder` is given)."""
    folder = Path(folder or os.environ.get("VLMRM_TEST_CACHE", Path.home() / ".cache" / "vlmrm-tests"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{task.name}-clip-{cache_key(task)}.pt"
    if not path.exists():  # on one thread, as the tests train it: float sums (so the weights) can depend on the count
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            train(str(path), task)
        finally:
            torch.set_num_threads(threads)
    return str(path)


if __name__ == "__main__":
    task = TASKS[sys.argv[2] if len(sys.argv) > 2 else "cartpole"]
    print(train(sys.argv[1] if len(sys.argv) > 1 else f"{task.name}-clip.pt", task))
