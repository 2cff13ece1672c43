"""Cost of SAC's NaN guard at one gradient step per training phase (CleanRL's schedule), Hopper-v5, ground-truth reward.

    python benchmarks/bench_nan_guard.py                  # 3 rounds of 4000 env steps
    python benchmarks/bench_nan_guard.py --repeats 5 --steps 6000

The guard keeps a finite copy of the networks and optimisers, saved if a training phase produces a NaN. Variants,
each a private copy of the script with the guard's condition replaced, run interleaved in fresh processes:
ours (a copy about every 100 gradient steps), no guard at all, and a copy before every phase (the previous code,
plus the finiteness check of the copy). Prints median SPS and the ratio to "no guard".
"""

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SCRIPTS, Clock, load, machine, main_or_worker, median, run_main, run_worker, spread, table  # noqa: E402

SAC_FILE, UTILS_FILE = "vlmrm_sac_humanoid.py", "vlmrm_utils.py"


def make_variant(patches: list[tuple[str, str]]) -> str | None:
    """A temp folder holding the SAC script and vlmrm_utils.py (home of the guard) with `patches` applied to the latter;
    None when a patch no longer applies."""
    text = (SCRIPTS / UTILS_FILE).read_text()
    for old, new in patches:
        if text.count(old) != 1:
            return None
        text = text.replace(old, new)
    folder = tempfile.mkdtemp(prefix="bench_variant_")
    open(os.path.join(folder, UTILS_FILE), "w").write(text)
    shutil.copy(SCRIPTS / SAC_FILE, folder)
    return folder


GUARD = "if self.steps >= 100:"
VARIANTS = {
    "no guard": [(GUARD, "if False:")],
    "ours (copy every ~100 gradient steps)": [],
    "copy before every phase (previous)": [(GUARD, "if True:")],
}


def worker(c: dict) -> dict:
    sys.path.insert(0, c["folder"])
    os.chdir(tempfile.mkdtemp(prefix="bench_nan_guard_"))
    import vlmrm_sac_humanoid as ours
    import vlmrm_utils

    assert os.path.dirname(vlmrm_utils.__file__) == c["folder"], vlmrm_utils.__file__
    args = ours.Args(
        env_id="Hopper-v5",
        reward="gt",
        num_envs=1,
        total_timesteps=c["steps"],
        learning_starts=c["steps"] // 4,
        train_frequency=1,
        gradient_steps=1,
        batch_size=256,
        buffer_size=100_000,
        policy_lr=3e-4,
        q_lr=1e-3,
    )
    return dict(sps=run_main(ours, args)["sps"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads in every run (0: torch's default)")
    a = p.parse_args()
    clock = Clock()
    print(f"machine: {machine()}")
    folders = {k: make_variant(v) for k, v in VARIANTS.items()}
    missing = [k for k, f in folders.items() if f is None]
    if missing:
        sys.exit(f"the guard's text changed, re-derive the patches: {missing}")
    res = {k: [] for k in folders}
    for r in range(a.repeats):  # interleaved: a burst of load hits every variant alike
        for k in res:
            res[k].append(run_worker(__file__, dict(folder=folders[k], steps=a.steps, threads=a.threads))["sps"])
        print(f"  round {r + 1}/{a.repeats} done (load {load()})", flush=True)
    base = median(res["no guard"])
    print()
    print(
        table(
            ["variant", "median SPS", "spread", "vs no guard"],
            [[k, f"{median(v):.0f}", spread(v), f"{median(v) / base:.3f}x"] for k, v in res.items()],
        )
    )
    ours = median(res["ours (copy every ~100 gradient steps)"]) / base
    previous = median(res["copy before every phase (previous)"]) / base
    print(
        f"\n{a.repeats} rounds, {a.steps} env steps per run, Hopper-v5, --train-frequency 1 --gradient-steps 1, "
        f"torch threads {a.threads or 'default'}; load average at the end {load()}; took {clock}"
    )
    print(f"summary: NaN guard speed ratio (guarded / unguarded): ours {ours:.3f}, previous {previous:.3f}")


if __name__ == "__main__":
    main_or_worker(main, worker)
