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

Two tasks (`task`): "arms" (above, experiments/humanoid_arms.py) and "kneel" (experiments/humanoid_kneel.py): two thirds
of its frames are kneeling-like states set through the MuJoCo data (`set_kneeling_like`: legs near the kneeling pose,
one knee down, crouching, sitting; the torso turned and tilted; put on the floor as the pose probe puts its poses), a
third from random-action rollouts; captioned by the posture `kneel_posture` reads from the state, whose "kneeling" is
the experiment's ground truth `kneeling`. Its frames are drawn as the kneeling runs draw them (`--renderer warp`).

    python experiments/humanoid_clip.py /tmp/humanoid-clip.pt
    python experiments/humanoid_clip.py /tmp/kneel-clip.pt kneel
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


# ---------------------------------------------------------------------------- the kneeling task
# The ground truth of kneeling, written before any run (tests/test_humanoid_kneel.py: the pose probe's "kneeling"
# counts; its standing, sitting, crouching, splits and lying poses do not). Knee: the knee joint's anchor; touching
# the floor it is 0.05 m high (the shin's radius), standing 0.44.
KNEE_HEIGHT = 0.15  # m: a knee below this is on the floor
UPRIGHT = 0.7  # the torso's up axis against the world's: within ~45 degrees of vertical
HIPS_ABOVE_KNEES = 0.2  # m: the pelvis above the higher knee (thighs >~30 deg from the floor: not splits, not sitting)
SUCCESS_STEPS = 20  # an episode succeeds when it kneels at each of its last 20 steps (of 100)


def knee_heights(data) -> tuple[float, float]:
    return data.joint("right_knee").xanchor[2], data.joint("left_knee").xanchor[2]


def rollout_action(actor, env, obs) -> np.ndarray:
    """The action of a judged rollout: the actor's, stochastic (SB3's default, the paper's rollouts), or a random one
    without an actor."""
    if actor is None:
        return env.action_space.sample()
    with torch.no_grad():
        unit = actor.get_action(torch.as_tensor(obs, dtype=torch.float32)[None])[0]
        return actor.to_env(unit)[0].numpy()


def kneeling(data) -> bool:
    """The humanoid kneels: both knees near the floor, the torso upright and the hips well above the knees."""
    knees, up = knee_heights(data), data.body("torso").xmat[8]  # xmat[8]: the torso's z axis, world z component
    return max(knees) < KNEE_HEIGHT and up > UPRIGHT and data.body("pelvis").xpos[2] - max(knees) > HIPS_ABOVE_KNEES


def kneel_posture(data) -> str:
    """The kneeling task's caption class of a state: kneeling (the ground truth), on one knee, standing, sitting,
    crouching, or the arms task's toppling and lying postures."""
    if kneeling(data):
        return "kneeling"
    knees, up, pelvis = knee_heights(data), data.body("torso").xmat[8], data.body("pelvis").xpos[2]
    if up > UPRIGHT and min(knees) < KNEE_HEIGHT and pelvis - min(knees) > HIPS_ABOVE_KNEES:
        return "one_knee"
    body = posture(data)
    if (body == "standing" and pelvis > 0.75) or up <= UPRIGHT:  # standing: the pelvis 0.87 m high
        return body
    return "sitting" if data.geom("butt").xpos[2] < 0.2 else "crouching"  # upright and low: on its seat or its feet


KNEEL_POSTURES = {
    "kneeling": [
        "a metal humanoid kneeling upright on both knees",
        "a robot kneeling on the slate floor",
        "a humanoid robot down on both knees, its body upright",
    ],
    "one_knee": ["a metal humanoid down on one knee", "a robot on one knee with the other foot on the floor"],
    "standing": POSTURES["standing"],
    "sitting": ["a humanoid robot sitting on the floor", "a robot seated on the slate floor"],
    "crouching": ["a humanoid robot crouching low on its feet", "a robot squatting above the floor"],
    **{name: POSTURES[name] for name in ("toppling", "back", "face_down", "side")},
}
LEGS = ["right_hip_y", "right_knee", "left_hip_y", "left_knee"]


