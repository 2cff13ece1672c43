"""Rendering speed of the textured Humanoid-v5 (our make_env): frame size, quality flags, subprocess envs.

    python benchmarks/bench_render.py
    python benchmarks/bench_render.py --num-envs 1 2 4 8 --frames 200 --repeats 3   # a bigger machine

Frames per second of `render()` alone (physics steps between frames are not timed), with the scene the
CLIP reward sees (sky, stone floor, metallic body, the paper's camera). `1` = one env in this process;
`N > 1` = N subprocess envs in `gym.vector.AsyncVectorEnv`, as training runs them, each rendering its own
frame in parallel (`envs.call("render")`): frames/s counts all N frames. MUJOCO_GL=egl: the GPU where there
is one, else Mesa's software EGL on the CPU. Each configuration runs in a fresh process; the configurations
are visited in rounds (each round visits all of them) and the median over rounds is reported.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Clock, load, machine, main_or_worker, median, run_worker, table  # noqa: E402


def worker(c: dict) -> dict:
    import gymnasium as gym
    import numpy as np

    import vlmrm_sac_humanoid as ours

    thunks = [ours.make_env("Humanoid-v5", 1, i, 100, c["size"], c["quality"], True) for i in range(c["num_envs"])]
    envs = gym.vector.AsyncVectorEnv(thunks) if c["num_envs"] > 1 else gym.vector.SyncVectorEnv(thunks)
    envs.reset(seed=1)
    envs.call("render")  # creates the renderers and sets the quality flags
    rng = np.random.default_rng(0)
    render_s = 0.0
    for _ in range(c["frames"]):
        envs.step(rng.uniform(-0.4, 0.4, envs.action_space.shape).astype(np.float32))
        start = time.perf_counter()
        frames = envs.call("render")
        render_s += time.perf_counter() - start
    assert frames[0].shape == (c["size"], c["size"], 3)
    envs.close()
    return dict(fps=c["frames"] * c["num_envs"] / render_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", type=int, default=[224, 480])
    p.add_argument("--qualities", nargs="+", default=["fast", "high"])
    p.add_argument("--num-envs", nargs="+", type=int, default=[1, 2])
    p.add_argument("--frames", type=int, default=30, help="rendered frames per env per measurement")
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    clock = Clock()
    print(f"machine: {machine()}, MUJOCO_GL={os.environ['MUJOCO_GL']}")
    configs = [dict(size=s, quality=q, num_envs=n, frames=a.frames) for s in a.sizes for q in a.qualities for n in a.num_envs]
    fps = {i: [] for i in range(len(configs))}
    for r in range(a.repeats):
        for i, c in enumerate(configs):
            fps[i].append(run_worker(__file__, c)["fps"])
        print(f"  round {r + 1}/{a.repeats} done (load {load()})", flush=True)
    base = median(fps[0])
    rows = []
    for i, c in enumerate(configs):
        f = median(fps[i])
        one_env = median(fps[configs.index(dict(c, num_envs=a.num_envs[0]))])
        rows.append(
            [c["size"], c["quality"], c["num_envs"], f"{f:.1f}", f"{1000 / f:.1f}", f"{f / base:.2f}x", f"{f / one_env:.2f}x"]
        )
    print()
    print(
        table(
            [
                "frame px",
                "quality",
                "envs",
                "frames/s",
                "ms/frame",
                f"vs {configs[0]['size']} {configs[0]['quality']} 1 env",
                f"vs {a.num_envs[0]} env, same size+quality",
            ],
            rows,
        )
    )
    print(f"\nmedian of {a.repeats} rounds; load average at the end {load()}; took {clock}")
    get = lambda s, q, n: median(fps[configs.index(dict(size=s, quality=q, num_envs=n, frames=a.frames))])  # noqa: E731
    s0, s1, n0, n1 = a.sizes[0], a.sizes[-1], a.num_envs[0], a.num_envs[-1]
    parts = [f"{s0}px fast {get(s0, 'fast', n0):.0f} frames/s with {n0} env"]
    if "high" in a.qualities and "fast" in a.qualities:
        parts.append(
            f"fast/high {get(s0, 'fast', n0) / get(s0, 'high', n0):.1f}x at {s0}px, "
            f"{get(s1, 'fast', n0) / get(s1, 'high', n0):.1f}x at {s1}px"
        )
    parts.append(f"{s0}/{s1}px {get(s0, 'fast', n0) / get(s1, 'fast', n0):.1f}x (fast)")
    if n1 != n0:
        parts.append(f"{n1} subprocess envs {get(s0, 'fast', n1) / get(s0, 'fast', n0):.2f}x the frames/s of {n0}")
    print("summary: rendering " + "; ".join(parts))


if __name__ == "__main__":
    main_or_worker(main, worker)
