"""vlmrm_sac_humanoid.py: reward-frame alignment over subprocess envs, SAC learning, CLI smoke run, bad input."""

from types import SimpleNamespace

import gymnasium as gym
import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from conftest import TINY_CLIP, TINY_CLIP_FLAGS, assert_clean_error, assert_refused, read_scalars, run_script, run_timed

import vlmrm_sac_humanoid as sac
import vlmrm_utils

SCRIPT = "vlmrm_sac_humanoid.py"


def stamped_render(self) -> np.ndarray:
    """Instrumented renderer (runs in the env subprocess): the frame carries the torso height it shows."""
    frame = np.zeros((32, 32, 3), dtype=np.uint8)
    frame[0, :4, 0] = np.frombuffer(np.float32(self.env.unwrapped.data.qpos[2]).tobytes(), dtype=np.uint8)
    return frame


def decoding_forward(self, frames: np.ndarray) -> np.ndarray:
    """Instrumented reward model: the reward of a frame is the torso height stamped in it."""
    return np.ascontiguousarray(frames[:, 0, :4, 0]).view(np.float32)[:, 0].copy()


@pytest.fixture
def added(monkeypatch):
    """Every batch the loop adds to the replay buffer, as a dict of copies."""
    batches, original_add = [], sac.ReplayBuffer.add

    def spy_add(self, *arrays):
        batches.append({k: np.array(a) for k, a in zip(("obs", "next_obs", "actions", "rewards", "terminations"), arrays)})
        original_add(self, *arrays)

    monkeypatch.setattr(sac.ReplayBuffer, "add", spy_add)
    return batches


def test_reward_belongs_to_the_frame_after_the_step_across_subprocess_autoresets(in_tmp, monkeypatch, added):
    # the env subprocesses are forked after this patch, so they render stamped frames
    monkeypatch.setattr(sac.MujocoRenderer, "render", stamped_render)
    monkeypatch.setattr(sac.CLIPReward, "forward", decoding_forward)
    small = dict(num_envs=3, episode_length=20, render_size=32, total_timesteps=300, learning_starts=60, train_frequency=10)
    small.update(gradient_steps=2, batch_size=32, reward_batch_size=16, buffer_size=1000)
    sac.main(sac.Args(clip_model=TINY_CLIP, clip_pretrained="none", **small))

    obs, next_obs, rewards = (np.concatenate([batch[k] for batch in added]) for k in ("obs", "next_obs", "rewards"))
    # 100 vector steps of 3 envs, episodes of 20 steps, finished envs reset outside any step: every step
    # is a transition, and no reset observation or reset frame is ever stored
    assert len(rewards) == 3 * 100
    # obs[0] of Humanoid-v5 is the torso height: the scored frame shows the state after the step
    np.testing.assert_array_equal(rewards, next_obs[:, 0].astype(np.float32))  # the stamp is float32
    assert len(np.unique(rewards)) > 200  # real, varied states, not one repeated frame
    # rows are step-major: an env's next row (3 rows later) continues from next_obs, except after an episode end
    chained = np.all(next_obs[:-3] == obs[3:], axis=1)
    episode_ends = np.zeros(len(rewards) - 3, dtype=bool)
    episode_ends[[t * 3 + i for t in range(19, 99, 20) for i in range(3)]] = True
    np.testing.assert_array_equal(chained, ~episode_ends)


def test_log_prob_is_the_unit_box_tanh_gaussian_one_as_in_sb3():
    # Humanoid-like bounds +-0.4: measured in env units, log pi would be 17 * log(1 / 0.4) = 15.6 nats higher
    envs = SimpleNamespace(
        single_observation_space=gym.spaces.Box(-np.inf, np.inf, (5,)),
        single_action_space=gym.spaces.Box(-0.4, 0.4, (17,), np.float32),
    )
    torch.manual_seed(0)
    actor, obs = sac.Actor(envs), torch.randn(256, 5)
    action, log_prob, deterministic = actor.get_action(obs)
    mean, log_std = actor(obs)
    unit_box = torch.distributions.TransformedDistribution(
        torch.distributions.Normal(mean, log_std.exp()), [torch.distributions.TanhTransform()]
    )
    expected = unit_box.log_prob(action).sum(1, keepdim=True)  # independent of the actor's formula
    torch.testing.assert_close(log_prob, expected, atol=1e-3, rtol=1e-4)
    assert action.abs().max() < 1  # the sampled action stays on the unit box (replay buffer, critics)
    torch.testing.assert_close(deterministic, 0.4 * torch.tanh(mean))  # evaluation and checkpoints: env units


