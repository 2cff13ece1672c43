"""Can the sentence "a humanoid robot with its arms raised" alone teach the humanoid, offline, on 2 CPU cores?

One command: train a small CLIP on captioned frames of the textured humanoid (experiments/humanoid_clip.py), check the
prompts are not training captions (words and embeddings), check the reward ranks arms-up frames above arms-down ones,
then train SAC through `vlmrm_sac_humanoid.py` twice at once, with the goal prompt and with the swapped prompt ("arms
down") as the control, each as a user types it. Judged by the ground truth: the fraction of steps with both hands
above the head in stochastic rollouts of each checkpoint, against a random policy. Saves the learning curve and frames
of the learned pose into docs/.

    python experiments/humanoid_arms.py            # 50 min measured on 2 cores shared with 4 other jobs
    python experiments/humanoid_arms.py --sac-steps 800 --learning-starts 400 --clip-frames 300 --clip-steps 40 \
        --eval-episodes 3 --out /tmp/h --docs /tmp/h  # a smoke run of the pipeline (4 min under the same load)

The paper's humanoid schedule, scaled to 2 cores (every change): 64 px frames instead of 480, rendering "fast" (no
shadows or reflections), 2 envs instead of 32, 30,000 steps per run (--sac-steps) instead of 10M, learning from step
2,000 instead of 50,000, 4 gradient steps every 4 vector steps (1 per 2 env steps) instead of 100 every 100 (1 per 32),
batch 256 instead of 512, a 100k buffer instead of 1M. Unchanged: gamma 0.95, tau 0.005, learning rates 6e-4, entropy
autotuning, 100-step episodes without early termination, the paper's camera and look, alpha 0 (the script's humanoid
default).
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))  # clip_trainer: the training recipe of every small CLIP here
os.environ.setdefault("MUJOCO_GL", "egl")

import clip_trainer  # noqa: E402
import humanoid_clip  # noqa: E402

GOAL = "a humanoid robot with its arms raised"
BASELINE = "a humanoid robot"
SWAPPED = "a humanoid robot with its arms down"
RENDER = ["--render-size", "64", "--render-quality", "fast"]  # the same frames the CLIP was trained on
SAC_FLAGS = ["--num-envs", "2", "--train-frequency", "4", "--gradient-steps", "4"]
SAC_FLAGS += ["--batch-size", "256", "--buffer-size", "100000", "--save-model", "--no-cuda"]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sac-steps", type=int, default=30_000, help="SAC env steps of each run (goal and swapped)")
    p.add_argument("--clip-frames", type=int, default=humanoid_clip.NUM_FRAMES, help="captioned frames the CLIP learns from")
    p.add_argument("--clip-steps", type=int, default=humanoid_clip.STEPS, help="contrastive training steps of the CLIP")
    p.add_argument("--learning-starts", type=int, default=2000, help="random-action steps before SAC learns")
    p.add_argument("--eval-episodes", type=int, default=100, help="stochastic episodes per policy for the final numbers")
    p.add_argument("--reuse-runs", action="store_true", help="evaluate the finished SAC runs in --out, do not train again")
    p.add_argument("--seed", type=int, default=1, help="seed of both SAC runs")
    p.add_argument("--out", default="runs/humanoid_arms", help="folder of the CLIP, the SAC runs and their logs")
    p.add_argument("--docs", default=str(ROOT / "docs"), help="folder of the curve and frame pictures")
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    args = p.parse_args()
    # checked before minutes of CLIP training: each is one sentence, as the training scripts' own checks
    small = [
        f"--{k.replace('_', '-')}" for k in ("sac_steps", "clip_frames", "clip_steps", "eval_episodes") if getattr(args, k) < 1
    ]
    if small or not 0 <= args.learning_starts < args.sac_steps:
        p.error(f"{', '.join(small) or '--learning-starts'} must be positive (learning starts below --sac-steps)")
    if args.reuse_runs and not all((Path(args.out) / name / "sac.log").is_file() for name in ("goal", "swapped")):
        p.error(f"--reuse-runs needs the finished runs of an earlier command in --out {args.out} (goal/ and swapped/)")
    try:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.docs).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"cannot make the output folder {e.filename}: {e.strerror}")
    return args


def load_model(path: str):
    model, _, tokenizer = clip_trainer.model_and_transform(humanoid_clip.CONFIG)
    model.load_state_dict(torch.load(path, map_location="cpu"))
    return model.eval(), tokenizer


def reward_ranking(model, tokenizer, frames: np.ndarray, hands: np.ndarray, goal: str) -> tuple[float, float, float]:
    """The script's own CLIPReward (its tensor preprocessing) at alpha 0 on held-out frames: mean reward of frames with
    both hands above the head, of frames with none, and the AUC (chance that an arms-up frame outscores an arms-down)."""
    from vlmrm_sac_humanoid import CLIPReward

    rewards = CLIPReward(model, tokenizer, (goal,), (BASELINE,), 0.0, 256, torch.device("cpu"))(frames)
    up, down = rewards[hands == 2], rewards[hands == 0]
    auc = float((up[:, None] > down[None, :]).mean() + 0.5 * (up[:, None] == down[None, :]).mean())
    return float(up.mean()), float(down.mean()), auc


def rollouts(actor, episodes: int, seed: int, render_size: int = 0) -> tuple[np.ndarray, list]:
    """Stochastic episodes (random actions when `actor` is None): per-episode fraction of steps with both hands above
    the head, and frames at `render_size` (when > 0) of the first episode."""
    from vlmrm_sac_humanoid import make_env

    size, quality = (render_size, "high") if render_size else (64, "fast")
    env = make_env("Humanoid-v5", seed, 0, 100, size, quality, True)()
    env.action_space.seed(seed)
    torch.manual_seed(seed)
    fractions, frames = [], []
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        up, done = 0, False
        while not done:
            action = humanoid_clip.rollout_action(actor, env, obs)
            obs, _, terminated, truncated, _ = env.step(action)
            done = terminated or truncated
            up += humanoid_clip.hands_above_head(env.unwrapped.data) == 2
            if render_size and episode == 0:
                frames.append(env.render())
        fractions.append(up / env.spec.max_episode_steps)
    env.close()
    return np.array(fractions), frames


def load_actor(path: Path):
    import gymnasium as gym

    from vlmrm_sac_humanoid import Actor
    from vlmrm_utils import UserError, check_intact

    try:  # --reuse-runs reads checkpoints written earlier: a damaged one is refused, never rolled out
        check_intact(str(path), str(path), "rerun without --reuse-runs")
    except UserError as e:
        sys.exit(f"error: {e}")
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("Humanoid-v5")])
    actor = Actor(envs)
    actor.load_state_dict(torch.load(path, map_location="cpu", weights_only=False)["actor"])
    envs.close()
    return actor.eval()


def main() -> None:
    args = parse()
    start = time.time()
    torch.set_num_threads(1)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    # 1. the CLIP, trained once per setting and source hash
    key = humanoid_clip.cache_key(frames=args.clip_frames, steps=args.clip_steps)
    clip_path = out / f"humanoid-clip-{key}.pt"
    if not clip_path.exists():
        humanoid_clip.train(str(clip_path), args.clip_frames, args.clip_steps)
    model, tokenizer = load_model(str(clip_path))
    print(f"clip: {clip_path} ({time.time() - start:.0f} s)")

    # 2. the prompts are no training captions; 3. the reward ranks held-out arms-up frames above arms-down ones
    for prompt in (GOAL, BASELINE, SWAPPED):
        nearest, cosine = humanoid_clip.check_prompt(model, tokenizer, prompt)
        print(f"prompt {prompt!r}: not a training caption; nearest caption {nearest!r}, cosine {cosine:.3f}")
    frames, hands, _, _ = humanoid_clip.render_dataset(300, seed=12345)
    for prompt in (GOAL, SWAPPED):
        up, down, auc = reward_ranking(model, tokenizer, frames, hands, prompt)
        print(
            f"held-out frames, goal {prompt!r}: mean reward arms up {up:.4f}, arms down {down:.4f}, AUC(up > down) {auc:.3f}"
        )

    # 4. SAC, goal and swapped prompt at once (one core each), as a user types the command
    script, clip_flags = str(ROOT / "vlmrm_sac_humanoid.py"), ["--clip-model", str(humanoid_clip.CONFIG)]
    clip_flags += ["--clip-checkpoint", str(clip_path)]
    every = [
        "--learning-starts",
        str(args.learning_starts),
        "--total-timesteps",
        str(args.sac_steps),
        "--checkpoint-frequency",
        str(max(200, args.sac_steps // 10)),
    ]
    runs = {}
    for name, goal in (("goal", GOAL), ("swapped", SWAPPED)):
        folder = out / name
        folder.mkdir(exist_ok=True)
        command = [sys.executable, script, "--goal", goal, "--baseline", BASELINE, *clip_flags, *RENDER, *SAC_FLAGS]
        command += [*every, "--seed", str(args.seed), "--exp-name", f"humanoid_arms_{name}"]
        print(f"sac {name}: python vlmrm_sac_humanoid.py {' '.join(repr(c) if ' ' in c else c for c in command[2:])}")
        if args.reuse_runs:
            runs[name] = (None, None, folder)
            continue
        log = open(folder / "sac.log", "w")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        runs[name] = (subprocess.Popen(command, cwd=folder, stdout=log, stderr=subprocess.STDOUT, env=env), log, folder)
    for name, (process, log, folder) in runs.items():
        if process is not None and process.wait() != 0:
            sys.exit(f"error: the {name} SAC run failed; see {folder / 'sac.log'}")
        if log is not None:
            log.close()
        done = [line for line in open(folder / "sac.log") if line.startswith("done:")]
        if not done:
            sys.exit(f"error: the {name} SAC run did not finish; see {folder / 'sac.log'}")
        print(f"sac {name}: {done[-1].strip()}")
    print(f"sac finished ({time.time() - start:.0f} s)")

    # 5. ground truth: stochastic rollouts of every checkpoint, the final one with more episodes, and a random policy
    curves, final = {}, {}
    random_fractions, random_frames = rollouts(None, args.eval_episodes, seed=777, render_size=160)
    for name, (_, _, folder) in runs.items():
        (run_dir,) = (folder / "runs").iterdir()
        points = sorted((int(p.stem.split("-")[1]), p) for p in (run_dir / "checkpoints").glob("step-*.pt"))
        curves[name] = [(step, rollouts(load_actor(p), 5, seed=777)[0].mean()) for step, p in points]
        fractions, frames = rollouts(load_actor(run_dir / "checkpoint.pt"), args.eval_episodes, seed=777, render_size=160)
        final[name] = (fractions, frames, run_dir)
    print(f"ground truth: fraction of steps with both hands above the head, {args.eval_episodes} stochastic episodes x 100")
    for name, fractions in [("goal", final["goal"][0]), ("swapped", final["swapped"][0]), ("random", random_fractions)]:
        sem = fractions.std(ddof=1) / np.sqrt(len(fractions))
        print(f"  {name:8s} {fractions.mean():.3f} +- {sem:.3f} (standard error over episodes)")
    for name, curve in curves.items():
        print(f"  {name} checkpoints (step: fraction, 5 episodes): " + ", ".join(f"{s}: {f:.2f}" for s, f in curve))

    # 6. the learning curve and frames of the learned pose
    docs = Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    plot(curves, random_fractions.mean(), {n: f[2] for n, f in final.items()}, docs / "humanoid_arms_curve.png")
    save_frames(
        {"goal": final["goal"][1], "swapped": final["swapped"][1], "random": random_frames}, docs / "humanoid_arms_frames.png"
    )
    print(f"saved {docs / 'humanoid_arms_curve.png'} and {docs / 'humanoid_arms_frames.png'}")
    print(f"wall time: {time.time() - start:.0f} s")


def plot(curves: dict, random_level: float, run_dirs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import read_scalars

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, curve in curves.items():
        left.plot(*zip(*curve), marker="o", label=f"goal: {GOAL if name == 'goal' else SWAPPED!r}")
        clip = read_scalars(run_dirs[name]).get("charts/clip_reward_mean", [])
        if clip:
            steps, values = np.array(clip).T
            window = max(1, len(values) // 20)
            right.plot(steps[window - 1 :], np.convolve(values, np.ones(window) / window, "valid"), label=name)
    left.axhline(random_level, color="grey", linestyle="--", label="random policy")
    left.set(xlabel="env steps", ylabel="steps with both hands above head", title="ground truth (stochastic rollouts)")
    right.set(xlabel="env steps", ylabel="mean CLIP reward per step", title="each run's own CLIP reward (training)")
    left.legend(fontsize=7), right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def save_frames(rows: dict, path: Path) -> None:
    """Rows of frames (steps 10, 30, 50, 70, 100 of the first stochastic episode) for each policy."""
    import imageio.v2 as imageio

    picks = [9, 29, 49, 69, 99]
    imageio.imwrite(path, np.concatenate([np.concatenate([frames[i] for i in picks], 1) for frames in rows.values()], 0))


if __name__ == "__main__":
    main()
