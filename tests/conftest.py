"""Shared helpers: the tiny random CLIP config, running a script as a user would, reading TensorBoard."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import open_clip  # noqa: F401  (imported before any EGL context: importing it after one can crash)
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TINY_CLIP = str(ROOT / "tests" / "vlmrm-tiny-test.json")
TINY_CLIP_FLAGS = ["--clip-model", TINY_CLIP, "--clip-pretrained", "none"]

sys.path.insert(0, str(ROOT))
os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
# Mesa's software renderer draws in this process's own thread pool (llvmpipe), then a test forks env workers: a child
# forked while that pool exists hangs for ever creating its GL context (seen in CI; reproduced with a test that draws
# in process followed by a subprocess-env run). With no pool, llvmpipe draws in the calling thread. The training
# scripts fork their env workers before drawing anything in process, so only a process that runs several does this.
os.environ.setdefault("LP_NUM_THREADS", "0")
# one torch thread, here and in every script the tests start: the small networks gain nothing from more, and on a
# shared CPU more threads make them several times slower (the scripts also default to 1: --torch-threads)
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def run_script(script: str, *args: str, cwd: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `python <script> <args>` from `cwd`, the way a user types it."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, str(ROOT / script), *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def only_run(cwd: Path) -> Path:
    """The one run folder a test's command wrote under cwd/runs."""
    (run_dir,) = (cwd / "runs").iterdir()
    return run_dir


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """All scalars of a TensorBoard run folder: tag -> [(step, value), ...]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_clean_error(result: subprocess.CompletedProcess, *words: str) -> None:
    """Bad input: non-zero exit, one sentence on stderr starting with 'error:', no traceback."""
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word.lower() in lines[0].lower(), (word, lines[0])


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """Run in a temporary folder so runs/ and videos/ do not land in the repo."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def interrupt_after(script: str, *args: str, cwd: Path, sig: int, after_lines: int, timeout: int = 300) -> tuple[int, str]:
    """Start `python <script> <args> --log-episodes`, send `sig` once it has printed `after_lines` episode lines.

    Returns (exit code, stdout)."""
    import signal as _signal  # noqa: F401  (callers pass signal.SIGINT / SIGTERM)

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / script), *args, "--log-episodes"],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    lines, seen = [], 0
    for line in proc.stdout:
        lines.append(line)
        seen += line.startswith("global_step=")
        if seen == after_lines:
            proc.send_signal(sig)
            break
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, "".join(lines) + out + err


def assert_refused(module, flags: list[str], *words: str) -> str:
    """In process (fast): the flags, parsed as from the command line, raise the script's UserError before any work.

    The path from UserError to `error: <sentence>` and exit code 2 is checked once per script through a real
    subprocess; this checks each message: one sentence that names what is wrong.
    """
    import tyro

    import vlmrm_utils

    outputs = lambda: sorted(Path("runs").rglob("*")) if Path("runs").exists() else None  # noqa: E731
    before = outputs()
    with pytest.raises(vlmrm_utils.UserError) as error:
        module.main(tyro.cli(module.Args, args=flags))
    message = str(error.value)
    assert "\n" not in message and message.endswith("."), message
    for word in words:
        assert word.lower() in message.lower(), (word, message)
    assert outputs() == before  # refused before any output (tests run in a temporary folder)
    return message


def run_timed(
    script: str, *args: str, cwd: Path, env: dict | None = None, timeout: int = 120
) -> tuple[int, list[tuple[float, str]]]:
    """Run `python <script> <args>`; (exit code, [(seconds since start, line)] of stdout and stderr together)."""
    import time

    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / script), *args],
        cwd=cwd,
        env=full_env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append((time.monotonic() - start, line.rstrip("\n")))
            if time.monotonic() - start > timeout:
                break
        return proc.wait(timeout=max(1, timeout - (time.monotonic() - start))), lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def pytest_terminal_summary(terminalreporter) -> None:
    """Say why tests were skipped even without -rs: a skip is a check that did not run (e.g. no Chromium)."""
    if "s" in getattr(terminalreporter, "reportchars", ""):
        return  # pytest lists them itself
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        terminalreporter.write_line(f"SKIPPED {report.nodeid}: {reason.removeprefix('Skipped: ')}", yellow=True)


# pytest-xdist hands whole files to the workers in collection order (pyproject: --no-loadscope-reorder): these files,
# minutes of CLIP training and learning runs each, go first (xdist's own order, most tests first, handed them out last)
SLOWEST_FILES = ["test_language_proof.py", "test_sac_language_proof.py", "test_sweep.py", "test_reliability.py"]


def pytest_collection_modifyitems(items) -> None:
    """The slowest files first, then the others as collected; each file's tests in their own order."""
    items.sort(key=lambda item: SLOWEST_FILES.index(item.path.name) if item.path.name in SLOWEST_FILES else len(SLOWEST_FILES))


def children(pid: int) -> list[str]:
    """The processes whose parent is `pid` (/proc), read safely while processes come and go."""
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] == str(pid):
                found.append(p)
        except (OSError, IndexError):  # ended meanwhile
            pass
    return found