def test_log_std_is_hard_clamped_to_sb3s_bounds():
    envs = SimpleNamespace(
        single_observation_space=gym.spaces.Box(-np.inf, np.inf, (5,)),
        single_action_space=gym.spaces.Box(-1, 1, (3,), np.float32),
    )
    actor = sac.Actor(envs)
    with torch.no_grad():
        actor.fc_logstd.weight.zero_()
        for bias, expected in [(-30.0, -20.0), (-10.0, -10.0), (1.0, 1.0), (10.0, 2.0)]:  # CleanRL's tanh: -5, -4.2, 1.1, 2
            actor.fc_logstd.bias.fill_(bias)
            torch.testing.assert_close(actor(torch.zeros(1, 5))[1], torch.full((1, 3), expected))


def test_entropy_coefficient_and_critic_losses_are_sb3s(in_tmp, monkeypatch):
    """SB3 differentiates its entropy-coefficient loss through log alpha itself: the gradient on log alpha is
    -(log pi + target entropy), whatever alpha is (CleanRL's exp() form scales it by alpha). Its critic loss is
    0.5 (mse1 + mse2)."""
    grads = []

    class Recording(torch.optim.Adam):
        def step(self, closure=None):
            params = [p for g in self.param_groups for p in g["params"]]
            if len(params) == 1 and params[0].numel() == 1:  # the entropy coefficient's optimiser: log alpha alone
                grads.append(params[0].grad.item())
            return super().step(closure)

    monkeypatch.setattr(sac.optim, "Adam", Recording)
    flags = dict(env_id="MountainCarContinuous-v0", reward="gt", num_envs=1, total_timesteps=101, learning_starts=100)
    flags.update(train_frequency=1, gradient_steps=1, batch_size=64, buffer_size=1000)
    for ent_coef in (1.0, 0.01):  # the same seed: the same log pi at the first gradient step
        sac.main(sac.Args(**flags, ent_coef=ent_coef))
    assert len(grads) == 2 and grads[0] != 0
    assert grads[1] == pytest.approx(grads[0], rel=1e-4)  # CleanRL's form: 100x smaller at alpha 0.01
    for run in (in_tmp / "runs").iterdir():
        losses = {k: v[0][1] for k, v in read_scalars(run).items() if k.startswith("losses/q")}
        assert losses["losses/qf_loss"] == pytest.approx(0.5 * (losses["losses/qf1_loss"] + losses["losses/qf2_loss"]))


def test_defaults_are_the_papers():
    args = sac.Args()
    assert (args.ent_coef, args.autotune) == (1.0, True)  # SB3's automatic coefficient starts at 1.0
    assert (args.render_size, args.render_quality, args.camera, args.realistic) == (480, "high", "paper", True)


def test_sac_learns_stock_inverted_pendulum_from_ground_truth(in_tmp):
    # --reward gt is the stock task by default: an episode ends when the pole falls (at most 1000 steps)
    flags = dict(
        num_envs=4, total_timesteps=10_000, learning_starts=1000, train_frequency=25, gradient_steps=25, batch_size=256
    )
    # ent_coef: SB3's start, 1.0, needs more than these 10k steps (79.5 here, just short of 80)
    sac.main(sac.Args(env_id="InvertedPendulum-v5", reward="gt", seed=1, gamma=0.99, ent_coef=0.2, **flags))
    (run_dir,) = (in_tmp / "runs").iterdir()
    scalars = read_scalars(run_dir)
    lengths = [v for _, v in scalars["charts/episodic_length"]]
    returns = [v for _, v in scalars["charts/gt_return"]]
    assert returns == [length - 1 for length in lengths]  # stock v5 reward: 1 a step, 0 on the step the pole falls
    assert np.mean(lengths[:8]) < 30  # random actions drop the pole within a few steps
    assert np.mean(lengths[-12:]) >= 40, lengths[-12:]  # measured 78 (random actions: about 5); the policy still samples


