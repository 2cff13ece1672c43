"""Experiment fixture, not a product feature: a small CLIP trained on captioned frames of the textured humanoid.

Pretrained CLIP weights cannot be downloaded here, so the humanoid experiment (experiments/humanoid_arms.py) needs a CLIP
that knows raised arms when it sees them. This trains one, as tests/clip_trainer.py does for CartPole: open_clip's own
model (experiments/humanoid-clip.json), loss (`ClipLoss`) and PIL transform (squash mode), on frames rendered by
`vlmrm_sac_humanoid.make_env` (the paper's camera and look) at states from random rollouts, half of them with the arm
joints set to random angles in their ranges and a third of the episodes starting on the floor, face up or down
(set through the MuJoCo data, then mj_forward). Captions come from the
simulator state: the body's posture (standing, toppling, lying on its back, face down, on its side) and how many hands
are above the head. A domain-trained CLIP proves the pipeline (text -> reward -> SAC -> behaviour), not the zero-shot
quality of web-scale CLIPs; the RL prompts are in-vocabulary paraphrases of these captions, not new words.

    python experiments/humanoid_clip.py /tmp/humanoid-clip.pt
"""

import hashlib
import os
import random
import re
import sys
import time
from pathlib import Path

import numpy as np
import open_clip  # before any EGL context: imported after one, it crashed the process here (segmentation fault)
import torch

ROOT = Path(__file__).resolve().parent.parent
CONFIG = Path(__file__).resolve().parent / "humanoid-clip.json"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # clip_trainer: the training recipe of every small CLIP here
os.environ.setdefault("MUJOCO_GL", "egl")

import clip_trainer  # noqa: E402

SEED = 0
NUM_FRAMES = 2000
STEPS = 400
EPISODE_STEPS = 60  # random-action steps per data episode (the humanoid falls after ~20-30)
ARMS = ["right_shoulder1", "right_shoulder2", "right_elbow", "left_shoulder1", "left_shoulder2", "left_elbow"]

POSTURES = {
    "standing": ["a metal humanoid standing upright", "a robot standing on the slate floor"],
    "toppling": ["a humanoid robot bent over, toppling", "a robot falling towards the floor"],
    "back": ["a humanoid robot lying on its back", "a robot lying face up on the floor"],
    "face_down": ["a humanoid robot lying face down", "a robot lying on its front on the floor"],
    "side": ["a humanoid robot lying on its side", "a robot lying sideways on the floor"],
}
ARM_PHRASES = {  # by the number of hands above the head
    2: ["both arms raised high above its head", "both hands lifted up over its head", "its arms stretched up overhead"],
    1: ["one arm raised above its head, the other low", "a single hand lifted over its head"],
    0: ["both hands down below its head", "its arms lowered beneath its head", "arms held low, not above its head"],
}


def hands_above_head(data) -> int:
    """How many hands (the centres of the hand geoms) are higher than the head's centre: the ground truth."""
    head = data.geom("head").xpos[2]
    return int(data.geom("right_hand").xpos[2] > head) + int(data.geom("left_hand").xpos[2] > head)


def posture(data) -> str:
    """The torso's posture from its height and orientation (the humanoid faces +x in its own frame)."""
    torso = data.body("torso")
    axes = torso.xmat.reshape(3, 3)  # columns: the torso's x (forward), y, z (up) axes in the world
    forward_up, up_up, height = axes[2, 0], axes[2, 2], torso.xpos[2]
    if up_up > 0.8 and height > 1.0:
        return "standing"
    if height > 0.5:
        return "toppling"
    return "back" if forward_up > 0.5 else "face_down" if forward_up < -0.5 else "side"


def caption(state_posture: str, hands: int, rng: random.Random) -> str:
    return f"{rng.choice(POSTURES[state_posture])} with {rng.choice(ARM_PHRASES[hands])}"


def all_captions() -> list[str]:
    """Every caption the trainer can write (for the check that the RL prompts are not among them)."""
    return sorted({f"{p} with {a}" for ps in POSTURES.values() for p in ps for arms in ARM_PHRASES.values() for a in arms})


def render_dataset(num_frames: int, seed: int, render_size: int = 64, quality: str = "fast"):
    """uint8 frames (N, S, S, 3), hands above the head (N,), postures and captions, from the SAC script's own env."""
    import mujoco

    from vlmrm_sac_humanoid import make_env

    rng, np_rng = random.Random(seed), np.random.default_rng(seed)
    env = make_env("Humanoid-v5", seed, 0, EPISODE_STEPS, render_size, quality, True)()
    model, data = env.unwrapped.model, env.unwrapped.data
    arm_joints = [model.joint(name).id for name in ARMS]
    frames, hands, postures, captions = [], [], [], []
    episode = 0
    while len(frames) < num_frames:
        env.reset(seed=seed + episode)
        episode += 1
        if episode % 3 == 0:  # start a third lying face up or face down: random actions topple it mostly backwards
            data.qpos[2], pitch = 0.25, rng.choice([-1, 1]) * np.pi / 4  # half the pitch angle, +-90 deg about y
            data.qpos[3:7] = [np.cos(pitch), 0.0, np.sin(pitch), 0.0]
            mujoco.mj_forward(model, data)
        for t in range(EPISODE_STEPS):
            env.step(env.action_space.sample())
            if t % 2:  # every second step: neighbouring frames are near copies
                continue
            if rng.random() < 0.5:  # arms anywhere in their joint ranges: raised arms are rare in random rollouts
                for j in arm_joints:
                    data.qpos[model.jnt_qposadr[j]] = np_rng.uniform(*model.jnt_range[j])
                mujoco.mj_forward(model, data)
            frames.append(env.render())
            hands.append(hands_above_head(data))
            postures.append(posture(data))
            captions.append(caption(postures[-1], hands[-1], rng))
            if len(frames) == num_frames:
                break
    env.close()
    return np.stack(frames), np.array(hands), postures, captions


