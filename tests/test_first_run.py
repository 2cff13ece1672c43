"""What a new user sees first in both training scripts: torch threads, the progress line, the memory estimate."""

import io
import os
import re
import subprocess
import sys

import pytest
import torch
import tyro
from conftest import ROOT, TINY_CLIP, TINY_CLIP_FLAGS, assert_refused, run_script

import vlmrm_dqn_classic as classic
import vlmrm_sac_humanoid as sac
import vlmrm_utils

SCRIPTS = {classic: "vlmrm_dqn_classic.py", sac: "vlmrm_sac_humanoid.py"}
SHORT_RUNS = {  # ground truth, a few seconds: 10 episodes (DQN), 8 episodes (SAC, 2 envs)
    classic: ["--reward", "gt", "--episodes", "fixed", "--total-timesteps", "2000", "--learning-starts", "500"],
    sac: (
        "--env-id InvertedPendulum-v5 --reward gt --episodes fixed --num-envs 2 --episode-length 50 "
        "--total-timesteps 400 --learning-starts 200 --train-frequency 10 --gradient-steps 2 --batch-size 32"
    ).split(),
}
PROGRESS = re.compile(
    r"^step (\d+)/(\d+) \(\d+%\) \| +[\d.?]+ steps/s \| elapsed \S+ \| left \S+"
    r" \| last (\d+) episodes: gt_return \S+$"
)


