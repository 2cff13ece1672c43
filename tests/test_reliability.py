"""Interruption, resume, determinism, validation, numerical safety and memory checks of both training scripts."""

import signal

import numpy as np
import pytest
import torch

import vlmrm_dqn_classic as classic
import vlmrm_sac_humanoid as sac
from conftest import TINY_CLIP, TINY_CLIP_FLAGS, assert_refused, interrupt_after, read_scalars, run_script

DQN = "vlmrm_dqn_classic.py"
SAC = "vlmrm_sac_humanoid.py"
# fixed-length episodes: an exact resume (stock episodes restart the episodes in flight, see below)
DQN_FLAGS = ["--reward", "gt", "--episodes", "fixed", "--total-timesteps", "6000", "--learning-starts", "1000", "--seed", "3", "--save-buffer"]
SAC_FLAGS = ["--env-id", "InvertedPendulum-v5", "--reward", "gt", "--episodes", "fixed", "--num-envs", "2", "--episode-length", "50",
             "--total-timesteps", "1600", "--learning-starts", "300", "--train-frequency", "10", "--gradient-steps", "10",
             "--batch-size", "64", "--seed", "3", "--save-buffer"]


def logged(run_dir, *tags):
    scalars = read_scalars(run_dir)
    return {tag: [v for _, v in scalars[tag]] for tag in tags}


@pytest.mark.parametrize("script, flags, sig, tags", [
    (DQN, DQN_FLAGS, signal.SIGINT, ("charts/episodic_return", "losses/td_loss")),
    (SAC, SAC_FLAGS, signal.SIGTERM, ("charts/episodic_return", "losses/qf1_loss", "losses/actor_loss")),
], ids=["dqn-sigint", "sac-sigterm"])
def test_interrupted_and_resumed_run_matches_an_uninterrupted_one(tmp_path, script, flags, sig, tags):
    (tmp_path / "full").mkdir()
    (tmp_path / "cut").mkdir()
    full = run_script(script, *flags, cwd=tmp_path / "full")
    assert full.returncode == 0, full.stderr[-2000:]

    code, output = interrupt_after(script, *flags, cwd=tmp_path / "cut", sig=sig, after_lines=8)
    assert code == 0, output[-2000:]  # a clean exit, not a traceback
    assert "checkpoint saved at step" in output and "--resume" in output
    (run_dir,) = (tmp_path / "cut" / "runs").iterdir()
    checkpoint = run_dir / "checkpoint.pt"
    stopped_at = torch.load(checkpoint, weights_only=False)["iteration"]
    partial = logged(run_dir, "charts/episodic_return")["charts/episodic_return"]
    assert 0 < len(partial) < len(logged(next((tmp_path / "full" / "runs").iterdir()), "charts/episodic_return")["charts/episodic_return"])

    resumed = run_script(script, "--resume", str(checkpoint), cwd=tmp_path / "cut")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed at step {stopped_at * (2 if script == SAC else 1)}" in resumed.stdout
    assert list((tmp_path / "cut" / "runs").iterdir()) == [run_dir]  # the same TensorBoard run folder
    expected = logged(next((tmp_path / "full" / "runs").iterdir()), *tags)
    got = logged(run_dir, *tags)
    for tag in tags:
        assert len(got[tag]) == len(expected[tag]) and got[tag] == expected[tag], tag


