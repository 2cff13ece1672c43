"""What a frame of the textured humanoid costs, part by part, and whether a cheaper one looks the same to CLIP.

    python benchmarks/bench_frame_cost.py                          # 480 px, tiny random CLIP and ViT-B-32 (random)
    python benchmarks/bench_frame_cost.py --clips ViT-B-32 experiments/humanoid-clip.json=/tmp/humanoid-clip.pt

Renders the same 40 states of a random-action trajectory (set through qpos/qvel, then mj_forward) with the paper's
"high" quality (MuJoCo's defaults: 4096 px shadow map, reflections, 4x multisampling) and with one part made cheaper at
a time: a smaller shadow map, no multisampling, no reflections, "fast" (no shadows, no reflections). Each setting
renders in a fresh process (its own GL context), the settings visited in rounds; ms/frame is the median over rounds.

Then each setting's frames are compared with high's where CLIP sees them: after the reward model's own squash to its
input size (bicubic, no antialiasing, as training), and as embeddings of each CLIP given (`--clips`: an open_clip
architecture with random weights, or CONFIG.json=WEIGHTS.pt for a model trained here) and as rewards of the default
prompts. Every difference is put next to what CLIP must tell apart: the same measure between consecutive frames of the
trajectory (5 physics steps apart) under high. A setting is indistinguishable here when, for every CLIP, its largest
reward difference is under a tenth of the smallest reward change between consecutive frames' median, and its mean
embedding distance under a tenth of the consecutive frames' median.
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import REPO, Clock, load, machine, main_or_worker, median, run_worker, table  # noqa: E402

TINY = str(REPO / "tests" / "vlmrm-tiny-test.json")
SETTINGS = {  # name: (shadow map px, multisamples, reflections, shadows)
    "high (paper)": (4096, 4, True, True),
    "shadow map 2048": (2048, 4, True, True),
    "shadow map 1024": (1024, 4, True, True),
    "shadow map 512": (512, 4, True, True),
    "no multisampling": (4096, 0, True, True),
    "no reflections": (4096, 4, False, True),
    "shadow 1024, no MSAA": (1024, 0, True, True),
    "fast (no shadows, no reflections)": (4096, 4, False, False),
}


def trajectory(states: int) -> list:
    """(qpos, qvel) of a seeded random-action rollout of Humanoid-v5, every 5th step (it falls within ~25 steps)."""
    import gymnasium as gym
    import numpy as np

    env = gym.make("Humanoid-v5", terminate_when_unhealthy=False)
    env.reset(seed=0)
    rng, out = np.random.default_rng(0), []
    for _ in range(states):
        for _ in range(5):
            env.step(rng.uniform(-0.4, 0.4, env.action_space.shape))
        out.append((env.unwrapped.data.qpos.copy(), env.unwrapped.data.qvel.copy()))
    return out


def worker(c: dict) -> dict:
    import mujoco
    import numpy as np

    import vlmrm_sac_humanoid as ours

    shadow, samples, reflections, shadows = SETTINGS[c["setting"]]
    env = ours.make_env("Humanoid-v5", 1, 0, 100, c["size"], "high", True)()
    env.reset(seed=0)
    base = env.unwrapped
    base.model.vis.quality.shadowsize, base.model.vis.quality.offsamples = shadow, samples  # read when the context is made
    env.render()  # creates the renderer
    flags = base.mujoco_renderer.viewer.scn.flags
    flags[mujoco.mjtRndFlag.mjRND_REFLECTION], flags[mujoco.mjtRndFlag.mjRND_SHADOW] = reflections, shadows
    frames, seconds = [], 0.0
    for qpos, qvel in trajectory(c["states"]):
        base.set_state(np.array(qpos), np.array(qvel))
        start = time.perf_counter()
        frames.append(env.render())
        seconds += time.perf_counter() - start
    path = os.path.join(c["out"], f"{list(SETTINGS).index(c['setting'])}.npy")
    np.save(path, np.stack(frames))
    return dict(ms=seconds / len(frames) * 1000, path=path)


def clip_reward(spec: str):
    """The training script's reward model of a CLIP given as a name (random weights) or CONFIG.json=WEIGHTS.pt."""
    import torch

    import vlmrm_sac_humanoid as ours

    config, _, weights = spec.partition("=")
    goal, baseline = ours.DEFAULT_PROMPTS["Humanoid-v5"]  # the training script's default sentences
    args = ours.Args(clip_model=config, clip_pretrained="none", clip_checkpoint=weights or None, reward_batch_size=8)
    args.goal, args.baseline, args.alpha = (goal,), (baseline,), 0.0
    torch.manual_seed(0)
    return ours.make_reward_model(args, torch.device("cpu"))


