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
import torch
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


def test_clip_cache_key_follows_the_drawn_look(tmp_path, monkeypatch):
    """The CLIP's cache key is the look's files, not only their code: a texture or the model's XML changed under the
    same source (the look's temp folder is keyed by a hand-bumped tag) gives another key; where the files are does not."""
    import shutil
    import tempfile

    import vlmrm_sac_humanoid as sac

    keys = []
    for folder in ("a", "b"):  # b: the same textures copied elsewhere (another checkout)
        (tmp_path / folder).mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / folder))
        if folder == "b":
            monkeypatch.setattr(sac, "TEXTURES", shutil.copytree(sac.TEXTURES, tmp_path / "textures"))
        sac.textured_humanoid_xml()
        keys.append(humanoid_clip.cache_key(frames=1, steps=1))
    assert keys[0] == keys[1]
    (xml,) = (tmp_path / "b").glob("vlmrm_humanoid_*/humanoid_textured.xml")
    xml.write_text(xml.read_text().replace('diffuse="1 1 1"', 'diffuse="0.5 0.5 0.5"', 1))
    keys.append(humanoid_clip.cache_key(frames=1, steps=1))
    (tmp_path / "textures" / "slate.png").write_bytes((tmp_path / "textures" / "metal.png").read_bytes())
    keys.append(humanoid_clip.cache_key(frames=1, steps=1))
    assert len(set(keys[1:])) == 3, keys


def test_clip_trains_on_one_thread_whoever_calls(tmp_path, monkeypatch):
    """The weights depend on torch's thread count (2 threads: loss 3.594 at step 100, 1 thread: 3.573), and the cache key
    cannot see it: the CLIP trains on one thread however it is called, and the caller's count comes back."""
    frames = np.zeros((4, 64, 64, 3), np.uint8)
    monkeypatch.setattr(humanoid_clip, "render_dataset", lambda *a: (frames, np.zeros(4), ["standing"] * 4, ["a"] * 4))
    seen = []
    monkeypatch.setattr(clip_trainer, "fit", lambda *a, **k: seen.append(torch.get_num_threads()))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        humanoid_clip.train(str(tmp_path / "clip.pt"), 4, 1, verbose=False)
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
