"""Does the README's sentence "a humanoid robot kneeling" teach the humanoid, offline, on 2 CPU cores?

One command: train a small CLIP on captioned frames of the textured humanoid, kneeling and its neighbours
(experiments/humanoid_clip.py, task "kneel"), check the prompts are not training captions, print how its reward ranks
held-out kneeling frames and the pose probe's verdict for the goal; then train SAC through `vlmrm_sac_humanoid.py`, as a
user types it, for each seed with the goal and with the swapped prompt "a humanoid robot standing"; judge every final
policy and a random one by the ground truth `humanoid_clip.kneeling` (both knees near the floor, the torso upright,
the hips above the knees) in stochastic rollouts: the fraction of steps kneeling (the score) and the episodes kneeling
at each of their last 20 steps (success), with a curve over the runs' checkpoints.

    python experiments/humanoid_kneel.py --parallel 2     # 3 seeds x (goal, swapped), 200k steps each, 2 runs at once
    python experiments/humanoid_kneel.py --seeds 1 --sac-steps 500000 --parallel 2 --out runs/humanoid_kneel_500k
    python experiments/humanoid_kneel.py --clip-only      # the CLIP (about 4 min of one core), its ranking, the pose probe
    python experiments/humanoid_kneel.py --smoke          # the whole pipeline, tiny: 6 min on 2 cores at load ~8

A run stopped (Ctrl-C, or this command killed) continues bit-exactly where its last checkpoint was when the same
command is typed again (--resume with the saved replay buffer); finished runs are judged, not trained again.

The paper's humanoid schedule, sized for 2 CPU cores (every change): 8 envs instead of 32; 64 px frames instead of 480,
drawn by MuJoCo Warp's ray tracer on the CPU (`--renderer warp --supersample 1`, no shadows: `--render-quality fast`)
instead of OpenGL with shadows; 200,000 steps per run instead of 10M (--sac-steps); learning from step 10,000 instead
of 50,000; a replay buffer of --sac-steps instead of 1M (nothing is evicted either way); checkpoints every tenth of the
run instead of every 128,000 steps. Unchanged: 100 env steps (8 envs x --train-frequency 100 = 800 steps) between training
phases of 25 gradient steps (the paper's 1 gradient step per 32 env steps), batch 512, gamma 0.95, tau 0.005, learning
rates 6e-4, entropy autotuning, fixed 100-step episodes, the paper's camera and look, baseline "a humanoid robot" and
alpha 0 (the script's humanoid defaults).
"""

import argparse
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import humanoid_arms  # noqa: E402  (the paths and MUJOCO_GL set; its CLIP loading, checkpoint loading and frame strips)

HERE, ROOT = humanoid_arms.HERE, humanoid_arms.ROOT
import humanoid_clip  # noqa: E402

