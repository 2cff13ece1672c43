"""--renderer warp: MuJoCo Warp's ray tracer draws the humanoid's frames in the trainer (CPU here: Warp's CPU device).

Warp compiles its kernels once per machine (about 10 s on a CPU) and caches them; every test here reuses them.
"""

import os
import runpy
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import tyro
from conftest import (
    ROOT,
    TINY_CLIP,
    TINY_CLIP_FLAGS,
    assert_clean_error,
    assert_refused,
    interrupt_after,
    read_scalars,
    run_script,
)

import reward_shape
import vlmrm_sac_humanoid as sac
import vlmrm_utils
import vlmrm_warp

SIZE = 96  # the comparison's frame size: the floor's tiles and the body's limbs are a few pixels wide


@pytest.fixture(scope="module")
def drawn_and_rendered():
    """Four states (the initial one, then a random rollout's), drawn by the ray tracer (2x2 rays per pixel) and by EGL
    "high" (the paper's renderer)."""
    env = sac.make_env("Humanoid-v5", 0, 0, 100, SIZE, "high", True)()
    env.reset(seed=0)
    env.unwrapped.set_state(env.unwrapped.init_qpos, env.unwrapped.init_qvel)
    env.action_space.seed(0)
    states, frames = [], []
    for t in range(31):
        if t % 10 == 0:
            states.append(env.unwrapped.data.qpos.copy())
            frames.append(env.render())
        env.step(env.action_space.sample())
    env.close()
    renderer = sac.warp_renderer(True, SIZE, 2, 3, torch.device("cpu"))  # 3 worlds: 4 states take two launches
    return renderer.draw(np.stack(states)), np.stack(frames), np.stack(states)


def test_the_ray_tracers_frames_agree_with_egl_high(drawn_and_rendered):
    drawn, rendered, _ = drawn_and_rendered
    assert drawn.dtype == torch.uint8 and drawn.shape == (4, SIZE, SIZE, 3) and drawn.device.type == "cpu"
    drawn, rendered = drawn.numpy().astype(float), rendered.astype(float)
    # measured 3.9 to 4.0 of 255 per pixel (4.0 to 4.9 with shadow rays not cut at the light's plane); the differences:
    # the floor's tiles filtered differently, the body's highlights
    diff = np.abs(drawn - rendered).mean((1, 2, 3))
    assert np.all(diff < 6), diff
    # the same layout: RGB (not BGR: 47), rows top down (flipped: 76), columns left to right (mirrored: 16 to 18)
    assert np.all(np.abs(drawn[..., ::-1] - rendered).mean((1, 2, 3)) > 2 * diff)
    assert np.all(np.abs(drawn[:, :, ::-1] - rendered).mean((1, 2, 3)) > 2 * diff)
    assert np.all(np.abs(drawn[:, ::-1] - rendered).mean((1, 2, 3)) > 5 * diff)
    # region by region (the sky's top 40%, the floor's bottom 30%): mean colours within 5 of 255 (measured 1.2, 3.1)
    for rows in (slice(0, int(0.4 * SIZE)), slice(int(0.7 * SIZE), SIZE)):
        np.testing.assert_allclose(drawn[:, rows].mean((1, 2)), rendered[:, rows].mean((1, 2)), atol=5)


def test_the_feet_cast_their_shadow_with_render_quality_high(drawn_and_rendered):
    """EGL "high" shows a black patch under the standing humanoid's feet; the ray tracer's shadow rays draw it with
    --render-quality high (a shadowed point gets none of the light, as in EGL), not with fast."""
    drawn, rendered, states = drawn_and_rendered
    fast = sac.warp_renderer(True, SIZE, 2, 1, torch.device("cpu"), quality="fast").draw(states[:1])[0]
    patch = (slice(77, 80), slice(44, 51))  # under the feet, initial state, 96 px (measured: 8 to 11 of 255 in both)
    assert rendered[0][patch].mean() < 20 and drawn[0][patch].float().mean() < 20
    assert fast[patch].float().mean() > 40


