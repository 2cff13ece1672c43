"""Grid sweeps of a training script through submitit: one SLURM job per grid point, or local processes without SLURM.

Preemption-safe (the job has the script checkpoint, then requeues itself and resumes); a rerun skips finished points
and resumes the others; each run's final numbers end up in sweeps/<sweep>/sweep.csv and sweep.md. See docs/sweep.md.

    python sweep.py --script vlmrm_dqn_classic.py --grid alpha=0,0.5 seed=1,2 -- --total-timesteps 100000
"""

import contextlib
import csv
import dataclasses
import fcntl
import hashlib
import importlib.util
import io
import itertools
import json
import logging
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal, Optional

import submitit
import tyro

from vlmrm_tools import write_atomic
from vlmrm_utils import UserError, check_writable, cli


@dataclass
class Args:
    script: str = "vlmrm_dqn_classic.py"
    """the training script to sweep; its fixed flags go after `--`"""
    grid: tuple[str, ...] = ()
    """axes `flag=v1,v2,...` of any flag of the script (alpha=0,0.5 seed=1,2); for values with commas, separate with `|`"""
    name: Optional[str] = None
    """the sweep's folder is sweeps/<name>; default: the script's name and a hash of the fixed flags"""
    cluster: Literal["auto", "slurm", "local"] = "auto"
    """slurm: one SLURM job per point; local: submitit's local executor; auto: slurm if a SLURM controller answers"""
    max_parallel: int = 0
    """most jobs running at once; 0: all on SLURM, one per `--cpus-per-job` cores locally"""
    partition: Optional[str] = None
    """SLURM partition (default: the cluster's)"""
    gpus_per_job: int = 1
    """GPUs per job (SLURM; locally the job sees GPU 0 when this is > 0)"""
    cpus_per_job: int = 4
    """CPU cores per job"""
    mem_gb: float = 32.0
    """memory per job (SLURM)"""
    timeout_min: int = 24 * 60
    """time limit of one job; a job that reaches it checkpoints and is requeued"""
    last_episodes: int = 10
    """the table's returns are the mean of each run's last n episodes"""


SWEEP_FLAGS = ["--save-model", "--save-buffer"]  # every run checkpoints its buffer too, so a resume is exact
OWN_FLAGS = {"exp-name", "resume", "evaluate"}  # the sweep sets or forbids these


