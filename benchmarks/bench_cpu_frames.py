"""CPU costs of every classic-control frame, before and after their fix, side by side in one process (A B A B ...).

    python benchmarks/bench_cpu_frames.py
    python benchmarks/bench_cpu_frames.py --rounds 9 --frames 32

1. The realistic MountainCar's pixels out of pygame: `surfarray.array3d(canvas).transpose(1, 0, 2)` (before) against
   `frombuffer(image.tobytes(canvas, "RGB"))` (now, `RealisticMountainCar.render`).
2. The reward's uint8 -> float cast of a batch of 600x400 frames before the bicubic squash: torch's `.float()` (before)
   against numpy's `astype` (now, `CLIPReward.preprocess` on the CPU), for the tiny test CLIP's 64 px and CLIP's 224.
3. A whole CartPole frame, drawn by gymnasium: its own `render` (draws, then copies through `surfarray`: before)
   against the DQN script's `GymnasiumPixels.render` (the same drawing, read out with `image.tobytes`: now).

Each pair must give identical arrays (checked); the table shows milliseconds per frame (median over rounds, one
thread) and the ratio before/now.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import load, machine, median, table  # noqa: E402

os.environ.setdefault("SDL_VIDEODRIVER", "dummy")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median reported)")
    p.add_argument("--frames", type=int, default=16, help="frames per measurement (the reward's batch)")
    args = p.parse_args()
    import numpy as np
    import pygame
    import torch
    import torch.nn.functional as F

    import vlmrm_dqn_classic as classic
    import vlmrm_sac_humanoid as ours

    torch.set_num_threads(1)
    env = ours.make_env("MountainCarContinuous-v0", 0, 0, 200, 64, "fast", True)()
    env.reset(seed=0)
    env.step(np.array([0.5], np.float32))
    frame = env.render()
    canvas = env.get_wrapper_attr("canvas")
    frames = torch.from_numpy(np.stack([np.roll(frame, i, axis=1) for i in range(args.frames)]))
    cartpole = classic.make_env("CartPole-v1", 0, 0, 200, False)()
    cartpole.reset(seed=0)
    cartpole.step(1)

    def squash(x, size):
        return F.interpolate(x, size=size, mode="bicubic", align_corners=False)

    def cast_before(size):  # CLIPReward.preprocess's cast as it was
        return squash(frames.permute(0, 3, 1, 2).float().div_(255), size)

    def cast_now(size):  # and as it is on the CPU
        return squash(torch.from_numpy(frames.numpy().astype(np.float32)).permute(0, 3, 1, 2).div_(255), size)

    pairs = {
        "pixels out of pygame": (
            lambda: pygame.surfarray.array3d(canvas).transpose(1, 0, 2),
            lambda: np.frombuffer(pygame.image.tobytes(canvas, "RGB"), np.uint8).reshape(400, 600, 3).copy(),
            1,
        ),
        **{
            f"uint8 -> float + squash to {s} px": (
                lambda s=s: cast_before((s, s)),
                lambda s=s: cast_now((s, s)),
                args.frames,
            )
            for s in (64, 224)
        },
        "a CartPole frame (drawing included)": (cartpole.unwrapped.render, cartpole.render, 1),
    }
    times = {(name, side): [] for name in pairs for side in (0, 1)}
    for name, (before, now, _) in pairs.items():
        a, b = before(), now()
        a, b = (x.numpy() if isinstance(x, torch.Tensor) else x for x in (a, b))
        assert a.shape == b.shape and np.array_equal(a, b), f"{name}: the two sides differ"
    for _ in range(args.rounds):
        for name, (before, now, n) in pairs.items():
            for side, fn in enumerate((before, now)):
                start, reps = time.perf_counter(), max(1, 64 // n)
                for _ in range(reps):
                    fn()
                times[name, side].append((time.perf_counter() - start) / reps / n * 1000)
    print(machine())
    rows = []
    for name in pairs:
        b, n = median(times[name, 0]), median(times[name, 1])
        rows.append([name, f"{b:.2f}", f"{n:.2f}", f"{b / n:.1f}x"])
    print(table(["per frame", "before (ms)", "now (ms)", "before / now"], rows))
    print(f"{args.rounds} rounds, identical outputs; load average at the end {load()}")


if __name__ == "__main__":
    main()