GOAL = "a humanoid robot kneeling"  # the README's sentence, the script's default goal
BASELINE = "a humanoid robot"
SWAPPED = "a humanoid robot standing"
SUPERSAMPLE = (
    1  # the fastest drawing (benchmarks/bench_kneel_schedule.py: 1.6x supersample 2's steps/s); the CLIP learns these frames
)
RENDER = ["--render-size", "64", "--render-quality", "fast", "--renderer", "warp", "--supersample", str(SUPERSAMPLE)]
SAC_FLAGS = ["--num-envs", "8", "--train-frequency", "100", "--gradient-steps", "25", "--batch-size", "512"]
SAC_FLAGS += ["--save-model", "--save-buffer", "--no-cuda"]
SMOKE = dict(sac_steps=1600, learning_starts=800, clip_frames=300, clip_steps=40, eval_episodes=3, curve_episodes=2)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="SAC seeds, each run with both prompts")
    p.add_argument("--sac-steps", type=int, default=200_000, help="SAC env steps of each run")
    p.add_argument("--learning-starts", type=int, default=10_000, help="random-action steps before SAC learns")
    p.add_argument("--clip-frames", type=int, default=3000, help="captioned frames the CLIP learns from")
    p.add_argument("--clip-steps", type=int, default=600, help="contrastive training steps of the CLIP")
    p.add_argument("--eval-episodes", type=int, default=100, help="stochastic episodes per final policy")
    p.add_argument("--curve-episodes", type=int, default=10, help="stochastic episodes per checkpoint of the curve")
    p.add_argument("--parallel", type=int, default=1, help="SAC runs at once (each uses about 1.5 cores)")
    p.add_argument("--clip-only", action="store_true", help="stop after the CLIP's checks and the pose probe")
    p.add_argument("--smoke", action="store_true", help=f"a tiny run of the whole pipeline: {SMOKE}, seed 1")
    p.add_argument("--out", default=None, help="folder of the CLIP, the runs and their logs (default runs/humanoid_kneel)")
    p.add_argument("--docs", default=None, help="folder of the curve and frame pictures (default: --out)")
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    args = p.parse_args()
    if args.smoke:
        vars(args).update(SMOKE, seeds=[1])
    args.out = Path(args.out or ("runs/humanoid_kneel_smoke" if args.smoke else "runs/humanoid_kneel")).resolve()
    args.docs = Path(args.docs).resolve() if args.docs else args.out
    small = [k for k in ("sac_steps", "clip_frames", "clip_steps", "eval_episodes", "curve_episodes", "parallel")]
    small = [f"--{k.replace('_', '-')}" for k in small if getattr(args, k) < 1]
    if small or not 0 <= args.learning_starts < args.sac_steps:
        p.error(f"{', '.join(small) or '--learning-starts'} must be positive (learning starts below --sac-steps)")
    if args.sac_steps % 800:
        p.error("--sac-steps must be a multiple of 800 (8 envs x 100-step episodes): the final state is a checkpoint")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        args.docs.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"cannot make the output folder {e.filename}: {e.strerror}")
    return args


def auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """The chance that a positive frame outscores a negative one (ties half)."""
    pos, neg = scores[positive][:, None], scores[~positive][None, :]
    return float((pos > neg).mean() + 0.5 * (pos == neg).mean())


def rewards(model, tokenizer, frames: np.ndarray, goal: str) -> np.ndarray:
    """The script's own CLIPReward (its preprocessing) at alpha 0, as the runs score frames."""
    from vlmrm_sac_humanoid import CLIPReward

    return CLIPReward(model, tokenizer, (goal,), (BASELINE,), 0.0, 256, torch.device("cpu"))(frames)


