"""End to end: CLIP-rewarded SAC on the textured humanoid, steps per second and where the time goes.

    python benchmarks/bench_end_to_end.py                        # CPU: tiny random CLIP, 224px frames, 2 envs
    python benchmarks/bench_end_to_end.py --clip-models RN50 --total-timesteps 400   # a real-size model on CPU (slow)
    python benchmarks/bench_end_to_end.py --clip-models ViT-bigG-14 --num-envs 16 --total-timesteps 8000 \
        --learning-starts 4000 --batch-size 512 --reward-batch-size 256     # a GPU machine: the paper's model

Runs `vlmrm_sac_humanoid.main` (random CLIP weights, `--clip-pretrained none`: speed does not depend on them)
and reads the script's own timers: env stepping, rendering (`envs.call("render")`), the reward model (every
CLIP call) and learning (gradient steps); "other" is the rest of the loop (action selection, replay buffer,
bookkeeping, logging). The schedule keeps the paper's shape: one gradient step per vector step after
learning_starts (`--train-frequency` = `--gradient-steps`). Each configuration runs `--repeats` times in fresh
processes, in rounds; the table shows the median run (by SPS) with its breakdown.
"""

import argparse
import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import REPO, Clock, emit, load, machine, median, run_main, run_worker, table, worker_payload  # noqa: E402

TINY = str(REPO / "tests" / "vlmrm-tiny-test.json")


def worker(c: dict) -> dict:
    import vlmrm_sac_humanoid as ours

    os.chdir(tempfile.mkdtemp(prefix="bench_e2e_"))
    args = ours.Args(
        clip_model=c["model"],
        clip_pretrained="none",
        reward="clip",
        render_size=c["render_size"],
        render_quality=c["quality"],
        num_envs=c["num_envs"],
        total_timesteps=c["total_timesteps"],
        learning_starts=c["learning_starts"],
        train_frequency=c["train_frequency"],
        gradient_steps=c["train_frequency"],
        batch_size=c["batch_size"],
        reward_batch_size=c["reward_batch_size"],
        buffer_size=100_000,
        alpha=0.5,
    )
    done = run_main(ours, args)
    return dict(elapsed=c["total_timesteps"] / max(done["sps"], 1e-9), **done)


def main() -> None:
    import torch

    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clip-models", nargs="+", default=["ViT-L-14"] if gpu else [TINY])
    p.add_argument("--render-size", type=int, default=224)
    p.add_argument("--render-quality", default="fast")
    p.add_argument("--num-envs", type=int, default=8 if gpu else 2)
    p.add_argument("--total-timesteps", type=int, default=4000 if gpu else 600)
    p.add_argument("--learning-starts", type=int, default=2000 if gpu else 300)
    p.add_argument("--train-frequency", type=int, default=25, help="vector steps between training phases (= gradient steps)")
    p.add_argument("--batch-size", type=int, default=512 if gpu else 256)
    p.add_argument("--reward-batch-size", type=int, default=256 if gpu else 32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads in every run (0: torch's default)")
    a = p.parse_args()
    clock = Clock()
    print(f"machine: {machine()}")
    configs = [
        dict(
            model=m,
            render_size=a.render_size,
            quality=a.render_quality,
            num_envs=a.num_envs,
            total_timesteps=a.total_timesteps,
            learning_starts=a.learning_starts,
            train_frequency=a.train_frequency,
            batch_size=a.batch_size,
            reward_batch_size=a.reward_batch_size,
        )
        for m in a.clip_models
    ]
    print(
        f"Humanoid-v5 textured, {a.render_size}px {a.render_quality}, {a.num_envs} subprocess envs, "
        f"{a.total_timesteps} steps, "
        f"learning starts {a.learning_starts}, {a.train_frequency} gradient steps every {a.train_frequency} vector steps, "
        f"batch {a.batch_size}, reward batch {a.reward_batch_size}"
    )
    runs = {i: [] for i in range(len(configs))}
    for r in range(a.repeats):
        for i, c in enumerate(configs):
            runs[i].append(run_worker(__file__, dict(c, threads=a.threads)))
            print(f"  {os.path.basename(c['model'])} run {r + 1}: {runs[i][-1]['sps']} SPS (load {load()})", flush=True)
    rows, summary = [], []
    for i, c in enumerate(configs):
        sps = [x["sps"] for x in runs[i]]
        m = sorted(runs[i], key=lambda x: x["sps"])[len(runs[i]) // 2]
        parts = {k: m[k] for k in ("env", "render", "reward_model", "learning")}
        parts["other"] = max(m["elapsed"] - sum(parts.values()), 0.0)
        share = {k: v / m["elapsed"] for k, v in parts.items()}
        name = os.path.basename(c["model"]).replace(".json", "")
        rows.append([name, f"{median(sps):.0f}"] + [f"{share[k] * 100:.0f}% ({parts[k]:.1f} s)" for k in parts])
        top = max(share, key=share.get)
        summary.append(f"{name} {median(sps):.0f} SPS, bottleneck {top} ({share[top] * 100:.0f}%)")
    print()
    print(table(["CLIP model", "SPS (median)", "env", "render", "reward model", "learning", "other"], rows))
    print(
        f"\nshares of the median run's wall time; {a.repeats} runs per model; load average at the end {load()}; took {clock}"
    )
    print("summary: end to end CLIP-rewarded SAC: " + "; ".join(summary))


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    payload = worker_payload()
    if payload is None:
        main()
    else:
        emit(worker(payload))
