"""The kneeling experiment's SAC schedule (experiments/humanoid_kneel.py) on the CPU: steps/s per way of drawing frames.

    python benchmarks/bench_kneel_schedule.py                                   # 16,000 steps a run, 2 rounds
    python benchmarks/bench_kneel_schedule.py --total-timesteps 4800 --learning-starts 2400 --repeats 1   # short

Runs `vlmrm_sac_humanoid.main` with the experiment's schedule and model (experiments/humanoid-clip.json, random
weights: speed does not depend on them): 64 px frames, 8 envs, 25 gradient steps of batch 512 every 100 vector steps
(the paper's 1 per 32 env steps), one torch thread (the script's CPU default). Contenders, interleaved A B C A B C:
`--renderer warp --render-quality fast` at `--supersample 1` and 2, and EGL `--render-quality fast`. Reads the
script's own timers (env, render, warp draw, reward model, reward wait, learning); prints steps/s ratios to the first.
"""

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import REPO, Clock, load, machine, main_or_worker, median, run_main, run_worker, spread, table  # noqa: E402

MODEL = str(REPO / "experiments" / "humanoid-clip.json")
CONTENDERS = {  # name: the script's drawing flags
    "warp, supersample 1": dict(renderer="warp", supersample=1),
    "warp, supersample 2": dict(renderer="warp", supersample=2),
    "EGL fast": dict(renderer="egl"),
}


def worker(c: dict) -> dict:
    import vlmrm_sac_humanoid as ours

    os.chdir(tempfile.mkdtemp(prefix="bench_kneel_"))
    args = ours.Args(
        **CONTENDERS[c["name"]],
        clip_model=MODEL,
        clip_pretrained="none",
        render_size=64,
        render_quality="fast",
        num_envs=8,
        train_frequency=100,
        gradient_steps=25,
        batch_size=512,
        total_timesteps=c["total_timesteps"],
        learning_starts=c["learning_starts"],
        buffer_size=c["total_timesteps"],
        cuda=False,
    )
    return run_main(ours, args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--total-timesteps", type=int, default=16_000)
    p.add_argument("--learning-starts", type=int, default=8_000)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    clock = Clock()
    print(f"machine: {machine()}")
    print(
        f"Humanoid-v5 textured, 64 px fast, 8 subprocess envs, {a.total_timesteps} steps, learning from "
        f"{a.learning_starts}, 25 gradient steps of batch 512 every 100 vector steps, model {MODEL} (random weights)"
    )
    runs = {name: [] for name in CONTENDERS}
    for r in range(a.repeats):
        for name in CONTENDERS:
            runs[name].append(
                run_worker(__file__, dict(name=name, total_timesteps=a.total_timesteps, learning_starts=a.learning_starts))
            )
            m = runs[name][-1]
            print(f"  {name} run {r + 1}: {m['sps']} SPS (load {load()})", flush=True)
    first = median([x["sps"] for x in runs[next(iter(CONTENDERS))]])
    rows = []
    for name, results in runs.items():
        sps = median([x["sps"] for x in results])
        m = sorted(results, key=lambda x: x["sps"])[len(results) // 2]
        parts = ("env", "render", "draw", "reward_model", "reward_wait", "learning")  # the script's timers
        per_step = {k: m[k] / a.total_timesteps * 1000 for k in parts if k in m}
        rows.append(
            [name, f"{sps:.0f}", spread([x["sps"] for x in results]), f"{sps / first:.2f}"]
            + [f"{v:.2f}" for v in per_step.values()]
        )
    print()
    print(table(["drawing", "SPS (median)", "spread", "ratio"] + [f"{k} ms/step" for k in per_step], rows))
    print(f"\n{a.repeats} runs each, interleaved; load average at the end {load()}; took {clock}")


if __name__ == "__main__":
    main_or_worker(main, worker)
