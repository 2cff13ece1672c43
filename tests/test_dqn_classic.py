"""vlmrm_dqn_classic.py: environments, reward-frame alignment, learning, CLI smoke run and bad input."""

import math

import numpy as np
import pytest
import torch
from conftest import TINY_CLIP, TINY_CLIP_FLAGS, assert_clean_error, assert_refused, read_scalars, run_script, run_timed

import vlmrm_dqn_classic as classic
import vlmrm_utils

SCRIPT = "vlmrm_dqn_classic.py"


# ---------------------------------------------------------------------------- environments
def test_cartpole_never_terminates_wraps_angle_and_clips_position():
    env = classic.make_env("CartPole-v1", seed=0, idx=0, episode_length=200, realistic=False)()
    obs, _ = env.reset(seed=0)
    rng = np.random.default_rng(0)
    angles, positions = [], []
    for t in range(1, 201):
        obs, reward, terminated, truncated, info = env.step(int(rng.integers(2)) if t % 50 else 1)
        assert not terminated
        assert truncated == (t == 200)  # fixed length: the time limit is the only end
        x, theta = float(obs[0]), float(obs[2])
        assert -math.pi <= theta < math.pi and abs(x) <= 2.4 + 1e-6
        assert reward == float(abs(theta) < 12 * math.pi / 180 and abs(x) < 2.4) == float(info["success"])
        angles.append(theta)
        positions.append(x)
    assert max(abs(a) for a in angles) > math.pi / 2  # random actions do topple the pole: it kept going


def test_cartpole_cart_stops_at_the_wall():
    env = classic.make_env("CartPole-v1", seed=0, idx=0, episode_length=200, realistic=False)()
    env.reset(seed=0)
    env.unwrapped.state = np.array([2.39, 3.0, 0.0, 0.0])
    obs, reward, *_ = env.step(1)
    assert obs[0] == pytest.approx(2.4) and obs[1] == 0.0 and reward == 0.0


@pytest.mark.parametrize("env_id", ["CartPole-v1", "MountainCar-v0"])
@pytest.mark.parametrize("fixed_length", [True, False], ids=["fixed", "stock"])
def test_frames_are_the_pixels_gymnasium_renders(env_id, fixed_length, monkeypatch):
    """GymnasiumPixels reads gymnasium's drawing out of pygame itself: the frames of the same env without it, step by
    step (the flag MountainCar's fixed-length episodes draw at 0.45 included), writable."""
    ours = classic.make_env(env_id, seed=0, idx=0, episode_length=100, realistic=False, fixed_length=fixed_length)()
    monkeypatch.setattr(classic, "GymnasiumPixels", lambda env: env)
    stock = classic.make_env(env_id, seed=0, idx=0, episode_length=100, realistic=False, fixed_length=fixed_length)()
    actions = np.random.default_rng(0).integers(ours.action_space.n, size=250)
    for env in (ours, stock):
        env.reset(seed=0)
    for action in actions:
        ended = [any(env.step(action)[2:4]) for env in (ours, stock)]
        frame, expected = ours.render(), stock.render()
        assert frame.shape == (400, 600, 3) and frame.flags.writeable and np.array_equal(frame, expected)
        if ended[0]:
            for env in (ours, stock):
                env.reset(seed=int(action))


def test_mountaincar_success_persists_within_episode_and_resets():
    env = classic.make_env("MountainCar-v0", seed=0, idx=0, episode_length=200, realistic=False)()
    env.reset(seed=0)
    env.unwrapped.state = np.array([0.44, 0.05])
    obs, reward, terminated, _, info = env.step(2)
    assert obs[0] >= 0.45 and reward == 1.0 and info["success"] and not terminated
    env.unwrapped.state = np.array([-0.5, 0.0])
    _, reward, _, _, info = env.step(1)
    assert reward == 0.0 and info["success"]  # reached once this episode
    env.reset(seed=1)
    _, _, _, _, info = env.step(1)
    assert not info["success"]