class PointJob(submitit.helpers.Checkpointable):
    """One grid point: runs (or resumes) the training script, forwards preemption to it, records how it ended."""

    def __init__(self, command: list[str], exp_name: str, folder: str, workdir: str, sweep_pid: Optional[int] = None):
        self.command, self.exp_name, self.folder, self.workdir = command, exp_name, Path(folder), workdir
        self.sweep_pid = sweep_pid  # local jobs end with their sweep (a SIGKILLed sweep leaves no orphan training)
        self._proc, self._offset, self._start, self._signalled = None, 0, 0.0, False
        self._sweep_gone = threading.Event()

    def __getstate__(self) -> dict:  # the subprocess stays behind when submitit pickles the job to requeue it
        state = {**self.__dict__, "_proc": None, "_offset": 0, "_start": 0.0, "_signalled": False}
        return {k: v for k, v in state.items() if k != "_sweep_gone"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _sweep_gone=threading.Event())

    def run_dir(self) -> Optional[Path]:
        """This point's run folder: the newest one with a checkpoint, else the newest."""
        runs = sorted(Path(self.workdir, "runs").glob(f"*__{self.exp_name}__*"), key=lambda p: p.stat().st_mtime)
        return ([r for r in runs if (r / "checkpoint.pt").exists()] or runs or [None])[-1]

    def segment_log(self) -> str:
        """What the script printed since this job started it."""
        with open(self.folder / "train.log", errors="replace") as f:
            f.seek(self._offset)
            return f.read()

    def watch_sweep(self) -> None:
        """Sets _sweep_gone when the local sweep process ends, however it ends (a pidfd is readable once it exits)."""
        try:
            fd = os.pidfd_open(self.sweep_pid)
        except ProcessLookupError:
            return self._sweep_gone.set()
        select.select([fd], [], [])
        os.close(fd)
        self._sweep_gone.set()

    def hold_point(self) -> Optional[int]:
        """This point's job.lock, so a rerun never runs a point twice: a job (or a training script it started) of a
        killed sweep may still be saving its checkpoint; wait for it. None when the sweep ended meanwhile."""
        fd = os.open(self.folder / "job.lock", os.O_RDWR | os.O_CREAT, 0o644)
        announced = False
        while not self._sweep_gone.is_set():
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if not announced:
                    print("the previous job of this point is still running: waiting for it", flush=True)
                    announced = True
                time.sleep(0.5)
        os.close(fd)
        return None

    def __call__(self) -> dict:
        local = self.sweep_pid is not None and os.environ.get("SUBMITIT_EXECUTOR") == "local"
        if local:
            threading.Thread(target=self.watch_sweep, daemon=True).start()
        lock_fd = self.hold_point() if local else None
        if local and lock_fd is None:
            return {"status": "stopped", "last_line": "the sweep ended before this job started"}
        done = read_state(self.folder / "done.json")
        if done:  # finished before a requeue or a rerun
            return done
        (self.folder / "job.pid").write_text(str(os.getpid()))  # to signal this job by hand (or in the tests)
        run = self.run_dir()
        resume = run is not None and (run / "checkpoint.pt").exists()
        cmd = [sys.executable, *([self.command[0], "--resume", str(run / "checkpoint.pt")] if resume else self.command)]
        with open(self.folder / "train.log", "a") as log:
            log.write(f"\n$ {shlex.join(cmd)}\n")
            log.flush()
            self._offset, self._start = log.tell(), time.time()
            # SLURM signals every process of the job: the script must not die of submitit's SIGUSR2 (default action: exit).
            # The script inherits job.lock: a rerun waits until the script itself has ended, even if this job was killed.
            self._proc = subprocess.Popen(
                cmd,
                cwd=self.workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                preexec_fn=ignore_user_signals,
                pass_fds=() if lock_fd is None else (lock_fd,),
            )
        threading.Thread(target=self._proc.wait, daemon=True).start()  # only this thread waits: no lock in signal handlers
        # SIGTERM to this job: checkpoint, then end. On SLURM the script got the same signal (SLURM signals every
        # process of a job step); a second SIGTERM would make it quit without saving.
        signal.signal(signal.SIGTERM, lambda *_: self.stop_script(forward=os.environ.get("SUBMITIT_EXECUTOR") != "slurm"))
        while self._proc.returncode is None:
            if self._sweep_gone.is_set():  # the sweep was killed: the script saves and exits, then so does this job
                self.stop_script()
            time.sleep(0.2)
        return self.record()

    def record(self) -> dict:
        """Add this segment's wall time and how it ended, from the exit code and the run's checkpoint: done (exit 0, the
        run reached its last step), stopped (exit 0 at an earlier checkpoint: a rerun resumes it) or failed."""
        proc, self._proc = self._proc, None  # recorded once
        if proc is None:
            return {}
        state = read_state(self.folder / "state.json") or {}
        rc, run, text = proc.returncode, self.run_dir(), self.segment_log()
        # exit 0 after a stop this job asked for: stopped (a rerun of a run that had just ended finishes at once); else
        # its checkpoint says whether it was stopped by someone else (reading it costs a torch import: seconds)
        status = ("stopped" if self._signalled or stopped_early(run) else "done") if rc == 0 else "failed"
        if rc < 0 and self._signalled and -rc in (signal.SIGTERM, signal.SIGINT):
            # our stop came after its last step (its final evaluation: SIGTERM ends the script at once); a rerun resumes
            # at that step to evaluate again, unless the checkpoint holds the final networks only: then the run is done
            status = "stopped" if checkpoint_step(run) is not None else "done"
        elif rc < 0:
            text += f"\nkilled by {signal.Signals(-rc).name}"
        result = {
            "status": status,
            "exit_code": rc,
            "run_dir": str(run or ""),
            "wall_s": state.get("wall_s", 0.0) + time.time() - self._start,
            "segments": state.get("segments", 0) + 1,
            "last_line": next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")
            or f"exit code {rc} without printing anything (see {self.folder / 'train.log'})",
        }
        write_state(self.folder / "state.json", result)
        if status == "done":
            write_state(self.folder / "done.json", result)
        return result

    def stop_script(self, forward: bool = True, wait: bool = False) -> None:
        """Have the script save a checkpoint at its next episode boundary and exit: one SIGTERM, never two."""
        proc = self._proc
        if proc is not None and proc.returncode is None and not self._signalled:
            self._signalled = True
            time.sleep(1.0)  # a signal to the whole process group reached the script too: it says so at once
            if forward and not re.search(r"^SIG(TERM|INT) received", self.segment_log(), re.M):
                proc.send_signal(signal.SIGTERM)
        while wait and proc is not None and proc.returncode is None:
            time.sleep(0.2)

    def checkpoint(self, *args, **kwargs) -> submitit.helpers.DelayedSubmission:
        """submitit's preemption or timeout signal: the script checkpoints, then the same job is requeued and resumes."""
        self.stop_script(wait=True)
        self.record()  # also marks the point done if it had just finished
        return super().checkpoint(*args, **kwargs)


