"""Rendering speed of the textured Humanoid-v5 (our make_env): frame size, quality flags, subprocess envs.

    python benchmarks/bench_render.py
    python benchmarks/bench_render.py --num-envs 1 2 4 8 --frames 200 --repeats 3   # a bigger machine
    python benchmarks/bench_render.py --renderers egl warp --sizes 64 224 480 --num-envs 1 2 8  # + MuJoCo Warp

Frames per second of `render()` alone (physics steps between frames are not timed), with the scene the
CLIP reward sees (sky, stone floor, metallic body, the paper's camera). `1` = one env in this process;
`N > 1` = N subprocess envs in `gym.vector.AsyncVectorEnv`, as training runs them, each rendering its own
frame in parallel (`envs.call("render")`): frames/s counts all N frames. MUJOCO_GL=egl: the GPU where there
is one, else Mesa's software EGL on the CPU. Each configuration runs in a fresh process; the configurations
are visited in rounds (each round visits all of them) and the median over rounds is reported.

`--renderers warp` (quality column: its supersampling, `--supersample`): MuJoCo Warp's ray tracer as `--renderer warp`
draws, the N envs' states (stepped in this process, not timed) drawn as one batch of N worlds by one WarpRenderer on
Warp's device (the GPU where there is one, else the CPU); frames/s counts all N frames.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Clock, load, machine, main_or_worker, median, run_worker, table  # noqa: E402


def warp_worker(c: dict) -> dict:
    import numpy as np
    import torch

    import vlmrm_sac_humanoid as ours

    envs = [ours.make_env("Humanoid-v5", 1, i, 100, 64, "fast", True)() for i in range(c["num_envs"])]
    for i, env in enumerate(envs):
        env.reset(seed=1 + i)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    renderer = ours.warp_renderer(True, c["size"], c["supersample"], c["num_envs"], device)
    renderer.draw(np.stack([e.unwrapped.data.qpos for e in envs]))  # the kernel: compiled once per machine, then cached
    rng, render_s = np.random.default_rng(0), 0.0
    for _ in range(c["frames"]):
        for env in envs:
            env.step(rng.uniform(-0.4, 0.4, env.action_space.shape).astype(np.float32))
        qpos = np.stack([e.unwrapped.data.qpos for e in envs])
        start = time.perf_counter()
        frames = renderer.draw(qpos)
        torch.cuda.synchronize() if device.type == "cuda" else None
        render_s += time.perf_counter() - start
    assert frames.shape == (c["num_envs"], c["size"], c["size"], 3)
    return dict(fps=c["frames"] * c["num_envs"] / render_s)


def worker(c: dict) -> dict:
    import gymnasium as gym
    import numpy as np

    import vlmrm_sac_humanoid as ours

    if c.get("renderer") == "warp":
        return warp_worker(c)

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
    p.add_argument("--renderers", nargs="+", default=["egl"], choices=["egl", "warp"])
    p.add_argument("--supersample", nargs="+", type=int, help="warp: rays per pixel per axis (default: the script's)")
    a = p.parse_args()
    clock = Clock()
    print(f"machine: {machine()}, MUJOCO_GL={os.environ['MUJOCO_GL']}")
    configs = [dict(size=s, quality=q, num_envs=n, frames=a.frames) for s in a.sizes for q in a.qualities for n in a.num_envs]
    configs = configs if "egl" in a.renderers else []
    if "warp" in a.renderers:  # quality: warp's supersampling
        import vlmrm_sac_humanoid as ours

        a.supersample = a.supersample or [ours.Args.supersample]
        warp = [dict(renderer="warp", supersample=x, quality=f"warp ss{x}") for x in a.supersample]
        configs += [dict(w, size=s, num_envs=n, frames=a.frames) for s in a.sizes for w in warp for n in a.num_envs]
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
    key = [(c["size"], c["quality"], c["num_envs"]) for c in configs]
    get = lambda s, q, n: median(fps[key.index((s, q, n))]) if (s, q, n) in key else float("nan")  # noqa: E731
    s0, s1, n0, n1 = a.sizes[0], a.sizes[-1], a.num_envs[0], a.num_envs[-1]
    fast = "egl" in a.renderers and "fast" in a.qualities
    parts = [f"{s0}px fast {get(s0, 'fast', n0):.0f} frames/s with {n0} env"] if fast else []
    if "high" in a.qualities and "fast" in a.qualities and "egl" in a.renderers:
        parts.append(
            f"fast/high {get(s0, 'fast', n0) / get(s0, 'high', n0):.1f}x at {s0}px, "
            f"{get(s1, 'fast', n0) / get(s1, 'high', n0):.1f}x at {s1}px"
        )
    if fast:
        parts.append(f"{s0}/{s1}px {get(s0, 'fast', n0) / get(s1, 'fast', n0):.1f}x (fast)")
    if n1 != n0 and fast:
        parts.append(f"{n1} subprocess envs {get(s0, 'fast', n1) / get(s0, 'fast', n0):.2f}x the frames/s of {n0}")
    if "warp" in a.renderers:
        w = f"warp ss{a.supersample[0]}"
        parts.append(f"{w} " + ", ".join(f"{get(s, w, n1):.0f} frames/s at {s}px" for s in a.sizes) + f" ({n1} worlds)")
    if "warp" in a.renderers and "egl" in a.renderers:
        q, w = "high" if "high" in a.qualities else a.qualities[0], f"warp ss{a.supersample[0]}"
        parts += [
            f"{w} / EGL {q} frames/s with {n1} envs: "
            + ", ".join(f"{get(s, w, n1) / get(s, q, n1):.2f}x at {s}px" for s in a.sizes)
        ]
    print("summary: rendering " + "; ".join(parts))


if __name__ == "__main__":
    main_or_worker(main, worker)