def kneel_all_captions() -> list[str]:
    return sorted({c for captions in KNEEL_POSTURES.values() for c in captions})


def set_kneeling_like(env, rng: np.random.Generator) -> None:
    """A state near kneeling through the MuJoCo data: both legs near the kneeling pose (40%), one knee down with the
    other foot in front (25%), crouching (20%) or sitting (15%), each leg a little apart; the abdomen bent, the torso
    turned, tilted and moved a little, the arms anywhere; then put down on the floor as the pose probe puts its poses
    (reward_shape.set_pose)."""
    import mujoco

    from reward_shape import set_pose

    kind = rng.choice(["both", "one", "crouch", "sit"], p=[0.4, 0.25, 0.2, 0.15])
    torso = (rng.uniform(-180, 180), rng.uniform(-15, 40), rng.uniform(-10, 10))  # yaw, pitch (forward), roll
    both = lambda hip, knee: [v + rng.normal(0, sd) for _ in "rl" for v, sd in ((hip, 5), (knee, 8))]  # noqa: E731
    abdomen = rng.uniform(-40, 20)
    # the shin is level (on the floor, the knee down) near knee = hip + pitch + abdomen - 90 (the kneeling pose's
    # -95 = 10 + 0 - 10 - 95); lower: the foot up, higher: the knee lifted
    shin_down = lambda hip: hip + torso[1] + abdomen - 90 + rng.uniform(-30, 20)  # noqa: E731
    if kind == "both":  # around kneeling: upright, sitting back, leaning forward, knees a little up
        hip = rng.uniform(-40, 25)
        legs = both(hip, shin_down(hip))
    elif kind == "one":  # one knee down, the other foot on the floor in front
        hip = rng.uniform(-25, 20)
        down, forward = [hip, shin_down(hip)], [rng.uniform(-110, -70), rng.uniform(-110, -70)]
        legs = down + forward if rng.random() < 0.5 else forward + down
    elif kind == "crouch":  # on its feet, hips low
        legs = both(rng.uniform(-120, -60), rng.uniform(-150, -90))
    else:  # on its seat, legs in front
        legs = both(rng.uniform(-110, -70), rng.uniform(-110, -20))
    model = env.unwrapped.model
    joints = dict(zip(LEGS, legs), abdomen_y=abdomen, abdomen_z=rng.uniform(-20, 20))
    joints.update({name: rng.uniform(*np.degrees(model.jnt_range[model.joint(name).id])) for name in ARMS})
    for name in LEGS + ["abdomen_y"]:  # within the joints' ranges
        joints[name] = float(np.clip(joints[name], *np.degrees(model.jnt_range[model.joint(name).id])))
    set_pose(env, torso, joints)
    env.unwrapped.data.qpos[:2] += rng.uniform(-0.5, 0.5, 2)  # not always where the probe puts it
    mujoco.mj_forward(model, env.unwrapped.data)


