"""RL loop speed: our SAC and DQN against Stable-Baselines3's, same hyperparameters, same envs, same steps.

    pip install -r requirements-bench.txt
    python benchmarks/bench_rl_vs_sb3.py                      # Hopper-v5, Humanoid-v5 (SAC), CartPole-v1 (DQN)
    # longer, steadier:
    python benchmarks/bench_rl_vs_sb3.py --repeats 5 --sac-steps 8000 --sac-learning-starts 2000 \
        --dqn-steps 50000 --dqn-learning-starts 10000

Ground-truth reward, no rendering: only the RL loop (env stepping, replay buffer, gradient steps) is timed.
Both sides get the very same environment (our `make_env` thunk: fixed-length episodes), the same number of
environment steps, the same learning_starts and train-frequency / gradient-steps schedule, the same networks
(SAC 256-256 actor and twin critics, DQN 120-84), optimiser, learning rate, batch, gamma, tau and buffer.
Envs step in-process on both sides (with --reward gt there is nothing to render, so our SAC uses
SyncVectorEnv; SB3 gets DummyVecEnv), SAC with 4 envs, DQN with one. Each run is a fresh process; the runs alternate
ours, SB3, ours, SB3... and the table reports median steps per second (SPS) and the ratio of medians.
SPS is measured over the training loop only (after the envs are created), on both sides.

Where the time goes, against the hardware: both sides also report the time per gradient step (ours: the script's
own `learning` timer; SB3: a timer around its `train()`). One extra run per side records, with torch.profiler, the
shapes of the matrix products its gradient steps do (aten::mm/addmm with the batch in a dimension: the FLOPs any
implementation of these networks must do), then times each shape on its own, back to back: "matrix products alone"
is that floor per gradient step, on this machine. "ours ceiling" is the SPS ours would reach if its gradient steps
took only that long, and its ratio to SB3 is the most any change to our loop could give here.

Known differences that SB3 does not let us switch off: SB3's DQN uses the Huber loss (ours: MSE) and always
computes the gradient norm for clipping (we pass max_grad_norm=inf, so it never clips); SB3's SAC hard-clamps
log_std to [-20, 2] (ours: tanh soft clamp to [-5, 2]) and both log a few scalars.
"""

import argparse
import contextlib
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Clock, load, machine, main_or_worker, median, run_main, run_worker, spread, table  # noqa: E402


def sac_config(env_id: str, a) -> dict:
    return dict(
        algo="sac",
        env_id=env_id,
        num_envs=a.sac_envs,
        total_timesteps=a.sac_steps,
        learning_starts=a.sac_learning_starts,
        train_frequency=100,
        gradient_steps=100,
        batch_size=512,
        buffer_size=a.buffer_size,
        gamma=0.95,
        tau=0.005,
        lr=6e-4,
        ent_coef=0.2,
        episode_length=100,
        seed=1,
    )


def dqn_config(a) -> dict:
    return dict(
        algo="dqn",
        env_id="CartPole-v1",
        num_envs=1,
        total_timesteps=a.dqn_steps,
        learning_starts=a.dqn_learning_starts,
        train_frequency=10,
        gradient_steps=1,
        batch_size=128,
        buffer_size=10_000,
        gamma=0.99,
        tau=1.0,
        lr=2.5e-4,
        target_network_frequency=500,
        exploration_fraction=0.5,
        start_e=1.0,
        end_e=0.05,
        episode_length=200,
        seed=1,
    )