def test_plain_mountaincar_draws_the_flag_at_our_goal():
    env = classic.make_env("MountainCar-v0", seed=0, idx=0, episode_length=200, realistic=False)()
    env.reset(seed=0)
    frame = env.render()
    flag = np.all(frame == (204, 204, 0), axis=2)  # Gymnasium's yellow flag, drawn from its pole to the right
    car = env.unwrapped
    x = car.min_position + np.flatnonzero(flag.any(0)).min() / (600 / (car.max_position - car.min_position))
    assert abs(x - classic.MOUNTAINCAR_GOAL) < 0.01, x
    assert car.goal_position == 0.5  # the drawing only: the env itself is unchanged


def test_realistic_mountaincar_is_a_landscape_that_shows_the_car_position():
    plain = classic.make_env("MountainCar-v0", 0, 0, 200, realistic=False)()
    real = classic.make_env("MountainCar-v0", 0, 0, 200, realistic=True)()
    frames = []
    for env in (plain, real):
        env.reset(seed=0)
        env.unwrapped.state = np.array([-0.5, 0.0])
        frames.append(env.render())
    assert frames[1].shape == frames[0].shape == (400, 600, 3) and frames[1].dtype == np.uint8
    sky = frames[1][:30].reshape(-1, 3).mean(0)
    assert sky[2] > sky[0] + 40  # blue sky, not the white page of the line art
    assert frames[0][:30].mean() > 250
    cloth = np.flatnonzero((np.abs(frames[1].astype(int) - (250, 210, 20)).max(2) < 10).any(0))
    assert cloth.min() == 552  # the yellow flag flies right of its pole at x = 0.45 (column 550), the paper's goal
    real.unwrapped.state = np.array([0.45, 0.0])
    at_flag = real.render()
    changed = np.any(at_flag != frames[1], axis=2)
    cols = np.flatnonzero(changed.any(0))
    # only the car moved: pixels changed around x=-0.5 (col 233) and x=0.45 (col 550), nowhere else
    assert changed.sum() > 500 and np.all((np.abs(cols - 233) < 45) | (np.abs(cols - 550) < 45))


# ---------------------------------------------------------------------------- reward-frame alignment
def stamped_render(self: classic.GymnasiumPixels) -> np.ndarray:
    """Instrumented renderer: the frame carries the float32 pole angle of the state it shows."""
    frame = np.zeros((400, 600, 3), dtype=np.uint8)  # the size CartPole draws
    frame[0, :4, 0] = np.frombuffer(np.float32(self.unwrapped.state[2]).tobytes(), dtype=np.uint8)
    return frame


def decoding_forward(self, frames: np.ndarray) -> np.ndarray:
    """Instrumented reward model: the reward of a frame is the pole angle stamped in it."""
    return np.ascontiguousarray(frames[:, 0, :4, 0]).view(np.float32)[:, 0].copy()


def test_reward_belongs_to_the_frame_after_the_step_across_autoresets(in_tmp, monkeypatch):
    monkeypatch.setattr(classic.GymnasiumPixels, "render", stamped_render)
    monkeypatch.setattr(classic.CLIPReward, "forward", decoding_forward)
    added = []
    original_add = classic.ReplayBuffer.add

    def spy_add(self, obs, next_obs, actions, rewards, terminations):
        added.append((obs.copy(), next_obs.copy(), np.asarray(rewards).copy()))
        original_add(self, obs, next_obs, actions, rewards, terminations)

    monkeypatch.setattr(classic.ReplayBuffer, "add", spy_add)
    args = classic.Args(
        clip_model=TINY_CLIP,
        clip_pretrained="none",
        num_envs=2,
        episode_length=50,
        total_timesteps=600,
        learning_starts=100,
        train_frequency=4,
        reward_batch_size=7,
        buffer_size=1000,
        batch_size=16,
    )
    classic.main(args)

    obs = np.concatenate([a[0] for a in added])
    next_obs = np.concatenate([a[1] for a in added])
    rewards = np.concatenate([a[2] for a in added])
    # 300 vector steps of 2 envs, episodes of 50 steps; finished envs are reset outside any step, so
    # every step is a transition and no reset observation or reset frame is ever stored
    assert len(rewards) == 2 * 300
    np.testing.assert_array_equal(rewards, next_obs[:, 2])  # scored frame == state after the step
    # rows are step-major: an env's next row (2 rows later) continues from next_obs, except after an episode end
    chained = np.all(next_obs[:-2] == obs[2:], axis=1)
    episode_ends = np.zeros(len(rewards) - 2, dtype=bool)
    episode_ends[[t * 2 + i for t in range(49, 299, 50) for i in range(2)]] = True
    np.testing.assert_array_equal(chained, ~episode_ends)
    assert len(added) > 1 and max(len(a[2]) for a in added) <= 8  # scored in batches of about 7


