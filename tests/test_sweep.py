"""sweep.py: a 2x2 grid end to end on submitit's local executor, a preempted job resumes exactly, failed points, kills
and concurrent sweeps, bad grids and names; SLURM when present."""

import contextlib
import csv
import fcntl
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, TINY_CLIP_FLAGS, assert_clean_error, read_scalars

from sweep import slurm_answers, stopped_early, write_state
from vlmrm_utils import UserError, cli

SWEEP = [sys.executable, str(ROOT / "sweep.py"), "--script", str(ROOT / "vlmrm_dqn_classic.py"), "--gpus-per-job", "0"]
SHORT_GT = ["--", "--reward", "gt", "--total-timesteps", "1000", "--learning-starts", "500", "--eval-episodes", "1"]
# fixed-length CLIP episodes (tiny random model): the resume is bit-exact with --save-buffer; 8 episodes, so a stop
# sent after the first one lands mid-run even at a few hundred steps per second
CLIP = ["--", *TINY_CLIP_FLAGS, "--learning-starts", "300", "--eval-episodes", "1", "--log-episodes"]
SHORT_CLIP = [*CLIP, "--total-timesteps", "1600"]  # the tests signal a job after its first episodes


needs_slurm = pytest.mark.skipif(not slurm_answers(), reason="no SLURM cluster here (.ci/slurm-single-node.sh starts one)")


def dead_slurm(tmp_path: Path) -> dict:
    """An environment where SLURM's commands are installed but no controller answers (a laptop with slurm-client)."""
    bin_dir = tmp_path / "dead-slurm-bin"
    bin_dir.mkdir()
    for command in ["sbatch", "scontrol", "sinfo", "squeue"]:  # what they print when slurmctld is down, and exit 1
        (bin_dir / command).write_text("#!/bin/sh\necho 'Unable to contact slurm controller (connect failure)' >&2\nexit 1\n")
        (bin_dir / command).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def sweep(*args: str, cwd: Path, env: dict | None = None, **kwargs) -> subprocess.Popen:
    env = {**(env or os.environ), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [*SWEEP, *args], cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs
    )


@pytest.fixture(autouse=True)
def same_scripts_for_the_other_tests():
    """sweep.py imports --script from its file into sys.modules (tyro reads the flags' help from the source): run
    in-process, it would leave this worker's later tests a second copy of the training script beside the tools' one."""
    modules = dict(sys.modules)
    yield
    for name, module in modules.items():
        if sys.modules.get(name) is not module:
            sys.modules[name] = module


