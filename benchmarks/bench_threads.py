"""torch threads: a ground-truth DQN CartPole run with the environment's default threads vs `OMP_NUM_THREADS=1`.

Each measurement is `python vlmrm_dqn_classic.py --reward gt ...` in a fresh process (its own `done: ... SPS` line is
the result). Contenders alternate within every round (A B A B ...), so load from other jobs hits them alike:

    default  the variable OMP_NUM_THREADS removed: what a user gets who sets nothing
    omp1     OMP_NUM_THREADS=1: the manual fix

With `--old <file>` the same pair is measured for another version of the script as well (e.g. the one before
`--torch-threads`: `git show <commit>:vlmrm_dqn_classic.py > /tmp/old/vlmrm_dqn_classic.py`).

    python benchmarks/bench_threads.py --old /tmp/old/vlmrm_dqn_classic.py --repeats 3
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load, machine  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def run(script: str, omp1: bool, flags: list[str]) -> float:
    """Steps per second of one fresh run, from the script's own `done:` line."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp1:
        env["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as cwd:  # runs/ lands here, not in the repository
        proc = subprocess.run([sys.executable, script, *flags], cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    match = re.search(r"^done: .*\((\d+) SPS\)", proc.stdout, re.M)
    if proc.returncode != 0 or not match:
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-2000:])
        raise RuntimeError(f"{script} failed with exit code {proc.returncode}")
    return float(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", help="another version of vlmrm_dqn_classic.py to measure the same way")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each runs every contender once")
    parser.add_argument("--total-timesteps", type=int, default=20_000)
    parser.add_argument("--learning-starts", type=int, default=1_000)
    args = parser.parse_args()
    flags = ["--reward", "gt", "--total-timesteps", str(args.total_timesteps), "--learning-starts", str(args.learning_starts)]
    scripts = {"new": str(REPO / "vlmrm_dqn_classic.py")}
    if args.old:
        scripts = {"old": str(Path(args.old).resolve()), **scripts}
    contenders = [(version, mode) for version in scripts for mode in ("default", "omp1")]

    print(machine())
    print(
        f"DQN CartPole-v1, {' '.join(flags)}; {os.cpu_count()} cores; scripts: "
        + ", ".join(f"{v} = {p}" for v, p in scripts.items())
    )
    print(f"{'round':>5} {'version':>7} {'threads':>8} {'SPS':>7}  load")
    sps: dict[tuple[str, str], list[float]] = {c: [] for c in contenders}
    for r in range(args.repeats):
        for version, mode in contenders:
            value = run(scripts[version], mode == "omp1", flags)
            sps[(version, mode)].append(value)
            print(f"{r + 1:>5} {version:>7} {mode:>8} {value:>7.0f}  {load()}", flush=True)

    print("\nmedian SPS (min-max):")
    for c, values in sps.items():
        print(f"  {c[0]:>4} {c[1]:>8}: {statistics.median(values):7.0f} ({min(values):.0f}-{max(values):.0f})")

    # ratios of the same round (interleaved neighbours), then their median
    def ratio(a: tuple[str, str], b: tuple[str, str]) -> str:
        ratios = [x / y for x, y in zip(sps[a], sps[b])]
        return f"{statistics.median(ratios):.2f} (per round: {', '.join(f'{x:.2f}' for x in ratios)})"

    lines = [f"new default / new OMP_NUM_THREADS=1 = {ratio(('new', 'default'), ('new', 'omp1'))}"]
    if "old" in scripts:
        lines += [
            f"old default / old OMP_NUM_THREADS=1 = {ratio(('old', 'default'), ('old', 'omp1'))}",
            f"new default / old default = {ratio(('new', 'default'), ('old', 'default'))}",
        ]
    print("\n".join(lines))
    print("summary: " + "; ".join(lines))


if __name__ == "__main__":
    main()