def checkpoint_step(run: Optional[Path]) -> Optional[tuple[int, int]]:
    """(step, --total-timesteps) of the run's resumable checkpoint; None without one, or when the run ended mid-episode
    (its final networks are checkpoints/step-<total>.pt; checkpoint.pt is its last episode end's). Tensors are mapped,
    not read: a replay buffer costs nothing."""
    if run is None or not (run / "checkpoint.pt").is_file():
        return None
    import torch

    try:
        checkpoint = torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=False, mmap=True)
        if "global_step" not in checkpoint:
            return None
        step, total = checkpoint["global_step"], checkpoint["args"]["total_timesteps"]
        return None if step < total and (run / "checkpoints" / f"step-{total}.pt").is_file() else (step, total)
    except Exception:  # not ours to judge: the script's exit code says how it ended
        return None


def stopped_early(run: Optional[Path]) -> bool:
    """The run was stopped: its checkpoint is resumable and short of its last step (a finished run's last checkpoint is
    at its last step, or holds its final networks only)."""
    step = checkpoint_step(run)
    return step is not None and step[0] < step[1]


WARNED = set()


def read_state(path: Path) -> Optional[dict]:
    """A sweep state file, or None when missing; an empty or corrupt one (a crash mid-write by an older version, a hand
    edit) counts as missing, with a one-line warning, so the point is rerun instead of every rerun crashing."""
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            return data
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        pass
    if path not in WARNED:
        WARNED.add(path)
        print(f"warning: {path} is empty or not valid JSON: the point counts as not done", file=sys.stderr, flush=True)
    return None


def write_state(path: Path, data: dict) -> None:
    """A sweep state file, whole: a kill mid-write leaves the old file or the new, never half."""
    write_atomic(str(path), lambda f: f.write(json.dumps(data).encode()))


def ignore_user_signals() -> None:
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)  # ignored signals stay ignored across exec


