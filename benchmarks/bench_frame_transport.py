"""How the frames reach the training loop: with the step through shared memory, or by a second, pickled call.

    python benchmarks/bench_frame_transport.py
    python benchmarks/bench_frame_transport.py --num-envs 2 8 32 --size 480   # a bigger machine

Two ways for N subprocess envs (`gym.vector.AsyncVectorEnv`, as training runs them) to hand back the frame rendered
after each step:
- "second call": `envs.step(actions)`, then `envs.call("render")`: two round trips to every env process per vector
  step, and every frame pickled through a pipe (the loop before);
- "with the step": `vlmrm_utils.make_vector_env(..., frame_shape)`: each env renders inside its step and the frame
  travels in the vector env's shared memory (one round trip, nothing pickled; the loop now).
Each is timed on two envs: "stub", whose render returns a ready frame (the transport alone: what is saved per vector
step), and the textured humanoid at --quality (what that saving is worth when the frames are really drawn, here in
software on the CPU). Vector steps per second, each configuration in a fresh process, visited in rounds (A B A B ...),
median over rounds; the ratio is "with the step" over "second call".
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Clock, load, machine, main_or_worker, median, run_worker, table  # noqa: E402


def stub_env(size: int):
    """A tiny env whose frame is ready-made: stepping and rendering cost nothing, so only the transport is timed."""
    import gymnasium as gym
    import numpy as np

    class Stub(gym.Env):
        observation_space = gym.spaces.Box(-1, 1, (348,), np.float64)  # Humanoid-v5's observation size
        action_space = gym.spaces.Box(-0.4, 0.4, (17,), np.float32)
        frame = np.full((size, size, 3), 127, np.uint8)

        def reset(self, seed=None, options=None):
            return np.zeros(348), {}

        def step(self, action):
            return np.zeros(348), 0.0, False, False, {}

        def render(self):
            return self.frame

    return Stub()


def worker(c: dict) -> dict:
    import gymnasium as gym
    import numpy as np

    import vlmrm_sac_humanoid as ours
    import vlmrm_utils

    if c["env"] == "stub":
        thunks = [lambda: stub_env(c["size"]) for _ in range(c["num_envs"])]
    else:
        thunks = [ours.make_env("Humanoid-v5", 1, i, 100, c["size"], c["quality"], True) for i in range(c["num_envs"])]
    with_step = c["transport"] == "with the step"
    envs = vlmrm_utils.make_vector_env(
        gym.vector.AsyncVectorEnv, thunks, gym.vector.AutoresetMode.DISABLED, (c["size"], c["size"], 3) if with_step else None
    )
    envs.reset(seed=1)
    rng = np.random.default_rng(0)
    for warm in (True, False):  # the first steps create each env's renderer
        start = time.perf_counter()
        for _ in range(3 if warm else c["steps"]):
            _, _, _, _, infos = envs.step(rng.uniform(-0.4, 0.4, envs.action_space.shape).astype(np.float32))
            frames = infos["frames"] if with_step else np.stack(envs.call("render"))
        seconds = time.perf_counter() - start
    assert frames.shape == (c["num_envs"], c["size"], c["size"], 3)
    envs.close()
    return dict(sps=c["steps"] / seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-envs", nargs="+", type=int, default=[2, 8])
    p.add_argument("--size", type=int, default=480)
    p.add_argument("--quality", default="fast")
    p.add_argument("--steps", type=int, default=100, help="vector steps per measurement (humanoid: a fifth of it)")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    clock = Clock()
    print(f"machine: {machine()}, MUJOCO_GL={os.environ['MUJOCO_GL']}")
    transports = ["second call", "with the step"]
    configs = [
        dict(env=env, num_envs=n, size=a.size, quality=a.quality, steps=a.steps if env == "stub" else max(a.steps // 5, 5))
        for env in ("stub", "humanoid")
        for n in a.num_envs
    ]
    sps = {(i, t): [] for i in range(len(configs)) for t in transports}
    for r in range(a.repeats):
        for i, c in enumerate(configs):
            for t in transports if r % 2 == 0 else transports[::-1]:  # A B, then B A: drift hits both alike
                sps[i, t].append(run_worker(__file__, dict(c, transport=t))["sps"])
        print(f"  round {r + 1}/{a.repeats} done (load {load()})", flush=True)
    rows, summary = [], []
    for i, c in enumerate(configs):
        before, after = median(sps[i, "second call"]), median(sps[i, "with the step"])
        saved_ms = 1000 / before - 1000 / after
        env = "stub (transport only)" if c["env"] == "stub" else f"humanoid {a.quality}"
        rows.append([env, c["num_envs"], f"{before:.1f}", f"{after:.1f}", f"**{after / before:.2f}x**", f"{saved_ms:.2f}"])
        summary.append(f"{env} {c['num_envs']} envs {after / before:.2f}x")
    print()
    header = ["envs render", "envs", "second call: vector steps/s", "with the step: vector steps/s", "ratio", "ms saved/step"]
    print(table(header, rows))
    print(f"\n{a.size} px frames; median of {a.repeats} rounds; load average at the end {load()}; took {clock}")
    print("summary: the frame with the step vs a second call: " + "; ".join(summary))


if __name__ == "__main__":
    main_or_worker(main, worker)