def test_the_arms_cast_no_shadow_as_in_egl_high(drawn_and_rendered):
    """EGL "high" draws a directional light's shadow map from the light (z = 1 m): the raised arms, above it, cast none.
    MuJoCo Warp's shadow rays, cut at the light's plane, leave the same floor lit (uncut: dark, 18 of 255)."""
    drawn, rendered, _ = drawn_and_rendered
    for patch in (slice(81, 83), slice(36, 39)), (slice(81, 83), slice(57, 60)):  # the uncut arms' shadows, 96 px
        assert rendered[0][patch].mean() > 45 and drawn[0][patch].float().mean() > 45  # measured 69 to 72, 65 to 69
    feet = (slice(77, 80), slice(44, 51))
    assert rendered[0][feet].mean() < 20 and drawn[0][feet].float().mean() < 20


def test_the_tracking_camera_follows_the_torso_as_egls_does():
    """The tracking camera (MuJoCo's trackcom mode on the torso) against EGL's."""
    env = sac.make_env("Humanoid-v5", 0, 0, 100, 64, "high", True, "tracking")()
    env.reset(seed=0)
    env.action_space.seed(0)
    states, frames = [], []
    for t in range(40):  # the body moved across the floor, then falling (turned: its centre of mass is what counts)
        if t in (0, 25, 39):
            qpos = env.unwrapped.data.qpos.copy()
            qpos[:2] += (1, 0.5) if t == 0 else 0  # the root's x and y
            env.unwrapped.set_state(qpos, env.unwrapped.data.qvel)
            states.append(qpos)
            frames.append(env.render())
        env.step(env.action_space.sample())
    env.close()
    drawn = sac.warp_renderer(True, 64, 2, 3, torch.device("cpu"), camera="tracking").draw(np.stack(states)).numpy()
    diff = np.abs(drawn.astype(float) - np.stack(frames)).mean((1, 2, 3))
    assert np.all(diff < 6), diff  # measured 3.7 to 4.3; the paper camera: 10 to 16 (the body leaves the middle)
    paper = sac.warp_renderer(True, 64, 2, 3, torch.device("cpu")).draw(np.stack(states)).numpy()
    assert np.all(np.abs(paper.astype(float) - np.stack(frames)).mean((1, 2, 3))[1:] > 2 * diff[1:])


def test_the_frame_scored_is_warps_drawing_of_the_state_after_the_step(in_tmp, monkeypatch):
    """Over subprocess envs with autoresets: each transition's reward scores the ray tracer's drawing of the state its
    env returned after the step (qpos[2:24] is next_obs[:22]), as a torch tensor straight from the renderer."""
    drawn, scored, added = [], [], []
    draw = vlmrm_warp.WarpRenderer.draw

    def spy_draw(self, qpos):
        frames = draw(self, qpos)
        drawn.append((np.array(qpos), frames.clone()))
        return frames

    def spy_forward(self, frames):
        assert torch.is_tensor(frames)  # no trip through the host's numpy
        scored.append(frames.clone())
        return frames.float().mean((1, 2, 3)).numpy()

    def spy_add(self, obs, next_obs, actions, rewards, terminations):
        added.append((np.array(next_obs), np.array(rewards)))

    monkeypatch.setattr(vlmrm_warp.WarpRenderer, "draw", spy_draw)
    monkeypatch.setattr(sac.CLIPReward, "forward", spy_forward)
    monkeypatch.setattr(sac.ReplayBuffer, "add", spy_add)
    small = dict(num_envs=2, episode_length=7, render_size=32, total_timesteps=30, learning_starts=28)
    sac.main(sac.Args(clip_model=TINY_CLIP, clip_pretrained="none", renderer="warp", reward_batch_size=4, **small))

    qpos = np.concatenate([q for q, _ in drawn])
    next_obs, rewards = (np.concatenate(a) for a in zip(*added))
    assert len(qpos) == len(rewards) == 30  # 15 vector steps of 2 envs, 2 episode ends each: no reset state drawn
    np.testing.assert_array_equal(qpos[:, 2:24], next_obs[:, :22])
    frames = torch.cat([f for _, f in drawn])
    assert torch.equal(torch.cat(scored), frames)
    np.testing.assert_array_equal(rewards, frames.float().mean((1, 2, 3)).numpy())
    assert len(np.unique(rewards)) > 20  # real, varied frames
    fresh = sac.warp_renderer(True, 32, 2, 30, torch.device("cpu")).draw(qpos)  # the drawing of those states
    assert torch.equal(fresh, frames)