def slurm_answers() -> bool:
    """A SLURM controller answers here: `scontrol ping` (instant when none listens; sbatch would retry for seconds)."""
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        return False
    try:
        return subprocess.run(["scontrol", "ping"], capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:  # a controller that accepts no connection (firewalled, hung)
        return False


def slug(text: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9.=+-]+", "_", text).strip("_")[:60]
    return clean if clean == text else f"{clean}-{hashlib.sha1(text.encode()).hexdigest()[:6]}"


def grid_points(grid: tuple[str, ...], fixed: list[str], script: Path) -> list[tuple[list, list[str], object]]:
    """Every point of the grid: its (flag, value) pairs, its flags, and those flags parsed by the script's own parser,
    so a typo fails here, not in 40 queued jobs. Importing a script runs nothing: its main is behind __main__."""
    advice = "pass a training script such as vlmrm_dqn_classic.py"
    if script.suffix != ".py":
        raise UserError(f"--script {script.name} is not a Python file (.py); {advice}.")
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[script.stem] = module  # tyro reads the flags' help from the source
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - a syntax error, a missing import: the script's problem, said in one line
        raise UserError(f"--script {script.name} cannot be imported ({type(e).__name__}: {str(e)[:120]}); {advice}.") from None
    if not dataclasses.is_dataclass(getattr(module, "Args", None)):
        raise UserError(f"--script {script.name} has no Args dataclass of flags to sweep; {advice}.")
    types = {f.name.replace("_", "-"): f.type for f in fields(module.Args)}
    axes = []
    for item in grid:  # alpha=0,0.5 -> ("alpha", ["0", "0.5"])
        key, sep, values = item.partition("=")
        key, split = key.strip().lstrip("-").replace("_", "-"), values.split("|" if "|" in values else ",")
        split = [v.strip() for v in split]  # `goal=pole up|pole up ` is one prompt typed twice, never two points
        if not sep or not key or any(not v.strip() for v in split):
            raise UserError(f"--grid {item!r} is not flag=value1,value2,... (e.g. alpha=0,0.5).")
        if key not in types:
            raise UserError(f"--grid {item!r}: the script has no flag --{key}.")
        if key in OWN_FLAGS or f"--{key}" in SWEEP_FLAGS or key in (a for a, _ in axes):
            raise UserError(f"--grid {item!r}: --{key} is set by the sweep or already an axis.")
        given = [
            f for f in fixed if f.split("=")[0].lstrip("-").replace("_", "-") in (key, f"no-{key}") and f.startswith("--")
        ]
        if given:
            raise UserError(f"--grid {item!r}: --{key} is also given after -- ({given[0]}); give it in one place.")
        axes.append((key, split))
    points = []
    for values in itertools.product(*[[(key, v) for v in vs] for key, vs in axes]):
        flags = list(fixed)
        for key, value in values:  # a switch: realistic=true -> --realistic, realistic=false -> --no-realistic
            is_switch = types[key] is bool and value.lower() in ("true", "false")
            flags += [f"--{'' if value.lower() == 'true' else 'no-'}{key}"] if is_switch else [f"--{key}", value]
        captured, label = io.StringIO(), " ".join(f"{k}={v}" for k, v in values)
        try:
            with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
                parsed = tyro.cli(module.Args, args=flags)
        except SystemExit:
            reason = next((line.strip() for line in captured.getvalue().splitlines() if ":" in line), "invalid flags")
            raise UserError(f"{script.name} rejects the flags of point {label}: {reason}.") from None
        key_of = [getattr(parsed, k.replace("-", "_")) for k, _ in values]
        twin = next((p for p in points if [getattr(p[2], k.replace("-", "_")) for k, _ in values] == key_of), None)
        if twin is not None:  # alpha=0,0.0: different text, the same run
            twin_label = " ".join(f"{k}={v}" for k, v in twin[0])
            raise UserError(f"--grid gives the same point twice ({twin_label} and {label}): two jobs would train one run.")
        points.append((list(values), flags, parsed))
    return points


def final_numbers(run_dir: Optional[str], last: int) -> dict:
    """Mean of the last episodes' scalars in a TensorBoard run folder, and the last logged step."""
    if not run_dir or not Path(run_dir).is_dir():
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    logging.getLogger("tensorboard").setLevel(logging.ERROR)  # a resumed run's purge is expected: no warning in the table
    acc.Reload()
    tags, out = acc.Tags()["scalars"], {}
    if "charts/episodic_length" in tags:
        out["steps"] = acc.Scalars("charts/episodic_length")[-1].step
    for column, tag in [
        ("gt_return", "charts/gt_return"),
        ("gt_success", "charts/gt_success"),
        ("clip_return", "charts/clip_return"),
        ("eval_gt_return", "eval/gt_return"),
    ]:
        if tag in tags:
            values = [e.value for e in acc.Scalars(tag)][-last:]
            out[column] = round(sum(values) / len(values), 4)
    return out


def main(args: Args, fixed: list[str]) -> None:
    script = Path(args.script).resolve()
    if not script.is_file():
        raise UserError(f"--script {args.script}: no such file.")
    if any(f.split("=")[0].lstrip("-").replace("_", "-") in OWN_FLAGS for f in fixed if f.startswith("--")):
        raise UserError("the flags after -- must not contain --evaluate, --exp-name or --resume: the sweep sets them.")
    if min(args.max_parallel, args.cpus_per_job, args.gpus_per_job) < 0 or min(args.timeout_min, args.last_episodes) < 1:
        raise UserError("--max-parallel, --cpus-per-job, --gpus-per-job must be >= 0, --timeout-min, --last-episodes >= 1.")
    name = args.name or f"{script.stem}-{hashlib.sha1(json.dumps([script.name, fixed]).encode()).hexdigest()[:6]}"
    if slug(name) != name or name.startswith("."):  # `..` would be the repository itself
        raise UserError(f"--name {name!r} is not a plain folder name: letters, digits and . = + -, not starting with a dot.")
    slurm = args.cluster != "local" and slurm_answers()
    if args.cluster == "slurm" and not slurm:
        raise UserError("--cluster slurm: no SLURM controller answers here (`scontrol ping`); use --cluster local.")
    if args.cluster == "auto" and not slurm and shutil.which("sbatch"):
        print("sbatch is installed but no SLURM controller answers (`scontrol ping`): running locally", flush=True)
    cluster = "slurm" if slurm else "local"
    if not os.path.exists(os.path.join("sweeps", name)):  # new, or a link that loops (resolve() raises) or dangles
        check_writable(os.path.join("sweeps", name), "--name", "choose another --name")
    root, points = Path("sweeps", name).resolve(), []
    for folder in (root.parent, root):
        if folder.exists() and not folder.is_dir():
            raise UserError(f"--name {name}: {folder} is a file, not a folder; move it away or choose another --name.")
    held = root.is_dir()
    if held:  # a second sweep into this folder is refused at once; a new folder is made only for a valid grid
        hold_sweep(root, name)
    grid = grid_points(args.grid, fixed, script)
    if not held:  # locked here even if the folder appeared meanwhile: another sweep started at the same moment
        hold_sweep(root, name)
    commands = []
    for values, flags, parsed in grid:  # every point checked before any is written
        point_id = slug("_".join(f"{k}={v}" for k, v in values) or "point")
        commands.append((point_id, [str(script), *flags, "--exp-name", f"{name}-{point_id}", *SWEEP_FLAGS]))
        ran, now = (read_state(root / point_id / "point.json") or {}).get("command"), commands[-1][1]
        if ran and [Path(ran[0]).name, *ran[1:]] != [script.name, *now[1:]]:  # a point is its whole command
            raise UserError(
                f"sweep {name} already has the point {point_id} run as `{shlex.join([Path(ran[0]).name, *ran[1:]])}`, "
                f"not `{shlex.join([script.name, *now[1:]])}`; pass a new --name for other flags."
            )
    for (values, flags, parsed), (point_id, command) in zip(grid, commands):
        points.append(
            {
                "values": dict(values),
                "label": " ".join(f"{k}={v}" for k, v in values) or "(no axes)",
                "folder": root / point_id,
                "parsed": parsed,
                "job": PointJob(command, f"{name}-{point_id}", str(root / point_id), os.getcwd(), os.getpid()),
            }
        )
        points[-1]["folder"].mkdir(parents=True, exist_ok=True)
        write_state(root / point_id / "point.json", {"values": dict(values), "command": command})

    todo = [p for p in points if not read_state(p["folder"] / "done.json")]
    resuming = sum(p["job"].run_dir() is not None for p in todo)
    print(
        f"sweep {name}: {len(points)} points ({len(points) - len(todo)} finished, {resuming} to resume, "
        f"{len(todo) - resuming} to start) on {cluster}; folder {root}",
        flush=True,
    )
    # locally every job's logs go to submitit/ itself: submitit's local controller would create a literal `%j` folder
    # each job unpickles this file's functions, which import vlmrm_tools from beside this file (a job starts elsewhere)
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    executor = submitit.AutoExecutor(folder=root / "submitit" / ("%j" if cluster == "slurm" else ""), cluster=cluster)
    executor.update_parameters(
        name=name,
        timeout_min=args.timeout_min,
        cpus_per_task=args.cpus_per_job,
        gpus_per_node=args.gpus_per_job,
        **({"mem_gb": args.mem_gb} if cluster == "slurm" else {}),
        **({"slurm_partition": args.partition} if cluster == "slurm" and args.partition else {}),
    )
    local_slots = max(1, (os.cpu_count() or 1) // max(1, args.cpus_per_job))
    limit = args.max_parallel or (len(todo) if cluster == "slurm" else local_slots)
    waiting, running, finished, start = list(todo), [], 0, time.time()
    for point in list(waiting):  # a rerun while the last sweep's SLURM jobs still run: wait for them, submit no twin
        job_file = point["folder"] / "slurm_job_id"
        if (
            cluster == "slurm"
            and job_file.exists()
            and subprocess.run(["squeue", "-h", "-j", job_file.read_text()], capture_output=True, text=True).stdout.strip()
        ):
            waiting.remove(point)
            running.append((point, submitit.SlurmJob(root / "submitit" / "%j", job_file.read_text().strip())))
            print(f"{point['label']}: job {job_file.read_text()} is still queued or running; waiting for it", flush=True)
    try:
        while waiting or running:
            while waiting and len(running) < limit:
                point = waiting.pop(0)
                try:
                    running.append((point, executor.submit(point["job"])))
                except submitit.core.utils.FailedJobError as e:  # sbatch refused it: resources this cluster lacks
                    why = next((line.strip() for line in reversed(str(e).splitlines()) if line.strip()), "no reason given")
                    raise UserError(
                        f"SLURM refused the job of {point['label']} ({why}); "
                        + (f"the {len(running)} submitted before it keep running; " if running else "")
                        + "set --gpus-per-job, --cpus-per-job and --mem-gb to what `sinfo` shows, then rerun."
                    ) from None
                if cluster == "slurm":
                    (point["folder"] / "slurm_job_id").write_text(running[-1][1].job_id)
            for point, job in [r for r in running if r[1].done()]:
                running.remove((point, job))
                finished += 1
                try:
                    result = job.result()
                except Exception as e:  # the job itself failed (not the script): submitit's error holds its traceback
                    result = {"status": "failed", "last_line": f"job failed ({type(e).__name__}); see {root / 'submitit'}"}
                    write_state(
                        point["folder"] / "state.json", {**(read_state(point["folder"] / "state.json") or {}), **result}
                    )
                detail = {"done": "done", "stopped": "stopped at a checkpoint (rerun the same command to resume)"}.get(
                    result["status"], f"failed: {result['last_line']}"
                )
                print(f"[{finished}/{len(todo)}] {point['label']}: {detail} ({time.time() - start:.0f} s)", flush=True)
            time.sleep(2.0 if running else 0)
    except KeyboardInterrupt:
        print(
            f"interrupted: rerun the same command to resume the {len(waiting) + len(running)} unfinished points",
            file=sys.stderr,
        )
        sys.exit(130)
    statuses = write_table(points, root, args.last_episodes)
    counts = ", ".join(f"{statuses.count(s)} {s}" for s in ["done", "failed", "stopped", "not started"] if s in statuses)
    advice = "; the error column says why each failed point failed" if "failed" in statuses else ""
    advice += "; rerun the same command to resume the rest" if {"stopped", "not started"} & set(statuses) else ""
    print(f"sweep {name}: {counts}{advice}", flush=True)
    if "failed" in statuses:
        sys.exit(1)


def hold_sweep(root: Path, name: str) -> None:
    """One sweep at a time in a folder: a lock the kernel drops when its holder ends, even by SIGKILL (never stale)."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / "sweep.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        raise UserError(f"sweep {name} is already running (pid {holder}) in {root}: wait for it to end.") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)  # held until this process ends


def write_table(points: list[dict], root: Path, last: int) -> list[str]:
    """One row per point: its axes, status (as its job recorded it), final numbers, wall time and, for a failed point,
    the last line its script printed; as sweep.csv and sweep.md. Returns the statuses."""
    rows = []
    for p in points:
        run = p["job"].run_dir()
        done = read_state(p["folder"] / "done.json") or {}
        state = done or read_state(p["folder"] / "state.json") or {}
        # a job killed before it recorded anything: stopped when it left a run folder (a rerun resumes or restarts it)
        status = "done" if done else state.get("status") if state.get("status") in ("failed", "stopped") else None
        status = status or ("stopped" if run else "not started")
        numbers = final_numbers(done.get("run_dir") or (run and str(run)), last)
        if done:
            numbers["steps"] = p["parsed"].total_timesteps
        rows.append(
            {
                **p["values"],
                "status": status,
                **numbers,
                "wall_s": round(state["wall_s"]) if "wall_s" in state else "",
                "run_dir": os.path.relpath(done.get("run_dir") or run, os.getcwd()) if (done.get("run_dir") or run) else "",
                **({"error": state.get("last_line", "")} if status == "failed" else {}),
            }
        )
    columns = list(points[0]["values"]) + [
        "status",
        "steps",
        "gt_return",
        "gt_success",
        "clip_return",
        "eval_gt_return",
        "wall_s",
        "run_dir",
        "error",
    ]
    columns = [c for c in columns if any(c in r for r in rows)]
    with open(root / "sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    table += ["| " + " | ".join(str(r.get(c, "")).replace("|", "\\|") for c in columns) + " |" for r in rows]
    (root / "sweep.md").write_text("\n".join(table) + "\n")
    print("\n".join(table) + f"\n(returns: mean of the last {last} episodes) written to {root}/sweep.csv and sweep.md")
    return [r["status"] for r in rows]


if __name__ == "__main__":
    argv = sys.argv[1:]
    fixed = argv[argv.index("--") + 1 :] if "--" in argv else []
    cli(lambda args: main(args, fixed), Args, argv=argv[: argv.index("--")] if "--" in argv else argv)