def render_kneel_dataset(num_frames: int, seed: int, render_size: int = 64, quality: str = "fast", renderer: str = "warp",
                         supersample: int = 1, set_fraction: float = 2 / 3):  # fmt: skip
    """uint8 frames (N, S, S, 3), kneeling (N,) 0/1, postures and captions: first every other step of random-action
    episodes (a third of them starting on the floor), then `set_fraction` of the frames kneeling-like states set
    through the MuJoCo data."""
    import mujoco

    from vlmrm_sac_humanoid import make_env

    rng, np_rng = random.Random(seed), np.random.default_rng(seed)
    env = make_env("Humanoid-v5", seed, 0, EPISODE_STEPS, render_size, quality, True, renderer=renderer,
                   supersample=supersample)()  # fmt: skip
    model, data = env.unwrapped.model, env.unwrapped.data
    frames, labels, postures, captions = [], [], [], []

    def add() -> None:
        frames.append(env.render())
        postures.append(kneel_posture(data))
        labels.append(int(postures[-1] == "kneeling"))
        captions.append(rng.choice(KNEEL_POSTURES[postures[-1]]))

    rollout_frames, episode = num_frames - round(num_frames * set_fraction), 0
    while len(frames) < rollout_frames:
        env.reset(seed=seed + episode)
        episode += 1
        if episode % 3 == 0:  # a third start on the floor, face up or face down
            data.qpos[2], pitch = 0.25, rng.choice([-1, 1]) * np.pi / 4
            data.qpos[3:7] = [np.cos(pitch), 0.0, np.sin(pitch), 0.0]
            mujoco.mj_forward(model, data)
        for t in range(EPISODE_STEPS):
            env.step(env.action_space.sample())
            if t % 2 == 0 and len(frames) < rollout_frames:  # every second step: neighbouring frames are near copies
                add()
    while len(frames) < num_frames:
        set_kneeling_like(env, np_rng)
        add()
    env.close()
    return np.stack(frames), np.array(labels), postures, captions


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
          quality: str = "fast", verbose: bool = True, task: str = "arms", renderer: str = "warp",
          supersample: int = 1) -> str:  # fmt: skip
    """Train the task's model on one torch thread and save its state dict to `path`; returns `path`. The arms task's
    frames are drawn with EGL, the kneeling task's by `renderer` (and `supersample`), as its runs draw them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # float sums (so the weights) depend on the count, which the cache key cannot see
    try:
        look = (render_size, quality) if task == "arms" else (render_size, quality, renderer, supersample)
        return train_on_this_thread(path, num_frames, steps, seed, look, verbose, task)
    finally:
        torch.set_num_threads(threads)


def train_on_this_thread(path: str, num_frames: int, steps: int, seed: int, look: tuple, verbose, task: str) -> str:
    from PIL import Image

    start = time.perf_counter()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    dataset = render_dataset if task == "arms" else render_kneel_dataset  # looked up here: tests replace them
    frames, labels, postures, captions = dataset(num_frames, seed, *look)
    model, transform, tokenizer = clip_trainer.model_and_transform(CONFIG)
    images = torch.stack([transform(Image.fromarray(f)) for f in frames])  # preprocessed once: no augmentation
    texts = tokenizer(captions)
    if verbose:
        counts = {k: int((labels == k).sum()) for k in ((0, 1, 2) if task == "arms" else (0, 1))}
        kinds = {p: postures.count(p) for p in (POSTURES if task == "arms" else KNEEL_POSTURES)}
        label = "hands above head" if task == "arms" else "kneeling"
        print(f"dataset: {len(images)} frames, {label} {counts}, postures {kinds}, "
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


def nearest_caption(model, tokenizer, prompt: str, task: str = "arms") -> tuple[str, float]:
    """The training caption whose text embedding is closest (cosine) to the prompt's, and that cosine."""
    captions = all_captions() if task == "arms" else kneel_all_captions()
    with torch.no_grad():
        e = torch.nn.functional.normalize(model.encode_text(tokenizer([prompt, *captions])).float(), dim=-1)
    cosines = e[1:] @ e[0]
    return captions[int(cosines.argmax())], float(cosines.max())


def check_prompt(model, tokenizer, prompt: str, max_cosine: float = 0.99, task: str = "arms") -> tuple[str, float]:
    """Refuse a prompt that is a training caption of the task: the same words (case and punctuation aside), or a text
    embedding closer than `max_cosine` to one; returns the nearest caption and its cosine."""
    if any(words(prompt) == words(c) for c in (all_captions() if task == "arms" else kneel_all_captions())):
        raise ValueError(f"the prompt {prompt!r} is a training caption")
    nearest, cosine = nearest_caption(model, tokenizer, prompt, task)
    if cosine >= max_cosine:
        raise ValueError(f"the prompt {prompt!r} embeds like the training caption {nearest!r} (cosine {cosine:.3f})")
    return nearest, cosine


if __name__ == "__main__":
    task = sys.argv[2] if len(sys.argv) > 2 else "arms"
    default = "humanoid-clip.pt" if task == "arms" else f"humanoid-{task}-clip.pt"
    print(train(sys.argv[1] if len(sys.argv) > 1 else default, task=task))