def test_an_interrupted_and_resumed_warp_run_matches_an_uninterrupted_one(tmp_path, monkeypatch):
    flags = [*TINY_CLIP_FLAGS, "--renderer", "warp", "--num-envs", "2", "--episode-length", "10", "--render-size", "32"]
    flags += "--total-timesteps 160 --learning-starts 40 --train-frequency 5 --gradient-steps 5 --batch-size 32".split()
    flags += "--reward-batch-size 8 --buffer-size 1000 --seed 3 --save-buffer".split()
    (tmp_path / "full").mkdir()
    (tmp_path / "cut").mkdir()
    monkeypatch.chdir(tmp_path / "full")  # in this process: its Python and Warp are already loaded
    sac.main(tyro.cli(sac.Args, args=flags))
    code, output = interrupt_after("vlmrm_sac_humanoid.py", *flags, cwd=tmp_path / "cut", sig=signal.SIGTERM, after_lines=6)
    assert code == 0 and "checkpoint saved at step" in output, output[-2000:]
    (run_dir,) = (tmp_path / "cut" / "runs").iterdir()
    resumed = run_script("vlmrm_sac_humanoid.py", "--resume", str(run_dir / "checkpoint.pt"), cwd=tmp_path / "cut")
    assert resumed.returncode == 0 and "resumed at step" in resumed.stdout, resumed.stdout[-2000:]
    expected, got = read_scalars(next((tmp_path / "full" / "runs").iterdir())), read_scalars(run_dir)
    # the losses are logged once, at step 100: after the resume
    for tag in ("charts/clip_return", "losses/qf1_loss", "losses/actor_loss"):
        assert len(expected[tag]) >= 1 and got[tag] == expected[tag], tag
    assert len({v for _, v in expected["charts/clip_return"]}) > 8  # the CLIP returns of real frames, not one repeated


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--env-id", "MountainCarContinuous-v0", "--renderer", "warp"], ["--renderer warp", "Humanoid-v5"]),
        (["--env-id", "Hopper-v5", "--renderer", "warp"], ["--renderer warp", "Humanoid-v5"]),
        (["--renderer", "warp", "--supersample", "0"], ["--supersample", "between 1 and 8", "0"]),
        (["--renderer", "warp", "--supersample", "9"], ["--supersample", "9"]),  # a flag of warp's: EGL ignores it
    ],
)
def test_renderer_refusals_are_one_sentence(in_tmp, flags, words):
    tiny = "--reward gt --num-envs 1 --total-timesteps 2 --learning-starts 1".split()  # were it not refused: a short run
    assert_refused(sac, [*flags, *tiny], *words)


def test_the_tools_refuse_warp_where_the_script_does():
    with pytest.raises(vlmrm_utils.UserError, match="Humanoid-v5 only"):
        reward_shape.check_args(reward_shape.Args(env_id="CartPole-v1", renderer="warp"))
    with pytest.raises(vlmrm_utils.UserError, match="between 1 and 8"):
        reward_shape.check_args(reward_shape.Args(env_id="Humanoid-v5", renderer="warp", supersample=0))


def test_warp_high_is_refused_without_mujoco_warp_4s_private_function(monkeypatch):
    monkeypatch.setattr(vlmrm_warp, "warp_lighting_hook", lambda: None)  # another version of mujoco-warp
    with pytest.raises(vlmrm_utils.UserError, match=r"pip install mujoco-warp==4\.0\.0, or use --render-quality fast"):
        sac.check_args(sac.Args(renderer="warp"))
    vlmrm_warp.check_available(sac.Args(renderer="warp", render_quality="fast"))  # no shadows: any version


def test_pose_probe_with_warp(monkeypatch, in_tmp, capsys):
    argv = f"--env-id Humanoid-v5 --clip-models {TINY_CLIP} --clip-pretrained none --render-size 32 --alphas 0 --no-cuda"
    monkeypatch.setattr(sys, "argv", ["reward_shape.py", *argv.split(), "--renderer", "warp"])
    drawn, draw = [], vlmrm_warp.WarpRenderer.draw
    monkeypatch.setattr(vlmrm_warp.WarpRenderer, "draw", lambda self, qpos: drawn.append(qpos) or draw(self, qpos))
    runpy.run_path(str(ROOT / "reward_shape.py"), run_name="__main__")  # a refusal or crash would raise SystemExit
    assert len(drawn) == 13  # each pose's frame drawn by the ray tracer
    (run_dir,) = Path("runs").iterdir()
    assert {p.name for p in run_dir.iterdir()} == {"poses.csv", "poses.png"}
    assert "rendered 13 Humanoid-v5 poses at 32 px (MuJoCo Warp, 2x supersampled, paper camera)" in capsys.readouterr().out


