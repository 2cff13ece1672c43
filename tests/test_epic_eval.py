"""Tests of epic_eval.py: the metric, the dataset checks, collect -> score end to end (the label page it serves is
label_server.py's: tests/test_label_server.py)."""

import csv
import hashlib
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from conftest import assert_clean_error  # noqa: E402

import epic_eval  # noqa: E402
import label_server  # noqa: E402
import vlmrm_dqn_classic  # noqa: E402
from epic_eval import UserError, average_precision, bootstrap_epic, epic_distance, roc_auc  # noqa: E402

SCRIPT = os.path.join(ROOT, "epic_eval.py")
TINY = os.path.join(ROOT, "tests", "vlmrm-tiny-test.json")
CHROMIUM = "/usr/bin/chromium"


def run_cli(command: str, cwd: str) -> subprocess.CompletedProcess:
    """`python epic_eval.py <command>` as a user types it (split like a shell), from `cwd`."""
    return subprocess.run(
        [sys.executable, SCRIPT, *shlex.split(command)], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def file_hash(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# ---------------------------------------------------------------------------------------------- metric
R = np.random.default_rng(2).normal(size=30)


@pytest.mark.parametrize(
    "rewards, labels, expected",
    [
        (R, R, 0.0),
        (-R, R, 1.0),  # negated
        (5 - 2 * R, R, 1.0),
        ([1, 2, 3], [1, 3, 2], 0.5),  # deviations (-1 0 1), (-1 1 0): cov 1, variances 2 and 2 -> rho 1/2 -> sqrt(1/4)
        ([1, 2, 3, 4], [1, 0, 0, 1], math.sqrt(0.5)),  # deviations (-1.5 -0.5 0.5 1.5), (0.5 -0.5 -0.5 0.5): rho 0
        ([1, 2, 3], [1, 1, 1], "labels are all the same"),
        ([0.7, 0.7, 0.7], [0, 1, 0], "rewards are all the same"),
    ],
)
def test_epic_distance(rewards, labels, expected):
    rewards, labels = np.array(rewards, dtype=float), np.array(labels, dtype=float)
    if isinstance(expected, str):  # undefined: a constant side has no correlation
        with pytest.raises(ValueError, match=expected):
            epic_distance(rewards, labels)
    else:
        assert epic_distance(rewards, labels) == pytest.approx(expected, abs=1e-7)


@pytest.mark.parametrize("scale, shift", [(3.0, 7.0), (0.01, -2.0), (250.0, 1e3)])
def test_epic_is_invariant_to_positive_affine_maps_of_either_side(scale, shift):
    rng = np.random.default_rng(1)
    labels = (rng.random(80) < 0.4).astype(float)
    rewards = labels + rng.normal(scale=0.8, size=80)
    reference = epic_distance(rewards, labels)
    assert 0.05 < reference < 0.95  # a non-trivial case, so invariance means something
    assert epic_distance(scale * rewards + shift, labels) == pytest.approx(reference, abs=1e-9)
    assert epic_distance(rewards, scale * labels + shift) == pytest.approx(reference, abs=1e-9)
    # a negative scale is not a positive affine map: it must change the distance
    assert epic_distance(-scale * rewards + shift, labels) == pytest.approx(math.sqrt(1 - reference**2), abs=1e-9)


@pytest.mark.parametrize("scale", [1e200, 1.7e308, -1.7e308, 1e-310])
def test_epic_and_its_interval_of_graded_labels_near_the_float_limits(scale, capsys):
    """Graded labels are any finite numbers: 1e200 made the interval [0.7071, 0.7071] (not containing EPIC), 1.7e308
    wrote EPIC=nan with exit 0 (squares overflowed). Pearson ignores the scale, so both equal those of 0/1 labels;
    near 0 (subnormal) too, and a label of -1.7e308 beside +1.7e308 (their difference overflows)."""
    rng = np.random.default_rng(1)
    labels = (rng.random(80) < 0.4).astype(float)
    rewards = labels + rng.normal(scale=0.8, size=80)
    graded = labels * scale if scale > 0 else np.where(labels == 1, -scale, scale)  # {-1.7e308, 1.7e308}
    assert np.isfinite(graded).all() and not epic_eval.is_constant(graded)
    assert epic_distance(rewards, graded) == pytest.approx(epic_distance(rewards, labels), abs=1e-9)
    interval = bootstrap_epic(rewards, labels, 300, 0.95, np.random.default_rng(0))
    assert bootstrap_epic(rewards, graded, 300, 0.95, np.random.default_rng(0)) == pytest.approx(interval, abs=1e-9)
    assert "overflow" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "scores, labels, auc, ap",
    [
        # pairs (positive, negative): 0.35>0.1, 0.35<0.4, 0.8>0.1, 0.8>0.4 -> 3/4;
        # ranked 0.8(+) 0.4(-) 0.35(+) 0.1(-): recall 1/2 at precision 1, recall 1 at precision 2/3
        ([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1], 0.75, 0.5 * 1 + 0.5 * 2 / 3),
        # ranked -0.1(-) -0.35(+) -0.4(-) -0.8(+): recall 1/2 at precision 1/2, recall 1 at precision 2/4
        ([-0.1, -0.4, -0.35, -0.8], [0, 0, 1, 1], 0.25, 0.5 * 0.5 + 0.5 * 0.5),
        # ties: one threshold for all tied scores; a tied positive/negative pair counts 1/2
        ([1.0, 1.0, 2.0], [0, 1, 1], 0.75, 0.5 * 1 + 0.5 * 2 / 3),
    ],
)
def test_roc_auc_and_average_precision_match_hand_computed_examples(scores, labels, auc, ap):
    assert roc_auc(np.array(scores), np.array(labels)) == pytest.approx(auc)
    assert average_precision(np.array(scores), np.array(labels)) == pytest.approx(ap)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bootstrap_interval_contains_the_point_estimate(seed):
    rng = np.random.default_rng(seed)
    labels = (rng.random(120) < 0.3).astype(float)
    rewards = labels * 0.5 + rng.normal(size=120)
    epic = epic_distance(rewards, labels)
    low, high = bootstrap_epic(rewards, labels, 500, 0.95, np.random.default_rng(seed))
    assert low < epic < high
    assert 0 < high - low < 0.5
    # a higher confidence level gives a wider interval
    low99, high99 = bootstrap_epic(rewards, labels, 500, 0.99, np.random.default_rng(seed))
    assert low99 <= low and high99 >= high


# ---------------------------------------------------------------------------------------------- collect + score
@pytest.fixture(scope="module")
def cartpole_dataset(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("data") / "cartpole")
    result = run_cli(f"collect --env-id CartPole-v1 --num-frames 60 --seed 3 --out {out}", cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return out


def copy_dataset(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def test_collect_writes_the_documented_layout(cartpole_dataset):
    with open(os.path.join(cartpole_dataset, "states.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 60
    assert list(rows[0])[:4] == ["frame", "env_id", "episode", "step"]
    assert {"x", "x_dot", "theta", "theta_dot", "gt"} <= set(rows[0])
    for row in rows:
        assert os.path.isfile(os.path.join(cartpole_dataset, "frames", row["frame"]))
        upright = abs(float(row["theta"])) < 12 * 2 * math.pi / 360 and abs(float(row["x"])) < 2.4
        assert row["gt"] == str(int(upright))
    assert len({row["gt"] for row in rows}) == 2  # random actions: upright first, then fallen


@pytest.mark.parametrize("env_id", ["MountainCar-v0", "MountainCarContinuous-v0"])
def test_mountaincar_gt_is_the_papers_flag_at_0_45(env_id):
    """Success is x >= 0.45 (the paper's flag, where the training script draws it), not Gymnasium's 0.5."""
    import gymnasium as gym

    env = gym.make(env_id)
    env.reset(seed=0)
    labels = {}
    for x in (0.44, 0.45, 0.47, 0.5):
        # in the env's own precision: the continuous car's step() keeps float32, and its clip puts it at float32(0.45)
        env.unwrapped.state = np.array([x, 0.0], np.float32 if "Continuous" in env_id else np.float64)
        labels[x] = epic_eval.env_state(env)[2]
    env.close()
    assert labels == {0.44: 0, 0.45: 1, 0.47: 1, 0.5: 1}


@pytest.fixture(scope="module")
def saved_policies(tmp_path_factory) -> dict[str, str]:
    """DQN (CartPole) and SAC checkpoint.pt files (Humanoid, MountainCarContinuous), from short --save-model runs."""
    import vlmrm_dqn_classic
    import vlmrm_sac_humanoid

    folder = tmp_path_factory.mktemp("policies")
    cwd = os.getcwd()
    os.chdir(folder)  # runs/ lands here
    try:
        dqn = dict(reward="gt", total_timesteps=400, learning_starts=100, episode_length=100, save_model=True, cuda=False)
        vlmrm_dqn_classic.main(vlmrm_dqn_classic.Args(**dqn))
        sac = dict(dqn, total_timesteps=100, learning_starts=50, episode_length=50, num_envs=1, batch_size=16)
        for env_id in ["Humanoid-v5", "MountainCarContinuous-v0"]:
            vlmrm_sac_humanoid.main(vlmrm_sac_humanoid.Args(env_id=env_id, **sac))
    finally:
        os.chdir(cwd)
    runs = sorted((folder / "runs").iterdir())
    return {
        "dqn": str(next(r for r in runs if "CartPole" in r.name) / "checkpoint.pt"),
        "sac": str(next(r for r in runs if "Humanoid" in r.name) / "checkpoint.pt"),
        "sac_car": str(next(r for r in runs if "MountainCarContinuous" in r.name) / "checkpoint.pt"),
    }


@pytest.mark.parametrize("which", ["dqn", "sac", "sac_car"])
def test_collect_follows_a_saved_policy(saved_policies, which, tmp_path):
    """With --policy and --epsilon 0 the states are exactly a rollout of that policy (greedy Q / the actor's mean)."""
    import gymnasium as gym
    import torch

    checkpoint = torch.load(saved_policies[which], map_location="cpu", weights_only=False)
    env_id = checkpoint["args"]["env_id"]
    args = epic_eval.Collect(
        out=str(tmp_path / "policy"), policy=saved_policies[which], num_frames=12, episode_length=6, render_size=32, seed=5
    )
    epic_eval.collect(args)
    assert args.env_id == env_id  # the environment comes from the checkpoint
    epic_eval.collect(
        epic_eval.Collect(out=str(tmp_path / "random"), env_id=env_id, num_frames=12, episode_length=6, render_size=32, seed=5)
    )
    columns = {
        "dqn": ["x", "x_dot", "theta", "theta_dot"],
        "sac": ["qpos_0", "qpos_1", "qpos_2"],
        "sac_car": ["position", "velocity"],
    }[which]

    def states(name: str) -> np.ndarray:
        with open(tmp_path / name / "states.csv", newline="") as f:
            return np.array([[float(row[c]) for c in columns] for row in csv.DictReader(f)])

    # the rollout, step by step, with the scripts' own env and network definitions
    if which.startswith("sac"):
        envs = gym.vector.SyncVectorEnv([epic_eval.make_humanoid_env(env_id, 5, 0, 6, 32, "fast", True)])
        actor = epic_eval.Actor(envs)
        actor.load_state_dict(checkpoint["actor"])
        policy = lambda x: actor.get_action(x)[2]  # noqa: E731
    else:
        envs = gym.vector.SyncVectorEnv([epic_eval.make_env(env_id, 5, 0, 6, False)])
        q_network = epic_eval.QNetwork(envs)
        q_network.load_state_dict(checkpoint["q_network"])
        policy = lambda x: q_network(x).argmax(dim=1)  # noqa: E731
    expected = []
    for episode in range(2):
        obs, _ = envs.reset(seed=5 + episode)
        for _ in range(6):
            with torch.no_grad():
                obs, _, _, _, _ = envs.step(policy(torch.from_numpy(obs).float()).numpy())
            names, values, _ = epic_eval.env_state(envs.envs[0])
            expected.append([values[names.index(c)] for c in columns])
    envs.close()
    np.testing.assert_allclose(states("policy"), np.array(expected), rtol=0, atol=1e-9)
    assert not np.allclose(states("random"), np.array(expected), atol=1e-3)  # random actions go elsewhere


def test_policy_networks_are_the_training_scripts_own():
    """collect loads the scripts' state dicts into the scripts' own classes (imported, not copied)."""
    import vlmrm_dqn_classic
    import vlmrm_sac_humanoid

    assert epic_eval.QNetwork is vlmrm_dqn_classic.QNetwork and epic_eval.Actor is vlmrm_sac_humanoid.Actor
    assert epic_eval.make_humanoid_env is vlmrm_sac_humanoid.make_env and epic_eval.make_env is vlmrm_dqn_classic.make_env


def test_collect_policy_problems_are_one_sentence_errors(saved_policies, tmp_path):
    import torch

    torch.save({"args": {"env_id": "CartPole-v1"}}, tmp_path / "empty.pt")
    (tmp_path / "text.pt").write_text("not a checkpoint")
    sac = torch.load(saved_policies["sac"], map_location="cpu", weights_only=False)
    pendulum = {"actor": sac["actor"], "args": dict(sac["args"], env_id="InvertedPendulum-v5"), "script": sac["script"]}
    torch.save(pendulum, tmp_path / "pendulum.pt")
    dqn = torch.load(saved_policies["dqn"], map_location="cpu", weights_only=False)
    relabelled = {"q_network": dqn["q_network"], "args": dict(dqn["args"], env_id="MountainCar-v0"), "script": dqn["script"]}
    torch.save(relabelled, tmp_path / "relabelled.pt")
    diverged = {k: v.clone() for k, v in sac["actor"].items()}
    next(v for v in diverged.values() if v.is_floating_point())[0] = float("inf")  # one weight of a diverged run
    torch.save({"actor": diverged, "args": sac["args"], "script": sac["script"]}, tmp_path / "diverged.pt")
    problems = {
        str(tmp_path / "missing.pt"): "no such file; pass the checkpoint.pt of vlmrm_dqn_classic.py",
        str(tmp_path / "text.pt"): "could not be read",
        str(tmp_path / "empty.pt"): "holds no policy",
        str(tmp_path / "pendulum.pt"): (
            "was trained on InvertedPendulum-v5; collect supports its policies on Humanoid-v5, MountainCarContinuous-v0 only"
        ),
        # CartPole's Q-network (4 inputs) under MountainCar's name (2 inputs): shapes do not fit
        str(tmp_path / "relabelled.pt"): "its q_network does not fit MountainCar-v0 .*size mismatch",
        str(tmp_path / "diverged.pt"): "its actor holds NaN or infinite weights, so it cannot act",  # it collected NaN states
    }
    for path, message in problems.items():
        with pytest.raises(UserError, match=message):
            epic_eval.collect(epic_eval.Collect(out=str(tmp_path / "ds"), policy=path))
    with pytest.raises(UserError, match="was trained on CartPole-v1, not --env-id MountainCar-v0"):
        epic_eval.collect(epic_eval.Collect(out=str(tmp_path / "ds"), policy=saved_policies["dqn"], env_id="MountainCar-v0"))
    assert not (tmp_path / "ds").exists()


def test_end_to_end_collect_then_score_with_ground_truth_labels(cartpole_dataset, tmp_path):
    command = f"score --dataset {cartpole_dataset} --labels gt --clip-models {TINY} --clip-pretrained none"
    result = run_cli(command + " --alphas 0 0.5 1 --bootstrap 300", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    (run_dir,) = [os.path.join(tmp_path, "runs", d) for d in os.listdir(tmp_path / "runs")]
    assert os.path.getsize(os.path.join(run_dir, "epic.png")) > 10_000
    with open(os.path.join(run_dir, "epic.csv"), newline="") as f:
        table = list(csv.DictReader(f))
    assert [float(r["alpha"]) for r in table] == [0.0, 0.5, 1.0]
    with open(os.path.join(run_dir, "rewards.csv"), newline="") as f:
        rewards = list(csv.DictReader(f))
    labels = np.array([float(r["label"]) for r in rewards])
    assert len(rewards) == 60 and set(labels) == {0.0, 1.0}
    for row in table:
        epic, low, high = float(row["epic"]), float(row["epic_low"]), float(row["epic_high"])
        assert 0.0 <= low <= epic <= high <= 1.0
        assert 0.0 <= float(row["roc_auc"]) <= 1.0 and 0.0 < float(row["pr_auc"]) <= 1.0
        # the table is the metric applied to the per-frame rewards it saved
        column = np.array([float(r[f"vlmrm-tiny-test/none@alpha={float(row['alpha']):g}"]) for r in rewards])
        assert epic == pytest.approx(epic_distance(column, labels), abs=1e-5)
        assert float(row["roc_auc"]) == pytest.approx(roc_auc(column, labels), abs=1e-5)
    # different alphas are different reward models
    assert len({row["epic"] for row in table}) == 3


def score_args(dataset: str, **kwargs) -> "epic_eval.Score":
    defaults = dict(clip_models=(TINY,), clip_pretrained=("none",), alphas=(0.0, 1.0), bootstrap=50)
    return epic_eval.Score(dataset=dataset, **{**defaults, **kwargs})


def test_score_defaults_to_the_papers_fig_4a_alphas():
    assert epic_eval.Score(dataset="d").alphas == (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99)


def read_run(run_dir: str) -> tuple[list[dict], list[dict]]:
    with open(os.path.join(run_dir, "epic.csv"), newline="") as f:
        table = list(csv.DictReader(f))
    with open(os.path.join(run_dir, "rewards.csv"), newline="") as f:
        rewards = list(csv.DictReader(f))
    return table, rewards


def test_both_reward_families_side_by_side(cartpole_dataset, tmp_path, monkeypatch):
    """One run scores the projection (per alpha) and the thresholded softmax, and the binary reward is 1[p > beta]."""
    monkeypatch.chdir(tmp_path)
    run_dir = epic_eval.score(
        score_args(cartpole_dataset, labels="gt", reward_families=("projection", "softmax"), temperature=0.1, soft=True)
    )
    table, rewards = read_run(run_dir)
    assert list(table[0])[:3] == ["model", "family", "alpha"]
    assert [(r["family"], r["alpha"]) for r in table] == [("projection", "0.0"), ("projection", "1.0"), ("softmax", "")]
    assert list(rewards[0])[2:] == [
        "vlmrm-tiny-test/none@alpha=0",
        "vlmrm-tiny-test/none@alpha=1",
        "vlmrm-tiny-test/none@softmax-p",
    ]
    labels = np.array([float(r["label"]) for r in rewards])
    p = np.array([float(r["vlmrm-tiny-test/none@softmax-p"]) for r in rewards])
    assert np.all((p > 0) & (p < 1)) and len(set(p)) > 30
    softmax_row = table[2]
    assert float(softmax_row["epic"]) == pytest.approx(epic_distance(p, labels), abs=1e-5)
    assert float(softmax_row["roc_auc"]) == pytest.approx(roc_auc(p, labels), abs=1e-5)
    assert float(softmax_row["pr_auc"]) == pytest.approx(average_precision(p, labels), abs=1e-5)
    assert os.path.getsize(os.path.join(run_dir, "epic.png")) > 10_000
    with open(os.path.join(run_dir, "args.json")) as f:
        saved = json.load(f)
    assert saved["negatives"] == list(vlmrm_dqn_classic.DEFAULT_NEGATIVES[(epic_eval.DEFAULT_PROMPTS["CartPole-v1"][0],)])

    # the binary reward at a threshold between two of those probabilities is exactly the indicator p > beta
    ordered = np.sort(np.unique(p))
    beta = float((ordered[len(ordered) // 2] + ordered[len(ordered) // 2 + 1]) / 2)
    time.sleep(1)  # the run folder is named by the second
    run_dir = epic_eval.score(
        score_args(cartpole_dataset, labels="gt", reward_families=("softmax",), temperature=0.1, threshold=beta)
    )
    table, rewards = read_run(run_dir)
    assert [(r["family"], r["alpha"]) for r in table] == [("softmax", "")]
    binary = np.array([float(r["vlmrm-tiny-test/none@softmax"]) for r in rewards])
    np.testing.assert_array_equal(binary, (p > beta).astype(float))
    assert float(table[0]["epic"]) == pytest.approx(epic_distance(binary, labels), abs=1e-5)
    assert float(table[0]["roc_auc"]) == pytest.approx(roc_auc(binary, labels), abs=1e-5)

    # a binary reward that never crosses the threshold is constant: EPIC is undefined, and the error says why
    time.sleep(1)
    with pytest.raises(UserError, match=r"softmax are the same for every frame \(a binary softmax reward .*--threshold"):
        epic_eval.score(
            score_args(cartpole_dataset, labels="gt", reward_families=("softmax",), temperature=0.1, threshold=0.999999)
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(reward_families=()), "--reward-families needs at least one of: projection, softmax"),
        (dict(reward_families=("softmax",), goal=("a pole",)), "needs at least one non-empty --negatives prompt"),
        (dict(reward_families=("softmax",), negatives=()), "needs at least one non-empty --negatives prompt"),
        (dict(reward_families=("softmax",), negatives=("pole vertically upright on top of the cart",)), "share the prompt"),
        (dict(temperature=0.0), "--temperature must be a positive number"),
        (dict(temperature=float("nan")), "--temperature must be a positive number"),
        (dict(threshold=1.0), r"--threshold must be in \(0, 1\)"),
        (dict(threshold=0.0), r"--threshold must be in \(0, 1\)"),
        (dict(alphas=()), "--alphas needs at least one value"),
        (dict(alphas=(0.0, 1.5)), r"--alphas must all be in \[0, 1\], got 1.5"),
        (dict(goal=("A Pole",), baseline=("a  pole ",)), "same prompts"),
        (dict(bootstrap=0), "--bootstrap and --reward-batch-size must be positive integers"),
        (dict(confidence=1.0), r"--confidence must be in \(0, 1\), got 1.0"),
        (dict(clip_pretrained=("none",) * 2), r"one per --clip-models entry \(1\), got 2"),
        (dict(clip_checkpoints=("none", "none")), "--clip-checkpoints needs one entry per model"),
        (dict(clip_models=(TINY, TINY)), "name the same model twice"),
        (dict(clip_models=("NoSuchNet",)), "^--clip-models NoSuchNet is not an open_clip architecture"),  # its flags' names
        (dict(clip_checkpoints=("nothing.pt",)), "^--clip-checkpoints nothing.pt: no such file"),
    ],
)
def test_score_refuses_bad_flags_before_loading_a_model(cartpole_dataset, tmp_path, monkeypatch, kwargs, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(epic_eval, "load_clip", lambda *a: pytest.fail("bad input must be refused before a model is loaded"))
    with pytest.raises(UserError, match=message):
        epic_eval.score(score_args(cartpole_dataset, labels="gt", **kwargs))
    assert not (tmp_path / "runs").exists()


def test_softmax_without_negatives_on_the_command_line(cartpole_dataset, tmp_path):
    command = f"score --dataset {cartpole_dataset} --labels gt --clip-models {TINY} --clip-pretrained none"
    result = run_cli(command + " --reward-families projection softmax --goal 'a pole'", cwd=str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: --reward-families softmax needs at least one non-empty --negatives prompt")
    assert result.stderr.count("\n") == 1 and not (tmp_path / "runs").exists()


def write_labels(dataset: str, lines: list[str]) -> None:
    with open(os.path.join(dataset, "labels.csv"), "w") as f:
        f.write("frame,label,time\n" + "".join(line + "\n" for line in lines))


def test_dataset_problems_are_one_sentence_errors(cartpole_dataset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # missing image files
    ds = copy_dataset(cartpole_dataset, str(tmp_path / "missing"))
    os.remove(os.path.join(ds, "frames", "000007.png"))
    with pytest.raises(UserError, match=r"1 of the 60 frames .* have no image file .*first: 000007.png"):
        epic_eval.score(score_args(ds, labels="gt"))
    # labels that are not numbers
    ds = copy_dataset(cartpole_dataset, str(tmp_path / "words"))
    write_labels(ds, ["000000.png,1,t", "000001.png,yes,t"])
    words_labels = file_hash(os.path.join(ds, "labels.csv"))
    with pytest.raises(UserError, match=r"label 'yes' of frame 000001.png on line 3 of .*labels.csv is not a number"):
        epic_eval.score(score_args(ds))
    # an empty dataset, no dataset, no labels yet
    ds = str(tmp_path / "empty")
    os.makedirs(os.path.join(ds, "frames"))
    with open(os.path.join(ds, "states.csv"), "w") as f:
        f.write("frame,env_id,episode,step,x,x_dot,theta,theta_dot,gt\n")
    with pytest.raises(UserError, match="lists no frames: the dataset is empty"):
        epic_eval.score(score_args(ds, labels="gt"))
    with pytest.raises(UserError, match="no states.csv"):
        epic_eval.score(score_args(str(tmp_path), labels="gt"))
    with pytest.raises(UserError, match="has no labelled frames yet"):
        epic_eval.score(score_args(cartpole_dataset))
    # constant labels (all skipped frames are left out, so these are all 1)
    ds = copy_dataset(cartpole_dataset, str(tmp_path / "constant_labels"))
    write_labels(ds, ["000000.png,1,t", "000001.png,1,t", "000002.png,skip,t"])
    with pytest.raises(UserError, match="all 2 labels .* are 1, so the correlation .* is undefined"):
        epic_eval.score(score_args(ds))
    # constant rewards: every frame is the same picture, while the labels differ
    ds = copy_dataset(cartpole_dataset, str(tmp_path / "constant_rewards"))
    for name in os.listdir(os.path.join(ds, "frames")):
        shutil.copyfile(os.path.join(cartpole_dataset, "frames", "000000.png"), os.path.join(ds, "frames", name))
    with pytest.raises(UserError, match="are the same for every frame, so their correlation .* is undefined"):
        epic_eval.score(score_args(ds, labels="gt"))
    # the command line turns each of them into "error: <sentence>" and exit code 2, no traceback
    result = run_cli(f"score --dataset {tmp_path / 'words'} --clip-models {TINY} --clip-pretrained none", cwd=str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.startswith("error: label 'yes'") and "Traceback" not in result.stderr
    # score reads datasets, never writes them
    assert file_hash(os.path.join(tmp_path / "words", "labels.csv")) == words_labels
    assert sorted(os.listdir(tmp_path / "words")) == ["frames", "labels.csv", "states.csv"]


def valid_crc_broken_png(path: str) -> None:
    """Corrupt the compressed pixels but keep every chunk checksum valid: only decoding the image finds it."""
    import struct
    import zlib

    data = bytearray(open(path, "rb").read())
    at = 8
    while True:
        length, kind = struct.unpack(">I4s", data[at : at + 8])
        if kind == b"IDAT":
            body = data[at + 8 : at + 8 + length]
            body[2:] = b"\xff" * (len(body) - 2)  # keep the zlib header, break the stream after it
            data[at + 8 : at + 8 + length] = body
            data[at + 8 + length : at + 12 + length] = struct.pack(">I", zlib.crc32(kind + bytes(body)))
            break
        at += 12 + length
    open(path, "wb").write(bytes(data))


def test_unreadable_frames_are_one_sentence_and_leave_no_run_folder(cartpole_dataset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ds = copy_dataset(cartpole_dataset, str(tmp_path / "truncated"))
    frame = os.path.join(ds, "frames", "000007.png")
    data = open(frame, "rb").read()
    open(frame, "wb").write(data[: len(data) // 2])
    # a real process: one sentence, exit code 2, no traceback, no runs/ (no args.json left behind)
    result = run_cli(f"score --dataset {ds} --labels gt --clip-models {TINY} --clip-pretrained none", cwd=str(tmp_path))
    assert_clean_error(result, "000007.png", "not a readable image")
    assert result.returncode == 2 and not (tmp_path / "runs").exists()
    # found before any model is loaded: a text file, an empty file, a frame of another size
    monkeypatch.setattr(epic_eval, "load_clip", lambda *a: pytest.fail("bad frames must be refused before a model is loaded"))
    for name, content, message in [
        ("text", b"not a png", "not a readable image"),
        ("empty", b"", "not a readable image"),
        ("size", None, r"different sizes \(000000.png is 600x400, 000059.png is 60x40\)"),
    ]:
        ds = copy_dataset(cartpole_dataset, str(tmp_path / name))
        if content is None:
            epic_eval.imageio.imwrite(os.path.join(ds, "frames", "000059.png"), np.zeros((40, 60, 3), dtype=np.uint8))
        else:
            open(os.path.join(ds, "frames", "000059.png"), "wb").write(content)
        with pytest.raises(UserError, match=message):
            epic_eval.score(score_args(ds, labels="gt"))
    assert not (tmp_path / "runs").exists()
    # a fault only decoding finds (checksums intact): found later, still one sentence and still no run folder
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    ds = copy_dataset(cartpole_dataset, str(tmp_path / "broken_pixels"))
    valid_crc_broken_png(os.path.join(ds, "frames", "000042.png"))
    epic_eval.check_images(ds, epic_eval.label_values(ds, "gt")[0])  # passes the header/checksum check
    with pytest.raises(UserError, match="frame 000042.png of .* is not a readable image"):
        epic_eval.score(score_args(ds, labels="gt"))
    assert not (tmp_path / "runs").exists()


def test_score_when_runs_is_a_file(cartpole_dataset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("not a folder")
    monkeypatch.setattr(epic_eval, "load_clip", lambda *a: pytest.fail("refused before a model is loaded"))
    with pytest.raises(UserError, match="cannot write to the output folder .*runs/ .*runs is a file"):
        epic_eval.score(score_args(cartpole_dataset, labels="gt"))
    assert (tmp_path / "runs").read_text() == "not a folder"


def test_epic_on_two_labels_warns_that_the_interval_is_undefined(cartpole_dataset, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert bootstrap_epic(np.array([0.2, 0.7]), np.array([0.0, 1.0]), 1000, 0.95, np.random.default_rng(0)) == (
        pytest.approx(float("nan"), nan_ok=True),
        pytest.approx(float("nan"), nan_ok=True),
    )
    ds = copy_dataset(cartpole_dataset, str(tmp_path / "ds"))
    write_labels(ds, ["000000.png,1,t", "000040.png,0,t"])
    args = score_args(ds, seed=0)
    args.bootstrap = 1000  # with seed 0, enough resamples that the old code printed a zero-width interval
    run_dir = epic_eval.score(args)
    assert "warning: only 2 labelled frames" in capsys.readouterr().out
    table, _ = read_run(run_dir)
    for row in table:
        assert float(row["epic"]) in (0.0, 1.0)  # two points always correlate +1 or -1
        assert math.isnan(float(row["epic_low"])) and math.isnan(float(row["epic_high"]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(env_id="Pendulum-v1"), "--env-id Pendulum-v1 is not supported; choose one of: CartPole-v1"),
        (dict(render_size=100000), "--render-size must be between 16 and 2048 pixels, got 100000"),
        (dict(render_size=8, env_id="Humanoid-v5"), "--render-size must be between 16 and 2048"),
        (dict(num_frames=0), "--num-frames must be a positive integer, got 0"),
        (dict(epsilon=1.5), r"--epsilon must be in \[0, 1\], got 1.5"),
        (dict(out="a_file/ds"), "cannot write to --out .*a_file/ds/ .*a_file is a file"),
        (dict(out="a_file/sub/ds"), "a_file is a file"),
        (dict(out="dataset"), "--out .*dataset already exists and is not empty"),  # a dataset is never overwritten
    ],
)
def test_collect_refuses_bad_flags_and_paths_up_front(tmp_path, kwargs, message):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "dataset").mkdir()
    (tmp_path / "dataset" / "states.csv").write_text("frame,env_id\n")
    kwargs = {"num_frames": 2, **kwargs, "out": str(tmp_path / kwargs.get("out", "ds"))}
    with pytest.raises(UserError, match=message):
        epic_eval.collect(epic_eval.Collect(**kwargs))
    assert sorted(os.listdir(tmp_path)) == ["a_file", "dataset"]  # nothing new, nothing hidden
    assert (tmp_path / "dataset" / "states.csv").read_text() == "frame,env_id\n"


def test_collect_refusal_in_a_real_process(tmp_path):
    result = run_cli("collect --env-id Humanoid-v5 --render-size 100000 --out ds", cwd=str(tmp_path))
    assert_clean_error(result, "--render-size", "100000")
    assert result.returncode == 2 and os.listdir(tmp_path) == []


@pytest.mark.parametrize("error", [RuntimeError("renderer failed"), KeyboardInterrupt()])
def test_collect_leaves_no_half_made_dataset(tmp_path, monkeypatch, error):
    """A crash or Ctrl-C part-way: no --out folder and no hidden partial one; the same --out works afterwards."""
    calls = []
    real_env_state = epic_eval.env_state

    def failing_env_state(env):
        calls.append(1)
        if len(calls) == 3:
            raise error
        return real_env_state(env)

    out = str(tmp_path / "data" / "ds")
    monkeypatch.setattr(epic_eval, "env_state", failing_env_state)
    with pytest.raises(type(error)):
        epic_eval.collect(epic_eval.Collect(out=out, num_frames=5))
    assert os.listdir(tmp_path / "data") == []
    monkeypatch.undo()
    os.makedirs(out)  # an empty --out folder is allowed, and filled
    epic_eval.collect(epic_eval.Collect(out=out, num_frames=5))
    assert sorted(os.listdir(out)) == ["frames", "states.csv"] and len(os.listdir(os.path.join(out, "frames"))) == 5
    assert os.listdir(tmp_path / "data") == ["ds"]


def test_human_labels_use_the_last_label_per_frame_and_leave_skips_out(cartpole_dataset, tmp_path):
    ds = copy_dataset(cartpole_dataset, str(tmp_path / "ds"))
    write_labels(ds, ["000000.png,1,t", "000001.png,0,t", "000000.png,0,t", "000002.png,skip,t", "000003.png,1,t"])
    frames, labels = epic_eval.label_values(ds, "human")
    assert frames == ["000000.png", "000001.png", "000003.png"]
    assert labels.tolist() == [0.0, 0.0, 1.0]
    # a line cut short by a crash (no time, no newline) is ignored, not an error
    with open(os.path.join(ds, "labels.csv"), "a") as f:
        f.write("000004.png,s")
    assert epic_eval.label_values(ds, "human")[0] == frames
    # and the next label starts on a line of its own, keeping the broken one as it was
    label_server.append_label(os.path.join(ds, "labels.csv"), "000005.png", "1")
    assert epic_eval.label_values(ds, "human")[0] == frames + ["000005.png"]
    with open(os.path.join(ds, "labels.csv")) as f:
        assert f.read().splitlines()[-2:][0] == "000004.png,s"


def test_goal_and_baseline_that_clip_cannot_tell_apart(cartpole_dataset, tmp_path, monkeypatch):
    """Past CLIP's 77 tokens two prompts have one embedding: found once the model has embedded them, before any output."""
    monkeypatch.chdir(tmp_path)
    goal, baseline = ("pole " * 80 + "left",), ("pole " * 80 + "right",)
    with pytest.raises(UserError, match="same CLIP embedding") as error:
        epic_eval.score(score_args(cartpole_dataset, labels="gt", goal=goal, baseline=baseline))
    assert "\n" not in str(error.value) and not (tmp_path / "runs").exists()
