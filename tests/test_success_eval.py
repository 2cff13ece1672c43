"""Tests of success_eval.py: rollouts from checkpoints of both training scripts, ground-truth success, the Wilson
interval, the report, the best checkpoint, the model-size study, and the episode label page in headless chromium."""

import contextlib
import csv
import dataclasses
import io
import json
import math
import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from conftest import TINY_CLIP, assert_clean_error, run_script

import label_server
import success_eval as se
import vlmrm_dqn_classic as dqn
import vlmrm_sac_humanoid as sac
from success_eval import UserError
from vlmrm_utils import script_record

CHROMIUM = "/usr/bin/chromium"


def read_episodes(folder: str) -> list[dict]:
    with open(os.path.join(folder, "episodes.csv"), newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Tiny --save-model runs: DQN CartPole with the (tiny) CLIP reward, SAC Humanoid with the ground truth."""
    folder = tmp_path_factory.mktemp("runs")
    cwd = os.getcwd()
    os.chdir(folder)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):  # DQN evaluates its final Q-network greedily: our reference
            dqn.main(
                dqn.Args(
                    clip_model=TINY_CLIP,
                    clip_pretrained="none",
                    total_timesteps=200,
                    learning_starts=100,
                    episode_length=25,
                    save_model=True,
                    eval_episodes=2,
                    cuda=False,
                )
            )
        sac.main(
            sac.Args(
                env_id="Humanoid-v5",
                reward="gt",
                episodes="fixed",
                episode_length=10,
                num_envs=1,
                total_timesteps=40,
                learning_starts=20,
                batch_size=8,
                render_size=32,
                render_quality="fast",
                save_model=True,
                cuda=False,
            )
        )
    finally:
        os.chdir(cwd)
    evals = [line.split() for line in out.getvalue().splitlines() if line.startswith("eval episode")]
    return {
        "dqn": str(next(folder.glob("runs/CartPole*/checkpoint.pt"))),
        "sac": str(next(folder.glob("runs/Humanoid*/checkpoint.pt"))),
        "dqn_eval": [(float(w[4].split("=")[1]), float(w[3].split("=")[1])) for w in evals],  # clip_return=.. gt_return=..
        "folder": folder,
    }


# ---------------------------------------------------------------------------------------------- rollout
def test_rollout_has_no_env_flags():
    """The env comes from the checkpoint alone: a mismatch cannot be typed."""
    names = {f.name for f in dataclasses.fields(se.Rollout)}
    assert not names & {
        "env_id",
        "episode_length",
        "episodes_mode",
        "realistic",
        "render_size",
        "render_quality",
        "camera",
        "goal",
        "baseline",
        "alpha",
        "clip_model",
        "reward",
    }


def test_dqn_rollout_reads_env_and_reward_from_the_checkpoint(runs, tmp_path):
    out = se.rollout(se.Rollout(checkpoint=runs["dqn"], episodes=2, deterministic=True, out=str(tmp_path / "det"), cuda=False))
    rows = read_episodes(out)
    assert [int(r["steps"]) for r in rows] == [25, 25]  # the run's --episode-length 25, not the default 200
    # exactly the training script's own greedy evaluation: same env, seeds, reward model (tiny CLIP) and returns
    assert [(float(r["gt_return"]), round(float(r["clip_return"]), 2)) for r in rows] == runs["dqn_eval"]
    for r in rows:  # fixed-length CartPole earns 1 per upright step: success = every step upright
        assert r["gt_success"] == str(int(float(r["gt_return"]) == 25))
        with imageio.get_reader(os.path.join(out, "videos", r["video"])) as video:
            frames = [frame for frame in video]
        assert len(frames) == 26 and frames[0].shape == (400, 600, 3)  # the reset frame + one per step
    with open(os.path.join(out, "policy.json")) as f:
        policy = json.load(f)
    assert policy["args"]["env_id"] == "CartPole-v1" and policy["args"]["episode_length"] == 25
    assert policy["mode"] == "deterministic" and policy["script"] == "vlmrm_dqn_classic.py"
    # stochastic by default: epsilon-greedy at the run's final epsilon; the default folder sits beside the checkpoint
    out = se.rollout(se.Rollout(checkpoint=runs["dqn"], episodes=2, cuda=False))
    assert out == os.path.join(os.path.dirname(runs["dqn"]), "rollouts-checkpoint-stochastic") and len(read_episodes(out)) == 2
    with pytest.raises(UserError, match="already exists and is not empty"):
        se.rollout(se.Rollout(checkpoint=runs["dqn"], episodes=1, cuda=False))


def test_sac_rollout_humanoid_is_left_to_a_person(runs, tmp_path):
    det = [
        read_episodes(
            se.rollout(
                se.Rollout(checkpoint=runs["sac"], episodes=2, deterministic=True, out=str(tmp_path / f"det{i}"), cuda=False)
            )
        )
        for i in range(2)
    ]
    stochastic = read_episodes(
        se.rollout(se.Rollout(checkpoint=runs["sac"], episodes=2, out=str(tmp_path / "sto"), cuda=False))
    )
    assert [r["gt_return"] for r in det[0]] == [r["gt_return"] for r in det[1]]  # deterministic: reproducible
    assert [r["gt_return"] for r in stochastic] != [r["gt_return"] for r in det[0]]  # the policy is sampled
    for r in stochastic:
        assert r["steps"] == "10" and r["clip_return"] == "" and r["gt_success"] == ""  # --reward gt; no ground truth
        with imageio.get_reader(str(tmp_path / "sto" / "videos" / r["video"])) as video:
            assert video.get_data(0).shape == (32, 32, 3)  # the run's --render-size 32


def test_rollout_problems_are_one_sentence_errors(runs, tmp_path):
    (tmp_path / "text.pt").write_text("not a checkpoint")
    torch.save({"args": {"env_id": "CartPole-v1"}}, tmp_path / "empty.pt")
    for path, message in [
        (tmp_path / "missing.pt", "no such file"),
        (tmp_path / "text.pt", "could not be read"),
        (tmp_path / "empty.pt", "holds no policy"),
    ]:
        with pytest.raises(UserError, match=message):
            se.rollout(se.Rollout(checkpoint=str(path), out=str(tmp_path / "out")))
    moved = crafted_checkpoint(tmp_path / "moved.pt", 1, clip_model="configs/elsewhere.json")
    with pytest.raises(UserError, match=r"cannot load the run's reward model \(--clip-model configs/elsewhere.json: no such"):
        se.rollout(se.Rollout(checkpoint=moved, out=str(tmp_path / "out")))
    assert se.rollout(se.Rollout(checkpoint=moved, episodes=1, clip_return=False, out=str(tmp_path / "no_clip"), cuda=False))
    result = run_script("success_eval.py", "rollout", "--checkpoint", str(tmp_path / "missing.pt"), cwd=tmp_path)
    assert_clean_error(result, "no such file")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- ground truth, Wilson
def test_ground_truth_success_on_crafted_episodes():
    up, tilted, at_wall = [0.0, 0, 0.1, 0], [0.0, 0, math.radians(12.5), 0], [2.4, 0, 0.0, 0]
    assert se.gt_success("CartPole-v1", [up] * 200) is True
    assert se.gt_success("CartPole-v1", [up] * 150 + [tilted] + [up] * 49) is False  # one step down is a failure
    assert se.gt_success("CartPole-v1", [up, [0, 0, -math.radians(11.9), 0]]) is True
    assert se.gt_success("CartPole-v1", [up, at_wall]) is False  # |x| < 2.4 is part of upright
    for env_id in ("MountainCar-v0", "MountainCarContinuous-v0"):
        assert se.gt_success(env_id, [[-0.5, 0]] * 100 + [[0.45, 0.01]] + [[0.3, -0.02]] * 10) is True  # reached once
        assert se.gt_success(env_id, [[0.449, 0]] * 200) is False
    assert se.gt_success("Humanoid-v5", [None] * 100) is None  # judged by a person


def pumping_mountaincar(path: Path, pump: bool) -> str:
    """A MountainCar-v0 Q-network that pushes along its velocity (pumps energy: reaches the flag) or always left."""
    envs = se.make_envs(dqn, dqn.Args(env_id="MountainCar-v0"), 0)
    q_network = dqn.QNetwork(envs)
    envs.close()
    with torch.no_grad():
        for layer in q_network.network[::2]:
            layer.weight.zero_()
            layer.bias.zero_()
        first, second, last = q_network.network[0], q_network.network[2], q_network.network[4]
        first.weight[0, 1], first.weight[1, 1] = 100.0, -100.0  # relu(v), relu(-v)
        second.weight[0, 0], second.weight[1, 1] = 1.0, 1.0
        if pump:  # Q(right) = relu(v) - relu(-v) = v, Q(left) = -v, Q(none) = 0
            last.weight[2, 0], last.weight[2, 1], last.weight[0, 0], last.weight[0, 1] = 1.0, -1.0, -1.0, 1.0
        else:
            last.bias[0] = 1.0
    args = dataclasses.asdict(dqn.Args(env_id="MountainCar-v0", reward="gt", episodes="fixed", episode_length=200))
    torch.save({"q_network": q_network.state_dict(), "args": args, "script": script_record(dqn.__file__)}, path)
    return str(path)


def test_mountaincar_rollout_success_is_the_flag_reached(tmp_path):
    for pump, expected in [(True, "1"), (False, "0")]:
        checkpoint = pumping_mountaincar(tmp_path / f"{pump}.pt", pump)
        rows = read_episodes(
            se.rollout(
                se.Rollout(checkpoint=checkpoint, episodes=1, deterministic=True, out=str(tmp_path / str(pump)), cuda=False)
            )
        )
        assert [r["gt_success"] for r in rows] == [expected] and all(r["steps"] == "200" for r in rows)
        # fixed-length MountainCar earns 1 per step at the flag: reached the flag = a positive return
        assert all((float(r["gt_return"]) > 0) == (expected == "1") for r in rows)


def test_mountaincarcontinuous_success_at_the_flag_clipped_in_float32():
    """The SAC env keeps x in float32 and clips it to float32(0.45) at the flag, 0.44999998 as a float64: still the flag."""
    args = sac.Args(env_id="MountainCarContinuous-v0", reward="gt", episodes="fixed", episode_length=200)
    envs = se.make_envs(sac, args, 0)

    def push_along_velocity(obs):  # pumps energy: reaches the flag
        return np.where(obs[:, 1:].numpy() < 0, -1.0, 1.0)

    _, states, gt_return = se.run_episode(envs, push_along_velocity, 0, torch.device("cpu"))
    envs.close()
    assert gt_return > 0 and min(abs(s[0] - 0.45) for s in states) < 1e-6  # steps at the clipped flag
    assert se.gt_success("MountainCarContinuous-v0", states) is True


@pytest.mark.parametrize(
    "k, n, low, high",
    [
        (8, 10, 0.4902, 0.9433),
        (0, 10, 0.0, 0.2775),
        (10, 10, 0.7225, 1.0),
        (50, 100, 0.4038, 0.5962),
        (1, 100, 0.0018, 0.0545),
    ],
)
def test_wilson_interval_known_values(k, n, low, high):
    assert se.wilson(k, n) == pytest.approx((low, high), abs=1e-4)


def test_wilson_interval_of_nothing_is_undefined():
    assert all(math.isnan(v) for v in se.wilson(0, 0))


# ---------------------------------------------------------------------------------------------- report
def test_report_judges_classic_control_by_ground_truth_and_humanoid_by_labels(runs, tmp_path):
    cart = se.rollout(se.Rollout(checkpoint=runs["dqn"], episodes=3, out=str(tmp_path / "cart"), cuda=False))
    human = se.rollout(se.Rollout(checkpoint=runs["sac"], episodes=4, out=str(tmp_path / "human"), cuda=False))
    for video, verdict in [
        ("episode-000.mp4", "1"),
        ("episode-001.mp4", "0"),
        ("episode-002.mp4", "skip"),
        ("episode-000.mp4", "0"),
        ("episode-000.mp4", "1"),
    ]:  # the last verdict wins
        label_server.append_label(os.path.join(human, "labels.csv"), video, verdict)
    table = se.report(se.Report(rollouts=(cart, human), out=str(tmp_path / "success")))
    gt_successes = sum(int(r["gt_success"]) for r in read_episodes(cart))
    assert (table[0]["judged_by"], table[0]["n"], table[0]["successes"]) == ("gt", 3, gt_successes)
    assert (table[0]["model"], table[0]["alpha"], table[0]["seed"]) == ("vlmrm-tiny-test/none", 0.0, 1)
    assert table[0]["task"] == "pole vertically upright on top of the cart"
    assert (table[1]["judged_by"], table[1]["n"], table[1]["successes"], table[1]["unjudged"]) == ("labels", 2, 1, 2)
    assert (float(table[1]["low"]), float(table[1]["high"])) == pytest.approx(se.wilson(1, 2), abs=1e-4)
    with open(tmp_path / "success.csv", newline="") as f:
        assert [r["judged_by"] for r in csv.DictReader(f)] == ["gt", "labels"]
    markdown = (tmp_path / "success.md").read_text()
    assert "| Humanoid-v5 | ground truth |  | gt | 1 | labels | 0.50 [" in markdown
    with pytest.raises(UserError, match="has no ground-truth success"):
        se.report(se.Report(rollouts=(human,), judge="gt", out=str(tmp_path / "x")))


# ---------------------------------------------------------------------------------------------- best
class CartX:
    """A stand-in reward model: how far right the cart is drawn (mean column of its black pixels), per frame."""

    def __call__(self, frames: np.ndarray) -> np.ndarray:
        dark = frames.max(axis=-1) < 30  # the cart (and the track line, the same in every frame)
        cols = np.arange(frames.shape[2])
        return np.array([(cols * d.sum(0)).sum() / max(d.sum(), 1) / frames.shape[2] for d in dark])


def crafted_checkpoint(path: Path, action: int, **changes) -> str:
    """A CartPole Q-network that always picks `action` (0 push left, 1 push right)."""
    envs = se.make_envs(dqn, dqn.Args(), 0)
    q_network = dqn.QNetwork(envs)
    envs.close()
    with torch.no_grad():
        q_network.network[-1].weight.zero_()
        q_network.network[-1].bias.copy_(torch.tensor([1.0 - action, float(action)]))
    flags = {
        "clip_model": TINY_CLIP,
        "clip_pretrained": "none",
        "episodes": "fixed",
        "episode_length": 30,
        "goal": ("pole vertically upright on top of the cart",),
        "baseline": ("pole and cart",),
    }
    args = dataclasses.asdict(dqn.Args(**{**flags, **changes}))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"q_network": q_network.state_dict(), "args": args, "script": script_record(dqn.__file__)}, path)
    return str(path)


def test_best_picks_the_highest_mean_clip_return(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(se, "reward_model_for", lambda *a: CartX())
    left = crafted_checkpoint(Path("runs/left/checkpoint.pt"), 0)
    right = crafted_checkpoint(Path("runs/right/checkpoint.pt"), 1)
    assert se.best(se.Best(by="rollouts", episodes=2, deterministic=True, cuda=False)) == right  # found under runs/
    out = capsys.readouterr().out
    means = {
        line.split(":")[0]: float(line.split("mean CLIP return ")[1].split()[0])
        for line in out.splitlines()
        if ": mean CLIP" in line
    }
    assert set(means) == {left, right} and means[right] > means[left]
    assert f"best: {right}: the highest mean CLIP return, {means[right]:.4f} (next best {means[left]:.4f})" in out
    assert se.best(se.Best(checkpoints=(left,), by="rollouts", episodes=1, cuda=False)) == left  # files given: only those
    other = crafted_checkpoint(tmp_path / "other.pt", 1, alpha=0.5)
    with pytest.raises(UserError, match="differs from .* in --alpha; CLIP returns compare only under one reward and episode"):
        se.best(se.Best(checkpoints=(left, other), cuda=False))
    with pytest.raises(UserError, match="no checkpoint under"):
        se.best(se.Best(runs=str(tmp_path / "nothing")))


def kept_checkpoint(path: Path, clip_return: float, step: int, script=dqn, **changes) -> str:
    """A checkpoint as the training scripts keep them: the args, the step and the training-time CLIP return (the
    networks are never read when choosing by the training-time return)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = dict(clip_model=TINY_CLIP, clip_pretrained="none", episodes="fixed", episode_length=30)
    if script is sac:
        flags.update(env_id="Humanoid-v5", render_size=64)
    args = dataclasses.asdict(script.Args(**{**flags, **changes}))
    network = {"q_network": {}} if script is dqn else {"actor": {}}
    state = {**network, "args": args, "global_step": step, "clip_return": clip_return}
    torch.save({**state, "script": script_record(script.__file__)}, path)
    return str(path)


def test_best_picks_by_training_time_clip_return_across_runs_and_steps(tmp_path, monkeypatch, capsys):
    """The paper's criterion: the highest training-time CLIP return over every kept step of every run; a mid-training
    step can win over the last one, and nothing is rolled out."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(se, "make_envs", lambda *a: pytest.fail("no rollouts by the training-time criterion"))
    kept_checkpoint(Path("runs/a/checkpoints/step-100.pt"), -9.0, 100)
    middle = kept_checkpoint(Path("runs/a/checkpoints/step-200.pt"), -2.0, 200)
    kept_checkpoint(Path("runs/a/checkpoints/step-300.pt"), -6.0, 300)
    kept_checkpoint(Path("runs/a/checkpoint.pt"), -6.0, 300)  # the same policy as step-300: counted once
    kept_checkpoint(Path("runs/b/checkpoints/step-100.pt"), float("nan"), 100)  # saved before an episode ended
    kept_checkpoint(Path("runs/b/checkpoint.pt"), -4.0, 150)  # the end of training, between two kept steps
    assert se.best(se.Best()) == middle
    out = capsys.readouterr().out
    assert out.count("runs/a/checkpoint.pt") == 0 and "runs/b/checkpoint.pt: training-time CLIP return -4.0000" in out
    assert "step-100.pt: no training-time CLIP return yet" in out
    assert f"best: {middle}: the highest training-time CLIP return, -2.0000 (next best -4.0000)" in out
    kept_checkpoint(Path("runs/b/checkpoint.pt"), -1.0, 150)
    assert se.best(se.Best()) == os.path.join("runs", "b", "checkpoint.pt")


@pytest.mark.parametrize(
    "script, change, flag",
    [
        (dqn, dict(episode_length=20), "--episode-length"),  # a sum over fewer (negative) rewards is higher
        (dqn, dict(episodes="stock"), "--episodes"),
        (dqn, dict(realistic=True, env_id="MountainCar-v0"), "--realistic"),
        (dqn, dict(clip_pretrained="openai"), "--clip-pretrained"),
        (dqn, dict(clip_checkpoint="weights.pt"), "--clip-checkpoint"),
        (dqn, dict(reward_family="softmax"), "--reward-family"),
        (dqn, dict(temperature=0.05), "--temperature"),
        (dqn, dict(alpha=0.5), "--alpha"),
        (dqn, dict(goal=("a pole",)), "--goal"),
        (dqn, dict(baseline=("a cart",)), "--baseline"),
        (dqn, dict(antialias=True), "--antialias"),
        (sac, dict(render_size=128), "--render-size"),
        (sac, dict(render_quality="fast"), "--render-quality"),
        (sac, dict(camera="tracking"), "--camera"),
        (sac, dict(env_id="MountainCarContinuous-v0"), "--env-id"),
    ],
)
def test_best_compares_like_with_like(tmp_path, script, change, flag):
    """Checkpoints whose CLIP returns mean different things are refused, by name of the flags, in both modes."""
    first = kept_checkpoint(tmp_path / "first.pt", -5.0, 100, script)
    other = kept_checkpoint(tmp_path / "other.pt", -1.0, 100, script, **change)
    for by in ("training", "rollouts"):
        with pytest.raises(UserError, match=f"other.pt differs from .*first.pt in .*{flag}[,;]"):
            se.best(se.Best(checkpoints=(first, other), by=by, cuda=False))


# ---------------------------------------------------------------------------------------------- study
def write_csv(path: Path, rows: list[dict]) -> str:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


def test_study_plots_epic_and_success_against_model_size(tmp_path):
    models = ["RN50/openai", "ViT-L-14/openai", "ViT-bigG-14/laion2b_s39b_b160k", "vlmrm-tiny-test/none"]
    epic = write_csv(
        tmp_path / "epic.csv",
        [
            {"model": m, "family": "projection", "alpha": a, "epic": 0.6 - 0.1 * i - 0.05 * a, "epic_low": "", "epic_high": ""}
            for i, m in enumerate(models)
            for a in (0.0, 0.5)
        ]
        + [{"model": "RN50/openai", "family": "softmax", "alpha": "", "epic": 0.1, "epic_low": "", "epic_high": ""}],
    )
    success = write_csv(
        tmp_path / "success.csv",
        [  # two seeds of ViT-bigG-14 at alpha 0: pooled to 15/20
            {"model": "ViT-bigG-14/laion2b_s39b_b160k", "alpha": 0.0, "seed": 1, "n": 10, "successes": 8},
            {"model": "ViT-bigG-14/laion2b_s39b_b160k", "alpha": 0.0, "seed": 2, "n": 10, "successes": 7},
            {"model": "RN50/openai", "alpha": 0.0, "seed": 1, "n": 10, "successes": 1},
            {"model": "gt", "alpha": "", "seed": 1, "n": 10, "successes": 10},
        ],
    )  # a ground-truth run: no CLIP size
    table = se.study(
        se.Study(
            epic=(epic,),
            success=(success,),
            model_configs=(TINY_CLIP,),
            model_params=("ViT-L-14=428e6",),
            out=str(tmp_path / "study"),
        )
    )
    params = {r["model"]: r["params"] for r in table}
    assert params["RN50/openai"] == 102_007_137 and params["ViT-bigG-14/laion2b_s39b_b160k"] == 2_539_567_105
    assert params["ViT-L-14/openai"] == 428e6 and params["vlmrm-tiny-test/none"] == 3_421_761
    pooled = [r for r in table if r["metric"] == "success_rate" and r["model"].startswith("ViT-bigG")]
    assert len(pooled) == 1 and pooled[0]["value"] == 0.75 and (pooled[0]["low"], pooled[0]["high"]) == se.wilson(15, 20)
    assert len([r for r in table if r["metric"] == "epic"]) == 8  # the softmax row has no alpha: left out
    with open(tmp_path / "study.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 10 and list(rows[0]) == ["metric", "model", "params", "alpha", "value", "low", "high", "n"]
    assert os.path.getsize(tmp_path / "study.png") > 10_000
    with pytest.raises(UserError, match="the size of ViT-nope is unknown"):
        unknown = write_csv(tmp_path / "s2.csv", [{"model": "ViT-nope/x", "alpha": 0, "n": 1, "successes": 1}])
        se.study(se.Study(success=(unknown,), out=str(tmp_path / "s2")))
    with pytest.raises(UserError, match="is not NAME=COUNT"):
        se.study(se.Study(epic=(epic,), model_params=("RN50:1e8",), out=str(tmp_path / "s3")))


def test_study_refuses_the_same_episodes_in_two_rows(runs, tmp_path):
    """Issue 46: two rollouts of one checkpoint with the default seed are the same episodes (identical episodes.csv);
    `study` over their two reports gave n = 6 from 3 episodes (Wilson upper bound 0.39 instead of 0.56), exit 0. So did
    a `cp -r` copy of a rollouts folder. Other seeds are other episodes; a copy of the checkpoint is the same policy."""

    def rollout_and_report(name: str, checkpoint: str = runs["dqn"], **flags) -> str:
        folder = se.rollout(se.Rollout(checkpoint=checkpoint, episodes=3, out=str(tmp_path / name), cuda=False, **flags))
        se.report(se.Report(rollouts=(folder,), out=str(tmp_path / f"success-{name}")))
        return str(tmp_path / f"success-{name}.csv")

    def study(*reports: str) -> list[dict]:
        return se.study(se.Study(success=reports, model_configs=(TINY_CLIP,), out=str(tmp_path / "study")))

    first, again = rollout_and_report("first"), rollout_and_report("again")
    assert read_episodes(tmp_path / "first") == read_episodes(tmp_path / "again")
    same = f"--success {again} line 2 and --success {first} line 2 hold the same episodes"
    with pytest.raises(UserError, match=f"^{same} .*{tmp_path}/again/videos/episode-000.mp4 is .*first/videos/episode-000"):
        study(first, again)
    shutil.copytree(tmp_path / "first", tmp_path / "copy")
    copy = tmp_path / "success-copy.csv"
    copy.write_text((tmp_path / "success-first.csv").read_text().replace(f"{tmp_path}/first", f"{tmp_path}/copy"))
    with pytest.raises(UserError, match=f"^--success {copy} line 2 and --success {first} line 2 hold the same episodes"):
        study(first, str(copy))
    with pytest.raises(UserError, match=r"^--rollouts .*copy and --rollouts .*first hold the same episodes"):
        se.report(se.Report(rollouts=(str(tmp_path / "first"), str(tmp_path / "copy")), out=str(tmp_path / "both")))
    shutil.copy(runs["dqn"], tmp_path / "copied.pt")  # the same policy under another name
    copied = rollout_and_report("copied", str(tmp_path / "copied.pt"))
    with pytest.raises(UserError, match="hold the same episodes"):
        study(first, copied)
    other_seed = rollout_and_report("other", seed=0)
    (row,) = [r for r in study(first, other_seed) if r["metric"] == "success_rate"]
    assert row["n"] == 6  # 3 episodes each: seeds 10001-10003 and 0-2


# ---------------------------------------------------------------------------------------------- label page
# the page and server themselves (one template, refusals, a full disk): tests/test_label_server.py


def start_server(folder: str, port: int = 0):
    server = se.make_episode_server(folder, port)  # what `success_eval.py label` serves
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def stop_server(server) -> socket.socket:
    """Stops serving and keeps the port bound but not listening (connections are refused), so that no other test's
    server, started meanwhile on a free port, can take it and answer (or hang) in the stopped server's place."""
    port = server.server_port
    server.shutdown()
    server.server_close()
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    blocker.bind(("127.0.0.1", port))
    return blocker


@pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason="needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium chromium-driver)",
)
def test_episode_label_page_in_headless_chromium(runs, tmp_path):
    from test_label_server import _ready, free_port, wait_for, webdriver

    chromedriver = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    folder = se.rollout(se.Rollout(checkpoint=runs["dqn"], episodes=4, out=str(tmp_path / "r"), cuda=False))
    labels_csv = os.path.join(folder, "labels.csv")
    label_server.append_label(labels_csv, "episode-000.mp4", "1")  # an earlier session: the page resumes after it
    server = start_server(folder)
    driver_port = free_port()
    driver = subprocess.Popen([chromedriver, f"--port={driver_port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{driver_port}"
    session = None
    try:
        wait_for(lambda: _ready(base), what="chromedriver")
        flags = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--autoplay-policy=no-user-gesture-required",
            f"--user-data-dir={tmp_path / 'profile'}",
        ]
        session = webdriver(
            "POST",
            f"{base}/session",
            {
                "capabilities": {
                    "alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {"binary": CHROMIUM, "args": flags}}
                }
            },
        )["sessionId"]

        def script(js: str):
            return webdriver("POST", f"{base}/session/{session}/execute/sync", {"script": js, "args": []})

        def press(*keys: str) -> None:
            actions = [a for key in keys for a in ({"type": "keyDown", "value": key}, {"type": "keyUp", "value": key})]
            webdriver(
                "POST",
                f"{base}/session/{session}/actions",
                {"actions": [{"type": "key", "id": "keyboard", "actions": actions}]},
            )

        def open_page(port: int) -> None:
            webdriver("POST", f"{base}/session/{session}/url", {"url": f"http://127.0.0.1:{port}/"})
            wait_for(lambda: script("return document.body.dataset.ready === '1'"), what="the page to load the rollouts")

        def labels_on_disk() -> list[list[str]]:
            with open(labels_csv, newline="") as f:
                return [row[:2] for row in csv.reader(f)][1:]

        open_page(server.server_port)
        assert script("return document.getElementById('task').textContent") == "pole vertically upright on top of the cart"
        assert script("return document.getElementById('name').textContent").startswith("episode-001.mp4 (2/4)")  # resumed
        wait_for(lambda: script("return document.getElementById('frame').videoWidth") == 600, what="the video to decode")
        # 1 (success), 0 (failure), Backspace (back to episode-002), s (skip it instead)
        press("1", "0", "\ue003", "s")
        wait_for(lambda: len(labels_on_disk()) == 4, what="3 new verdicts")
        rows = labels_on_disk()
        assert rows == [
            ["episode-000.mp4", "1"],
            ["episode-001.mp4", "1"],
            ["episode-002.mp4", "0"],
            ["episode-002.mp4", "skip"],
        ]
        wait_for(
            lambda: script("return document.getElementById('name').textContent").startswith("episode-003.mp4"),
            what="the page to move on",
        )
        progress = script("return document.getElementById('progress').textContent")
        assert progress.startswith("3 of 4 episodes judged (2 success, 0 failure, 1 skipped)"), progress

        # the server stops mid-way: the page says the verdict was NOT saved, and nothing on disk changes
        blocker = stop_server(server)
        press("0")
        wait_for(lambda: "NOT saved" in script("return document.getElementById('status').textContent"), what="NOT saved")
        assert labels_on_disk() == rows
        blocker.close()
        # a restart resumes at the first episode without a verdict
        server = start_server(folder)
        open_page(server.server_port)
        assert script("return document.getElementById('name').textContent").startswith("episode-003.mp4 (4/4)")
        press("0")
        wait_for(lambda: len(labels_on_disk()) == 5, what="the last verdict")
        wait_for(lambda: "all done" in script("return document.getElementById('progress').textContent"), what="all done")
        assert labels_on_disk()[-1] == ["episode-003.mp4", "0"]
    finally:
        if session:
            try:
                webdriver("DELETE", f"{base}/session/{session}")
            except OSError:
                pass
        driver.terminate()
        driver.wait(10)
        stop_server(server).close()
    table = se.report(se.Report(rollouts=(folder,), judge="labels", out=str(tmp_path / "success")))
    assert (table[0]["n"], table[0]["successes"], table[0]["unjudged"]) == (3, 2, 1)
