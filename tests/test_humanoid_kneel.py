"""The kneeling experiment's ground truth (experiments/humanoid_clip.py `kneeling`, used by experiments/humanoid_kneel.py)
on the pose probe's poses and on random-action frames, its prompts against the CLIP's captions, and a CI-sized CLIP's
ranking of held-out frames. CPU only: seconds, and about 45 s of one core once to train that CLIP (then cached).
"""

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "experiments"))
import humanoid_clip  # noqa: E402
import humanoid_kneel  # noqa: E402

import reward_shape  # noqa: E402


@pytest.fixture(scope="module")
def env():
    from vlmrm_sac_humanoid import make_env

    env = make_env("Humanoid-v5", 0, 0, 100, 64, "fast", True)()
    env.reset(seed=0)
    yield env
    env.close()


@pytest.mark.parametrize("pose", list(reward_shape.POSES))
def test_only_the_probes_kneeling_pose_kneels(env, pose):
    """The probe's kneeling pose kneels; standing (arms anyhow, one leg up), bending over, crouching, sitting, the
    splits (knees down, hips on the floor) and lying do not. The caption class agrees."""
    reward_shape.set_pose(env, *reward_shape.POSES[pose])
    data = env.unwrapped.data
    assert humanoid_clip.kneeling(data) == (pose == "kneeling")
    expected = {"kneeling": "kneeling", "crouching": "crouching", "sitting": "sitting", "splits": "sitting"}
    expected.update(lying_on_back="back", lying_face_down="face_down", bending_over="toppling")
    assert humanoid_clip.kneel_posture(data) == expected.get(pose, "standing")


def test_one_knee_down_is_not_kneeling(env):
    """The probe's kneeling pose with the left foot put on the floor in front, or the left knee lifted 0.21 m (the hips
    still 0.26 m above it): one knee down is not kneeling."""
    import mujoco

    model, data = env.unwrapped.model, env.unwrapped.data
    joints = dict(reward_shape.POSES["kneeling"][1], left_hip_y=-80, left_knee=-95)
    reward_shape.set_pose(env, reward_shape.POSES["kneeling"][0], joints)
    assert min(humanoid_clip.knee_heights(data)) < 0.06 and data.geom("left_foot").xpos[2] < 0.08  # knee and foot down
    assert not humanoid_clip.kneeling(data) and humanoid_clip.kneel_posture(data) == "one_knee"
    reward_shape.set_pose(env, *reward_shape.POSES["kneeling"])
    for name, degrees in (("left_hip_y", -45), ("left_knee", -140)):  # not put down again: the right knee stays down
        data.qpos[model.jnt_qposadr[model.joint(name).id]] = np.radians(degrees)
    mujoco.mj_forward(model, data)
    right, left = humanoid_clip.knee_heights(data)
    assert right < 0.06 and 0.2 < left < data.body("pelvis").xpos[2] - 0.2
    assert not humanoid_clip.kneeling(data) and humanoid_clip.kneel_posture(data) == "one_knee"


def test_random_action_frames(env):
    """Random actions: the start (standing) never kneels; the humanoid falls, often through kneeling (0.06 of steps
    measured here, so the random policy scores above 0), and no step counted as kneeling is a fallen one."""
    env.action_space.seed(0)
    kneels, lying = [], []
    for episode in range(10):
        env.reset(seed=episode)
        assert not humanoid_clip.kneeling(env.unwrapped.data)
        for _ in range(100):
            env.step(env.action_space.sample())
            data = env.unwrapped.data
            kneels.append(humanoid_clip.kneeling(data))
            lying.append(data.body("torso").xpos[2] < 0.4)
            if kneels[-1]:  # upright above the knees: the head half a metre above them or more (the probe's: 1.03)
                assert data.geom("head").xpos[2] - max(humanoid_clip.knee_heights(data)) > 0.5
    kneels, lying = np.array(kneels), np.array(lying)
    assert 0.01 < kneels.mean() < 0.15, kneels.mean()
    assert lying.mean() > 0.3 and not (kneels & lying).any()


def test_score_and_success_of_rollouts(monkeypatch):
    """The score is the fraction of steps kneeling; success is kneeling at each of the last SUCCESS_STEPS steps."""
    for pattern, fraction, success in (
        ([0] * 80 + [1] * 20, 0.2, True),
        ([0] * 81 + [1] * 19, 0.19, False),
        ([1] * 99 + [0], 0.99, False),
    ):
        steps = iter(pattern)
        monkeypatch.setattr(humanoid_clip, "kneeling", lambda data: bool(next(steps)))
        fractions, successes, _, postures = humanoid_kneel.rollouts(None, 1, seed=0)
        assert fractions[0] == pytest.approx(fraction) and successes[0] == success
        assert postures["kneeling"] == sum(pattern) and postures.total() == 100  # the steps' postures, counted


def test_prompts_are_in_vocabulary_paraphrases():
    """No RL prompt is a kneeling caption (by words), and every word of them is in the captions."""
    captions = humanoid_clip.kneel_all_captions()
    vocabulary = {w for c in captions for w in humanoid_clip.words(c)}
    for prompt in (humanoid_kneel.GOAL, humanoid_kneel.BASELINE, humanoid_kneel.SWAPPED):
        assert humanoid_clip.words(prompt) not in {humanoid_clip.words(c) for c in captions}
        assert set(humanoid_clip.words(prompt)) <= vocabulary, prompt


# The experiment's CLIP (3,000 frames, 600 steps: 4.5 min of one core) ranks held-out kneeling frames with AUC 0.88 for
# the goal and 0.19 for the swapped prompt; a CI-sized one (600 frames, 100 steps: 42 s of one core) 0.74 and 0.45.
CI_CLIP = dict(frames=600, steps=100)


def test_a_small_clip_ranks_kneeling_frames_for_the_goal(tmp_path):
    """The reward of the goal ranks 300 held-out frames (drawn as the CLIP's training frames, another seed) kneeling
    above the rest: AUC above 0.65; the swapped prompt's below 0.5. The CLIP is cached under VLMRM_TEST_CACHE."""
    import humanoid_arms

    folder = Path(os.environ.get("VLMRM_TEST_CACHE", Path.home() / ".cache" / "vlmrm-tests"))
    folder.mkdir(parents=True, exist_ok=True)
    key = humanoid_clip.cache_key(task="kneel", renderer="warp", supersample=humanoid_kneel.SUPERSAMPLE, **CI_CLIP)
    path = folder / f"humanoid-kneel-clip-{key}.pt"
    if not path.exists():
        humanoid_clip.train(str(path), CI_CLIP["frames"], CI_CLIP["steps"], task="kneel", verbose=False)
    model, tokenizer = humanoid_arms.load_model(str(path))
    frames, kneel, _, _ = humanoid_clip.render_kneel_dataset(300, 12345, 64, "fast", "warp", humanoid_kneel.SUPERSAMPLE)
    kneel = kneel.astype(bool)
    goal = humanoid_kneel.auc(humanoid_kneel.rewards(model, tokenizer, frames, humanoid_kneel.GOAL), kneel)
    swapped = humanoid_kneel.auc(humanoid_kneel.rewards(model, tokenizer, frames, humanoid_kneel.SWAPPED), kneel)
    assert goal > 0.65 and swapped < 0.5, (goal, swapped)