def test_ground_truth_default_is_the_stock_task_and_the_flag_restores_fixed_length(in_tmp, monkeypatch, added):
    common = dict(
        env_id="InvertedPendulum-v5", reward="gt", num_envs=2, total_timesteps=400, learning_starts=200, batch_size=32
    )
    common.update(train_frequency=10, gradient_steps=1, episode_length=50)
    for episodes in ("auto", "fixed"):
        added.clear()
        run_dir = in_tmp / episodes
        run_dir.mkdir()
        monkeypatch.chdir(run_dir)
        sac.main(sac.Args(episodes=episodes, **common))
        (tb_dir,) = (run_dir / "runs").iterdir()
        lengths = [v for _, v in read_scalars(tb_dir)["charts/episodic_length"]]
        terminations = np.concatenate([batch["terminations"] for batch in added])
        if episodes == "auto":  # stock: the random policy drops the pole after a few steps, stored as terminal
            assert max(lengths) < 50 and len(set(lengths)) > 3 and terminations.sum() >= len(lengths)
        else:  # fixed: 50 steps each, the time limit a truncation (bootstrapped), never terminal
            assert lengths == [50] * 8 and not terminations.any()


def test_clip_rewarded_smoke_run_trains_checkpoints_records_and_rolls_out(tmp_path):
    flags = "--num-envs 2 --render-size 64 --render-quality fast --total-timesteps 600 --learning-starts 200 --alpha 0.5"
    flags += " --train-frequency 20 --gradient-steps 5 --batch-size 64 --capture-video --video-frequency 300 --save-model"
    result = run_script(SCRIPT, *TINY_CLIP_FLAGS, *flags.split(), "--checkpoint-frequency", "300", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    scalars = read_scalars(run_dir)
    tags = "charts/episodic_return charts/clip_return charts/clip_reward_mean charts/gt_return gt/reward_forward"
    tags += " gt/reward_survive gt/reward_ctrl losses/qf1_loss losses/qf_loss losses/actor_loss losses/ent_coef charts/SPS"
    for tag in (tags + " time/render_s time/reward_model_s eval/clip_return eval/gt_return").split():
        values = [v for _, v in scalars[tag]]
        assert values and np.all(np.isfinite(values)), tag
    assert len(scalars["charts/episodic_return"]) == 2 * 3  # 600 steps = 3 episodes of 100 steps in each of 2 envs
    # logged at the step each episode ended (global_step counts both envs), though scored in a later batch
    assert [s for s, _ in scalars["charts/episodic_return"]] == [198, 198, 398, 398, 598, 598]
    videos = sorted(p.name for p in (tmp_path / "videos" / run_dir.name).iterdir())
    assert videos == ["step-300.mp4", "step-600.mp4"]
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)  # holds RNG states and arrays
    assert checkpoint["global_step"] == 600 and {"actor", "qf1", "qf2", "log_ent_coef"} <= checkpoint.keys()

    # the command the run printed, as printed: its CLIP model, render size and quality come from the checkpoint
    printed = next(line for line in result.stdout.splitlines() if "--evaluate" in line).split("python ")[1].split()
    rollout = run_script(SCRIPT, *printed[1:], "--eval-episodes", "1", cwd=tmp_path)
    assert rollout.returncode == 0, rollout.stderr[-3000:]
    assert "clip_return=" in rollout.stdout
    eval_dir = tmp_path / "videos" / run_dir.name  # the trained run's folder, beside its training videos
    assert (eval_dir / "eval-episode-0.mp4").stat().st_size > 1000
    frames = sorted((eval_dir / "eval-episode-0").glob("frame-*.png"))
    assert len(frames) == 101 and imageio.imread(frames[0]).shape == (64, 64, 3)  # reset frame + 100 steps, at 64 px