def our_gradient_steps(c: dict) -> int:
    """How many gradient steps our loop takes: after learning_starts, every train_frequency-th vector step."""
    return sum(
        c["gradient_steps"]
        for it in range(c["total_timesteps"] // c["num_envs"])
        if it * c["num_envs"] >= c["learning_starts"] and it % c["train_frequency"] == 0
    )


# ----------------------------------------------------------------------------------------------
# workers (one fresh process per measurement)
# ----------------------------------------------------------------------------------------------
def run_ours(c: dict) -> dict:
    os.chdir(tempfile.mkdtemp(prefix="bench_ours_"))  # runs/ goes here
    if c["algo"] == "sac":
        import vlmrm_sac_humanoid as ours

        args = ours.Args(
            env_id=c["env_id"],
            reward="gt",
            num_envs=c["num_envs"],
            total_timesteps=c["total_timesteps"],
            learning_starts=c["learning_starts"],
            train_frequency=c["train_frequency"],
            gradient_steps=c["gradient_steps"],
            batch_size=c["batch_size"],
            buffer_size=c["buffer_size"],
            gamma=c["gamma"],
            tau=c["tau"],
            policy_lr=c["lr"],
            q_lr=c["lr"],
            ent_coef=c["ent_coef"],
            episodes="fixed",
            episode_length=c["episode_length"],
            seed=c["seed"],
            cuda=c.get("cuda", True),
        )
    else:
        import vlmrm_dqn_classic as ours

        args = ours.Args(
            env_id=c["env_id"],
            reward="gt",
            num_envs=c["num_envs"],
            total_timesteps=c["total_timesteps"],
            learning_starts=c["learning_starts"],
            train_frequency=c["train_frequency"],
            batch_size=c["batch_size"],
            buffer_size=c["buffer_size"],
            gamma=c["gamma"],
            tau=c["tau"],
            learning_rate=c["lr"],
            target_network_frequency=c["target_network_frequency"],
            exploration_fraction=c["exploration_fraction"],
            start_e=c["start_e"],
            end_e=c["end_e"],
            episodes="fixed",
            episode_length=c["episode_length"],
            seed=c["seed"],
            cuda=c.get("cuda", True),
        )
    with profiled(c) as gemm:
        done = run_main(ours, args)
    grad_steps = our_gradient_steps(c)
    return dict(
        sps=done.pop("sps"),
        gradient_steps=grad_steps,
        ms_per_grad_step=done["learning"] / grad_steps * 1e3,
        gemm_ms_per_grad_step=gemm["s"] / grad_steps * 1e3,
        gemm_gflops=gemm["flop"] / gemm["s"] / 1e9,
        **{f"time_{k}": v for k, v in done.items()},
    )


def run_sb3(c: dict) -> dict:
    import torch
    from stable_baselines3 import DQN, SAC
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv

    device = "cuda" if torch.cuda.is_available() and c.get("cuda", True) else "cpu"
    torch.manual_seed(c["seed"])
    if c["algo"] == "sac":
        import vlmrm_sac_humanoid as ours

        thunk = ours.make_env(c["env_id"], c["seed"], 0, c["episode_length"], 224, "fast", True)  # never rendered
        # ours steps the envs in-process with --reward gt (nothing to render), so SB3 gets its in-process DummyVecEnv
        envs = make_vec_env(lambda: thunk(), n_envs=c["num_envs"], seed=c["seed"], vec_env_cls=DummyVecEnv)
        model = SAC(
            "MlpPolicy",
            envs,
            learning_rate=c["lr"],
            buffer_size=c["buffer_size"],
            learning_starts=c["learning_starts"],
            batch_size=c["batch_size"],
            tau=c["tau"],
            gamma=c["gamma"],
            train_freq=(c["train_frequency"], "step"),
            gradient_steps=c["gradient_steps"],
            ent_coef=f"auto_{c['ent_coef']}",
            target_update_interval=1,
            target_entropy="auto",
            policy_kwargs=dict(net_arch=[256, 256]),
            device=device,
            seed=c["seed"],
            verbose=0,
        )
    else:
        import vlmrm_dqn_classic as ours

        thunk = ours.make_env(c["env_id"], c["seed"], 0, c["episode_length"], False)
        envs = make_vec_env(lambda: thunk(), n_envs=c["num_envs"], seed=c["seed"], vec_env_cls=DummyVecEnv)
        model = DQN(
            "MlpPolicy",
            envs,
            learning_rate=c["lr"],
            buffer_size=c["buffer_size"],
            learning_starts=c["learning_starts"],
            batch_size=c["batch_size"],
            tau=c["tau"],
            gamma=c["gamma"],
            train_freq=(c["train_frequency"], "step"),
            gradient_steps=c["gradient_steps"],
            target_update_interval=c["target_network_frequency"],
            exploration_fraction=c["exploration_fraction"],
            exploration_initial_eps=c["start_e"],
            exploration_final_eps=c["end_e"],
            max_grad_norm=float("inf"),
            policy_kwargs=dict(net_arch=[120, 84]),
            device=device,
            seed=c["seed"],
            verbose=0,
        )
    train, train_time = model.train, [0.0]

    def timed_train(*args, **kwargs):  # SB3's gradient steps all happen in train(): time them like our `learning` timer
        t0 = time.perf_counter()
        train(*args, **kwargs)
        train_time[0] += time.perf_counter() - t0

    model.train = timed_train
    with profiled(c) as gemm:
        start = time.perf_counter()
        model.learn(total_timesteps=c["total_timesteps"])
        elapsed = time.perf_counter() - start
    envs.close()
    return dict(
        sps=model.num_timesteps / elapsed,
        gradient_steps=model._n_updates,
        ms_per_grad_step=train_time[0] / model._n_updates * 1e3,
        gemm_ms_per_grad_step=gemm["s"] / model._n_updates * 1e3,
        gemm_gflops=gemm["flop"] / gemm["s"] / 1e9,
    )


@contextlib.contextmanager
def profiled(c: dict):
    """With c["profile"]: record the run's matrix products on batches (shape and count), then yield in {"s": ...}
    the seconds they take when timed on their own, on the run's device. The profiler's overhead does not enter it."""
    result = {"s": float("nan"), "flop": float("nan")}
    if not c.get("profile"):
        yield result
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        yield result
    calls = [
        (e.key, e.input_shapes, e.count)
        for e in prof.key_averages(group_by_input_shape=True)
        if e.key in ("aten::mm", "aten::addmm") and any(c["batch_size"] in s for s in e.input_shapes)
    ]
    device = "cuda" if torch.cuda.is_available() and c.get("cuda", True) else "cpu"  # where the run computed
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    total, flop = 0.0, 0.0
    for op, shapes, count in calls:
        if op == "aten::addmm":  # (bias, a, b) -> bias + a @ b
            bias, a, b = (torch.randn(s, device=device) for s in shapes[:3])
            fn = lambda: torch.addmm(bias, a, b)  # noqa: E731
        else:
            a, b = (torch.randn(s, device=device) for s in shapes[:2])
            fn = lambda: torch.mm(a, b)  # noqa: E731
        for _ in range(5):
            fn()
        reps = 50
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        total += (time.perf_counter() - t0) / reps * count
        flop += 2 * a.shape[0] * a.shape[1] * b.shape[1] * count
    result["s"], result["flop"] = total, flop


def large_gemm_gflops(threads: int) -> float:
    """What this machine does at its best: a 2048 x 2048 x 2048 float32 product, best of 5, where the runs computed."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    a, b = torch.randn(2048, 2048, device=device), torch.randn(2048, 2048, device=device)
    best = float("inf")
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * 2048**3 / best / 1e9


# ----------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="runs of each side (alternating ours, SB3)")
    p.add_argument("--sac-envs", type=int, default=4)
    p.add_argument("--sac-steps", type=int, default=2400)
    p.add_argument("--sac-learning-starts", type=int, default=800)
    p.add_argument("--dqn-steps", type=int, default=12000)
    p.add_argument("--dqn-learning-starts", type=int, default=2000)
    p.add_argument("--buffer-size", type=int, default=100_000, help="SAC replay buffer (the paper: 1M)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads on both sides (0: torch's default, one per core). Default 1: these MLPs are "
        "small, and on a loaded machine OpenMP threads waiting for each other made a SAC gradient step "
        "several times slower",
    )
    p.add_argument("--tasks", nargs="+", default=["Hopper-v5", "Humanoid-v5", "CartPole-v1"])
    a = p.parse_args()
    clock = Clock()
    print(f"machine: {machine()}")
    configs = [dqn_config(a) if t == "CartPole-v1" else sac_config(t, a) for t in a.tasks]
    for c in configs:
        print(
            f"{c['algo'].upper()} {c['env_id']}: {c['num_envs']} envs, {c['total_timesteps']} steps, "
            f"learning starts {c['learning_starts']}, {c['gradient_steps']} gradient step(s) every {c['train_frequency']} "
            f"vector steps, batch {c['batch_size']}, buffer {c['buffer_size']}"
        )
    rows, ratios, ceilings, gflops = [], [], [], []
    for c in configs:
        res = {"ours": [], "sb3": []}
        for r in range(a.repeats):
            for side in ("ours", "sb3"):
                res[side].append(run_worker(__file__, dict(c, side=side, threads=a.threads)))
                print(
                    f"  {c['env_id']} run {r + 1}/{a.repeats} {side}: {res[side][-1]['sps']:.0f} SPS (load {load()})",
                    flush=True,
                )
        # the profiled runs only need about 200 gradient steps: per-step shapes and counts do not change after learning starts
        short = dict(
            c, total_timesteps=c["learning_starts"] + c["num_envs"] * c["train_frequency"] * max(1, 200 // c["gradient_steps"])
        )
        prof = {
            side: run_worker(__file__, dict(short, side=side, threads=a.threads, profile=True)) for side in ("ours", "sb3")
        }
        print(f"  {c['env_id']} profiled runs done (load {load()})", flush=True)
        ours_sps, sb3_sps = [x["sps"] for x in res["ours"]], [x["sps"] for x in res["sb3"]]
        ours_ms, sb3_ms = (
            median([x["ms_per_grad_step"] for x in res["ours"]]),
            median([x["ms_per_grad_step"] for x in res["sb3"]]),
        )
        ours_gemm, sb3_gemm = prof["ours"]["gemm_ms_per_grad_step"], prof["sb3"]["gemm_ms_per_grad_step"]
        grad_steps = res["ours"][0]["gradient_steps"]
        ceiling_sps = c["total_timesteps"] / (
            c["total_timesteps"] / median(ours_sps) - grad_steps * (ours_ms - ours_gemm) / 1e3
        )
        ratio = median(ours_sps) / median(sb3_sps)
        paired = median([o / s for o, s in zip(ours_sps, sb3_sps)])
        ratios.append((f"{c['algo'].upper()} {c['env_id']}", ratio))
        rows.append(
            [
                f"{c['algo'].upper()} {c['env_id']}",
                c["total_timesteps"],
                f"{res['ours'][0]['gradient_steps']} / {res['sb3'][0]['gradient_steps']}",
                f"{median(ours_sps):.0f} ({spread(ours_sps)})",
                f"{median(sb3_sps):.0f} ({spread(sb3_sps)})",
                f"**{ratio:.2f}x**",
                f"{paired:.2f}x",
                f"{ours_ms:.2f} / {sb3_ms:.2f}",
                f"{ours_gemm:.2f} / {sb3_gemm:.2f}",
                f"{ceiling_sps:.0f} ({ceiling_sps / median(sb3_sps):.2f}x)",
            ]
        )
        ceilings.append(ceiling_sps / median(sb3_sps))
        gflops.append(f"{c['algo'].upper()} {c['env_id']} {prof['ours']['gemm_gflops']:.0f}")
    print()
    print(
        table(
            [
                "task",
                "env steps",
                "gradient steps ours / SB3",
                "ours SPS (min/max)",
                "SB3 SPS (min/max)",
                "ours / SB3",
                "median of paired ratios",
                "ms / gradient step ours / SB3",
                "matrix products alone ours / SB3",
                "ours ceiling SPS (vs SB3)",
            ],
            rows,
        )
    )
    print(
        f"\nmatrix products alone (ours), GFLOP/s: {', '.join(gflops)}; one large product (2048^3) on the same "
        f"threads: {large_gemm_gflops(a.threads):.0f} GFLOP/s"
    )
    print(
        f"{a.repeats} runs per side, interleaved, torch threads {a.threads or 'default'}; "
        f"load average at the end {load()}; took {clock}"
    )
    print(
        "summary: ours vs Stable-Baselines3 (median SPS ratio): "
        + ", ".join(f"{n} {r:.2f}x" for n, r in ratios)
        + f" (goal >= 1.5x: {'met' if min(r for _, r in ratios) >= 1.5 else 'NOT met'} on all; "
        + "ceiling with matrix products only: "
        + ", ".join(f"{x:.2f}x" for x in ceilings)
        + ")"
    )


if __name__ == "__main__":
    main_or_worker(main, lambda payload: run_ours(payload) if payload["side"] == "ours" else run_sb3(payload))
