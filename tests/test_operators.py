"""What people who run this for real rely on: runs you can extend, the paper's checkpoints, CleanRL's --track,
checkpoint paths that are regular files, --evaluate with the run's own settings, messages that fit the input."""

import math
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY_CLIP, assert_clean_error, assert_refused, only_run, read_scalars, run_script

import vlmrm_dqn_classic as classic
import vlmrm_utils

GT_RUN = dict(reward="gt", episodes="fixed", episode_length=100, learning_starts=100, save_model=True)


def test_a_larger_total_timesteps_extends_a_finished_run_in_place(in_tmp):
    classic.main(classic.Args(**GT_RUN, total_timesteps=400, checkpoint_frequency=200))
    run = only_run(in_tmp)
    checkpoint = str(run / "checkpoint.pt")
    assert_refused(classic, ["--resume", checkpoint, "--total-timesteps", "300"], "--total-timesteps 300", "400")
    assert_refused(classic, ["--resume", checkpoint, "--total-timesteps", "800", "--gamma", "0.9"], "--gamma")
    classic.main(classic.Args(resume=checkpoint, total_timesteps=800))
    assert [p.name for p in (in_tmp / "runs").iterdir()] == [run.name]  # the same run folder
    steps = [s for s, _ in read_scalars(run)["charts/episodic_return"]]
    assert steps == [99, 199, 299, 399, 499, 599, 699, 799]  # one TensorBoard history, each episode once (its last step)
    saved = torch.load(checkpoint, weights_only=False)
    assert saved["global_step"] == 800 and saved["args"]["total_timesteps"] == 800
    # epsilon keeps the schedule of the run as first started: it does not jump back up when the run is extended
    assert saved["schedule_steps"] == 400


def test_step_checkpoints_are_all_kept_with_their_training_time_clip_return(in_tmp):
    clip = dict(clip_model=TINY_CLIP, clip_pretrained="none", goal=("a pole",), baseline=("a cart",))
    flags = dict(GT_RUN, reward="clip", episode_length=50, total_timesteps=400, checkpoint_frequency=200)
    classic.main(classic.Args(**flags, **clip))
    run = only_run(in_tmp)
    files = sorted((run / "checkpoints").iterdir(), key=lambda p: int(p.stem.split("-")[1]))
    assert [p.name for p in files] == ["step-200.pt", "step-400.pt"]
    returns = []
    for path in files:
        saved = torch.load(path, weights_only=False)
        assert {"q_network", "args", "run_name", "global_step", "clip_return"} <= saved.keys()
        assert saved["global_step"] == int(path.stem.split("-")[1]) and saved["run_name"] == run.name
        assert math.isfinite(saved["clip_return"])
        returns.append(saved["clip_return"])
    # the return recorded is the mean CLIP return of the episodes ended so far, as logged in TensorBoard
    logged = [v for _, v in read_scalars(run)["charts/clip_return"]]
    assert returns == pytest.approx([sum(logged[:4]) / 4, sum(logged) / 8], rel=1e-5)
    # rolled out: a step checkpoint is networks, not a run state
    assert_refused(classic, ["--resume", str(files[0])], "no resumable training state")


def test_evaluate_rolls_out_with_the_runs_own_episode_length(in_tmp):
    classic.main(classic.Args(**dict(GT_RUN, episode_length=30), total_timesteps=300, checkpoint_frequency=300))
    run = only_run(in_tmp)
    classic.main(classic.Args(evaluate=str(run / "checkpoint.pt"), eval_episodes=1))
    (frames,) = [p for p in (in_tmp / "videos").glob("*/eval-episode-0") if p.is_dir()]
    assert len(list(frames.glob("*.png"))) == 31  # the reset frame and 30 steps: the run's --episode-length, not 200