@pytest.mark.parametrize("script, flags", [
    (DQN, ["--reward", "gt", "--num-envs", "4", "--total-timesteps", "4000", "--learning-starts", "500"]),
    (SAC, ["--env-id", "InvertedPendulum-v5", "--reward", "gt", "--num-envs", "4", "--total-timesteps", "2000",
           "--learning-starts", "300", "--train-frequency", "10", "--gradient-steps", "5", "--batch-size", "64"]),
], ids=["dqn", "sac"])
def test_stock_episodes_stop_at_the_next_step_and_resume_with_restarted_episodes(tmp_path, script, flags):
    # stock episodes (the --reward gt default) end at different steps in each env: the stop cannot wait for them all
    code, output = interrupt_after(script, *flags, "--save-buffer", cwd=tmp_path, sig=signal.SIGINT, after_lines=8)
    assert code == 0, output[-2000:]
    assert "checkpoint saved at step" in output and "--resume" in output
    (run_dir,) = (tmp_path / "runs").iterdir()
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert saved["args"]["episodes"] == "stock"
    assert all(not v for v in saved["pending"].values())  # every transition so far is in the saved buffer
    eighth = [int(line.split(",")[0].split("=")[1]) for line in output.splitlines() if line.startswith("global_step=")][7]
    assert 0 < saved["iteration"] * 4 - eighth < 1000, (saved["iteration"], eighth)  # soon after the signal
    resumed = run_script(script, "--resume", str(run_dir / "checkpoint.pt"), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    total = int(flags[flags.index("--total-timesteps") + 1])
    assert f"resumed at step {saved['iteration'] * 4}" in resumed.stdout
    assert f"done: {total - saved['iteration'] * 4} steps" in resumed.stdout
    # the episodes in flight restarted: none logged after the resume is longer than the steps since (no partial sums added on)
    after = [(step, length) for step, length in read_scalars(run_dir)["charts/episodic_length"] if step >= saved["iteration"] * 4]
    assert after and all(length <= (step - saved["iteration"] * 4) // 4 + 1 for step, length in after), after[:8]


def test_same_seed_same_returns_dqn_with_clip_reward(tmp_path):
    flags = [*TINY_CLIP_FLAGS, "--total-timesteps", "800", "--learning-starts", "200", "--train-frequency", "4",
             "--episode-length", "100", "--alpha", "0.5"]
    results = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        result = run_script(DQN, *flags, cwd=tmp_path / name)
        assert result.returncode == 0, result.stderr[-2000:]
        results.append(logged(next((tmp_path / name / "runs").iterdir()), "charts/episodic_return", "losses/td_loss"))
    assert results[0] == results[1] and len(results[0]["charts/episodic_return"]) == 8


def test_same_seed_same_returns_sac_with_clip_reward_in_subprocess_envs(tmp_path):
    flags = [*TINY_CLIP_FLAGS, "--num-envs", "2", "--render-size", "48", "--episode-length", "50", "--total-timesteps", "400",
             "--learning-starts", "100", "--train-frequency", "10", "--gradient-steps", "5", "--batch-size", "32",
             "--render-quality", "fast"]
    results = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        result = run_script(SAC, *flags, cwd=tmp_path / name)
        assert result.returncode == 0, result.stderr[-2000:]
        results.append(logged(next((tmp_path / name / "runs").iterdir()), "charts/episodic_return", "losses/qf1_loss"))
    assert results[0] == results[1] and len(results[0]["charts/episodic_return"]) == 8


BAD_RUN_FLAGS = {
    "learning never starts": (DQN, ["--learning-starts", "500000"], ["--learning-starts 125000"]),
    # the short run: 10,000 steps round up to 10,016 (32 envs), then learning would start at 50,000
    "short run, default learning start": (SAC, ["--total-timesteps", "10000"], ["--learning-starts 2504", "lower"]),
    "gamma out of range": (DQN, ["--gamma", "1.5"], ["--gamma", "1.5"]),
    "batch larger than buffer": (SAC, ["--batch-size", "4096", "--buffer-size", "1000"], ["--batch-size", "--buffer-size"]),
    "negative learning rate": (SAC, ["--q-lr", "-1"], ["--q-lr"]),
    "buffer too large for memory": (SAC, ["--buffer-size", "10000000000"], ["--buffer-size", "GiB"]),
    "missing resume file": (DQN, ["--resume", "nope.pt"], ["nope.pt"]),
}


@pytest.mark.parametrize("case", BAD_RUN_FLAGS, ids=list(BAD_RUN_FLAGS))
def test_bad_run_settings_are_refused_before_any_work(in_tmp, case):
    script, flags, words = BAD_RUN_FLAGS[case]
    assert_refused(classic if script == DQN else sac, flags, *words)


@pytest.mark.parametrize("module", [classic, sac], ids=["dqn", "sac"])
def test_total_timesteps_round_up_to_the_vector_size_with_a_note(in_tmp, module, capsys):
    args = module.Args(reward="gt", num_envs=3, total_timesteps=1000, learning_starts=100, goal=("a pole",))
    module.check_args(args)
    assert args.total_timesteps == 1002
    assert "--total-timesteps 1000 rounded up to 1002" in capsys.readouterr().out


@pytest.mark.parametrize("module", [classic, sac], ids=["dqn", "sac"])
def test_unwritable_output_folder_is_refused(in_tmp, module):
    (in_tmp / "runs").write_text("a file where the output folder should be")
    with pytest.raises(module.UserError, match="runs"):
        module.main(module.Args(reward="gt"))


def test_corrupt_or_foreign_checkpoints_are_refused(in_tmp):
    (in_tmp / "garbage.pt").write_bytes(b"\x00not a checkpoint")
    assert_refused(classic, ["--resume", "garbage.pt"], "garbage.pt", "readable")
    torch.save({"iteration": 3, "rng": {}, "args": {"policy_lr": 1.0}}, in_tmp / "sac.pt")
    assert_refused(classic, ["--resume", "sac.pt"], "another script")
    torch.save({"q_network": {}, "args": {}}, in_tmp / "model.pt")
    assert_refused(classic, ["--resume", "model.pt"], "no resumable training state")


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = str(tmp_path / "checkpoint.pt")
    classic.save_checkpoint(path, {"good": torch.ones(3)})

    def crash_mid_write(obj, f):
        with open(f, "wb") as handle:
            handle.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash_mid_write)
    with pytest.raises(OSError):
        sac.save_checkpoint(path, {"good": torch.zeros(3)})
    assert torch.equal(torch.load(path)["good"], torch.ones(3))  # the good checkpoint is still in place


def test_nan_reward_stops_training_and_saves_the_networks(in_tmp, monkeypatch):
    calls = {"n": 0}

    def nan_on_third_batch(self, frames):
        calls["n"] += 1
        return np.full(len(frames), np.nan if calls["n"] == 3 else 0.5, dtype=np.float32)

    monkeypatch.setattr(classic.CLIPReward, "forward", nan_on_third_batch)
    monkeypatch.setattr(classic, "warn_if_slow_on_cpu", lambda *a: None)
    added = []
    monkeypatch.setattr(classic.ReplayBuffer, "add", lambda self, *a: added.append(a[3]))
    with pytest.raises(classic.NonFiniteError, match="not finite .* at step"):
        classic.main(classic.Args(clip_model=TINY_CLIP, clip_pretrained="none", total_timesteps=2000, learning_starts=100,
                                  reward_batch_size=16))
    assert len(added) == 2 and all(np.isfinite(r).all() for r in added)  # the NaN batch never reached the buffer
    (run_dir,) = (in_tmp / "runs").iterdir()
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert all(torch.isfinite(t).all() for t in saved["q_network"].values())


def test_nan_loss_stops_sac_and_saves_the_last_finite_networks(in_tmp, monkeypatch):
    original_sample = sac.ReplayBuffer.sample
    calls = {"n": 0}

    def poisoned_sample(self, batch_size):
        calls["n"] += 1
        batch = original_sample(self, batch_size)
        if calls["n"] > 30:  # from the 4th training phase on
            batch[2][:] = float("nan")
        return batch

    monkeypatch.setattr(sac.ReplayBuffer, "sample", poisoned_sample)
    with pytest.raises(sac.NonFiniteError, match="loss"):
        sac.main(sac.Args(env_id="InvertedPendulum-v5", reward="gt", num_envs=2, total_timesteps=2000, learning_starts=200,
                          train_frequency=10, gradient_steps=10, batch_size=32))
    (run_dir,) = (in_tmp / "runs").iterdir()
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    for name in ("actor", "qf1", "qf2"):
        assert all(torch.isfinite(t).all() for t in saved[name].values()), name