def train(path: str, num_frames: int = NUM_FRAMES, steps: int = STEPS, seed: int = SEED, render_size: int = 64,
          quality: str = "fast", verbose: bool = True) -> str:  # fmt: skip
    """Train the model on one torch thread and save its state dict to `path`; returns `path`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # float sums (so the weights) depend on the count, which the cache key cannot see
    try:
        return train_on_this_thread(path, num_frames, steps, seed, render_size, quality, verbose)
    finally:
        torch.set_num_threads(threads)


def train_on_this_thread(path: str, num_frames: int, steps: int, seed: int, render_size: int, quality: str, verbose) -> str:
    from PIL import Image

    start = time.perf_counter()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    frames, hands, postures, captions = render_dataset(num_frames, seed, render_size, quality)
    model, transform, tokenizer = clip_trainer.model_and_transform(CONFIG)
    images = torch.stack([transform(Image.fromarray(f)) for f in frames])  # preprocessed once: no augmentation
    texts = tokenizer(captions)
    if verbose:
        counts = {k: int((hands == k).sum()) for k in (0, 1, 2)}
        kinds = {p: postures.count(p) for p in POSTURES}
        print(f"dataset: {len(images)} frames, hands above head {counts}, postures {kinds}, "
              f"{len(set(captions))} distinct captions, {time.perf_counter() - start:.0f} s")  # fmt: skip
    return clip_trainer.fit(model, images, texts, steps, seed, path, start, every=100 if verbose else 0)


def scene_files() -> bytes:
    """The look the frames are drawn from, as files: the textured model's XML (the files' folders aside) and every file it
    names. Read from the files, not their code: they are cached in a temp folder under a hand-bumped tag, so a look
    change without the bump (or a stale folder) draws other frames under the same source, and the look's code may move."""
    import mujoco

    from vlmrm_sac_humanoid import textured_humanoid_xml

    xml = Path(textured_humanoid_xml())
    text = xml.read_text()
    names = sorted(set(re.findall(r'file\w*="([^"]+)"', text)))
    files = [Path(xml.parent, name).read_bytes() for name in names]
    for name in names:  # the files' bytes count, not where this checkout keeps them
        text = text.replace(name, Path(name).name)
    return b"".join([text.encode(), *files, mujoco.__version__.encode()])


def cache_key(**settings) -> str:
    """Hash of what determines the weights: this file, the recipe, the config, the env code, the scene's files, the
    settings, the versions."""
    h = hashlib.sha256()
    for f in (Path(__file__), Path(clip_trainer.__file__), CONFIG, ROOT / "vlmrm_sac_humanoid.py"):
        h.update(f.read_bytes())
    h.update(scene_files())
    h.update(f"{sorted(settings.items())} {torch.__version__} {open_clip.__version__}".encode())
    return h.hexdigest()[:16]


def words(text: str) -> tuple[str, ...]:
    return tuple(re.findall(r"[a-z0-9]+", text.lower()))


def nearest_caption(model, tokenizer, prompt: str) -> tuple[str, float]:
    """The training caption whose text embedding is closest (cosine) to the prompt's, and that cosine."""
    captions = all_captions()
    with torch.no_grad():
        e = torch.nn.functional.normalize(model.encode_text(tokenizer([prompt, *captions])).float(), dim=-1)
    cosines = e[1:] @ e[0]
    return captions[int(cosines.argmax())], float(cosines.max())


def check_prompt(model, tokenizer, prompt: str, max_cosine: float = 0.99) -> tuple[str, float]:
    """Refuse a prompt that is a training caption: the same words (case and punctuation aside), or a text embedding
    closer than `max_cosine` to one; returns the nearest caption and its cosine."""
    if any(words(prompt) == words(c) for c in all_captions()):
        raise ValueError(f"the prompt {prompt!r} is a training caption")
    nearest, cosine = nearest_caption(model, tokenizer, prompt)
    if cosine >= max_cosine:
        raise ValueError(f"the prompt {prompt!r} embeds like the training caption {nearest!r} (cosine {cosine:.3f})")
    return nearest, cosine


if __name__ == "__main__":
    print(train(sys.argv[1] if len(sys.argv) > 1 else "humanoid-clip.pt"))