def test_checkpoint_paths_must_be_regular_files_of_their_own_run(in_tmp):
    os.mkfifo("pipe.pt")
    os.mkdir("folder.pt")
    done = threading.Event()
    threading.Timer(30, lambda: done.is_set() or os._exit(3)).start()  # a pipe used to wait forever: fail, not hang
    for flag in ("--resume", "--evaluate"):
        assert_refused(classic, [flag, "pipe.pt"], "pipe.pt", "not a regular file")
        assert_refused(classic, [flag, "folder.pt"], "folder.pt", "is a folder")
    done.set()
    classic.main(classic.Args(**GT_RUN, total_timesteps=200, checkpoint_frequency=200))
    run = only_run(in_tmp)
    os.rename(run / "checkpoint.pt", "copied.pt")  # a checkpoint copied out of its run folder
    assert_refused(classic, ["--resume", "copied.pt"], f"runs/{run.name}/", "copied.pt")


@pytest.mark.skipif(sys.platform != "linux", reason="W&B offline mode is tested on Linux")
def test_track_logs_to_weights_and_biases_offline(tmp_path):
    flags = "--reward gt --episodes fixed --total-timesteps 300 --learning-starts 100 --track --wandb-project-name t"
    result = run_script("vlmrm_dqn_classic.py", *flags.split(), cwd=tmp_path, env={"WANDB_MODE": "offline"})
    assert result.returncode == 0, result.stderr[-2000:]
    run = only_run(tmp_path)
    (offline,) = (tmp_path / "wandb").glob("offline-run-*")  # ./wandb, as CleanRL's: not inside the run it syncs
    (log,) = offline.glob("*.wandb")  # what `wandb sync` uploads later
    assert b"total_timesteps" in log.read_bytes() and b"learning_starts" in log.read_bytes()  # the flags as config
    assert any((offline / "files").rglob("events.out.tfevents.*"))  # synced from the TensorBoard logs
    assert "wandb sync" in result.stdout + result.stderr
    # the run folder holds files only (TensorBoard's, its lock): no copy of W&B's copy of it, nested ever deeper
    assert len(list(run.glob("events.out.tfevents.*"))) == 1 and all(p.is_file() for p in run.rglob("*")), list(run.rglob("*"))