# ---------------------------------------------------------------------------- learning
@pytest.mark.parametrize("seed", [1, 2])
def test_dqn_learns_stock_cartpole_from_ground_truth(in_tmp, seed):
    # --reward gt is Gymnasium's own CartPole-v1 by default: episodes end when the pole falls, at most 500 steps
    args = classic.Args(reward="gt", seed=seed, total_timesteps=30_000, learning_starts=1000, exploration_fraction=0.3)
    classic.main(args)
    (run_dir,) = (in_tmp / "runs").iterdir()
    lengths = [v for _, v in read_scalars(run_dir)["charts/episodic_length"]]
    assert np.mean(lengths[:10]) < 40  # the random policy drops the pole within a few dozen steps
    assert np.mean(lengths[-20:]) > 70 and max(lengths) > 200, lengths[-20:]  # balances, past the old fixed length


def spy_on_buffer(monkeypatch) -> list:
    added = []
    original_add = classic.ReplayBuffer.add

    def spy_add(self, obs, next_obs, actions, rewards, terminations):
        added.append((next_obs.copy(), np.asarray(terminations).copy()))
        original_add(self, obs, next_obs, actions, rewards, terminations)

    monkeypatch.setattr(classic.ReplayBuffer, "add", spy_add)
    return added


def test_ground_truth_default_is_the_stock_task_with_terminal_transitions(in_tmp, monkeypatch):
    added = spy_on_buffer(monkeypatch)
    classic.main(classic.Args(reward="gt", total_timesteps=1000, learning_starts=500))
    next_obs = np.concatenate([a[0] for a in added])
    terminations = np.concatenate([a[1] for a in added])
    (run_dir,) = (in_tmp / "runs").iterdir()
    lengths = [v for _, v in read_scalars(run_dir)["charts/episodic_length"]]
    assert len(set(lengths)) > 3 and max(lengths) < 200  # the (mostly random) policy drops the pole: stock episodes vary
    # every episode ended by the pole falling (or the cart leaving the track) is stored as terminal: no bootstrap
    fallen = (np.abs(next_obs[:, 2]) > 12 * math.pi / 180) | (np.abs(next_obs[:, 0]) > 2.4)
    np.testing.assert_array_equal(terminations == 1, fallen)
    assert terminations.sum() >= len(lengths)


def test_fixed_length_flag_keeps_fixed_episodes_with_the_ground_truth(in_tmp, monkeypatch):
    added = spy_on_buffer(monkeypatch)
    classic.main(classic.Args(reward="gt", episodes="fixed", total_timesteps=1000, learning_starts=500))
    assert not np.concatenate([a[1] for a in added]).any()  # never terminal: the time limit is a truncation
    (run_dir,) = (in_tmp / "runs").iterdir()
    assert [v for _, v in read_scalars(run_dir)["charts/episodic_length"]] == [200] * 5


