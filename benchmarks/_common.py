"""Helpers shared by the benchmark scripts: machine description, worker subprocesses, tables.

Every benchmark runs each measurement in a fresh Python subprocess (same interpreter, same flags), so one
run's allocator, thread pool or forked envs never leak into the next, and interleaves the contenders
(A B A B ...) so that a burst of load from other jobs on a shared machine hits both sides alike.
"""

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# `import vlmrm_sac_humanoid as ours` from the repository root, or from VLMRM_BENCH_SCRIPTS: a folder holding another
# version of the two scripts (e.g. a commit's, `git show HEAD:vlmrm_sac_humanoid.py > /tmp/v/vlmrm_sac_humanoid.py`)
SCRIPTS = Path(os.environ.get("VLMRM_BENCH_SCRIPTS", REPO)).resolve()
sys.path.insert(0, str(SCRIPTS))

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])


def machine() -> str:
    """One line: CPU model and cores, GPU, torch version, load average now."""
    cpu = platform.processor() or "cpu"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{cpu}, {os.cpu_count()} cores, {gpu}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"Python {platform.python_version()}, load average {load()}\nscripts: {scripts()}"
    )


def scripts() -> str:
    """Which version of our scripts is measured: folder and a short hash of each file."""
    import hashlib

    sums = [
        f"{name} {hashlib.sha1((SCRIPTS / name).read_bytes()).hexdigest()[:8]}"
        for name in ("vlmrm_sac_humanoid.py", "vlmrm_dqn_classic.py")
        if (SCRIPTS / name).exists()
    ]
    return f"{SCRIPTS} ({', '.join(sums)})"


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def run_worker(script: str, payload: dict, timeout: float = 1800) -> dict:
    """Run `python script --worker '<json>'` in a fresh process; its last stdout line is a JSON result."""
    cmd = [sys.executable, script, "--worker", json.dumps(payload)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=os.environ.get("BENCH_CWD"))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise RuntimeError(f"worker {payload} failed with exit code {proc.returncode}")
    return json.loads(lines[-1])


def pin_threads(threads: int) -> None:
    """torch intra-op threads for this process (0: torch's default), kept even when a script's `main` would set its own
    (their `--torch-threads` default is 1 on CPU): the benchmark's flag decides, for every version of the scripts."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    torch.set_num_threads = lambda n: None


def worker_payload() -> dict | None:
    """The JSON payload when this process was started as a worker, else None."""
    if len(sys.argv) >= 3 and sys.argv[1] == "--worker":
        payload = json.loads(sys.argv[2])
        pin_threads(payload.get("threads", 0))  # the same for every contender (0: torch's default)
        return payload
    return None


def run_main(ours, args) -> dict:
    """Run one of our scripts' `main(args)` quietly; parse its last line, "done: N steps in E s (S SPS); time in
    env a s, render b s, reward_model c s, learning d s", into {"sps": S, "env": a, ..., "learning": d}."""
    import contextlib
    import io
    import re

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ours.main(args)
    done = [line for line in out.getvalue().splitlines() if line.startswith("done:")][-1]
    parts = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) s", done.split("time in", 1)[1])}
    return dict(sps=int(re.search(r"\((\d+) SPS\)", done).group(1)), **parts)


def emit(result: dict) -> None:
    print(json.dumps(result), flush=True)


def main_or_worker(main, worker) -> None:
    """A benchmark's entry point: `main()` runs the comparison; started as a worker (`--worker <json>`), the process
    measures one contender and prints its result as one JSON line."""
    import warnings

    warnings.filterwarnings("ignore")
    payload = worker_payload()
    if payload is None:
        main()
    else:
        emit(worker(payload))


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(xs: list[float]) -> str:
    """min-max of repeated measurements, as a +-% of the median: how noisy the machine was."""
    m = median(xs)
    return f"{min(xs) / m * 100 - 100:+.0f}/{max(xs) / m * 100 - 100:+.0f}%" if m else "-"


def table(header: list[str], rows: list[list]) -> str:
    """A GitHub-markdown table (readable in a terminal too)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([fmt(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(r) for r in cells[1:]])


class Clock:
    """Wall-clock stopwatch for the whole benchmark."""

    def __init__(self):
        self.start = time.perf_counter()

    def __str__(self) -> str:
        return f"{time.perf_counter() - self.start:.0f} s"
