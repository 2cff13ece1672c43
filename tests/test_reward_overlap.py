"""CLIP scores while the environments step: chunks go to the reward model in a background thread, and every reward is
in the replay buffer before whatever needs it (a gradient step, a checkpoint, the end of the run)."""

import importlib
import threading
import time

import numpy as np
import pytest
import torch
from conftest import TINY_CLIP

import vlmrm_utils

SMALL = {  # 2 envs: 3 vector steps fill a chunk of 6 frames; a gradient step every 20 vector steps, so chunks overlap
    "vlmrm_sac_humanoid": dict(
        num_envs=2, render_size=32, render_quality="fast", episode_length=20, total_timesteps=240, learning_starts=80,
        train_frequency=20, gradient_steps=2, batch_size=16, buffer_size=1000,
    ),
    "vlmrm_dqn_classic": dict(num_envs=2, episode_length=20, total_timesteps=240, learning_starts=80, train_frequency=20),
}  # fmt: skip
DELAY = 0.15  # seconds each chunk takes in the reward model: as long as several vector steps


@pytest.mark.parametrize("devices", [(), ("cpu", "cpu")], ids=["one-device", "two-replicas"])
@pytest.mark.parametrize("name", SMALL)
def test_rewards_that_complete_late_are_in_the_buffer_before_anything_uses_them(name, devices, in_tmp, monkeypatch):
    script = importlib.import_module(name)
    steps, encoded, stored, checks = [], [], [0], []  # env step times; (replica, start, end) per chunk; rewards stored

    def slow_reward_model(*a):  # the real CLIP reward, each replica's encoder made slow, as a busy GPU would be
        reward_model = make_reward_model(*a)
        for model, _ in reward_model.replicas:
            model.encode_image = lambda x, encode=model.encode_image: time.sleep(DELAY) or encode(x)  # the "device" is busy

        def embed_images(frames, replica=0, embed=reward_model.embed_images):  # a replica's chunk, preprocessing included
            start = time.perf_counter()
            out = embed(frames, replica)
            encoded.append((replica, start, time.perf_counter()))
            return out

        reward_model.embed_images = embed_images
        return reward_model

    def timed_step(self, actions):
        steps.append(time.perf_counter())
        return frames_step(self, actions)

    def counted_add(self, obs, *rest):
        stored[0] += len(obs)
        add(self, obs, *rest)

    def all_stored(what):  # every transition stepped so far has its reward in the buffer
        def check(*a, **k):
            checks.append((what, stored[0], len(steps) * SMALL[name]["num_envs"]))
            return original[what](*a, **k)

        return check

    make_reward_model, frames_step, add = script.make_reward_model, vlmrm_utils.FramesInInfo.step, script.ReplayBuffer.add
    original = {"sample": script.ReplayBuffer.sample, "save": vlmrm_utils.Run.save, "finish": vlmrm_utils.Run.finish}
    monkeypatch.setattr(script, "make_reward_model", slow_reward_model)
    monkeypatch.setattr(vlmrm_utils.FramesInInfo, "step", timed_step)
    monkeypatch.setattr(script.ReplayBuffer, "add", counted_add)
    monkeypatch.setattr(script.ReplayBuffer, "sample", all_stored("sample"))
    monkeypatch.setattr(vlmrm_utils.Run, "save", all_stored("save"))
    monkeypatch.setattr(vlmrm_utils.Run, "finish", all_stored("finish"))
    torch.manual_seed(0)
    flags = dict(clip_model=TINY_CLIP, clip_pretrained="none", reward_batch_size=6 // max(1, len(devices)), alpha=0.0)
    script.main(script.Args(**flags, **SMALL[name], reward_devices=devices, save_model=True, checkpoint_frequency=100))

    assert {what for what, _, _ in checks} == {"sample", "save", "finish"}
    for what, have, stepped in checks:
        assert have == stepped, f"at a {what}, {stepped - have} of {stepped} transitions had no reward yet"
    # the envs stepped while each replica was scoring: the chunks overlapped the stepping, they did not block it
    for replica in range(max(1, len(devices))):
        busy = [(start, end) for i, start, end in encoded if i == replica and start < steps[-1]]  # not the evaluation
        overlapped = sum(any(start < t < end for t in steps) for start, end in busy)
        assert overlapped >= len(busy) // 2, (replica, overlapped, len(busy))
    assert threading.active_count() < 10  # the scoring thread ends with the run (a new one per run would pile up)


@pytest.mark.parametrize("name", SMALL)
def test_a_failing_reward_model_stops_the_run_with_its_error(name, in_tmp, monkeypatch):
    """An error in the scoring thread reaches the loop (never a silent hang or a missing reward)."""
    script = importlib.import_module(name)
    make_reward_model = script.make_reward_model

    def failing(*a):
        reward_model = make_reward_model(*a)
        reward_model.model.encode_image = lambda x: (_ for _ in ()).throw(RuntimeError("CUDA out of memory (a test)"))
        return reward_model

    monkeypatch.setattr(script, "make_reward_model", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        script.main(script.Args(clip_model=TINY_CLIP, clip_pretrained="none", reward_batch_size=6, **SMALL[name]))
    assert len(list((in_tmp / "runs").iterdir())) == 1


@pytest.mark.parametrize("name", SMALL)
def test_the_loop_keeps_at_most_two_chunks_with_a_slow_reward_model_and_stores_them_in_order(name, in_tmp, monkeypatch):
    """The overlap in main(): a chunk is submitted, and the oldest is waited for once two are with the reward model,
    rather than frames piling up; the chunks reach the buffer in the order they were made."""
    script = importlib.import_module(name)
    submitted, stored, score = [], [], script.score

    class CountingPool(script.ThreadPoolExecutor):
        def submit(self, fn, frames, *a):
            assert len(submitted) - len(stored) < 3, "a third chunk was sent while two were with the reward model"
            submitted.append(frames[:, 0, 0, 0].copy())
            return super().submit(fn, frames, *a)

    def slow_score(frames, *a):
        time.sleep(DELAY)
        return score(frames, *a)

    def stamped_forward(self, frames):  # the reward is the frame's own stamp: each chunk's order is visible
        return np.asarray(frames)[:, 0, 0, 0].astype(np.float32)

    add = script.ReplayBuffer.add
    monkeypatch.setattr(script, "ThreadPoolExecutor", CountingPool)
    monkeypatch.setattr(script, "score", slow_score)
    monkeypatch.setattr(script.CLIPReward, "forward", stamped_forward)
    monkeypatch.setattr(script.ReplayBuffer, "add", lambda self, obs, n, a, rewards, *r: stored.append(rewards) or add(
        self, obs, n, a, rewards, *r))  # fmt: skip
    script.main(script.Args(clip_model=TINY_CLIP, clip_pretrained="none", reward_batch_size=6, **SMALL[name]))
    assert len(submitted) == len(stored) > 10
    for frames, rewards in zip(submitted, stored):  # the chunks stored oldest first, each with its own rewards
        np.testing.assert_array_equal(rewards, frames.astype(np.float32))
