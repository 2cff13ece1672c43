"""Does our SAC learn like the paper's (Stable-Baselines3's)? Same settings, same stock task, several seeds, side by side.

Trains `vlmrm_sac_humanoid.py --reward gt` (the stock task: the env's own reward, termination and time limit) and
Stable-Baselines3's SAC with the same hyperparameters on a MuJoCo task, and prints per seed the mean return of the last
10 training episodes ("final") and of all training episodes ("mean", the area under the learning curve), plus a random
policy's return for scale. Runs are fresh processes with one torch thread; `--jobs 2` runs two at once.

    pip install -r requirements-bench.txt
    python benchmarks/bench_sac_learning_vs_sb3.py  # Hopper-v5, 3 seeds, 30k steps (about 40 min on 2 cores)
    python benchmarks/bench_sac_learning_vs_sb3.py --steps 5000 --seeds 1  # a quick look
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
# the paper's SAC semantics on a stock task, CleanRL's MuJoCo schedule: one env, one gradient step per env step
HP = dict(learning_starts=5000, batch_size=256, gamma=0.99, lr=3e-4, tau=0.005)


def ours(env_id: str, steps: int, seed: int, workdir: str) -> list[tuple[int, float]]:
    cmd = [
        sys.executable,
        str(REPO / "vlmrm_sac_humanoid.py"),
        "--env-id",
        env_id,
        "--reward",
        "gt",
        "--seed",
        str(seed),
        "--num-envs",
        "1",
        "--total-timesteps",
        str(steps),
        "--learning-starts",
        str(HP["learning_starts"]),
        "--train-frequency",
        "1",
        "--gradient-steps",
        "1",
        "--batch-size",
        str(HP["batch_size"]),
        "--gamma",
        str(HP["gamma"]),
        "--policy-lr",
        str(HP["lr"]),
        "--q-lr",
        str(HP["lr"]),
        "--tau",
        str(HP["tau"]),
        "--buffer-size",
        str(steps),
        "--no-cuda",
        "--exp-name",
        f"bench{seed}",
    ]
    subprocess.run(cmd, cwd=workdir, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = [p for p in Path(workdir, "runs").iterdir() if f"bench{seed}" in p.name]
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("charts/episodic_return")]


def sb3(env_id: str, steps: int, seed: int) -> list[tuple[int, float]]:
    code = f"""
import json, gymnasium as gym, torch
from stable_baselines3 import SAC
from stable_baselines3.common.monitor import Monitor
torch.set_num_threads(1)
env = Monitor(gym.make({env_id!r}))
model = SAC("MlpPolicy", env, learning_rate={HP["lr"]}, buffer_size={steps}, learning_starts={HP["learning_starts"]},
            batch_size={HP["batch_size"]}, tau={HP["tau"]}, gamma={HP["gamma"]}, train_freq=1, gradient_steps=1,
            policy_kwargs=dict(net_arch=[256, 256]), seed={seed}, device="cpu")
model.learn({steps})
print(json.dumps([[int(t), float(r)] for t, r in zip(env.get_episode_lengths(), env.get_episode_rewards())]))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    ).stdout
    lengths_returns = json.loads(out.strip().splitlines()[-1])
    steps_done = np.cumsum([length for length, _ in lengths_returns])
    return [(int(s), r) for s, (_, r) in zip(steps_done, lengths_returns)]


def random_return(env_id: str, episodes: int = 20) -> float:
    import gymnasium as gym

    env, total = gym.make(env_id), []
    for k in range(episodes):
        env.reset(seed=k)
        env.action_space.seed(k)
        ret, done = 0.0, False
        while not done:
            _, r, terminated, truncated, _ = env.step(env.action_space.sample())
            ret, done = ret + r, terminated or truncated
        total.append(ret)
    return float(np.mean(total))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env-id", default="Hopper-v5")
    p.add_argument("--steps", type=int, default=30_000)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--jobs", type=int, default=2, help="runs at once (each uses one core)")
    a = p.parse_args()
    jobs = [(impl, seed) for seed in a.seeds for impl in ("ours", "sb3")]  # interleaved: load hits both sides alike
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(a.jobs) as pool:

        def run(job):
            impl, seed = job
            if impl == "ours":
                return ours(a.env_id, a.steps, seed, tmp)
            return sb3(a.env_id, a.steps, seed)

        curves = dict(zip(jobs, pool.map(run, jobs)))
    print(
        f"SAC on {a.env_id}, {a.steps} steps, {HP}, one env, one gradient step per step; random policy: "
        f"{random_return(a.env_id):.0f}"
    )
    print("| seed | ours final | SB3 final | ours mean | SB3 mean | episodes ours / SB3 |\n|---|---|---|---|---|---|")
    finals = {"ours": [], "sb3": []}
    for seed in a.seeds:
        row = {impl: np.array([r for _, r in curves[(impl, seed)]]) for impl in ("ours", "sb3")}
        for impl in finals:
            finals[impl].append(row[impl][-10:].mean())
        print(
            f"| {seed} | {row['ours'][-10:].mean():.0f} | {row['sb3'][-10:].mean():.0f} | {row['ours'].mean():.0f} | "
            f"{row['sb3'].mean():.0f} | {len(row['ours'])} / {len(row['sb3'])} |"
        )
    print(
        f"summary: final return over seeds, ours {np.mean(finals['ours']):.0f} +- {np.std(finals['ours']):.0f}, "
        f"SB3 {np.mean(finals['sb3']):.0f} +- {np.std(finals['sb3']):.0f}"
    )


if __name__ == "__main__":
    main()