@pytest.mark.skipif(sys.platform != "linux", reason="W&B offline mode is tested on Linux")
def test_track_without_a_login_is_one_sentence_before_the_run_folder(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["HOME"] = str(tmp_path)  # no ~/.netrc, no W&B settings: not logged in
    flags = "--reward gt --total-timesteps 300 --learning-starts 100 --track".split()
    result = subprocess.run(
        [sys.executable, str(ROOT / "vlmrm_dqn_classic.py"), *flags], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert_clean_error(result, "--track", "`wandb login`", "WANDB_MODE=offline")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "wandb").exists()


def test_messages_fit_the_input(in_tmp):
    # RN50 alone: the tags open_clip has for RN50, not the default tag of ViT-bigG-14 that the user never typed
    message = assert_refused(classic, ["--clip-model", "RN50", "--goal", "x"], "needs --clip-pretrained", "openai", "yfcc15m")
    assert "laion2b_s39b_b160k" not in message
    # cpu:0 is a device torch accepts; gpu is none
    vlmrm_utils.check_common_args(classic.Args(reward="gt", reward_devices=("cpu:0", "cpu")), "", "", "q_network")
    assert_refused(classic, ["--reward", "gt", "--reward-devices", "gpu"], "--reward-devices gpu is not a device", "cpu")


def test_the_first_eta_waits_for_measured_speed_and_the_last_is_zero(capsys, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(vlmrm_utils.time, "time", lambda: now[0])
    progress = vlmrm_utils.Progress(1000, 0, clip=False, recent=10, interval=0.0)
    now[0] += 1
    progress.update(100)  # 1 s in: one second of speed predicts nothing
    now[0] += 10
    progress.update(500)
    now[0] += 10
    progress.update(1000, final=True)
    short = vlmrm_utils.Progress(1000, 0, clip=False, recent=10, interval=0.0)
    now[0] += 2
    short.update(1000, final=True)  # a run shorter than the wait: done is done
    done = vlmrm_utils.Progress(1000, 1000, clip=False, recent=10, interval=0.0)  # --resume of a finished run: 0 steps
    now[0] += 6
    done.update(1000, final=True)
    lines = capsys.readouterr().out.splitlines()
    assert "left ?" in lines[0] and "left 00:11" in lines[1] and "left 00:00" in lines[2] and "left 00:00" in lines[3], lines
    assert "left 00:00" in lines[4], lines


def test_evaluate_writes_beside_the_trained_runs_videos_and_replaces_an_earlier_evaluation(in_tmp, capsys):
    classic.main(classic.Args(**dict(GT_RUN, episode_length=30), total_timesteps=300, checkpoint_frequency=300))
    run = only_run(in_tmp)
    classic.main(classic.Args(evaluate=str(run / "checkpoint.pt"), eval_episodes=2))
    classic.main(classic.Args(evaluate=str(run / "checkpoint.pt"), eval_episodes=1, episode_length=10))
    assert [p.name for p in (in_tmp / "videos").iterdir()] == [run.name]  # the trained run's folder, not a new name's
    videos = in_tmp / "videos" / run.name
    assert sorted(p.name for p in videos.iterdir()) == ["eval-episode-0", "eval-episode-0.mp4"]  # nothing left of the first
    assert len(list((videos / "eval-episode-0").glob("*.png"))) == 11  # not 31: no frames of the longer episode behind
    out = capsys.readouterr().out
    assert f"replaced the earlier evaluation in videos/{run.name}/" in out
    assert "eval episode 0: gt_return=" in out and "clip_return" not in out  # --reward gt: no clip_return=nan


def files_under(folder) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "frame, said",
    [
        (lambda f: np.full((1, 1, 3), 0.5, np.float32), "a float32 array of shape (1, 1, 3) (values 0.5 to 0.5)"),
        (lambda f: f[:200], "a uint8 array of shape (200, 600, 3), but the reward model needs uint8 frames of "
         "shape (400, 600, 3)"),
    ],
    ids=["float", "shape"],
)  # fmt: skip
def test_evaluate_checks_the_frames_and_keeps_the_earlier_evaluation(in_tmp, monkeypatch, frame, said):
    """Issue 46: float frames deleted the earlier evaluation, then PIL's TypeError traceback, a broken MP4 and an empty
    frames folder; a frame of another shape mid-episode was a traceback of imageio's."""
    classic.main(classic.Args(**dict(GT_RUN, episode_length=30), total_timesteps=300, checkpoint_frequency=300))
    run = only_run(in_tmp)
    classic.main(classic.Args(evaluate=str(run / "checkpoint.pt"), eval_episodes=1))
    videos = in_tmp / "videos" / run.name
    before, render, calls = files_under(videos), classic.GymnasiumPixels.render, []

    def bad_from_the_4th_frame(self):
        calls.append(1)
        return frame(render(self)) if len(calls) >= 4 else render(self)

    monkeypatch.setattr(classic.GymnasiumPixels, "render", bad_from_the_4th_frame)
    with pytest.raises(vlmrm_utils.RunError) as error:
        classic.main(classic.Args(evaluate=str(run / "checkpoint.pt"), eval_episodes=1))
    assert str(error.value).startswith(f"CartPole-v1 rendered {said}"), error.value
    assert files_under(videos) == before and [p.name for p in videos.iterdir() if p.name.startswith(".")] == []


def test_evaluate_replaces_the_earlier_evaluation_only_once_the_new_one_is_complete(in_tmp, monkeypatch):
    classic.main(classic.Args(**dict(GT_RUN, episode_length=30), total_timesteps=300, checkpoint_frequency=300))
    run = only_run(in_tmp)
    classic.main(classic.Args(evaluate=str(run / "checkpoint.pt"), eval_episodes=2))
    videos = in_tmp / "videos" / run.name
    before, write, calls = files_under(videos), vlmrm_utils.imageio.imwrite, []

    def full_disk_at_the_40th_png(*args, **kwargs):
        calls.append(1)
        if len(calls) == 40:
            raise OSError(28, "No space left on device")
        return write(*args, **kwargs)

    monkeypatch.setattr(vlmrm_utils.imageio, "imwrite", full_disk_at_the_40th_png)
    with pytest.raises(OSError, match="No space left"):
        classic.main(classic.Args(evaluate=str(run / "checkpoint.pt"), eval_episodes=2, episode_length=20))
    assert files_under(videos) == before and sorted(p.name for p in videos.iterdir())[0] == "eval-episode-0"