def sweep_here(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """sweep.py's command line run in this process (no interpreter or torch to start): its exit code and what it printed.
    The real process's exit 2 and one line are checked by test_bad_grid_is_one_sentence."""
    import sweep as sweep_module

    argv, before = [*SWEEP[2:], *args], os.getcwd()
    split = argv.index("--") if "--" in argv else len(argv)
    out, err, code = io.StringIO(), io.StringIO(), 0
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli(lambda a: sweep_module.main(a, argv[split + 1 :]), sweep_module.Args, argv=argv[:split])
    except SystemExit as e:
        code = e.code
    finally:
        os.chdir(before)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def table(cwd: Path, name: str) -> list[dict]:
    with open(cwd / "sweeps" / name / "sweep.csv") as f:
        return list(csv.DictReader(f))


def test_local_grid_end_to_end_then_rerun_skips_finished(tmp_path):
    proc = sweep(  # --cluster auto where sbatch is installed but no controller answers: local, at once
        "--cluster",
        "auto",
        "--name",
        "g",
        "--max-parallel",
        "4",
        "--grid",
        "alpha=0,0.5",
        "seed=1,2",
        *SHORT_GT,
        cwd=tmp_path,
        env=dead_slurm(tmp_path),
    )
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert "no SLURM controller answers (`scontrol ping`): running locally" in out and ") on local;" in out, out
    assert out.count(": done (") == 4, out  # one progress line per finished job
    rows = table(tmp_path, "g")
    assert [(r["alpha"], r["seed"], r["status"], r["steps"]) for r in rows] == [
        ("0", "1", "done", "1000"),
        ("0", "2", "done", "1000"),
        ("0.5", "1", "done", "1000"),
        ("0.5", "2", "done", "1000"),
    ]
    for r in rows:
        assert (tmp_path / r["run_dir"] / "checkpoint.pt").is_file() and float(r["gt_success"]) <= 1
        assert r["run_dir"].startswith("runs/CartPole-v1__g-alpha=") and float(r["gt_return"]) > 0
    assert (tmp_path / "sweeps" / "g" / "sweep.md").read_text().count("| done |") == 4

    again = sweep("--cluster", "local", "--name", "g", "--grid", "alpha=0,0.5", "seed=1,2", *SHORT_GT, cwd=tmp_path)
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0 and "4 finished" in out and ": done (" not in out, out  # nothing ran again
    assert table(tmp_path, "g") == rows


def check_preemption_resumes_exactly(tmp_path: Path, cluster: str, preempt, plain_steps: str = "1600") -> None:
    """Preempt the job of one point mid-run: the script checkpoints, the job is requeued and resumes; every logged
    episode equals an uninterrupted run's (the first point of the plain sweep, whose other points must finish too)."""
    flags = ["--cluster", cluster, "--cpus-per-job", "1", "--mem-gb", "2", "--grid"]
    plain = sweep("--name", "plain", *flags, f"total-timesteps={plain_steps}", *CLIP, "--seed", "3", cwd=tmp_path)
    preempted = sweep("--name", "preempted", *flags, "total-timesteps=1600", *CLIP, "--seed", "3", cwd=tmp_path)
    point = tmp_path / "sweeps" / "preempted" / "total-timesteps=1600"
    wait_for_episodes(point, preempted, 1)
    preempt(point)
    out_plain, _ = plain.communicate(timeout=600)
    out, _ = preempted.communicate(timeout=600)
    assert plain.returncode == 0 and preempted.returncode == 0, out_plain + out
    log = (point / "train.log").read_text()
    assert log.count("SIGTERM received") == 1 and log.count("\n$ ") == 2 and " --resume " in log, log  # stopped, resumed
    saved = re.search(r"checkpoint saved at step (\d+)", log)
    assert saved and f"resumed at step {saved.group(1)}" in log and int(saved.group(1)) < 1600, log  # mid-run
    (a, *others), (b,) = table(tmp_path, "plain"), table(tmp_path, "preempted")
    assert [r["status"] for r in [a, *others, b]] == ["done"] * (2 + len(others)), out_plain
    for column in ["steps", "gt_return", "gt_success", "clip_return", "eval_gt_return"]:
        assert a[column] == b[column], (column, a, b)
    scalars_a, scalars_b = read_scalars(tmp_path / a["run_dir"]), read_scalars(tmp_path / b["run_dir"])
    for tag in ["charts/episodic_return", "charts/gt_return", "charts/clip_return", "eval/gt_return"]:
        assert len(scalars_a[tag]) >= 1 and scalars_a[tag] == scalars_b[tag], tag  # no episode lost or changed


def test_local_preempted_job_resumes_with_the_same_numbers(tmp_path):
    # SIGUSR2 is submitit's preemption/timeout signal (its local executor sends it before --timeout-min)
    check_preemption_resumes_exactly(tmp_path, "local", lambda point: signal_job(point, signal.SIGUSR2))


def signal_job(point: Path, sig: int) -> None:
    os.kill(int((point / "job.pid").read_text()), sig)


def wait_for_episodes(point: Path, proc: subprocess.Popen, episodes: int) -> None:
    deadline = time.time() + 300
    while not ((point / "train.log").exists() and (point / "train.log").read_text().count("global_step=") >= episodes):
        assert time.time() < deadline and proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)


