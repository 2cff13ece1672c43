"""--reward-devices: one CLIP replica per device, each scoring batch split across them, the same rewards as one device."""

import importlib
import threading

import numpy as np
import pytest
import torch
from conftest import TINY_CLIP, TINY_CLIP_FLAGS, assert_clean_error, read_scalars, run_script

import vlmrm_utils

SCRIPTS = ["vlmrm_dqn_classic", "vlmrm_sac_humanoid"]


@pytest.mark.parametrize("family", ["projection", "softmax"])
@pytest.mark.parametrize("name", SCRIPTS)
def test_two_cpu_replicas_give_exactly_one_devices_rewards(name, family):
    script = importlib.import_module(name)
    torch.manual_seed(0)
    args = script.Args(
        clip_model=TINY_CLIP,
        clip_pretrained="none",
        goal=("a goal",),
        baseline=("a baseline",),
        alpha=0.5,
        reward_batch_size=3,
        reward_devices=("cpu", "cpu"),
        reward_family=family,
        negatives=("a negative", "another negative"),
        soft=True,
    )
    two = script.make_reward_model(args, torch.device("cpu"))
    assert len(two.replicas) == 2 and two.replicas[1][0] is not two.model  # a copy with the same weights
    for a, b in zip(two.model.state_dict().values(), two.replicas[1][0].state_dict().values()):
        assert torch.equal(a, b)
    seen, together = {i: [] for i in range(2)}, threading.Barrier(2, timeout=20)  # frames each replica scored
    for i, (model, _) in enumerate(two.replicas):

        def encode(x, encode=model.encode_image, i=i):
            if not seen[i]:
                together.wait()  # both replicas are inside their first chunk at once: in parallel (else a timeout)
            seen[i].append(len(x))
            return encode(x)

        model.encode_image = encode
    frames = np.random.default_rng(0).integers(0, 256, size=(8, 40, 60, 3), dtype=np.uint8)  # chunks 3, 3, 2: uneven
    rewards = two(frames)
    assert seen == {0: [3, 2], 1: [3]}  # chunks 0, 2 and chunk 1
    first = two(frames[:1])  # fewer chunks than replicas
    two.replicas = two.replicas[:1]  # the same model on one device
    assert rewards.shape == (8,) and len(set(rewards.tolist())) > 1
    np.testing.assert_array_equal(rewards, two(frames))  # exactly, on CPU
    np.testing.assert_array_equal(first, two(frames[:1]))


@pytest.mark.parametrize("device", ["gpu", "cuda:7", "cuda:x", "meta"])
@pytest.mark.parametrize("name", SCRIPTS)
def test_unknown_reward_device_is_refused_in_one_sentence(name, device, in_tmp):
    script = importlib.import_module(name)
    args = script.Args(clip_model=TINY_CLIP, clip_pretrained="none", reward_devices=("cpu", device))
    args.goal, args.baseline = ("a goal",), ("a baseline",)
    with pytest.raises(vlmrm_utils.UserError, match=f"--reward-devices {device} is not a device of this machine"):
        script.check_args(args)


@pytest.mark.parametrize("name", SCRIPTS)
def test_bad_reward_device_exits_with_one_sentence(name, in_tmp):
    result = run_script(f"{name}.py", *TINY_CLIP_FLAGS, "--reward-devices", "cuda:9", cwd=in_tmp)
    assert result.returncode == 2
    assert_clean_error(result, "--reward-devices cuda:9", "cpu")


def test_dqn_run_on_two_cpu_replicas_logs_exactly_what_one_device_logs(in_tmp, monkeypatch):
    """End to end: the training loop waits for one --reward-batch-size chunk per device, and learns the same."""
    classic = importlib.import_module("vlmrm_dqn_classic")
    make_reward_model, calls = classic.make_reward_model, []

    def recording(*a):  # the frames per reward-model call
        reward_model = make_reward_model(*a)
        score = reward_model.forward
        reward_model.forward = lambda frames: calls[-1].append(len(frames)) or score(frames)
        return reward_model

    monkeypatch.setattr(classic, "make_reward_model", recording)
    scalars = []
    for devices in [(), ("cpu", "cpu")]:
        calls.append([])
        classic.main(
            classic.Args(
                clip_model=TINY_CLIP,
                clip_pretrained="none",
                alpha=0.5,
                total_timesteps=1200,
                learning_starts=400,
                train_frequency=4,
                reward_batch_size=3,
                reward_devices=devices,
                exp_name=f"devices{len(devices)}",
                cuda=False,  # both runs on the CPU (on a GPU machine the default device would be the GPU)
            )
        )
        (run_dir,) = (in_tmp / "runs").glob(f"*devices{len(devices)}*")
        scalars.append(
            {
                tag: values
                for tag, values in read_scalars(run_dir).items()
                if tag.startswith(("charts/", "losses/")) and tag != "charts/SPS"
            }
        )
    # before learning starts: one chunk per device and call (no other frames: on CPU nothing is scored before the run)
    assert calls[0][:100] == [3] * 100 and calls[1][:60] == [6] * 60
    assert scalars[0]["charts/clip_return"] and scalars[0]["losses/td_loss"]
    assert scalars[0] == scalars[1]
