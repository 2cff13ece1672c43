"""Why one MountainCar seed reaches the flag and another does not: for each run of an experiments/mountaincar_sac.py
folder, along training, the CLIP return of its episodes, SAC's entropy coefficient and where the car spends its steps
(a histogram of x), read from the run's TensorBoard log and its replay buffer (the experiment saves it).

    python experiments/mountaincar_seeds.py --out runs/mountaincar_sac    # a table per run and <out>/seeds.png

A run extended with --resume (twice the steps, say) is read to its end; the flag is x >= 0.45.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

FLAG = np.float32(0.45)  # the env clips x to float32(0.45) at the flag: compared in float32, as the env's state
# the left hill, the valley (its bottom at about -0.52), the right slope, the flag
EDGES = np.array([-1.2, -0.9, -0.6, -0.3, 0.0, 0.3, FLAG, 0.6], np.float32)
EPISODE, NUM_ENVS = 200, 4  # the experiment's fixed episodes and envs


def load(run: Path) -> dict:
    """x after each step, CLIP reward and action, in step order, and the TensorBoard curves of one run folder."""
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (checkpoint,) = run.glob("runs/*/checkpoint.pt")
    buffer = torch.load(checkpoint, map_location="cpu", weights_only=False)["replay_buffer"]
    if buffer is None:
        sys.exit(f"error: {checkpoint} holds no replay buffer (run with --save-buffer).")
    events = EventAccumulator(str(checkpoint.parent), size_guidance={"scalars": 0}).Reload()
    curve = lambda tag: np.array([(s.step, s.value) for s in events.Scalars(tag)])  # noqa: E731
    x, reward = buffer["next_obs"][:, 0].numpy(), buffer["rewards"].numpy()
    # rows are step-major (env i of vector step t is row NUM_ENVS * t + i): episodes are (episode, step, env) blocks
    blocks = len(x) // (EPISODE * NUM_ENVS)
    episodes = lambda a: a[: blocks * EPISODE * NUM_ENVS].reshape(blocks, EPISODE, NUM_ENVS)  # noqa: E731
    return dict(
        x=x,
        reward=reward,
        action=buffer["actions"][:, 0].numpy(),
        velocity=buffer["obs"][:, 1].numpy(),  # before the step: the action pushes with it or against it
        ent_coef=curve("losses/ent_coef"),
        clip_return=curve("charts/clip_return"),
        flag=curve("charts/gt_success"),
        episode_max_x=episodes(x).max(axis=1),  # (round of episodes, env)
    )


def table(name: str, run: dict, window: int) -> None:
    """One row per `window` steps. "pushes with motion": the share of steps whose action pushes the way the car moves,
    which pumps energy into the swing (the flag needs it); the x columns: the share of steps in each stretch of road."""
    steps = np.arange(len(run["x"])) // NUM_ENVS * NUM_ENVS
    first = next((int(s) for s, v in run["flag"] if v > 0), None)
    print(f"\n{name}: {len(run['x'])} steps; first training episode at the flag: {first or 'never'}")
    print(f"  {'steps':>13}  CLIP reward/step  ent_coef  pushes with motion  highest x  episodes at the flag  "
          "% of steps with x in " + " ".join(f"[{a:+.2f}," for a in EDGES[:-1]))  # fmt: skip
    for low in range(0, steps[-1] + 1, window):
        m = (steps >= low) & (steps < low + window)
        e = run["ent_coef"][(run["ent_coef"][:, 0] >= low) & (run["ent_coef"][:, 0] < low + window), 1]
        rounds = run["episode_max_x"][low // (EPISODE * NUM_ENVS) : (low + window) // (EPISODE * NUM_ENVS)]
        pumping = np.mean(np.sign(run["action"][m]) == np.sign(run["velocity"][m])) * 100
        hist = np.histogram(np.clip(run["x"][m], EDGES[0], EDGES[-1]), EDGES)[0] / m.sum() * 100
        print(f"  {low:6d}-{low + window:<6d}  {run['reward'][m].mean():+16.3f}  {e.mean() if len(e) else np.nan:8.4f}  "
              f"{pumping:17.0f}%  {run['x'][m].max():+9.2f}  {(rounds >= FLAG).sum():>11d} of {rounds.size:<7d}  "
              + " ".join(f"{h:6.1f}" for h in hist))  # fmt: skip
    where = np.digitize(np.clip(run["x"], EDGES[0], EDGES[-1] - 1e-3), EDGES) - 1  # the reward this run's CLIP gave there
    means = [run["reward"][where == b].mean() if (where == b).any() else np.nan for b in range(len(EDGES) - 1)]
    print(f"  {'mean CLIP reward by x, all steps':>104}  " + " ".join(f"{m:+6.2f}" for m in means))


def plot(runs: dict, path: Path, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 3, figsize=(15, 2.6 * len(runs)), squeeze=False)
    for row, (name, run) in zip(axes, runs.items()):
        steps = np.arange(len(run["x"])) // NUM_ENVS * NUM_ENVS
        c = run["clip_return"]
        row[0].plot(c[:, 0], c[:, 1], ".", ms=2)
        f = run["flag"]
        row[0].plot(f[f[:, 1] > 0, 0], c[f[:, 1] > 0, 1], ".", ms=3, color="red", label="episode at the flag")
        row[0].set(ylabel=f"{name}\nCLIP return", xlabel="env step")
        row[0].legend(loc="lower right", fontsize=7)
        row[1].semilogy(run["ent_coef"][:, 0], run["ent_coef"][:, 1])
        row[1].set(ylabel="entropy coefficient", xlabel="env step")
        bins, every = np.linspace(-1.2, 0.6, 37), EPISODE * NUM_ENVS  # one column per round of episodes
        heat = [np.histogram(run["x"][(steps >= s) & (steps < s + every)], bins)[0] for s in range(0, len(steps), every)]
        heat = np.stack(heat)
        row[2].imshow(
            np.log1p(heat).T, origin="lower", aspect="auto", extent=(0, steps[-1] + NUM_ENVS, bins[0], bins[-1]), cmap="magma"
        )
        row[2].axhline(FLAG, color="yellow", lw=0.8)
        row[2].set(ylabel="car x (log steps per bin)", xlabel="env step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"\nfigure: {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="the --out folder of experiments/mountaincar_sac.py")
    p.add_argument("--runs", nargs="+", help="run names in it (default: all)")
    p.add_argument("--window", type=int, default=4000, help="env steps per row of the table")
    args = p.parse_args()
    out = Path(args.out)
    names = args.runs or sorted(d.name for d in out.iterdir() if (d / "runs").is_dir())
    if not names:
        p.error(f"--out {out} holds no runs of experiments/mountaincar_sac.py")
    runs = {name: load(out / name) for name in names}
    for name, run in runs.items():
        table(name, run, args.window)
    plot(runs, out / "seeds.png", args.window)


if __name__ == "__main__":
    main()