def main() -> None:
    import numpy as np
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=480, help="square frame size (480: the paper's)")
    p.add_argument("--states", type=int, default=40, help="states of the trajectory rendered by every setting")
    p.add_argument("--clips", nargs="+", default=[TINY, "ViT-B-32"], help="name (random weights) or CONFIG.json=WEIGHTS.pt")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    clock, out = Clock(), tempfile.mkdtemp(prefix="bench_frame_cost_")
    print(f"machine: {machine()}, MUJOCO_GL={os.environ['MUJOCO_GL']}")
    ms = {name: [] for name in SETTINGS}
    for r in range(a.repeats):
        for name in SETTINGS:
            result = run_worker(__file__, dict(setting=name, size=a.size, states=a.states, out=out))
            ms[name].append(result["ms"])
        print(f"  round {r + 1}/{a.repeats} done (load {load()})", flush=True)
    frames = {name: np.load(os.path.join(out, f"{i}.npy")) for i, name in enumerate(SETTINGS)}

    torch.set_num_threads(1)
    rows, verdicts = [], {}
    clips = {spec: clip_reward(spec) for spec in a.clips}
    squash = {name: clips[a.clips[0]].preprocess(torch.from_numpy(f)) for name, f in frames.items()}  # CLIP's input
    pixel_step = (squash["high (paper)"][1:] - squash["high (paper)"][:-1]).abs().mean().item()  # consecutive frames
    unit = torch.nn.functional.normalize
    embed = {
        s: {n: unit(m.embed_images(torch.from_numpy(f)).float(), dim=-1) for n, f in frames.items()} for s, m in clips.items()
    }
    rewards = {s: {n: m.rewards(e).numpy() for n, e in embed[s].items()} for s, m in clips.items()}
    for name in SETTINGS:
        row = [name, f"{median(ms[name]):.1f}", f"{median(ms['high (paper)']) / median(ms[name]):.2f}x"]
        diff = (squash[name] - squash["high (paper)"]).abs().mean().item()
        row.append(f"{diff / pixel_step:.3f}")
        same = True
        for spec in a.clips:
            e, e_high = embed[spec][name], embed[spec]["high (paper)"]
            distance = (1 - (e * e_high).sum(-1)).mean().item()
            step = median((1 - (e_high[1:] * e_high[:-1]).sum(-1)).tolist())
            r, r_high = rewards[spec][name], rewards[spec]["high (paper)"]
            reward_step = median(np.abs(np.diff(r_high)).tolist())
            worst = np.abs(r - r_high).max()
            row += [f"{distance / step:.3f}", f"{worst / reward_step:.3f}"]
            same = same and distance < 0.1 * step and worst < 0.1 * reward_step
        verdicts[name] = same
        rows.append(row + ["yes" if same else "no"])
    print()
    header = ["setting", "ms/frame", "vs high", "pixels / consecutive"]
    for spec in a.clips:
        label = os.path.basename(spec.partition("=")[0]).replace(".json", "")
        header += [f"{label}: embedding / consecutive", f"{label}: max reward diff / consecutive"]
    print(table(header + ["indistinguishable"], rows))
    print(
        f"\n{a.size} px, {a.states} states, median of {a.repeats} rounds; differences to high, each over the median of "
        f"the same measure between consecutive frames under high (pixels after CLIP's squash: {pixel_step:.4f} mean abs); "
        f"load average at the end {load()}; took {clock}"
    )
    cheap = [n for n in SETTINGS if verdicts[n] and n != "high (paper)"]
    best = min(cheap, key=lambda n: median(ms[n]), default=None)
    print(
        "summary: frame cost: "
        + (
            f"the cheapest indistinguishable setting is {best!r}, {median(ms['high (paper)']) / median(ms[best]):.2f}x "
            "faster than high"
            if best
            else "no cheaper setting is indistinguishable from high"
        )
        + f"; fast is {median(ms['high (paper)']) / median(ms['fast (no shadows, no reflections)']):.2f}x faster"
    )


if __name__ == "__main__":
    main_or_worker(main, worker)