def test_mountain_car_success_latches_within_an_episode_and_clears_at_reset():
    for textured in (False, True):  # Gymnasium's line art, the realistic landscape
        env = sac.make_env("MountainCarContinuous-v0", 0, 0, 200, 480, "high", textured)()
        env.reset(seed=0)
        assert env.render().shape == (400, 600, 3)
        car = env.unwrapped
        infos = []
        for x in (-0.5, 0.5, -0.5):  # below the goal, past it, back down: success stays
            car.state = np.array([x, 0.0])
            _, _, terminated, _, info = env.step(np.zeros(1, np.float32))
            assert not terminated  # Gymnasium would end the episode at the goal: fixed-length episodes never do
            infos.append(info["success"])
        assert infos == [False, True, True]
        env.reset(seed=1)
        car.state = np.array([-0.5, 0.0])
        assert env.step(np.zeros(1, np.float32))[4]["success"] is False  # a new episode starts unsuccessful
        env.close()


@pytest.mark.parametrize("env_id", ["MountainCarContinuous-v0", "MountainCar-v0"])
def test_mountain_car_clips_x_at_the_flag_after_success(env_id):
    """As the paper's env: driving on past the flag leaves the car at the flag (never past it) until the episode ends."""
    import vlmrm_dqn_classic as classic

    env = (
        sac.make_env(env_id, 0, 0, 200, 224, "fast", True)()
        if "Continuous" in env_id
        else classic.make_env(env_id, 0, 0, 200, True)()
    )
    push = np.ones(1, np.float32) if "Continuous" in env_id else 2
    env.reset(seed=0)
    car = env.unwrapped
    car.state = np.array([0.40, 0.06], np.asarray(car.state).dtype)  # fast enough to pass 0.45 in the first step
    xs = [(env.step(push)[0][0], car.state[0]) for _ in range(10)]
    assert all(obs == pytest.approx(sac.MOUNTAINCAR_GOAL) == state for obs, state in xs), xs
    env.reset(seed=1)
    assert car.state[0] < 0  # the reset starts the car in the valley again
    env.close()