def test_local_stopped_job_is_stopped_and_a_rerun_resumes_it(tmp_path):
    """SIGTERM to a job (someone stops it): the script checkpoints, the point is stopped; the same command resumes it."""
    command = ["--cluster", "local", "--name", "stop", "--grid", "seed=4", *SHORT_CLIP]
    proc, point = sweep(*command, cwd=tmp_path), tmp_path / "sweeps" / "stop" / "seed=4"
    wait_for_episodes(point, proc, 1)
    signal_job(point, signal.SIGTERM)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "seed=4: stopped at a checkpoint" in out, out
    assert table(tmp_path, "stop")[0]["status"] == "stopped"
    again = sweep(*command, cwd=tmp_path)
    out, _ = again.communicate(timeout=600)
    assert again.returncode == 0 and "(0 finished, 1 to resume, 0 to start)" in out and "seed=4: done (" in out, out
    (row,) = table(tmp_path, "stop")
    assert row["status"] == "done" and row["steps"] == "1600", row
    log = (point / "train.log").read_text()
    saved = re.search(r"checkpoint saved at step (\d+)", log)
    assert log.count("SIGTERM received") == 1 and saved and int(saved.group(1)) < 1600, log  # stopped mid-run
    assert f"resumed at step {saved.group(1)}" in log, log


