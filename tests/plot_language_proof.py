"""Docs of tests/test_language_proof.py (not a test): the learning curves and the reward shape of the trained CLIP, and
the learning margin on several seeds (offline: CI runs one seed).

    python tests/plot_language_proof.py --runs <upright run dir> <swapped run dir> --shape <reward_shape.csv> --out docs/
    python tests/plot_language_proof.py --seeds 1 2 3 --work /tmp/language-proof   # the test's runs, per seed
Run dirs: the TensorBoard folders of the learning test (pytest -s prints where they are) or of --seeds.
"""

import argparse
import csv
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import read_scalars


def curves(run_dirs: list[str], labels: list[str], path: Path) -> None:
    fig, (ax_gt, ax_clip) = plt.subplots(1, 2, figsize=(11, 4))
    for run_dir, label in zip(run_dirs, labels):
        scalars = read_scalars(Path(run_dir))
        steps, success = zip(*scalars["charts/gt_success"])
        ax_gt.plot(steps, success, marker=".", label=label)
        steps, clip_return = zip(*scalars["charts/clip_return"])
        ax_clip.plot(steps, clip_return, marker=".", label=label)
        evals = [v / 200 for _, v in scalars.get("eval/gt_return", [])]
        if evals:
            ax_gt.plot(
                steps[-1],
                np.mean(evals),
                marker="*",
                markersize=14,
                color=ax_gt.lines[-1].get_color(),
                linestyle="none",
                label=f"{label}: greedy evaluation, {np.mean(evals):.2f}",
            )
    ax_gt.set(
        xlabel="environment step",
        ylabel="ground-truth upright fraction of the episode",
        ylim=(-0.02, 1.02),
        title="ground truth (never seen by the agent)",
    )
    ax_clip.set(xlabel="environment step", ylabel="CLIP return per episode (200 steps)", title="CLIP reward (learnt from)")
    ax_gt.legend(fontsize=7)
    ax_clip.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def shape(csv_path: str, path: Path, title: str) -> None:
    with open(csv_path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["family"] == "projection"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for alpha in sorted({float(r["alpha"]) for r in rows}):
        curve = [(float(r["state"]), float(r["reward_normalised"])) for r in rows if float(r["alpha"]) == alpha]
        ax.plot(*zip(*curve), label=f"alpha = {alpha:g}")
    ax.axvline(0.0, color="grey", linestyle="--", linewidth=1)
    ax.set(xlabel="pole angle theta (rad), cart centred", ylabel="reward, min-max normalised per alpha", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def margins(seeds: list[int], work: Path) -> None:
    """The learning test's two runs (and the random policy) on each seed: a markdown table of upright fractions."""
    import clip_trainer
    import test_language_proof as proof

    checkpoint = clip_trainer.cached_checkpoint()
    print("| seed | random policy | goal | swapped control | goal - random | swapped - random |\n|---|---|---|---|---|---|")
    for seed in seeds:
        (work / f"seed-{seed}").mkdir(parents=True)
        u = proof.learning_runs(checkpoint, work / f"seed-{seed}", seed)
        print(
            f"| {seed} | {u['random']:.3f} | {u['upright']:.3f} | {u['swapped']:.3f} | {u['upright'] - u['random']:+.3f} "
            f"| {u['swapped'] - u['random']:+.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", nargs="+")
    parser.add_argument("--labels", nargs="+", default=["goal: upright pole", "control: goal and baseline swapped"])
    parser.add_argument("--shape")
    parser.add_argument("--title", default="CLIP trained on captioned CartPole frames")
    parser.add_argument("--out", default="docs")
    parser.add_argument("--seeds", nargs="+", type=int)
    parser.add_argument("--work", default="language-proof-seeds", help="where --seeds writes its runs (a new folder)")
    a = parser.parse_args()
    if a.runs:
        curves(a.runs, a.labels, Path(a.out) / "language_proof_curve.png")
    if a.shape:
        shape(a.shape, Path(a.out) / "language_proof_reward_shape.png", a.title)
    if a.seeds:
        margins(a.seeds, Path(a.work))