def test_mountain_car_trains_with_the_clip_reward_and_logs_success(tmp_path):
    flags = "--env-id MountainCarContinuous-v0 --num-envs 2 --total-timesteps 800 --learning-starts 400 --train-frequency 20"
    result = run_script(SCRIPT, *TINY_CLIP_FLAGS, *flags.split(), *"--gradient-steps 5 --batch-size 64".split(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "goal=('a car at the peak of the mountain, next to the yellow flag',)" in result.stdout
    scalars = read_scalars(next((tmp_path / "runs").iterdir()))
    assert [s for s, _ in scalars["charts/gt_success"]] == [398, 398, 798, 798]  # episodes of 200 steps by default
    assert {v for _, v in scalars["charts/gt_success"]} <= {0.0, 1.0}
    assert len(scalars["charts/clip_return"]) == 4


BAD_INPUT = {
    "alpha above 1": (["--alpha", "2"], ["--alpha"]),
    "goal equals baseline": (["--goal", "a robot", "--baseline", "a robot", "--alpha", "1"], ["--goal", "--baseline"]),
    "goal equals baseline up to case and spaces": (
        ["--goal", "A Pole", "--baseline", "a  pole ", "--alpha", "0.5"],
        ["--goal", "--baseline"],
    ),
    "empty goal": (["--goal", " "], ["--goal"]),
    "unknown env": (["--env-id", "Humanoid-v99"], ["Humanoid-v99"]),
    "not a MuJoCo env": (["--env-id", "CartPole-v1"], ["MuJoCo"]),
    "Humanoid-v4": (["--env-id", "Humanoid-v4"], ["Humanoid-v4", "Humanoid-v5"]),
    "unknown model": (["--clip-model", "ViT-Nope-99"], ["ViT-Nope-99"]),
    "unknown pretrained tag": (["--clip-pretrained", "nope"], ["nope", "laion2b_s39b_b160k"]),
    "missing checkpoint": (["--clip-checkpoint", "missing.pt"], ["missing.pt"]),
    "missing policy": (["--evaluate", "missing-policy.pt"], ["missing-policy.pt"]),
    "zero gradient steps": (["--gradient-steps", "0"], ["--gradient-steps"]),
    "softmax without negatives": (
        ["--reward-family", "softmax", "--goal", "a humanoid robot doing the splits"],
        ["--reward-family softmax", "--negatives"],
    ),
    "softmax with empty negatives": (["--reward-family", "softmax", "--negatives"], ["--negatives"]),
    "temperature zero": (["--reward-family", "softmax", "--temperature", "0"], ["--temperature", "positive"]),
    "threshold above 1": (["--reward-family", "softmax", "--threshold", "1.5"], ["--threshold", "(0, 1)"]),
}


@pytest.mark.parametrize("case", BAD_INPUT, ids=list(BAD_INPUT))
def test_bad_input_is_one_clear_sentence(in_tmp, case):
    flags, words = BAD_INPUT[case]
    assert_refused(sac, flags, *words)


def test_bad_input_on_the_command_line_exits_2_with_one_line_and_no_traceback(tmp_path):
    flags, words = BAD_INPUT["goal equals baseline"]
    assert_clean_error(run_script(SCRIPT, *flags, cwd=tmp_path), *words)
    assert not (tmp_path / "runs").exists()
    # run as a script its module is __main__: the sentence still names the script's file
    assert_clean_error(run_script(SCRIPT, "--resume", "nothere.pt", cwd=tmp_path), "a checkpoint.pt of vlmrm_sac_humanoid.py")


def test_weights_that_cannot_be_downloaded(tmp_path):
    flags = f"--clip-model RN50 --clip-pretrained openai --clip-cache-dir {tmp_path / 'c'} --num-envs 1".split()
    result = run_script(SCRIPT, *flags, cwd=tmp_path, env={"HF_HUB_OFFLINE": "1"})
    assert_clean_error(result, "RN50", "network", "--clip-checkpoint")


def test_prompts_with_the_same_embedding_are_one_sentence_not_a_hang(tmp_path):
    # CLIP reads at most 77 tokens: prompts that differ only after them have one embedding, so d = g - b = 0
    prompts = ["--goal", "pole " * 80 + "left", "--baseline", "pole " * 80 + "right", "--alpha", "0.5"]
    result = run_script(
        SCRIPT, *TINY_CLIP_FLAGS, "--num-envs", "2", "--render-size", "32", *prompts, cwd=tmp_path, timeout=120
    )
    assert_clean_error(result, "--goal", "--baseline", "embedding", "--alpha 0")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "content, words",
    [
        ("{not json", ["not an open_clip model config", "embed_dim"]),
        ("[1, 2]", ["not an open_clip model config", "embed_dim"]),
        ('{"embed_dim": 32, "vision_cfg": {"layers": "two"}, "text_cfg": {}}', ["could not build", "config file"]),
    ],
)
def test_a_bad_model_config_file_is_named_as_such(in_tmp, content, words):
    (in_tmp / "model.json").write_text(content)
    with pytest.raises(vlmrm_utils.UserError) as error:
        sac.main(sac.Args(clip_model="model.json", clip_pretrained="none", num_envs=1, total_timesteps=20, learning_starts=10))
    message = str(error.value)
    assert "\n" not in message and "network" not in message, message
    for word in words:
        assert word in message, message


def test_missing_weights_say_what_is_fetched_and_fail_within_seconds_before_the_envs_start(tmp_path):
    # a documentation address (RFC 5737) stands for an unreachable hub, also where the machine has a network
    env = {"HF_ENDPOINT": "https://192.0.2.1", "HF_HUB_OFFLINE": "", "HTTPS_PROXY": "", "https_proxy": ""}
    flags = f"--clip-model RN50 --clip-pretrained openai --clip-cache-dir {tmp_path / 'cache'} --no-cuda --num-envs 2".split()
    code, lines = run_timed(SCRIPT, *flags, cwd=tmp_path, env=env, timeout=120)
    text = "\n".join(line for _, line in lines)
    assert code == 2 and "Traceback" not in text, text
    (fetching,) = [t for t, line in lines if line.startswith("fetching the RN50/openai CLIP weights (102M parameters")]
    (error,) = [t for t, line in lines if line.startswith("error: ")]
    assert "network" in text and "192.0.2.1" in text
    assert error - fetching < 20, (fetching, error)  # open_clip's own retries took about a minute