def test_bad_grid_is_one_sentence(tmp_path):
    result = subprocess.run([*SWEEP, "--grid", "alpah=0,1"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert_clean_error(result, "no flag --alpah")
    result = subprocess.run([*SWEEP, "--grid", "alpha=0,x"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert_clean_error(result, "alpha=x", "float")
    result = subprocess.run([*SWEEP, "--", "--resume", "x.pt"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert_clean_error(result, "--resume")
    result = subprocess.run(
        [*SWEEP, "--cluster", "slurm"], cwd=tmp_path, env=dead_slurm(tmp_path), capture_output=True, text=True, timeout=120
    )
    assert_clean_error(result, "--cluster slurm", "no SLURM controller answers")
    assert not (tmp_path / "sweeps").exists()


def test_refused_grids_and_names_are_one_sentence(tmp_path):
    def refused(*args: str) -> subprocess.CompletedProcess:
        return sweep_here("--cluster", "local", *args, cwd=tmp_path)

    assert_clean_error(refused("--grid", "seed=1,1"), "same point twice (seed=1 and seed=1)")
    assert_clean_error(refused("--grid", "alpha=0,0.0"), "same point twice", "alpha=0 and alpha=0.0")
    assert_clean_error(refused("--grid", "seed=1,2", "--", "--seed", "5"), "--seed is also given after --")
    assert_clean_error(refused("--grid", "realistic=true,false", "--", "--no-realistic"), "--realistic is also given")
    for name in ["..", ".", "a/b", str(tmp_path / "abs")]:
        assert_clean_error(refused("--name", name), "is not a plain folder name")
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)  # nothing written anywhere, the parent included
    assert not (tmp_path.parent / "submitit").exists() and not (tmp_path.parent / "sweep.lock").exists()


def test_a_name_that_is_a_symbolic_link_loop_is_one_sentence(tmp_path):
    (tmp_path / "sweeps").mkdir()
    os.symlink("loop", tmp_path / "sweeps" / "loop")  # a link to itself: Path.resolve raised RuntimeError
    result = sweep_here("--cluster", "local", "--name", "loop", cwd=tmp_path)
    assert result.returncode == 2, result
    assert_clean_error(result, "--name", "sweeps/loop is a symbolic link to loop, which loops")


FAST = ["--gpus-per-job", "0", "--cpus-per-job", "1", "--cluster", "local"]
# learning-starts=5000 fails at once (not below --total-timesteps), learning-starts=100 trains 400 ground-truth steps
MIXED = [*FAST, "--name", "m", "--grid", "learning-starts=100,5000", "--", "--reward", "gt", "--total-timesteps", "400"]


def test_failed_points_say_so_exit_non_zero_and_a_rerun_skips_the_done_ones(tmp_path):
    out = subprocess.run([*SWEEP, *MIXED], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "learning-starts=5000: failed: error: --learning-starts 5000 is not below" in out.stdout, out.stdout
    assert "sweep m: 1 done, 1 failed;" in out.stdout and "Traceback" not in out.stdout + out.stderr, out.stdout
    done, failed = table(tmp_path, "m")
    assert (done["status"], done["steps"], done["error"]) == ("done", "400", ""), done
    assert failed["status"] == "failed" and failed["error"].startswith("error: --learning-starts 5000 is not below"), failed
    assert "| failed |" in (tmp_path / "sweeps" / "m" / "sweep.md").read_text()
    assert not list((tmp_path / "sweeps" / "m" / "submitit").glob("%*")), "a literal %j folder"  # submitit's logs only

    # an empty done.json (a crash mid-write by an older version) and a cut state.json: not done, a warning, no traceback
    point_done, point_failed = (tmp_path / "sweeps" / "m" / f"learning-starts={v}" for v in [100, 5000])
    (point_failed / "done.json").write_text("")
    (point_failed / "state.json").write_text('{"wall_s": 1')
    rows = table(tmp_path, "m")
    again = subprocess.run([*SWEEP, *MIXED], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and "Traceback" not in again.stdout + again.stderr, again.stdout + again.stderr
    assert f"warning: {point_failed / 'done.json'} is empty or not valid JSON" in again.stderr, again.stderr
    assert "(1 finished, 0 to resume, 1 to start)" in again.stdout and "learning-starts=5000: failed: " in again.stdout
    assert ": done (" not in again.stdout and table(tmp_path, "m")[0] == rows[0]  # the done point did not run again
    assert json.loads((point_failed / "state.json").read_text())["segments"] == 1  # rewritten whole, from zero


def test_state_files_are_replaced_whole(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    write_state(path, {"wall_s": 1.0})

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)  # the write fails once the file is open: the old one stays whole
    with pytest.raises(UserError, match="No space left on device"):  # one sentence naming the file
        write_state(path, {"wall_s": 2.0})
    assert json.loads(path.read_text()) == {"wall_s": 1.0} and os.listdir(tmp_path) == ["state.json"]


def test_stopped_or_done_is_read_from_the_checkpoint(tmp_path):
    """A script that exits 0 after a SIGTERM no job sent (someone signalled the script itself): its checkpoint says."""
    import torch

    for name, checkpoint, stopped in [
        ("stopped", {"global_step": 840, "args": {"total_timesteps": 1600}, "q_network": torch.zeros(3)}, True),
        ("done", {"global_step": 1600, "args": {"total_timesteps": 1600}}, False),
        ("final-networks", {"q_network": torch.zeros(3), "args": {"total_timesteps": 1600}}, False),  # nothing to resume
        ("ended-mid-episode", {"global_step": 1500, "args": {"total_timesteps": 1600}}, False),  # final: step-1600.pt
    ]:
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        if name == "ended-mid-episode":
            torch.save({"q_network": torch.zeros(3)}, tmp_path / name / "checkpoints" / "step-1600.pt")
        torch.save(checkpoint, tmp_path / name / "checkpoint.pt")
        assert stopped_early(tmp_path / name) is stopped, name
    assert not stopped_early(tmp_path / "no-run") and not stopped_early(None)


def test_a_rerun_job_waits_for_the_previous_job_of_its_point(tmp_path):
    """job.lock: while a point is held (here by the test, as by a job or script of a killed sweep), no twin starts."""
    command = [*FAST, "--name", "w", "--grid", "seed=1", "--", "--total-timesteps", "400"]  # fails at once when it runs
    point = tmp_path / "sweeps" / "w" / "seed=1"
    point.mkdir(parents=True)
    with open(point / "job.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = sweep(*command, cwd=tmp_path)
        deadline = time.time() + 120
        while "waiting for it" not in "".join(p.read_text() for p in (tmp_path / "sweeps" / "w").glob("submitit/*.out")):
            assert time.time() < deadline and proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        time.sleep(1)
        assert not (point / "train.log").exists()  # the script has not started
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "seed=1: failed: error: --learning-starts" in out, out  # ran once released


def sweep_processes(cwd: Path) -> list[str]:
    """Every process working in `cwd`: a sweep, submitit's controllers and jobs, the training scripts and their envs."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd") == str(cwd):
                found.append(f"{pid} " + Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:120])
        except OSError:  # ended meanwhile, or not ours to read
            pass
    return found


def test_sigkilled_sweep_leaves_nothing_running_and_one_sweep_at_a_time(tmp_path):
    command = [*FAST, "--max-parallel", "2", "--name", "k", "--grid", "seed=1,2", *SHORT_GT[:3], "--total-timesteps"]
    command += ["10000", "--learning-starts", "200", "--eval-episodes", "1", "--log-episodes"]  # 6 s at 1600 steps/s
    proc, points = sweep(*command, cwd=tmp_path), [tmp_path / "sweeps" / "k" / f"seed={s}" for s in [1, 2]]
    lock, deadline = tmp_path / "sweeps" / "k" / "sweep.lock", time.time() + 120
    while not (lock.exists() and lock.read_text()):  # the first sweep holds the folder (while its jobs start)
        assert time.time() < deadline and proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    second = subprocess.run([*SWEEP, *command], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert_clean_error(second, f"sweep k is already running (pid {proc.pid})", "wait for it to end")
    for point in points:
        wait_for_episodes(point, proc, 1)

    os.kill(proc.pid, signal.SIGKILL)  # mid-run: both scripts are training
    proc.wait()
    killed, deadline = time.time(), time.time() + 30
    while sweep_processes(tmp_path):  # each job sees its sweep end: SIGTERM to its script, which saves and exits
        assert time.time() < deadline, sweep_processes(tmp_path)
        time.sleep(0.2)
    print(f"nothing of the sweep left {time.time() - killed:.1f} s after SIGKILL")
    for point in points:
        assert json.loads((point / "state.json").read_text())["status"] == "stopped"

    again = sweep(*command, cwd=tmp_path)  # the lock died with its holder: not refused
    out, _ = again.communicate(timeout=600)
    assert again.returncode == 0 and "(0 finished, 2 to resume, 0 to start)" in out and out.count(": done (") == 2, out
    for point, row in zip(points, table(tmp_path, "k")):
        log = (point / "train.log").read_text()
        starts = re.findall(r"^\$ .*", log, re.M)  # the killed segment, then the rerun's resume of its checkpoint
        assert len(starts) == 2 and " --resume " in starts[1] and log.count("SIGTERM received") == 1, log
        assert row["status"] == "done" and row["steps"] == "10000", row
    assert len(list((tmp_path / "runs").iterdir())) == 2  # one run per point: nothing trained twice


@needs_slurm
def test_slurm_preempted_job_is_requeued_and_resumes_exactly(tmp_path):
    def preempt(point: Path) -> None:  # what submitit's own tests do: SIGTERM, then SIGUSR2, to every process of the job
        squeue = subprocess.run(["squeue", "-h", "-o", "%i", "-n", "preempted"], capture_output=True, text=True, check=True)
        (job_id,) = squeue.stdout.split()
        for sig in ["TERM", "USR2"]:
            subprocess.run(["scancel", "--signal", sig, job_id], check=True)

    # the plain sweep is also the SLURM grid test: a grid of two points (the second one short), submitted together
    check_preemption_resumes_exactly(tmp_path, "slurm", preempt, plain_steps="1600,400")


@needs_slurm
def test_a_job_slurm_refuses_is_one_sentence_naming_the_resource_flags(tmp_path):
    # more GPUs a job than any node has (the CI node has none): sbatch refuses the job when it is submitted
    flags = ["--grid", "seed=1,2", "--cluster", "slurm", "--gpus-per-job", "999", "--", "--total-timesteps", "500"]
    out, _ = sweep(*flags, cwd=tmp_path).communicate(timeout=120)
    lines = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "SLURM refused the job of seed=1" in lines[0] and "--gpus-per-job" in lines[0], out
    assert "Traceback" not in out


def test_a_rerun_with_other_fixed_flags_is_refused_not_reported_as_the_old_runs(tmp_path):
    """A point is its whole command: the same --name with other flags after -- must not show the old runs as its own."""
    command = [*FAST, "--name", "fixA", "--grid", "seed=1", "--", "--reward", "gt", "--learning-starts", "100"]
    first = subprocess.run([*SWEEP, *command, "--total-timesteps", "400"], cwd=tmp_path, capture_output=True, text=True)
    assert first.returncode == 0, first.stdout + first.stderr
    point, rows = tmp_path / "sweeps" / "fixA" / "seed=1", table(tmp_path, "fixA")
    before = (point / "point.json").read_text()
    again = subprocess.run([*SWEEP, *command, "--total-timesteps", "800"], cwd=tmp_path, capture_output=True, text=True)
    assert_clean_error(again, "already has the point seed=1", "--total-timesteps 400", "--total-timesteps 800", "new --name")
    assert (point / "point.json").read_text() == before and table(tmp_path, "fixA") == rows  # nothing rewritten
    same = subprocess.run([*SWEEP, *command, "--total-timesteps", "400"], cwd=tmp_path, capture_output=True, text=True)
    assert same.returncode == 0 and "1 finished" in same.stdout, same.stdout + same.stderr  # its own command still reruns


def test_scripts_names_and_values_that_are_not_what_they_seem_are_one_sentence(tmp_path):
    def refused(*args: str) -> subprocess.CompletedProcess:
        return sweep_here("--cluster", "local", *args, cwd=tmp_path)

    (tmp_path / "noargs.py").write_text("x = 1\n")
    assert_clean_error(refused("--script", str(ROOT / "README.md")), "README.md is not a Python file")
    assert_clean_error(refused("--script", "noargs.py"), "noargs.py has no Args")
    (tmp_path / "broken.py").write_text("def (\n")
    assert_clean_error(refused("--script", "broken.py"), "broken.py cannot be imported", "SyntaxError")
    assert_clean_error(refused("--grid", "goal=pole up|pole up "), "same point twice")  # a trailing space: one prompt
    (tmp_path / "sweeps").mkdir()
    (tmp_path / "sweeps" / "afile").write_text("")
    assert_clean_error(refused("--name", "afile"), "--name afile", "is a file")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["afile", "broken.py", "noargs.py", "sweeps"]


def test_a_script_that_fails_silently_is_named_by_its_exit_code(tmp_path):
    script = tmp_path / "silent.py"
    script.write_text(
        "import sys\nfrom dataclasses import dataclass\n\n\n@dataclass\nclass Args:\n    seed: int = 1\n"
        "    total_timesteps: int = 1\n\n\nif __name__ == '__main__':\n    sys.exit(3)\n"
    )
    result = subprocess.run(
        [*SWEEP[:2], "--script", str(script), *FAST, "--name", "s", "--grid", "seed=1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "seed=1: failed: exit code 3 without printing anything (see " in result.stdout, result.stdout
    assert table(tmp_path, "s")[0]["error"].startswith("exit code 3 without printing anything")


def test_two_sweeps_started_at_once_into_one_new_folder_one_is_refused(tmp_path, monkeypatch):
    """The folder did not exist when both looked; the other sweep made and locked it while this one read its grid."""
    import sweep as sweep_module

    monkeypatch.chdir(tmp_path)
    parse, holder = sweep_module.grid_points, []

    def other_sweep_meanwhile(*args):
        (tmp_path / "sweeps" / "twin").mkdir(parents=True)
        holder.append(open(tmp_path / "sweeps" / "twin" / "sweep.lock", "w"))
        fcntl.flock(holder[0], fcntl.LOCK_EX)
        holder[0].write("4242")
        holder[0].flush()
        return parse(*args)

    monkeypatch.setattr(sweep_module, "grid_points", other_sweep_meanwhile)
    monkeypatch.setattr(sweep_module.submitit, "AutoExecutor", lambda **kw: pytest.fail("the second sweep went on"))
    args = sweep_module.Args(script=str(ROOT / "vlmrm_dqn_classic.py"), name="twin", cluster="local", grid=("seed=1",))
    with pytest.raises(sweep_module.UserError, match=r"sweep twin is already running \(pid 4242\)"):
        sweep_module.main(args, [])
    assert not (tmp_path / "sweeps" / "twin" / "seed=1").exists()


def test_the_table_has_no_tensorboard_warnings_about_a_resumed_runs_purge(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path)) as writer:
        for step in range(1, 6):
            writer.add_scalar("charts/episodic_length", step, step)
    time.sleep(1.1)  # the resumed run's event file sorts after the first
    with SummaryWriter(str(tmp_path), purge_step=3) as writer:  # what --resume does after a crash
        for step in range(3, 6):
            writer.add_scalar("charts/episodic_length", step, step)
    code = f"import sweep; print(sweep.final_numbers({str(tmp_path)!r}, 10))"  # a process of its own: pytest keeps no log
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.stdout == "{'steps': 5}\n" and result.stderr == "", result.stdout + result.stderr