def test_the_default_renderer_does_not_import_warp(tmp_path):
    """EGL runs never pay Warp's import: the script, its envs (with frames after each step) and the tools."""
    code = """
import sys, gymnasium as gym, numpy as np
import vlmrm_sac_humanoid as sac, vlmrm_utils, reward_shape, epic_eval, success_eval
args = sac.Args(reward="gt", num_envs=1)
sac.check_args(args)
fn = sac.make_env("Humanoid-v5", 0, 0, 10, 32, "fast", True, frame_shape=(32, 32, 3))
envs = vlmrm_utils.make_vector_env(gym.vector.SyncVectorEnv, [fn], gym.vector.AutoresetMode.DISABLED, frames=True)
envs.reset(seed=0)
frames = envs.step(np.zeros((1, 17)))[4]["frames"]
assert frames.shape == (1, 32, 32, 3) and frames.dtype == np.uint8 and frames.any()
print(sorted(m for m in sys.modules if m.split(".")[0] in ("warp", "mujoco_warp", "vlmrm_warp")))
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_one_line_says_when_the_kernels_compile(monkeypatch, capsys, drawn_and_rendered):
    """Said when Warp's cache holds no compiled ray tracer for the device (simulated: the cache is never emptied)."""
    sac.warp_renderer(True, 16, 1, 1, torch.device("cpu"))  # compiled by the fixture: nothing said
    assert "compiling" not in capsys.readouterr().out
    glob = Path.glob
    monkeypatch.setattr(Path, "glob", lambda self, pattern: iter(()) if "mujoco_warp" in pattern else glob(self, pattern))
    sac.warp_renderer(True, 16, 1, 1, torch.device("cpu"))
    out = capsys.readouterr().out
    assert out.startswith("compiling MuJoCo Warp's ray tracer kernels for cpu (once per machine: ~10 s on a CPU")
    assert out.count("\n") == 1


def test_ground_truth_runs_with_warp_and_draws_nothing(in_tmp, monkeypatch):
    monkeypatch.setattr(vlmrm_warp.WarpRenderer, "draw", lambda *a: pytest.fail("--reward gt scores no frame"))
    tiny = dict(num_envs=2, total_timesteps=20, learning_starts=10, buffer_size=100, batch_size=8)
    sac.main(sac.Args(reward="gt", renderer="warp", **tiny))
    assert len(list(Path("runs").iterdir())) == 1


