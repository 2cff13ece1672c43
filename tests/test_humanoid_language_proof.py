"""Shortened CI check of the humanoid experiment (experiments/humanoid_arms.py; its numbers are in
docs/language_proof.md): its ground truth and its prompt guard only. Shortened to what fits CI: the experiment's CLIP
and SAC runs took 50 min on 2 shared cores, and a CLIP trained for 150 steps on 600 frames failed a ranking check
(goal AUC > 0.65, swapped < 0.35), so the reward's ranking is checked by the experiment itself, which prints it.
tests/test_sac_humanoid.py runs the SAC loop.
"""

import sys

import clip_trainer
import mujoco
import numpy as np
import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "experiments"))
import humanoid_arms  # noqa: E402
import humanoid_clip  # noqa: E402

RAISED = {"right_shoulder1": -84, "right_shoulder2": -26, "right_elbow": -41}  # hands above the head, found by search
RAISED.update({"left_shoulder1": 83, "left_shoulder2": 35, "left_elbow": -30})


def test_ground_truth_sees_raised_hands():
    from vlmrm_sac_humanoid import make_env

    env = make_env("Humanoid-v5", 0, 0, 100, 64, "fast", True)()
    env.reset(seed=0)
    model, data = env.unwrapped.model, env.unwrapped.data
    assert humanoid_clip.hands_above_head(data) == 0  # the stock pose: arms down
    assert humanoid_clip.posture(data) == "standing"
    for name, degrees in RAISED.items():
        data.qpos[model.jnt_qposadr[model.joint(name).id]] = np.radians(degrees)
    mujoco.mj_forward(model, data)
    assert humanoid_clip.hands_above_head(data) == 2
    env.close()


def test_prompt_guard_refuses_training_captions_by_words():
    model, _, tokenizer = clip_trainer.model_and_transform(humanoid_clip.CONFIG)
    caption = humanoid_clip.all_captions()[0]
    for prompt in (caption, caption.upper() + ".", caption.replace(" with ", ",  with ")):
        with pytest.raises(ValueError, match="is a training caption"):
            humanoid_clip.check_prompt(model, tokenizer, prompt)
    for prompt in (humanoid_arms.GOAL, humanoid_arms.BASELINE, humanoid_arms.SWAPPED):
        assert humanoid_clip.words(prompt) not in {humanoid_clip.words(c) for c in humanoid_clip.all_captions()}