@pytest.mark.parametrize("module", SCRIPTS, ids=["dqn", "sac"])
def test_one_torch_thread_on_cpu_by_default_and_gpu_runs_left_alone(module, monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    vlmrm_utils.set_torch_threads(module.Args(), torch.device("cpu"))  # default on CPU: 1
    vlmrm_utils.set_torch_threads(module.Args(), torch.device("cuda"))  # default on GPU: untouched
    vlmrm_utils.set_torch_threads(module.Args(torch_threads=0), torch.device("cpu"))  # 0: torch's default, untouched
    vlmrm_utils.set_torch_threads(module.Args(torch_threads=3), torch.device("cuda"))  # asked for: applied
    assert calls == [1, 3]


@pytest.mark.parametrize("module", SCRIPTS, ids=["dqn", "sac"])
def test_training_applies_the_thread_setting_before_any_work(module, in_tmp, monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    module.main(tyro.cli(module.Args, args=[*SHORT_RUNS[module], "--no-cuda"]))
    assert calls == [1]


@pytest.mark.parametrize("module", SCRIPTS, ids=["dqn", "sac"])
def test_negative_torch_threads_is_refused(module, in_tmp):
    flags = ["--torch-threads", "-1"] + (["--goal", "x"] if module is classic else [])
    assert_refused(module, flags, "--torch-threads")


@pytest.mark.parametrize("module", SCRIPTS, ids=["dqn", "sac"])
def test_a_copy_of_the_script_runs_in_any_folder(module, tmp_path):
    """README: copy a script into your own experiment folder and run it there; the install (`pip install -e .` in
    requirements.txt) makes the shared plumbing importable from any folder, as `pip install cleanrl` does
    `cleanrl_utils`."""
    experiment = tmp_path / "exp"
    experiment.mkdir()
    copy = experiment / "my_reward.py"
    copy.write_bytes((ROOT / SCRIPTS[module]).read_bytes())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing points at the repository
    result = subprocess.run(
        [sys.executable, str(copy), *SHORT_RUNS[module]], cwd=experiment, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (run_dir,) = (experiment / "runs").iterdir()
    assert "__my_reward__" in run_dir.name  # the copy's own experiment name


def test_an_edited_copy_trains_with_its_own_camera_and_episode_length_and_the_original_is_unchanged(tmp_path):
    """Issue 45: what CLIP sees and how long an episode lasts are lines of the training script, so a researcher changes
    them by editing their copy only: the copy trains and evaluates with its camera and episode length."""
    import importlib.util

    import imageio.v2 as imageio
    import numpy as np

    original = (ROOT / "vlmrm_sac_humanoid.py").read_text()
    length = "args.episode_length = 200 if mountain_car else "
    edits = [('HUMANOID_CAMERA = {"distance": 3.5,', 'HUMANOID_CAMERA = {"distance": 6.0,'), (length + "100", length + "30")]
    edited = original
    for old, new in edits:
        assert original.count(old) == 1, old
        edited = edited.replace(old, new)
    copy = tmp_path / "my_reward.py"
    copy.write_text(edited)
    flags = [*TINY_CLIP_FLAGS, *"--num-envs 1 --render-size 32 --render-quality fast --total-timesteps 90".split()]
    flags += "--learning-starts 30 --batch-size 16 --train-frequency 30 --gradient-steps 1 --buffer-size 1000".split()
    flags += ["--log-episodes"]
    train = subprocess.run([sys.executable, str(copy), *flags, "--save-model"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert train.returncode == 0, train.stderr[-2000:]
    ended = [int(m) for m in re.findall(r"^global_step=(\d+),", train.stdout, re.M)]
    assert ended == [29, 59, 89], train.stdout  # the copy's 30-step episodes (steps count from 0)
    (run_dir,) = (tmp_path / "runs").iterdir()
    rollout = [sys.executable, str(copy), "--evaluate", f"runs/{run_dir.name}/checkpoint.pt", "--eval-episodes", "1"]
    evaluation = subprocess.run(rollout, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert evaluation.returncode == 0, evaluation.stderr[-2000:]
    frames = sorted((tmp_path / "videos" / run_dir.name / "eval-episode-0").glob("frame-*.png"))
    assert len(frames) == 31  # the reset frame and 30 steps

    def reset_frame(path: str, name: str) -> np.ndarray:  # the evaluation's first frame, drawn by that file's make_env
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        env = module.make_env("Humanoid-v5", 10_001, 0, 30, 32, "fast", True)()
        env.reset(seed=10_001)
        return env.render()

    drawn = imageio.imread(frames[0])
    np.testing.assert_array_equal(drawn, reset_frame(str(copy), "my_reward"))  # the copy's camera, 6 m away
    assert not np.array_equal(drawn, reset_frame(str(ROOT / "vlmrm_sac_humanoid.py"), "original"))
    assert (ROOT / "vlmrm_sac_humanoid.py").read_text() == original and sac.HUMANOID_CAMERA["distance"] == 3.5


@pytest.mark.parametrize("module", SCRIPTS, ids=["dqn", "sac"])
def test_a_copy_without_the_install_says_to_reinstall(module, tmp_path):
    """Issue 46 item 11: the checkout moved or deleted after `pip install -e`: one sentence, not a ModuleNotFoundError."""
    copy = tmp_path / "my_reward.py"
    copy.write_bytes((ROOT / SCRIPTS[module]).read_bytes())
    gone = f"import runpy, sys; sys.modules['vlmrm_utils'] = None; runpy.run_path({str(copy)!r}, run_name='__main__')"
    result = subprocess.run([sys.executable, "-c", gone], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert result.stderr.startswith("error: vlmrm_utils is not importable") and "pip install -e" in result.stderr


@pytest.mark.parametrize("module", SCRIPTS, ids=["dqn", "sac"])
def test_short_run_prints_a_few_lines_with_progress_and_episode_lines_on_request(module, tmp_path):
    quiet = run_script(SCRIPTS[module], *SHORT_RUNS[module], cwd=tmp_path)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    lines = quiet.stdout.splitlines()
    assert len(lines) <= 6 and not any(line.startswith("global_step=") for line in lines), quiet.stdout
    progress = [m for m in map(PROGRESS.match, lines) if m]
    assert progress, quiet.stdout
    step, total, recent = map(int, progress[-1].groups())
    assert step == total and recent == (10 if module is classic else 8)  # the last 10 episodes, or all of them
    assert not any(line.startswith("memory:") for line in lines)  # small buffers: no estimate worth a line

    verbose = run_script(SCRIPTS[module], *SHORT_RUNS[module], "--log-episodes", cwd=tmp_path)
    assert verbose.returncode == 0, verbose.stderr[-2000:]
    episodes = [line for line in verbose.stdout.splitlines() if line.startswith("global_step=")]
    assert len(episodes) == (10 if module is classic else 8)
    assert "episodic_return=" in episodes[0] and "gt_return=" in episodes[0]


def test_progress_line_is_redrawn_in_place_on_a_terminal(monkeypatch):
    out = io.StringIO()
    out.isatty = lambda: True
    monkeypatch.setattr(sys, "stdout", out)
    progress = vlmrm_utils.Progress(1000, 0, clip=True, recent=2)
    for gt_return, clip_return in [(10, 1.0), (20, 2.0), (30, 3.0)]:
        progress.returns.append((gt_return, clip_return))
    progress.update(500)  # too soon after the start: nothing
    assert out.getvalue() == ""
    progress.last -= 1
    progress.update(500)
    text = out.getvalue()
    assert text.startswith("\r") and text.endswith("\r") and "\n" not in text
    assert "step 500/1000 (50%)" in text and "left" in text and "last 2 episodes: gt_return 25.0, clip_return 2.50" in text
    progress.update(1000, final=True)  # the last update ends the line
    assert out.getvalue().endswith("\n") and out.getvalue().count("\n") == 1


def test_progress_in_a_log_is_one_line_every_interval(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    progress = vlmrm_utils.Progress(1000, 0, clip=False, recent=10, interval=10.0)
    progress.update(100)
    progress.last -= 9
    progress.update(200)  # 9 s after the last line: nothing
    progress.last -= 2
    progress.update(300)
    assert out.getvalue().splitlines() == [out.getvalue().splitlines()[0]] and "step 300/1000 (30%)" in out.getvalue()
    assert "gt_return" not in out.getvalue()  # no episode finished yet


@pytest.mark.parametrize("module", SCRIPTS, ids=["dqn", "sac"])
def test_memory_estimate_only_when_training_and_when_it_matters(module, in_tmp, capsys, monkeypatch):
    flags = {"clip_model": TINY_CLIP, "clip_pretrained": "none"} | ({"goal": ("x",)} if module is classic else {})
    module.check_args(module.Args(**flags))
    # the humanoid's 1M-step buffer is GiBs: one line; CartPole's default needs a few MiB: no line
    assert capsys.readouterr().out.count("memory:") == (1 if module is sac else 0)
    module.check_args(module.Args(**flags, buffer_size=30_000_000 if module is classic else 2_000_000))
    assert capsys.readouterr().out.count("memory:") == 1
    (in_tmp / "checkpoint.pt").write_bytes(b"")  # its checks are --evaluate's own tests; here a checkpoint that passes them
    monkeypatch.setattr(vlmrm_utils, "read_checkpoint", lambda *a: {"actor": {}, "q_network": {}, "args": {}})
    module.check_args(module.Args(**flags, evaluate=str(in_tmp / "checkpoint.pt")))
    assert "memory:" not in capsys.readouterr().out


def test_skipped_tests_say_why_without_rs(tmp_path):
    (tmp_path / "test_skip.py").write_text(
        "import pytest\n\n@pytest.mark.skip(reason='needs chromium (apt-get install chromium chromium-driver)')\n"
        "def test_browser():\n    pass\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", "test_skip.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "1 skipped" in result.stdout, result.stdout + result.stderr
    assert "needs chromium (apt-get install chromium chromium-driver)" in result.stdout, result.stdout
