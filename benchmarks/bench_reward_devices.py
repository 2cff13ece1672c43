"""--reward-devices: frames/s of the reward model on one device vs one CLIP replica on each of N devices.

    python benchmarks/bench_reward_devices.py                     # GPUs: all of them vs cuda:0 (ViT-bigG-14, batch 256)
    python benchmarks/bench_reward_devices.py --devices cpu cpu   # no GPU: two CPU replicas vs one (RN50, batch 16)

Each measurement is one call of the training scripts' reward model (`make_reward_model` with `--reward-devices`, so
`CLIPReward.__call__`: uint8 frames in, rewards back on the host) as training calls it with N reward devices: N chunks
of `--batch-size` frames, one per device (`--frames` changes that). Each contender runs in a fresh process (one warm-up
call, then `--calls` timed calls, median); contenders alternate their order every round. Weights are random
(`pretrained=None`): speed does not depend on them.

With N >= 2 distinct GPUs the speed-up is measured. Otherwise the N-device frame rate is also *computed* from the
measured one-device rate: the C chunks of a call are dealt round-robin, so the busiest device scores ceil(C / N) of
them and the rate is at most rate_1 x C / ceil(C / N) (= N x rate_1 for one chunk per device; the host-side frame
copies and the thread per device not counted). The output says which numbers are measured and which are expected.
On CPU, N replicas use N cores (1 torch thread each, the scripts' default on CPU), so they are also compared with one
replica given N torch threads.
"""

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import REPO, Clock, load, machine, main_or_worker, median, run_worker, table  # noqa: E402

TINY = str(REPO / "tests" / "vlmrm-tiny-test.json")


def worker(c: dict) -> dict:
    import numpy as np
    import torch

    import vlmrm_sac_humanoid as ours

    args = ours.Args(
        clip_model=c["model"],
        clip_pretrained="none",
        reward_devices=tuple(c["devices"]),
        alpha=0.5,
        reward_batch_size=c["batch_size"],
    )
    args.goal, args.baseline = ((prompt,) for prompt in ours.DEFAULT_PROMPTS["Humanoid-v5"])  # the script's defaults
    reward_model = ours.make_reward_model(args, torch.device(c["devices"][0]))
    frames = np.random.default_rng(0).integers(0, 256, (c["frames"], c["frame_size"], c["frame_size"], 3), dtype=np.uint8)
    reward_model(frames)  # warm-up: allocator, cuDNN autotune, thread pools
    times = []
    for _ in range(c["calls"]):
        start = time.perf_counter()
        reward_model(frames)  # ends with the rewards on the host: synchronised
        times.append(time.perf_counter() - start)
    return dict(fps=c["frames"] / median(times), best_fps=c["frames"] / min(times))


def expected(rate_1: float, chunks: int, n: int) -> float:
    """The N-device frame rate if every device scores its chunks as fast as one device alone."""
    return rate_1 * chunks / math.ceil(chunks / n)


def main() -> None:
    import torch

    gpus = torch.cuda.device_count()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--devices",
        nargs="+",
        default=[f"cuda:{i}" for i in range(gpus)] if gpus else ["cpu", "cpu"],
        help="the N devices (default: every GPU, else two CPU replicas); the first alone is the 1-device run",
    )
    p.add_argument("--model", default="ViT-bigG-14" if gpus else "RN50", help="open_clip architecture or .json config")
    p.add_argument("--frames", type=int, default=None, help="frames per scoring call (default: one batch per device)")
    p.add_argument("--batch-size", type=int, default=256 if gpus else 16, help="--reward-batch-size: frames per chunk")
    p.add_argument("--frame-size", type=int, default=224, help="rendered frame size (the humanoid default; 480: the paper's)")
    p.add_argument("--calls", type=int, default=3, help="timed calls per process")
    p.add_argument("--rounds", type=int, default=3, help="fresh processes per contender, order alternating")
    a = p.parse_args()
    n, cpu = len(a.devices), all(d == "cpu" for d in a.devices)
    a.frames = a.frames or a.batch_size * n
    distinct_gpus = len({d for d in a.devices if d.startswith("cuda")})
    clock = Clock()
    print(f"machine: {machine()}")
    base = dict(model=a.model, frames=a.frames, batch_size=a.batch_size, frame_size=a.frame_size, calls=a.calls)
    contenders = {f"1 device ({a.devices[0]})": dict(devices=a.devices[:1], threads=1 if cpu else 0)}
    if n > 1:
        contenders[f"{n} devices ({' '.join(a.devices)})"] = dict(devices=a.devices, threads=1 if cpu else 0)
    if cpu and n > 1:  # the same cores given to one replica instead
        contenders[f"1 device ({a.devices[0]}), {n} torch threads"] = dict(devices=a.devices[:1], threads=n)
    results = {name: [] for name in contenders}
    for r in range(a.rounds):
        for name in sorted(contenders, reverse=bool(r % 2)):
            results[name].append(run_worker(__file__, {**base, **contenders[name]}))
        print(f"  round {r + 1}/{a.rounds} done (load {load()})", flush=True)
    rate_1 = median([x["fps"] for x in results[next(iter(contenders))]])
    chunks = math.ceil(a.frames / a.batch_size)
    rows = [
        [
            name,
            "measured",
            f"{median([x['fps'] for x in res]):.2f}",
            f"{max(x['best_fps'] for x in res):.2f}",
            f"{median([x['fps'] for x in res]) / rate_1:.2f}x",
        ]
        for name, res in results.items()
    ]
    for k in sorted({2, 4, 8, n} - {1}):  # what the chunk dealing allows, from the measured one-device rate
        rate_k = expected(rate_1, math.ceil(a.frames * k / n / a.batch_size), k)  # calls grow with the devices, as in training
        rows.append([f"{k} devices", "expected", f"{rate_k:.2f}", "-", f"{rate_k / rate_1:.2f}x"])
    print()
    print(table(["reward devices", "how", "frames/s (median)", "frames/s (best call)", "vs 1 device"], rows))
    print(
        f"\n{os.path.basename(a.model).replace('.json', '')}, {a.frame_size}px frames, {a.frames} frames per call in "
        f"{chunks} chunks of {a.batch_size}; {a.rounds} rounds x {a.calls} calls; load average at the end {load()}; "
        f"took {clock}"
    )
    if distinct_gpus >= 2:
        print(
            f"summary: speed-up with {distinct_gpus} GPUs measured: {rows[1][4]} "
            f"(expected at most {expected(rate_1, chunks, n) / rate_1:.2f}x)"
        )
    else:
        print(
            f"summary: no {'multi-GPU machine' if not cpu else 'GPU'} here, so the GPU speed-up is NOT measured: the "
            f"'expected' rows are computed from the measured one-device rate ({rate_1:.2f} frames/s)"
            + (f"; measured on CPU with {n} replicas: {rows[1][4]}" if cpu and n > 1 else "")
        )


if __name__ == "__main__":
    main_or_worker(main, worker)
