"""End to end: CLIP-rewarded SAC on the textured humanoid, steps per second and where the time goes.

    python benchmarks/bench_end_to_end.py                        # CPU: tiny random CLIP, 224px frames, 2 envs
    python benchmarks/bench_end_to_end.py --clip-models RN50 --total-timesteps 400   # a real-size model on CPU (slow)
    python benchmarks/bench_end_to_end.py --clip-models ViT-bigG-14 --num-envs 16 --total-timesteps 8000 \
        --learning-starts 4000 --batch-size 512 --reward-batch-size 256     # a GPU machine: the paper's model
    # the overlap of CLIP and the envs without a GPU: a stand-in that holds "the device" 8 ms per frame (sleeping)
    python benchmarks/bench_end_to_end.py --reward-stand-in-ms 8 --train-frequency 100 --gradient-steps 1

Runs `vlmrm_sac_humanoid.main` (random CLIP weights, `--clip-pretrained none`: speed does not depend on them)
and reads the script's own timers: env stepping, rendering (in the env processes, with the step), the time the
loop waited for rewards (the reward model itself scores in a background thread, overlapped with the envs) and
learning (gradient steps); "other" is the rest of the loop (action selection, replay buffer, bookkeeping,
logging). By default the schedule keeps the paper's shape: one gradient step per vector step after
learning_starts (`--gradient-steps` = `--train-frequency`). Each configuration runs `--repeats` times in fresh
processes, in rounds; the table shows the median run (by SPS) with its breakdown.

`--reward-stand-in-ms MS ...` replaces CLIP by a stand-in that sleeps MS milliseconds per frame in the scoring
thread: it holds "the device" without using a CPU core, as a GPU does. Each round also runs the stand-in at 0 ms
(the envs and rendering alone). The overlap efficiency is the end-to-end SPS over the slower of the two sides alone
(envs alone, and the stand-in alone: 1000 / MS frames/s): 1 is perfect overlap; a serial loop gets the harmonic sum
of the two, printed beside it. `VLMRM_BENCH_SCRIPTS=<folder>` measures another version of the scripts (e.g. the serial
loop of an older commit: `git show <commit>:vlmrm_sac_humanoid.py > <folder>/vlmrm_sac_humanoid.py`, and its utils).
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import REPO, Clock, load, machine, main_or_worker, median, run_main, run_worker, table  # noqa: E402

TINY = str(REPO / "tests" / "vlmrm-tiny-test.json")


class StandIn:
    """Scores nothing: holds "the device" for `ms` per frame (a sleep: no CPU core used), then returns zero rewards."""

    def __init__(self, ms: float):
        import torch

        self.ms, self.device = ms, torch.device("cpu")

    def __call__(self, frames):
        import numpy as np

        time.sleep(self.ms * len(frames) / 1000)
        return np.zeros(len(frames), np.float32)


def worker(c: dict) -> dict:
    import vlmrm_sac_humanoid as ours

    model = os.path.abspath(c["model"]) if os.path.exists(c["model"]) else c["model"]  # a config file: found after cd
    os.chdir(tempfile.mkdtemp(prefix="bench_e2e_"))
    if c.get("stand_in_ms") is not None:
        ours.make_reward_model = lambda args, device: StandIn(c["stand_in_ms"])
        for name in ("check_reward_memory", "say_reward_model_cost", "warn_if_slow_on_cpu"):  # its names in each version
            setattr(ours.utils, name, lambda *a: None)
    # --renderer warp: the frames drawn by MuJoCo Warp on the reward's device (passed only when given: older scripts)
    warp = {k: c[k] for k in ("renderer", "supersample") if c.get(k) is not None}
    args = ours.Args(
        **warp,
        clip_model=model,
        clip_pretrained="none",
        reward="clip",
        render_size=c["render_size"],
        render_quality=c["quality"],
        num_envs=c["num_envs"],
        total_timesteps=c["total_timesteps"],
        learning_starts=c["learning_starts"],
        train_frequency=c["train_frequency"],
        gradient_steps=c["gradient_steps"],
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
    p.add_argument("--reward-stand-in-ms", nargs="+", type=float, help="a stand-in for CLIP: milliseconds per frame")
    p.add_argument("--render-size", type=int, default=224)
    p.add_argument("--render-quality", default="fast")
    p.add_argument("--renderer", choices=["egl", "warp"], help="the script's --renderer (default: its own, egl)")
    p.add_argument("--supersample", type=int, help="the script's --supersample for --renderer warp (default: its own)")
    p.add_argument("--num-envs", type=int, default=8 if gpu else 2)
    p.add_argument("--total-timesteps", type=int, default=4000 if gpu else 600)
    p.add_argument("--learning-starts", type=int, default=2000 if gpu else 300)
    p.add_argument("--train-frequency", type=int, default=25, help="vector steps between training phases")
    p.add_argument("--gradient-steps", type=int, help="gradient steps per training phase (default: --train-frequency)")
    p.add_argument("--batch-size", type=int, default=512 if gpu else 256)
    p.add_argument("--reward-batch-size", type=int, default=256 if gpu else 32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads in every run (0: torch's default)")
    a = p.parse_args()
    a.gradient_steps = a.gradient_steps or a.train_frequency
    clock = Clock()
    print(f"machine: {machine()}")
    common = dict(render_size=a.render_size, quality=a.render_quality, num_envs=a.num_envs, batch_size=a.batch_size)
    common.update(total_timesteps=a.total_timesteps, learning_starts=a.learning_starts, train_frequency=a.train_frequency)
    common.update(gradient_steps=a.gradient_steps, reward_batch_size=a.reward_batch_size, model=TINY)
    common.update(renderer=a.renderer, supersample=a.supersample)
    if a.reward_stand_in_ms:  # 0 ms first: the envs and rendering alone
        configs = [dict(common, stand_in_ms=ms) for ms in [0.0, *a.reward_stand_in_ms]]
        names = [f"stand-in {ms:g} ms/frame" for ms in [0.0, *a.reward_stand_in_ms]]
    else:
        configs, names = [dict(common, model=m) for m in a.clip_models], [Path(m).stem for m in a.clip_models]
    print(
        f"Humanoid-v5 textured, {a.render_size}px {a.render_quality}, renderer {a.renderer or 'egl'}, "
        f"{a.num_envs} subprocess envs, "
        f"{a.total_timesteps} steps, learning starts {a.learning_starts}, {a.gradient_steps} gradient steps every "
        f"{a.train_frequency} vector steps, batch {a.batch_size}, reward batch {a.reward_batch_size}"
    )
    runs = {i: [] for i in range(len(configs))}
    for r in range(a.repeats):
        for i, c in enumerate(configs):
            runs[i].append(run_worker(__file__, dict(c, threads=a.threads)))
            print(f"  {names[i]} run {r + 1}: {runs[i][-1]['sps']} SPS (load {load()})", flush=True)
    rows, summary, sps = [], [], {}
    for i, c in enumerate(configs):
        sps[i] = median([x["sps"] for x in runs[i]])
        m = sorted(runs[i], key=lambda x: x["sps"])[len(runs[i]) // 2]
        # the loop's own time: the reward model overlaps it (older, serial versions: its time is all waiting)
        parts = {"env": m["env"], "render": m["render"], "reward wait": m.get("reward_wait", m["reward_model"])}
        parts["learning"] = m["learning"]
        parts["other"] = max(m["elapsed"] - sum(parts.values()), 0.0)
        share = {k: v / m["elapsed"] for k, v in parts.items()}
        busy = f"{m['reward_model'] / m['elapsed'] * 100:.0f}%"
        rows.append([names[i], f"{sps[i]:.0f}"] + [f"{share[k] * 100:.0f}% ({parts[k]:.1f} s)" for k in parts] + [busy])
        top = max(share, key=share.get)
        summary.append(f"{names[i]} {sps[i]:.0f} SPS, bottleneck {top} ({share[top] * 100:.0f}%)")
    print()
    header = ["reward model", "SPS (median)", "env", "render", "reward wait", "learning", "other", "reward model busy"]
    print(table(header, rows))
    print(f"\nshares of the median run's wall time; {a.repeats} runs each; load average at the end {load()}; took {clock}")
    if not a.reward_stand_in_ms:
        print("summary: end to end CLIP-rewarded SAC: " + "; ".join(summary))
        return
    rows, envs_alone = [], sps[0]
    for i, ms in enumerate(a.reward_stand_in_ms, start=1):
        alone = 1000 / ms  # frames/s of the stand-in alone
        slower, faster = min(envs_alone, alone), max(envs_alone, alone)
        serial, efficiency = 1 / (1 / envs_alone + 1 / alone), sps[i] / slower
        rows.append([f"{ms:g}", f"{envs_alone:.0f}", f"{alone:.0f}", f"{faster / slower:.1f}x", f"{sps[i]:.0f}"])
        rows[-1] += [f"**{efficiency:.2f}**", f"{serial / slower:.2f}"]
        summary.append(f"{ms:g} ms/frame: overlap efficiency {efficiency:.2f}")
    print()
    header = ["stand-in ms/frame", "envs alone SPS", "stand-in alone SPS", "slower / faster side", "end to end SPS"]
    print(table(header + ["overlap efficiency", "a serial loop's (harmonic sum)"], rows))
    print("summary: CLIP overlapped with the envs: " + "; ".join(summary[len(configs) :]))


if __name__ == "__main__":
    main_or_worker(main, worker)