def clip_checks(args, model, tokenizer, clip_path: Path) -> None:
    """The prompt guard, the ranking of held-out frames, and the pose probe's verdict, printed."""
    for prompt in (GOAL, BASELINE, SWAPPED):
        try:
            nearest, cosine = humanoid_clip.check_prompt(model, tokenizer, prompt, task="kneel")
        except ValueError as e:  # --smoke's barely trained CLIP embeds every text alike: said, not fatal there
            if not args.smoke:
                sys.exit(f"error: {e}")
            print(f"smoke: {e}")
            continue
        print(f"prompt {prompt!r}: not a training caption; nearest caption {nearest!r}, cosine {cosine:.3f}")
    look = (64, "fast", "warp", SUPERSAMPLE)
    n = 150 if args.smoke else 600
    held_out = humanoid_clip.render_kneel_dataset(n, 12345, *look)  # a third random rollouts, as training draws them
    rollout = humanoid_clip.render_kneel_dataset(n, 54321, *look, set_fraction=0.0)  # the states a random policy visits
    for name, (frames, kneel, postures, _) in (("held-out frames", held_out), ("random-rollout frames", rollout)):
        kneel = kneel.astype(bool)
        for prompt in (GOAL, SWAPPED):
            r = rewards(model, tokenizer, frames, prompt)
            print(
                f"{name} ({kneel.sum()} of {len(kneel)} kneeling), goal {prompt!r}: mean reward kneeling "
                f"{r[kneel].mean():.4f}, not {r[~kneel].mean():.4f}, AUC(kneeling > not) {auc(r, kneel):.3f}"
            )
            means = {p: r[np.asarray(postures) == p].mean() for p in sorted(set(postures))}  # which postures it prefers
            print("  by posture: " + ", ".join(f"{p} {v:+.3f}" for p, v in sorted(means.items(), key=lambda pv: -pv[1])))
    # the pose probe, as a user types it: where does the kneeling pose rank among 13 for the goal, and for the control
    probe = [sys.executable, str(ROOT / "reward_shape.py"), "--env-id", "Humanoid-v5", "--clip-models"]
    probe += [str(humanoid_clip.CONFIG), "--clip-pretrained", "none", "--clip-checkpoint", str(clip_path), "--goal", GOAL]
    probe += ["--prompts", SWAPPED, "--baseline", BASELINE, "--alphas", "0", "--no-cuda", *RENDER]
    probe += ["--expect", f"{GOAL}=kneeling", f"{SWAPPED}=kneeling", "--exp-name", "pose_probe"]
    done = subprocess.run(probe, cwd=args.out, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    verdicts = [line for line in done.stdout.splitlines() if "ranks" in line or "ties" in line]
    if done.returncode != 0 or not verdicts:
        sys.exit(f"error: the pose probe failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    print("pose probe: python reward_shape.py " + " ".join(repr(c) if " " in c else c for c in probe[2:]))
    for line in verdicts:
        print(f"  {line.strip()}")


def sac_command(clip_path: Path, goal: str, seed: int, args) -> list[str]:
    command = [sys.executable, str(ROOT / "vlmrm_sac_humanoid.py"), "--goal", goal, "--baseline", BASELINE]
    command += ["--clip-model", str(humanoid_clip.CONFIG), "--clip-checkpoint", str(clip_path), *RENDER, *SAC_FLAGS]
    command += ["--total-timesteps", str(args.sac_steps), "--learning-starts", str(args.learning_starts)]
    command += ["--buffer-size", str(args.sac_steps), "--checkpoint-frequency", str(max(800, args.sac_steps // 10))]
    return command + ["--seed", str(seed), "--exp-name", f"humanoid_kneel_{'goal' if goal == GOAL else 'swapped'}"]


def run_dir(folder: Path) -> Path | None:
    found = sorted((folder / "runs").glob("*/checkpoint.pt")) if (folder / "runs").is_dir() else []
    return found[-1].parent if found else None


def finished(folder: Path) -> str | None:
    log = folder / "sac.log"
    done = [line for line in open(log)] if log.is_file() else []
    done = [line for line in done if line.startswith("done:")]
    return done[-1].strip() if done and run_dir(folder) and not (folder / "stopped").exists() else None


def train_runs(args, clip_path: Path) -> dict:
    """Every (prompt, seed) run, --parallel at a time, each as a user types it; a stopped one is resumed."""
    runs, waiting, active = {}, [], []
    for seed in args.seeds:
        for name, goal in (("goal", GOAL), ("swapped", SWAPPED)):
            folder = args.out / f"{name}-{seed}"
            folder.mkdir(exist_ok=True)
            runs[(name, seed)] = folder
            command = sac_command(clip_path, goal, seed, args)
            print(
                f"sac {name} seed {seed}: python vlmrm_sac_humanoid.py "
                + " ".join(repr(c) if " " in c else c for c in command[2:])
            )
            if finished(folder):
                continue
            if run_dir(folder):  # stopped earlier: continue it exactly (its flags come from the checkpoint)
                command = [*command[:2], "--resume", str(run_dir(folder) / "checkpoint.pt")]
                print(f"  continuing: python vlmrm_sac_humanoid.py --resume {run_dir(folder) / 'checkpoint.pt'}")
            waiting.append((name, seed, folder, command))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    try:
        while waiting or active:
            while waiting and len(active) < args.parallel:
                name, seed, folder, command = waiting.pop(0)
                (folder / "stopped").touch()  # until it says done
                log = open(folder / "sac.log", "a")
                active.append(
                    (name, seed, folder, subprocess.Popen(command, cwd=folder, stdout=log, stderr=subprocess.STDOUT, env=env))
                )
            time.sleep(1)
            for item in [a for a in active if a[3].poll() is not None]:
                active.remove(item)
                name, seed, folder, process = item
                if process.returncode == 130:  # stopped by Ctrl-C at its checkpoint: the same command continues it
                    print(f"sac {name} seed {seed}: stopped; type the same command to continue it")
                    sys.exit(130)
                if process.returncode != 0:
                    sys.exit(
                        f"error: the {name} seed {seed} SAC run failed (exit {process.returncode}); see {folder / 'sac.log'}"
                    )
                (folder / "stopped").unlink()
                print(f"sac {name} seed {seed}: {finished(folder)}")
    except KeyboardInterrupt:  # the runs got the signal too: each saves a checkpoint at its next episode end
        for *_, process in active:
            process.wait()
        print("stopped; type the same command to continue the runs")
        sys.exit(130)
    return runs


def rollouts(actor, episodes: int, seed: int, render_size: int = 0) -> tuple[np.ndarray, np.ndarray, list, Counter]:
    """Stochastic episodes (random actions when `actor` is None): per-episode fraction of steps kneeling, success
    (kneeling at each of the last SUCCESS_STEPS steps), frames at `render_size` (when > 0) of the first episode, and the
    steps' postures (`humanoid_clip.kneel_posture`: what the policy does when it does not kneel)."""
    from vlmrm_sac_humanoid import make_env

    env = make_env("Humanoid-v5", seed, 0, 100, render_size or 64, "high", True)()
    env.action_space.seed(seed)
    torch.manual_seed(seed)
    fractions, successes, frames, postures = [], [], [], Counter()
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        kneels, done = [], False
        while not done:
            action = humanoid_clip.rollout_action(actor, env, obs)
            obs, _, terminated, truncated, _ = env.step(action)
            done = terminated or truncated
            posture = humanoid_clip.kneel_posture(env.unwrapped.data)  # "kneeling" exactly when humanoid_clip.kneeling
            kneels.append(posture == "kneeling")
            postures[posture] += 1
            if render_size and episode == 0:
                frames.append(env.render())
        fractions.append(np.mean(kneels))
        successes.append(all(kneels[-humanoid_clip.SUCCESS_STEPS :]))
    env.close()
    return np.array(fractions), np.array(successes), frames, postures


def judge(args, runs: dict) -> None:
    """The ground truth on the final policies (and a random one), per seed, and a curve over checkpoints."""
    n, table, curves, strips, clip_returns = args.eval_episodes, [], {}, {}, {}
    fractions, successes, strips["random"], postures = rollouts(None, n, seed=777, render_size=160)
    table.append(("random", "-", fractions, successes, postures))
    for (name, seed), folder in runs.items():
        run = run_dir(folder)
        points = sorted((int(p.stem.split("-")[1]), p) for p in (run / "checkpoints").glob("step-*.pt"))
        curve = [(step, rollouts(humanoid_arms.load_actor(p), args.curve_episodes, seed=777)[0].mean()) for step, p in points]
        curves[(name, seed)] = curve
        clip_returns[(name, seed)] = clip_return_between(run, [0] + [step for step, _ in points])
        fractions, successes, frames, postures = rollouts(humanoid_arms.load_actor(run / "checkpoint.pt"), n, 777, 160)
        table.append((name, seed, fractions, successes, postures))
        strips.setdefault(name, frames)  # the first seed's
    print(
        f"ground truth: fraction of steps kneeling, and episodes kneeling at each of their last "
        f"{humanoid_clip.SUCCESS_STEPS} steps, {n} stochastic episodes x 100 steps per policy"
    )
    for name, seed, fractions, successes, postures in table:
        sem = fractions.std(ddof=1) / np.sqrt(len(fractions)) if len(fractions) > 1 else float("nan")
        print(
            f"  {name:8s} seed {seed}: kneeling {fractions.mean():.3f} +- {sem:.3f} (standard error over episodes), "
            f"success {successes.mean():.2f}; steps: "
            + ", ".join(f"{posture} {k / postures.total():.2f}" for posture, k in postures.most_common(4))
        )
    for name in ("goal", "swapped"):
        means = [f.mean() for nm, _, f, *_ in table if nm == name]
        spread = np.std(means, ddof=1) / np.sqrt(len(means)) if len(means) > 1 else float("nan")
        print(
            f"  {name:8s} over {len(means)} seed(s): kneeling {np.mean(means):.3f} +- {spread:.3f} (standard error over seeds)"
        )
    for (name, seed), curve in curves.items():
        print(
            f"  {name} seed {seed} checkpoints (step: kneeling, {args.curve_episodes} episodes): "
            + ", ".join(f"{s}: {f:.2f}" for s, f in curve)
        )
        print(f"    its training CLIP return per episode since the previous checkpoint: {clip_returns[(name, seed)]}")
    plot(curves, table[0][2].mean(), args.docs / "humanoid_kneel_curve.png")
    humanoid_arms.save_frames(strips, args.docs / "humanoid_kneel_frames.png")
    print(
        f"saved {args.docs / 'humanoid_kneel_curve.png'} and {args.docs / 'humanoid_kneel_frames.png'} "
        f"(rows: {', '.join(strips)}; steps 10, 30, 50, 70, 100 of the first episode)"
    )


def clip_return_between(run: Path, steps: list[int]) -> str:
    """The mean training-episode CLIP return (TensorBoard's charts/clip_return) between consecutive checkpoint steps:
    does the reward rise while the ground truth does not?"""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    logged = np.array([(e.step, e.value) for e in events.Scalars("charts/clip_return")])
    means = [logged[(logged[:, 0] > a) & (logged[:, 0] <= b), 1].mean() for a, b in zip(steps, steps[1:])]
    return ", ".join(f"{b}: {m:.1f}" for b, m in zip(steps[1:], means))


def plot(curves: dict, random_level: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for (name, seed), curve in curves.items():
        if curve:
            ax.plot(*zip(*curve), marker="o", color="C0" if name == "goal" else "C1", label=f"{name} seed {seed}")
    ax.axhline(random_level, color="grey", linestyle="--", label="random policy")
    ax.set(xlabel="env steps", ylabel="fraction of steps kneeling", title="ground truth (stochastic rollouts)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    args = parse()
    start = time.time()
    torch.set_num_threads(1)
    settings = dict(task="kneel", frames=args.clip_frames, steps=args.clip_steps, renderer="warp", supersample=SUPERSAMPLE)
    clip_path = args.out / f"humanoid-kneel-clip-{humanoid_clip.cache_key(**settings)}.pt"
    if not clip_path.exists():
        humanoid_clip.train(str(clip_path), args.clip_frames, args.clip_steps, task="kneel", supersample=SUPERSAMPLE)
    model, tokenizer = humanoid_arms.load_model(str(clip_path))
    print(f"clip: {clip_path} ({time.time() - start:.0f} s)")
    clip_checks(args, model, tokenizer, clip_path)
    print(f"clip checks done ({time.time() - start:.0f} s)")
    if args.clip_only:
        return
    runs = train_runs(args, clip_path)
    print(f"sac finished ({time.time() - start:.0f} s)")
    judge(args, runs)
    print(f"wall time: {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