def test_an_unwritable_kernel_cache_is_refused_before_the_run_folder(tmp_path):
    """It was `[Errno 30] Read-only file system: '.../1.19.0'` once the run folder was made, naming neither Warp's cache
    nor WARP_CACHE_PATH. /proc/self/...: a folder no one can make, root included (who ignores folder permissions)."""
    flags = [*TINY_CLIP_FLAGS, "--renderer", "warp", "--num-envs", "1", "--total-timesteps", "4", "--learning-starts", "2"]
    env = {**os.environ, "WARP_CACHE_PATH": "/proc/self/warp"}
    result = run_script("vlmrm_sac_humanoid.py", *flags, "--render-size", "16", cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 2 and not (tmp_path / "runs").exists(), result.stdout[-2000:] + result.stderr[-2000:]
    assert_clean_error(result, "MuJoCo Warp's kernel cache /proc/", "/warp/", "set WARP_CACHE_PATH to a writable folder")


def test_a_full_disk_under_the_kernel_cache_is_refused_before_a_compile(monkeypatch):
    """A full disk under the cache was LLVM's `IO failure on output stream` midway through the first compile."""
    monkeypatch.setattr(vlmrm_warp.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**30, 2**30 - 2**20, 2**20))
    vlmrm_warp.check_available(sac.Args(renderer="warp"), torch.device("cpu"))  # compiled already: nothing to write
    monkeypatch.setattr(vlmrm_warp, "compiled", lambda device: False)
    with pytest.raises(vlmrm_utils.UserError, match=r"kernel cache .* has 1 MiB free, .* \(needs 64 MiB\); .*WARP_CACHE_PATH"):
        sac.check_args(sac.Args(renderer="warp"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a CUDA driver")
def test_no_cuda_driver_is_said_once_in_our_words():
    """Warp's C code printed `Warp CUDA warning: Could not find or load the NVIDIA CUDA driver. GPU execution will not be
    available.` on every run (training, reward_shape.py); one line of ours says it, once per process."""
    code = """
import torch, vlmrm_sac_humanoid as sac
for worlds in (2, 1):  # the trainer's renderer, then the evaluation env's
    sac.warp_renderer(True, 16, 1, worlds, torch.device("cpu"))
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "CUDA" not in result.stderr, result.stderr
    assert result.stdout.count("this machine has no CUDA driver") == 1, result.stdout


def test_the_evaluation_env_draws_where_the_trainer_does(monkeypatch):
    """The evaluation env's one-world renderer used CUDA whenever there was one, ignoring --no-cuda and
    --reward-devices; it and the trainer's now both take draw_device's choice (CUDA pretended here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert sac.draw_device(True, ()) == torch.device("cuda")
    assert sac.draw_device(False, ()) == torch.device("cpu")
    assert sac.draw_device(True, ("cpu",)) == torch.device("cpu")
    assert sac.draw_device(False, ("cuda:1", "cuda:0")) == torch.device("cuda", 1)
    made, blank = [], SimpleNamespace(draw=lambda qpos: torch.zeros((1, 16, 16, 3), dtype=torch.uint8))
    monkeypatch.setattr(sac, "warp_renderer", lambda *a, **kw: made.append(a[4]) or blank)  # the device it is made on
    for cuda, devices in [(False, ()), (True, ("cpu",)), (True, ("cuda:1",))]:
        env = sac.make_env("Humanoid-v5", 0, 0, 10, 16, "fast", True, renderer="warp", cuda=cuda, reward_devices=devices)()
        env.reset(seed=0)
        env.render()
        env.close()
    assert made == [torch.device("cpu"), torch.device("cpu"), torch.device("cuda", 1)]


def test_two_ctrl_cs_during_one_long_c_call_quit():
    """Python runs a signal's handler once for every delivery that arrived while the main thread was in one C call, as
    in Warp's first kernel compile: two quick Ctrl-Cs there were one (`SIGINT received` once, a checkpoint, exit 0).
    Here another thread takes both while the main thread waits in a join, which a signal to another thread leaves
    waiting; the handler then runs once and must count two."""
    previous = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), signal.set_wakeup_fd(-1)
    try:
        stop = vlmrm_utils.install_stop_handlers()
        thread = threading.Thread(target=lambda: [signal.pthread_kill(threading.get_ident(), signal.SIGINT) for _ in "12"])
        with pytest.raises(KeyboardInterrupt):
            thread.start()
            thread.join()
            time.sleep(0.1)  # the handler runs here, once
        assert not stop["requested"]  # quit at once: no checkpoint
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
        signal.set_wakeup_fd(previous[2])


def test_the_memory_estimate_counts_a_warp_env_as_one_that_draws_nothing(monkeypatch, capsys):
    """`--renderer warp --num-envs 128` was refused needing 21.5 GiB: each env counted as an EGL worker (180 MB); a warp
    worker returns its state (measured 13.5 MB, plus 1.4 MB a world in the trainer's renderer)."""
    monkeypatch.setattr(vlmrm_utils, "available_memory", lambda: 8 * 2**30)
    flags = dict(clip_model=TINY_CLIP, clip_pretrained="none", num_envs=128, buffer_size=10_000, cuda=False)
    sac.check_args(sac.Args(renderer="warp", **flags))
    assert "128 envs 1.79," in capsys.readouterr().out  # GiB: 128 x 15 MB
    with pytest.raises(vlmrm_utils.UserError, match="lower --num-envs"):  # EGL: 128 processes drawing
        sac.check_args(sac.Args(renderer="egl", **flags))