def test_stock_cartpole_env_terminates_and_truncates_at_500():
    env = classic.make_env("CartPole-v1", seed=0, idx=0, episode_length=200, realistic=False, fixed_length=False)()
    env.reset(seed=0)
    for t in range(1, 501):
        theta, theta_dot = env.unwrapped.state[2:]
        _, reward, terminated, truncated, info = env.step(int(theta + 0.5 * theta_dot > 0))  # a balancing controller
        assert reward == 1.0 and not terminated and truncated == (t == 500) and info["success"]
    env.reset(seed=0)
    for t in range(1, 100):
        _, reward, terminated, truncated, info = env.step(1)  # always push right: the pole falls
        if terminated:
            break
    assert terminated and not truncated and not info["success"] and t < 100


# ---------------------------------------------------------------------------- CLI
def test_clip_rewarded_smoke_run_trains_saves_evaluates_and_records(tmp_path):
    car = ["--env-id", "MountainCar-v0", "--realistic"]
    flags = "--alpha 0.5 --total-timesteps 800 --learning-starts 400 --train-frequency 4 --save-model --eval-episodes 1"
    video = ["--capture-video", "--video-frequency", "400"]
    result = run_script(SCRIPT, *TINY_CLIP_FLAGS, *car, *flags.split(), *video, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    scalars = read_scalars(run_dir)
    tags = "episodic_return gt_return gt_success clip_reward_mean SPS".split()
    for tag in [*(f"charts/{t}" for t in tags), "losses/td_loss", "losses/q_values", "time/render_s", "eval/clip_return"]:
        values = [v for _, v in scalars[tag]]
        assert values and np.all(np.isfinite(values)), tag
    assert len(scalars["charts/episodic_return"]) == 800 // 200
    # logged at the step each episode ended, though its rewards were scored in a later batch
    assert [s for s, _ in scalars["charts/episodic_return"]] == [199, 399, 599, 799]
    # a greedy episode every --video-frequency steps, then the final Q-network's --eval-episodes at the last step
    assert [s for s, _ in scalars["eval/gt_return"]] == [400, 800, 800]
    videos = sorted(p.name for p in (tmp_path / "videos" / run_dir.name).iterdir())
    assert videos == ["step-400.mp4", "step-800.mp4"]
    assert all((tmp_path / "videos" / run_dir.name / v).stat().st_size > 1000 for v in videos)
    checkpoint = run_dir / "checkpoint.pt"
    saved = torch.load(checkpoint, weights_only=False)
    assert {"q_network", "iteration", "rng"} <= saved.keys()  # resumable: the run ended at an episode boundary
    evaluation = run_script(
        SCRIPT, *TINY_CLIP_FLAGS, *car, "--evaluate", str(checkpoint), "--eval-episodes", "1", cwd=tmp_path
    )
    assert evaluation.returncode == 0, evaluation.stderr[-3000:]
    assert evaluation.stdout.count("eval episode") == 1 and "clip_return=" in evaluation.stdout
    eval_dir = tmp_path / "videos" / run_dir.name  # the trained run's folder, beside its training videos
    assert (eval_dir / "eval-episode-0.mp4").stat().st_size > 1000
    assert len(list((eval_dir / "eval-episode-0").glob("frame-*.png"))) == 201  # reset frame + 200 steps


def test_a_run_that_ends_mid_episode_keeps_a_resumable_checkpoint_and_its_final_networks_to_evaluate(in_tmp):
    flags = dict(episodes="fixed", episode_length=100, total_timesteps=250, learning_starts=100, eval_episodes=1)
    classic.main(classic.Args(reward="gt", save_model=True, checkpoint_frequency=1000, **flags))
    (run,) = (in_tmp / "runs").iterdir()
    saved = torch.load(run / "checkpoint.pt", weights_only=False)  # the last episode end's: resumable, extendable
    assert saved["global_step"] == 200 and saved["args"]["total_timesteps"] == 250 and "optimizer" in saved
    final = torch.load(run / "checkpoints" / "step-250.pt", weights_only=False)
    assert {"q_network", "args", "run_name", "global_step", "clip_return", "script"} == final.keys()
    assert_refused(classic, ["--resume", str(run / "checkpoints" / "step-250.pt")], "no resumable training state")
    classic.main(classic.Args(reward="gt", evaluate=str(run / "checkpoints" / "step-250.pt"), **flags))  # rolls it out
    assert len(list((in_tmp / "videos").glob("*/eval-episode-0/frame-*.png"))) == 101


BAD_INPUT = {
    "alpha above 1": (["--alpha", "1.5"], ["--alpha"]),
    "alpha below 0": (["--alpha", "-0.1"], ["--alpha"]),
    "goal equals baseline": (["--goal", "a cart", "--baseline", "a cart", "--alpha", "0.5"], ["--goal", "--baseline"]),
    "goal equals baseline up to case and spaces": (
        ["--goal", "A Pole", "--baseline", "a  pole ", "--alpha", "0.5"],
        ["--goal", "--baseline"],
    ),
    "empty goal": (["--goal", ""], ["--goal"]),
    "unknown model": (["--clip-model", "ViT-Nope-99"], ["ViT-Nope-99", "list_models"]),
    "unknown pretrained tag": (["--clip-model", "RN50", "--clip-pretrained", "nope"], ["nope", "openai"]),
    "missing checkpoint": (["--clip-model", "RN50", "--clip-checkpoint", "missing.pt"], ["missing.pt"]),
    "missing model config": (["--clip-model", "nowhere/tiny.json"], ["nowhere/tiny.json"]),
    "non-positive steps": (["--total-timesteps", "0"], ["--total-timesteps"]),
    "softmax without negatives": (
        ["--reward-family", "softmax", "--goal", "a balanced pole"],
        ["--reward-family softmax", "--negatives"],
    ),
    "softmax with empty negatives": (["--reward-family", "softmax", "--negatives"], ["--negatives"]),
    "negative equal to goal": (
        ["--reward-family", "softmax", "--goal", "a pole", "--negatives", "a pole"],
        ["--negatives", "--goal"],
    ),
    "temperature zero": (["--reward-family", "softmax", "--temperature", "0"], ["--temperature", "positive"]),
    "threshold one": (["--reward-family", "softmax", "--threshold", "1"], ["--threshold", "(0, 1)"]),
    "threshold negative": (["--threshold", "-0.2"], ["--threshold", "(0, 1)"]),
}


@pytest.mark.parametrize("case", BAD_INPUT, ids=list(BAD_INPUT))
def test_bad_input_is_one_clear_sentence(in_tmp, case):
    flags, words = BAD_INPUT[case]
    assert_refused(classic, flags, *words)


def test_bad_input_on_the_command_line_exits_2_with_one_line_and_no_traceback(tmp_path):
    flags, words = BAD_INPUT["goal equals baseline"]
    assert_clean_error(run_script(SCRIPT, *flags, cwd=tmp_path), *words)
    assert not (tmp_path / "runs").exists()


def test_weights_that_cannot_be_downloaded(tmp_path):
    # HF_HUB_OFFLINE makes the hub fail at once, the same way it does without a network
    flags = ["--clip-model", "RN50", "--clip-pretrained", "openai", "--clip-cache-dir", str(tmp_path / "cache")]
    result = run_script(SCRIPT, *flags, cwd=tmp_path, env={"HF_HUB_OFFLINE": "1"})
    assert_clean_error(result, "RN50", "network", "--clip-cache-dir", "--clip-checkpoint")


def test_corrupt_checkpoint(in_tmp):
    (in_tmp / "weights.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(vlmrm_utils.UserError, match="weights.pt"):
        classic.main(classic.Args(clip_model=TINY_CLIP, clip_checkpoint="weights.pt"))


# CLIP reads at most 77 tokens: prompts that differ only after them have one embedding, so d = g - b = 0
SAME_EMBEDDING = ["--goal", "pole " * 80 + "left", "--baseline", "pole " * 80 + "right", "--alpha", "0.5"]


def test_prompts_with_the_same_embedding_are_refused_after_encoding(in_tmp):
    assert_refused(classic, [*TINY_CLIP_FLAGS, *SAME_EMBEDDING], "--goal", "--baseline", "embedding", "--alpha 0")


@pytest.mark.parametrize(
    "content, words",
    [
        ("{not json", ["not an open_clip model config", "embed_dim"]),
        ('{"name": "not a model"}', ["not an open_clip model config", "embed_dim"]),
        ('{"embed_dim": 32, "vision_cfg": {"layers": "two"}, "text_cfg": {}}', ["could not build", "config file"]),
    ],
)
def test_a_bad_model_config_file_is_named_as_such(in_tmp, content, words):
    (in_tmp / "model.json").write_text(content)
    with pytest.raises(vlmrm_utils.UserError) as error:
        classic.main(classic.Args(clip_model="model.json", clip_pretrained="none", total_timesteps=20, learning_starts=10))
    message = str(error.value)
    assert "\n" not in message and "network" not in message, message
    for word in words:
        assert word in message, message


def test_a_config_without_model_keys_named_as_a_built_in_model_is_refused_not_replaced_by_it(in_tmp):
    """open_clip skips a config without embed_dim, vision_cfg and text_cfg silently: RN50.json would load the stock RN50."""
    (in_tmp / "RN50.json").write_text('{"embed_dims": 1024, "vision_cfg": {}, "text_cfg": {}}')
    assert_refused(classic, ["--clip-model", "RN50.json", "--clip-pretrained", "openai"], "RN50.json", "not an open_clip")


def test_missing_weights_say_what_is_fetched_and_fail_within_seconds(tmp_path):
    # a documentation address (RFC 5737) stands for an unreachable hub, also where the machine has a network
    env = {"HF_ENDPOINT": "https://192.0.2.1", "HF_HUB_OFFLINE": "", "HTTPS_PROXY": "", "https_proxy": ""}
    flags = ["--clip-model", "RN50", "--clip-pretrained", "openai", "--clip-cache-dir", str(tmp_path / "cache")]
    code, lines = run_timed(SCRIPT, *flags, cwd=tmp_path, env=env, timeout=120)
    text = "\n".join(line for _, line in lines)
    assert code == 2 and "Traceback" not in text, text
    (fetching,) = [t for t, line in lines if line.startswith("fetching the RN50/openai CLIP weights (102M parameters")]
    (error,) = [t for t, line in lines if line.startswith("error: ")]
    assert "network" in text and "192.0.2.1" in text
    assert error - fetching < 20, (fetching, error)  # open_clip's own retries took about a minute


def test_cached_weights_load_without_touching_the_network(in_tmp, monkeypatch, capsys):
    """Weights in the Hugging Face cache: nothing is fetched, no connection is opened, the weights are the cached ones."""
    import socket

    import open_clip

    torch.manual_seed(0)
    model, _ = vlmrm_utils.load_clip(classic.Args(clip_model=TINY_CLIP, clip_pretrained="none"), torch.device("cpu"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = in_tmp / "cache" / "models--nobody--vlmrm-tiny" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (in_tmp / "cache" / "models--nobody--vlmrm-tiny" / "refs").mkdir()
    (in_tmp / "cache" / "models--nobody--vlmrm-tiny" / "refs" / "main").write_text(commit)
    torch.save(model.state_dict(), snapshot / "open_clip_pytorch_model.bin")
    monkeypatch.setitem(open_clip.pretrained._PRETRAINED, "vlmrm-tiny-test", {"cached": {"hf_hub": "nobody/vlmrm-tiny/"}})

    def no_network(*args, **kwargs):
        raise AssertionError("cached weights must load without a connection")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    capsys.readouterr()
    args = classic.Args(clip_model=TINY_CLIP, clip_pretrained="cached", clip_cache_dir=str(in_tmp / "cache"))
    loaded, _ = vlmrm_utils.load_clip(args, torch.device("cpu"))
    assert "fetching" not in capsys.readouterr().out
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)
    import huggingface_hub.constants

    assert not huggingface_hub.constants.HF_HUB_OFFLINE  # the offline switch is only held while loading
