"""Failures during a run (issue 41): a dead env worker, a frame of the wrong dtype or shape, Ctrl-C while the scorer is
slow, the reward model out of GPU memory, the NaN guard's step, and a MuJoCo OpenGL backend whose library is missing."""

import ctypes.util
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY_CLIP, TINY_CLIP_FLAGS, assert_clean_error, children, run_script

import vlmrm_dqn_classic as classic
import vlmrm_sac_humanoid as sac
import vlmrm_utils

CAR = dict(env_id="MountainCarContinuous-v0", num_envs=2, episode_length=50, learning_starts=100, reward_batch_size=20)


def gone(pids, seconds: float = 10) -> bool:
    deadline = time.time() + seconds
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    return not any(os.path.exists(f"/proc/{p}") for p in pids)


def test_a_killed_env_worker_stops_the_run_in_one_sentence_and_frees_it(tmp_path, monkeypatch):
    """SIGKILL of one env worker after a checkpoint: the trainer waited for ever, holding run.lock (4 of 5 tries)."""
    flags = [*TINY_CLIP_FLAGS, *(f"--{k.replace('_', '-')}={v}" for k, v in CAR.items())]
    flags += "--total-timesteps 100000 --save-model --checkpoint-frequency 100".split()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "vlmrm_sac_humanoid.py"), *flags],
        cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        for line in proc.stdout:  # training, with a checkpoint saved
            if line.startswith("checkpoint saved"):
                break
        workers = children(proc.pid)
        assert len(workers) == 2, workers
        os.kill(int(workers[0]), signal.SIGKILL)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:  # the hang: end it and its workers, then fail
            for pid in [*children(proc.pid), proc.pid]:
                os.kill(int(pid), signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 1, err[-3000:]
    assert_clean_error(subprocess.CompletedProcess([], 1, out, err), f"env worker 0 (pid {workers[0]}) died", "SIGKILL")
    assert gone(workers), workers  # the other worker was stopped too
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert f"--resume runs/{run_dir.name}/checkpoint.pt" in err
    monkeypatch.chdir(tmp_path)  # --resume's checks, the lock among them: the run is free and its checkpoint whole
    assert vlmrm_utils.read_checkpoint(f"runs/{run_dir.name}/checkpoint.pt", sac.Args)["global_step"] >= 100


@pytest.mark.parametrize("signum, how", [(signal.SIGKILL, "killed by SIGKILL"), (signal.SIGRTMIN + 1, "exited with code -35")])
def test_a_worker_dead_when_the_trainer_sends_to_it_is_the_same_sentence(in_tmp, monkeypatch, signum, how):
    """A broken pipe on the send was `[Errno 32] Broken pipe` with the surviving worker's traceback. A real-time signal
    has no name in `signal.Signals`: said by its exit code (naming it raised ValueError inside the error handler)."""
    step, calls = vlmrm_utils.FramesInInfo.step, []

    def kill_then_step(self, actions):
        calls.append(1)
        if len(calls) == 60:  # after the checkpoint at step 100
            worker = self.env.unwrapped.processes[1]
            os.kill(worker.pid, signum)
            worker.join()
        return step(self, actions)

    monkeypatch.setattr(vlmrm_utils.FramesInInfo, "step", kill_then_step)
    args = sac.Args(**CAR, clip_model=TINY_CLIP, clip_pretrained="none", total_timesteps=400, save_model=True,
                    checkpoint_frequency=100)  # fmt: skip
    try:
        with pytest.raises(vlmrm_utils.RunError, match=rf"^env worker 1 \(pid \d+\) died \({how}\); .*--resume"):
            sac.main(args)
    finally:
        left = multiprocessing.active_children()
        for worker in left:  # never leave a worker that ignores SIGTERM in the test process
            worker.kill()
            worker.join()
    assert not left and not vlmrm_utils.RUN_LOCKS
    (run_dir,) = (in_tmp / "runs").iterdir()
    assert vlmrm_utils.read_checkpoint(f"runs/{run_dir.name}/checkpoint.pt", sac.Args)["global_step"] == 100


@pytest.mark.parametrize(
    "frame, said",
    [
        (lambda f: f / 255.0, "a float64 array of shape (400, 600, 3) (values 0 to 1)"),
        (lambda f: f[:200], "a uint8 array of shape (200, 600, 3)"),
        (lambda f: None, "None"),
    ],
    ids=["float", "shape", "none"],
)
def test_a_frame_of_the_wrong_dtype_or_shape_is_one_sentence_naming_the_env(in_tmp, monkeypatch, frame, said):
    """Float frames in [0, 1] trained on black frames (gymnasium's shared memory casts them to 0), a wrong shape was a
    broadcast traceback: in process (DQN) and in env workers (SAC)."""
    render = classic.GymnasiumPixels.render
    monkeypatch.setattr(classic.GymnasiumPixels, "render", lambda self: frame(render(self)))
    expected = f"CartPole-v1 rendered {said}, but the reward model needs uint8 frames of shape (400, 600, 3)"
    with pytest.raises(vlmrm_utils.RunError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        classic.main(classic.Args(clip_model=TINY_CLIP, clip_pretrained="none", total_timesteps=300, learning_starts=100))


def test_a_wrong_frame_from_an_env_worker_is_one_sentence(in_tmp, monkeypatch):
    step = sac.FrameAfterStep.step

    def float_frames(self, action):  # runs in the env workers (forked after the patch)
        self.env.render = lambda render=self.env.render: render() / 255.0
        return step(self, action)

    monkeypatch.setattr(sac.FrameAfterStep, "step", float_frames)
    args = sac.Args(**CAR, clip_model=TINY_CLIP, clip_pretrained="none", total_timesteps=200)
    with pytest.raises(vlmrm_utils.RunError, match=r"MountainCarContinuous-v0 rendered a float64 array of shape \(400, 600"):
        sac.main(args)
    assert not multiprocessing.active_children()


def test_the_nan_guard_names_the_step_of_the_first_bad_frame():
    run = object.__new__(vlmrm_utils.Run)
    run.args = SimpleNamespace(reward="clip", num_envs=4)
    run.name, run.finite = "run", None  # the NaN guard's state (Run.start)
    rewards = np.zeros(12, np.float32)  # rows are step-major: 3 vector steps of 4 envs, the last one is step 108
    rewards[[5, 11]] = np.nan  # env 1 at step 104, env 3 at step 108
    with pytest.raises(vlmrm_utils.NonFiniteError, match=r"not finite for 2 of 12 frames, the first at step 104 \(env 1\)"):
        run.check_rewards(rewards, 108, lambda: None)


def test_cuda_out_of_memory_in_the_scorer_is_one_sentence_naming_the_batch_size(in_tmp, monkeypatch, capsys):
    def out_of_memory(self, frames):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 20 lines follow)")

    cost = vlmrm_utils.check_reward_memory
    monkeypatch.setattr(classic.CLIPReward, "forward", out_of_memory)
    flags = [*TINY_CLIP_FLAGS, *"--total-timesteps 300 --learning-starts 100 --reward-batch-size 64".split()]
    with pytest.raises(SystemExit) as exit:
        vlmrm_utils.cli(classic.main, classic.Args, flags)
    err = capsys.readouterr().err
    assert exit.value.code == 1 and err.count("\n") == 1, err
    assert re.match(r"error: out of GPU memory; lower --reward-batch-size 64 ", err), err
    # at start-up, where the reward model's peak memory is measured on a full chunk: refused as a flag would be
    reward_model = lambda frames: out_of_memory(None, frames)  # noqa: E731
    reward_model.device, reward_model.replicas = torch.device("cuda"), [(None, torch.device("cuda", 0))]
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
    with pytest.raises(vlmrm_utils.UserError, match=r"scoring --reward-batch-size 64 frames .*; lower --reward-batch-size"):
        cost(reward_model, SimpleNamespace(reward_batch_size=64), (8, 8, 3))


def test_an_interrupt_drops_the_chunks_still_queued_for_the_scorer(in_tmp, monkeypatch):
    """Ctrl-C (or an error) with chunks queued behind the one being scored: the queued ones are never scored."""
    scored, calls, due = [], [], vlmrm_utils.Run.checkpoint_due

    def slow(self, frames):  # a busy device
        time.sleep(0.4)
        scored.append(len(frames))
        return np.zeros(len(frames), np.float32)

    def step_then_ctrl_c(self, *a, **k):  # once per vector step
        calls.append(1)
        if len(calls) == 52:  # chunks of 16 steps: the 1st scored, the 2nd being scored, the 3rd queued
            raise KeyboardInterrupt
        return due(self, *a, **k)

    monkeypatch.setattr(classic.CLIPReward, "forward", slow)
    monkeypatch.setattr(vlmrm_utils.Run, "checkpoint_due", step_then_ctrl_c)
    args = classic.Args(clip_model=TINY_CLIP, clip_pretrained="none", total_timesteps=2000, learning_starts=1000,
                        reward_batch_size=16)  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        classic.main(args)
    time.sleep(1.5)  # long enough for the 2nd and a 3rd chunk
    assert scored == [16, 16], scored


def test_a_second_ctrl_c_while_the_scorer_is_slow_quits_without_scoring_the_queued_chunks(tmp_path):
    """It quit only once every queued chunk was scored (26 s with three 8 s chunks); a third Ctrl-C printed a traceback."""
    delay = 2.0  # seconds per chunk: the loop keeps two chunks queued behind the one being scored
    wrapper = f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        import vlmrm_dqn_classic as m
        score = m.CLIPReward.forward
        m.CLIPReward.forward = lambda self, x: time.sleep({delay}) or score(self, x) if len(x) > 8 else score(self, x)
        m.utils.cli(m.main, m.Args)
    """
    (tmp_path / "run.py").write_text(textwrap.dedent(wrapper))
    flags = [*TINY_CLIP_FLAGS, *"--total-timesteps 100000 --learning-starts 1000 --reward-batch-size 16".split()]
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "run.py"), *flags], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        for line in proc.stdout:
            if line.startswith("run: "):
                break
        time.sleep(0.5)  # three chunks made at once, two of them queued behind the one being scored
        proc.send_signal(signal.SIGINT)
        for line in proc.stdout:
            if line.startswith("SIGINT received"):
                break
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        err = ""
        while not err.endswith("interrupted\n"):  # the exit's own line: the process is ending
            line = proc.stderr.readline()
            assert line, err[-3000:]
            err += line
        proc.send_signal(signal.SIGINT)  # a third, while the exit waits for the chunk being scored
        out, rest = proc.communicate(timeout=60)
        err, took = err + rest, time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert took < 1.5 * delay, f"quit {took:.1f} s after the second Ctrl-C (a chunk takes {delay} s)"
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    assert proc.returncode in (130, -signal.SIGINT), (proc.returncode, err[-3000:])


def test_a_second_interrupt_inside_a_step_ends_at_once_however_the_workers_reply(tmp_path):
    """A second Ctrl-C or SIGTERM inside a step whose first worker had replied hung for ever (1 in 6 tries with 8 envs,
    3 in 3 with a slow env): gymnasium's close waited for replies already read. A fast env beside one whose step takes
    2 s makes the race certain; each try runs the run's own exit (`Run.closing`), INT, INT or TERM, TERM."""
    tries = 12
    script = f"""
        import signal, sys, threading, os, time
        sys.path.insert(0, {str(ROOT)!r})
        import gymnasium as gym, numpy as np
        import vlmrm_utils as utils

        class Env(gym.Env):
            observation_space, action_space = gym.spaces.Box(-1, 1, (1,)), gym.spaces.Discrete(2)
            def __init__(self, delay):
                self.delay = delay
            def reset(self, seed=None, options=None):
                return np.zeros(1, np.float32), {{}}
            def step(self, action):
                time.sleep(self.delay)
                return np.zeros(1, np.float32), 0.0, False, False, {{}}

        run = object.__new__(utils.Run)
        run.scorer = run.writer = None
        run.name = "run"
        for i in range({tries}):
            sig = (signal.SIGINT, signal.SIGTERM)[i % 2]
            fns = [lambda: Env(0.0), lambda: Env(2.0)]
            envs = utils.make_vector_env(gym.vector.AsyncVectorEnv, fns, gym.vector.AutoresetMode.DISABLED)
            workers = [p.pid for p in envs.unwrapped.processes]
            run.stop = utils.install_stop_handlers()
            envs.reset(seed=i)
            sent = []
            for after in (0.2, 0.4):  # the first asks for a checkpoint, the second quits: env 0 has replied by then
                threading.Timer(after, lambda: sent.append(time.monotonic()) or os.kill(os.getpid(), sig)).start()
            try:
                with run.closing(envs):
                    envs.step(np.zeros(2, np.int64))
            except KeyboardInterrupt:
                took = time.monotonic() - sent[1]
            else:
                raise SystemExit("the step ended before the second interrupt")
            print(f"{{took:.2f}}", *[os.path.exists(f"/proc/{{p}}") for p in workers], flush=True)
    """
    (tmp_path / "tries.py").write_text(textwrap.dedent(script))
    proc = subprocess.Popen([sys.executable, str(tmp_path / "tries.py")], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    try:
        out, err = proc.communicate(timeout=40)  # 12 tries take about 8 s
    except subprocess.TimeoutExpired:  # the hang: its workers end with it (die_with_parent)
        proc.kill()
        out, err = proc.communicate()
    rows = [line.split() for line in out.splitlines() if line.strip() and not line.endswith("(again: quit now)")]
    assert proc.returncode == 0, f"{len(rows)} of {tries} tries ended, then it hung:\n{out}{err[-2000:]}"
    assert len(rows) == tries, out
    for seconds, *alive in rows:
        assert float(seconds) < 1.0 and alive == ["False", "False"], out  # the slow env's 2 s step was not waited for


@pytest.mark.skipif(ctypes.util.find_library("OSMesa") is not None, reason="libOSMesa is installed here: nothing is missing")
def test_mujoco_gl_osmesa_without_osmesa_is_one_sentence(tmp_path):
    result = run_script(
        "vlmrm_sac_humanoid.py",
        "--help",
        cwd=tmp_path,
        env={"MUJOCO_GL": "osmesa", "PYOPENGL_PLATFORM": "osmesa"},
        timeout=120,
    )
    assert result.returncode == 2
    assert_clean_error(result, "MUJOCO_GL=osmesa", "libosmesa6", "MUJOCO_GL=egl")
