"""Plumbing shared by the training scripts and tools, as CleanRL's `cleanrl_utils` (the method lives in each script); it
imports no script or tool and reads only the flags both training scripts share (its sections say what it holds)."""

import contextlib
import copy
import ctypes
import difflib
import functools
import hashlib
import io
import json
import logging
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
import zipfile
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, fields
from pathlib import Path
from typing import Callable, Literal, Optional, get_args, get_origin, get_type_hints

import filelock
import gymnasium as gym
import imageio.v2 as imageio
import numpy as np
import psutil
import torch
import torch.nn as nn
import tyro
from tqdm import tqdm


# --- Errors and the entry point ---------------------------------------------------------------
class UserError(Exception):
    """Bad input or a missing resource: reported as one sentence and exit code 2, never a traceback."""


class NonFiniteError(Exception):
    """A NaN or infinite reward or loss: training stops (exit code 1) instead of poisoning the buffer."""


class RunError(Exception):
    """A failure no flag could have refused (a dead env worker, a bad frame, GPU memory): one sentence, exit code 1."""


GIVEN: set[str] = set()  # the flags (as field names) on the command line that `cli` parsed
NOTED: set[str] = set()  # the notes already printed: --evaluate reads a checkpoint twice (for its flags, then to check it)


def cli(main: Callable, args_class, argv: Optional[list] = None, interrupted: str = "interrupted") -> None:
    """Every entry point: tyro's flags; bad input one sentence and exit 2, failures exit 1, Ctrl-C `interrupted` and 130."""
    warnings.filterwarnings("ignore", message=".*No pretrained weights.*")
    args, argv = None, sys.argv[1:] if argv is None else argv  # args: the parsed flags, for the errors worded here
    GIVEN.clear()  # a flag typed with its default value still says what the user wants (--resume, --evaluate); no_cuda: cuda
    GIVEN.update(a[2:].split("=")[0].replace("-", "_").removeprefix("no_") for a in argv if a.startswith("--") and a != "--")
    try:
        main(args := tyro.cli(args_class, args=argv))
    except (UserError, NonFiniteError, RunError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, UserError) else 1)
    except torch.cuda.OutOfMemoryError:  # torch's message is 20 lines; the flag that sets the reward's memory is one
        size = f" {args.reward_batch_size}" if hasattr(args, "reward_batch_size") else ""
        print(f"error: out of GPU memory; lower --reward-batch-size{size} (the frames CLIP scores at once on each device) "
              "or --batch-size.", file=sys.stderr)  # fmt: skip
        sys.exit(1)
    except KeyboardInterrupt as e:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # another Ctrl-C ends the process: no traceback from the exit's wait
        print(str(e) or interrupted, file=sys.stderr)
        sys.exit(130)
    finally:
        GIVEN.clear()


# --- Before anything starts: the flags, the machine's memory and disk -------------------------
def check_common_args(args, positive: str, unit_interval: str, network: str) -> None:
    """The checks of the flags both training scripts share, each one sentence, before anything expensive starts."""
    if args.num_envs > 0 and args.total_timesteps % args.num_envs:  # every vector step takes one step in each env
        rounded = -(-args.total_timesteps // args.num_envs) * args.num_envs
        print(f"note: --total-timesteps {args.total_timesteps} rounded up to {rounded}, a multiple of --num-envs")
        args.total_timesteps = rounded
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    known = ["cpu", "cpu:0", *(["cuda"] if gpus else []), *(f"cuda:{i}" for i in range(gpus))]
    v, unknown = vars(args), [name for name in args.reward_devices if name not in known]
    projection = args.reward == "clip" and args.alpha > 0  # the prompts matter with the CLIP reward only
    for failed, message in [  # inf passes `> 0` and fails at the first update: finite too
        *((not 0 < v[n] < math.inf, f"--{n.replace('_', '-')} must be positive and finite, got {v[n]}.")
          for n in positive.split()),
        *((not 0 <= v[n] <= 1, f"--{n.replace('_', '-')} must be in [0, 1], got {v[n]}.") for n in unit_interval.split()),
        (args.reward == "clip" and (not args.goal or not all(p.strip() for p in args.goal)),
         "--goal needs at least one non-empty prompt (only the paper's environments have a default)."),
        (projection and not all(p.strip() for p in args.baseline or [""]), "--baseline needs a prompt when --alpha > 0."),
        (projection and same_prompts(args.goal, args.baseline or ()),
         "--goal and --baseline are the same prompts (up to case and spaces); change one or use --alpha 0."),
        (args.learning_starts < 0, f"--learning-starts must be 0 or more, got {args.learning_starts}."),
        (args.learning_starts >= args.total_timesteps, f"--learning-starts {args.learning_starts} is not below "
         f"--total-timesteps {args.total_timesteps}; lower it, e.g. to a quarter of the run: --learning-starts "
         f"{args.total_timesteps // 4}."),
        (args.batch_size > args.buffer_size, f"--batch-size {args.batch_size} exceeds --buffer-size {args.buffer_size}."),
        (args.torch_threads is not None and args.torch_threads < 0, "--torch-threads must be 0 (torch's default) or more."),
        (bool(unknown), f"--reward-devices {' '.join(unknown)} is not a device of this machine: {', '.join(known)}."),
    ]:  # fmt: skip
        if failed:
            raise UserError(message)
    if args.resume is None and args.evaluate is None:  # a run already trained on such prompts stays resumable
        check_one_word_prompts(args.goal if args.reward == "clip" else (), "--goal")
        check_one_word_prompts(args.baseline if projection else (), "--baseline")
    if args.evaluate is not None:  # the checks of --resume, then networks of this env
        saved = read_checkpoint(args.evaluate, type(args), "--evaluate")
        if network not in saved or saved["args"].get("env_id", args.env_id) != args.env_id:
            raise UserError(f"--evaluate {args.evaluate} holds no networks trained on --env-id {args.env_id} (its --env-id: "
                            f"{saved['args'].get('env_id', args.env_id)}).")  # fmt: skip
    check_writable("runs")
    if args.capture_video or args.evaluate is not None:
        check_writable("videos")
    if args.track and args.evaluate is None:  # a login or offline mode: wandb.init's error is a traceback in the run
        import wandb

        with contextlib.redirect_stderr(io.StringIO()):  # wandb.init says the same again moments later
            offline = os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled")
            if not offline and not wandb.login(prompt=False, verify=False):  # verify=False: no network round trip here
                raise UserError("--track found no W&B login here; log in with `wandb login`, or set WANDB_MODE=offline.")


def check_writable(folder: str, what: str = "", advice: str = "run from another") -> None:
    """Outputs must be writable before hours of training produce them (the folder itself may not exist yet)."""
    existing = os.path.abspath(folder)
    where = f"{what} {existing}/".lstrip()
    while not os.path.exists(existing):
        if os.path.islink(existing):  # a loop or a dangling link: making folders under it fails with [Errno 17]
            how = "loops" if os.path.islink(os.path.realpath(existing)) else "points to nothing"  # a loop resolves to a link
            link = f"{existing} is a symbolic link to {os.readlink(existing)}, which {how}"
            raise UserError(f"cannot write to {where} ({link}); {advice}.")
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):  # os.access also sees a read-only mount
        why = "is a file" if os.path.isfile(existing) else "is not a writable folder"
        raise UserError(f"cannot write to {where} ({existing} {why}); {advice}.")


def check_clip_args(args, model_flag: str = "--clip-model", checkpoint_flag: str = "--clip-checkpoint") -> None:
    """Refuse an unknown CLIP model, tag, config or weights file before loading; the flags named as the caller names them."""
    import open_clip

    tags = ["none", *open_clip.list_pretrained_tags_by_model(Path(args.clip_model).stem)]  # a config: named as a model
    if args.clip_model.endswith(".json"):
        if not os.path.isfile(args.clip_model):
            raise UserError(f"{model_flag} {args.clip_model}: no such model config file.")
        config = None  # open_clip skips a config without these keys, silently: a built-in model of its name would load
        with contextlib.suppress(OSError, ValueError):  # unreadable, not UTF-8, not JSON: refused below
            config = json.loads(Path(args.clip_model).read_text(encoding="utf-8"))
        if not isinstance(config, dict) or not {"embed_dim", "vision_cfg", "text_cfg"} <= config.keys():
            raise UserError(f"{model_flag} {args.clip_model} is not an open_clip model config (a JSON object with "
                            "embed_dim, vision_cfg and text_cfg, as tests/vlmrm-tiny-test.json).")  # fmt: skip
        if args.clip_checkpoint is None and args.clip_pretrained not in tags and not os.path.isfile(args.clip_pretrained):
            raise UserError(f"{model_flag} {args.clip_model} is a model config, which has no --clip-pretrained "
                            f"{args.clip_pretrained} weights; add --clip-pretrained none (random weights, for tests) or a "
                            f"weights file with {checkpoint_flag}.")  # fmt: skip
    elif args.clip_model not in open_clip.list_models():
        raise UserError(f"{model_flag} {args.clip_model} is not an open_clip architecture (see open_clip.list_models()).")
    elif args.clip_checkpoint is None and args.clip_pretrained not in tags:  # the default tag, ViT-bigG-14's: left unsaid
        given = "" if args.clip_pretrained == "laion2b_s39b_b160k" else f" ({args.clip_pretrained} is not one of them)"
        raise UserError(f"{model_flag} {args.clip_model} needs --clip-pretrained, one of: {', '.join(tags)}{given}.")
    if args.clip_checkpoint is not None and not os.path.isfile(args.clip_checkpoint):
        raise UserError(f"{checkpoint_flag} {args.clip_checkpoint}: no such file.")


def check_one_word_prompts(prompts, flag: str) -> None:
    """`--goal pole upright` unquoted is two prompts averaged: two or more prompts all of one word are refused."""
    if prompts and len(prompts) > 1 and all(len(p.split()) == 1 for p in prompts):
        raise UserError(f"{flag} got {len(prompts)} one-word prompts ({', '.join(prompts)}), each scored on its own and "
                        f'averaged; if you meant one sentence, quote it: {flag} "{" ".join(prompts)}" (prompts that are all '
                        "one word are refused).")  # fmt: skip


def same_prompts(goal: tuple[str, ...], baseline: tuple[str, ...]) -> bool:
    """Prompts that CLIP cannot tell apart: its tokenizer ignores case and extra spaces."""
    return {" ".join(p.lower().split()) for p in goal} == {" ".join(p.lower().split()) for p in baseline}


def resolve_negatives(goal: tuple[str, ...], negatives: Optional[tuple], flag: str, defaults: dict) -> tuple[str, ...]:
    """The softmax family's negative prompts: --negatives, else the defaults of the default goal; one-sentence errors."""
    negatives = defaults.get(tuple(goal), ()) if negatives is None else tuple(negatives)
    if not negatives or not all(n.strip() for n in negatives):
        raise UserError(f"{flag} needs at least one non-empty --negatives prompt (only the default --goal has defaults).")
    if shared := sorted(set(negatives) & set(goal)):
        raise UserError(f"--negatives and --goal share the prompt {shared[0]!r}; a negative is what the goal is not.")
    return negatives


def check_resources(args, observation_space: gym.Space, action_space: gym.Space, frame_shape: tuple, env_bytes: float,
                    activations: int) -> int:  # fmt: skip
    """Refuse a run too big for the available memory; the estimate in bytes (`activations`: a sample's floats in the nets)."""
    action_bytes = 8 if isinstance(action_space, gym.spaces.Discrete) else 4 * int(np.prod(action_space.shape))
    transition = 2 * 4 * int(np.prod(observation_space.shape)) + action_bytes + 4 + 4  # obs, next_obs, action, reward, done
    chunks = args.reward_batch_size * max(1, len(args.reward_devices))  # frames scored in one go: a chunk per device
    waiting = -(-chunks // args.num_envs) * args.num_envs  # in whole vector steps
    held = 4 * waiting + 2 * args.num_envs  # 2 chunks with CLIP, a 3rd waiting and its copy; a step's frames in 2 places
    frame, clip, cuda = int(np.prod(frame_shape)), args.reward == "clip", args.cuda and torch.cuda.is_available()
    copies = 2 if args.save_buffer and args.resume is None else 1  # --resume loads the saved buffer, then copies it in
    needs = {
        "--buffer-size": ("--buffer-size", args.buffer_size * transition * copies),
        "--batch-size": ("--batch-size", args.batch_size * (transition + 4 * activations)),
        f"{args.num_envs} envs": ("--num-envs", args.num_envs * env_bytes),
        "frames in flight": ("--num-envs" if waiting == args.num_envs else "--reward-batch-size", held * frame * clip),
    }
    if clip and all(torch.device(d).type == "cpu" for d in args.reward_devices or ["cuda" if cuda else "cpu"]):
        needs["CLIP weights"] = ("--clip-model", 4 * clip_parameters(args.clip_model))  # on the CPU: float32 weights
        needs["CLIP input"] = ("--reward-batch-size", 4 * min(args.reward_batch_size, waiting) * frame)  # float32, unsquashed
    total, available, gib = sum(v for _, v in needs.values()), available_memory(), 2**30
    if total > gib or (available and total > 0.25 * available):  # said only when it matters (not 0.00 GiB for CartPole)
        terms = ", ".join(f"{k} {v / gib:.2f}" for k, (_, v) in needs.items() if v >= 0.005 * gib)
        print(f"memory: {total / gib:.2f} GiB ({terms} GiB)" + (f", {available / gib:.1f} GiB available" if available else ""))
    if available and total > 0.9 * available:
        by_flag = {flag: sum(v for f, v in needs.values() if f == flag) for flag, _ in needs.values()}
        flag = max(by_flag, key=by_flag.get)
        advice = "use a GPU or a smaller --clip-model" if flag == "--clip-model" else f"lower {flag}"
        raise UserError(f"{flag} {getattr(args, flag[2:].replace('-', '_'))} makes the run need {total / gib:.1f} GiB of "
                        f"memory, more than the {0.9 * available / gib:.1f} GiB it may take (90% of the "
                        f"{available / gib:.1f} GiB available); {advice}.")  # fmt: skip
    return total


def clip_parameters(model: str) -> int:
    """An open_clip model's parameter count on the meta device (no memory, under a second); 0 if unknown (refused later)."""
    import open_clip

    logging.disable(logging.WARNING)  # the model counted here has random weights, as open_clip would warn
    try:
        if model.endswith(".json"):
            open_clip.add_model_config(model)
        with torch.device("meta"):
            return sum(p.numel() for p in open_clip.create_model(Path(model).stem, device="meta").parameters())
    except Exception:  # noqa: BLE001 - a bad name or config: refused later, in one sentence
        return 0
    finally:
        logging.disable(logging.NOTSET)


def available_memory() -> int:
    """Bytes of memory available to a new allocation (Linux: MemAvailable)."""
    return psutil.virtual_memory().available


def check_checkpoint_disk(args, networks: dict[str, dict], rb) -> None:
    """--save-model: a run refused if its checkpoints (step files, checkpoint.pt twice while replaced) do not fit."""
    if not args.save_model:
        return
    format_bytes = lambda n: f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"  # noqa: E731
    size = sum(p.numel() * p.element_size() for m in networks.values() for p in m.values()) + 2**16
    buffer = sum(v.nbytes for v in rb.data.values()) if args.save_buffer else 0
    count, state = args.total_timesteps // args.checkpoint_frequency, 4 * size + buffer
    free, total = shutil.disk_usage(os.path.abspath("runs") if os.path.isdir("runs") else ".").free, size * count + 2 * state
    steps = f"{count} step checkpoint{'s' * (count > 1)} of {format_bytes(size)}" if count else "no step checkpoints"
    what = f"checkpoint.pt {format_bytes(state)}{' with the replay buffer' if buffer else ''} twice while replaced, {steps}"
    print(f"disk: checkpoints take up to {format_bytes(total)} in runs/ ({what}), {format_bytes(free)} free")
    if total > 0.9 * free:
        advice = "lower --buffer-size or drop --save-buffer" if buffer else "free some disk space"
        raise UserError(f"the checkpoints take up to {format_bytes(total)} ({what}), but {format_bytes(free)} is free; "
                        + ("raise --checkpoint-frequency." if size * count > 2 * state else f"{advice}."))  # fmt: skip


# --- A resumed or evaluated run: its checkpoint and its flags ---------------------------------
def read_checkpoint(path: str, args_class: type, flag: str = "--resume") -> dict:
    """A checkpoint of the script whose flags are `args_class` (resumable for --resume), or a one-sentence error."""
    script = os.path.basename(sys.modules[args_class.__module__].__file__)  # run directly, the module is __main__
    if not os.path.isfile(path):  # a folder, a named pipe (torch.load would wait on it forever), nothing at all
        what = "is a folder" if os.path.isdir(path) else "is not a regular file" if os.path.exists(path) else "does not exist"
        raise UserError(f"{flag} {path} {what}; pass a checkpoint.pt of {script}.")
    check_intact(path, f"{flag} {path}", "pass another checkpoint.pt")
    try:  # our own file with RNG states and arrays: weights_only=False, so only load checkpoints you trust
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise UserError(f"{flag} {path} is not a readable checkpoint ({type(e).__name__}); pass a checkpoint.pt.") from None
    saved = checkpoint.get("args") if isinstance(checkpoint, dict) else None
    if not isinstance(saved, dict) or not set(saved) <= {f.name for f in fields(args_class)}:
        raise UserError(f"{flag} {path} was written by another script; pass a checkpoint.pt of {script}.")
    record, own = checkpoint_script(checkpoint, f"{flag} {path}"), script_record(sys.modules[args_class.__module__].__file__)
    same_file = record["file"] == own["file"] or os.path.realpath(record["path"]) == os.path.realpath(own["path"])
    if record["sha256"] != own["sha256"] and not same_file:  # the reward, env and nets are its code; equal hashes: a link
        raise UserError(f"{flag} {path} was written by {record['file']} (sha256 {record['sha256'][:12]}), whose reward, "
                        f"env and networks this {script} (sha256 {own['sha256'][:12]}) may not share; run it with "
                        f"{record['file']}.")  # fmt: skip
    if record["sha256"] != own["sha256"] and (line := f"note: {script} changed since {path} was written ("
            f"{script_changes(record, own)}): {flag} uses it as it is now") not in NOTED:  # fmt: skip
        NOTED.add(line), print(line)  # the research loop: fix a bug, add a log line, go on
    for key, kind in get_type_hints(args_class).items():  # the parser checks a choice typed, not one saved
        if get_origin(kind) is Literal and key in saved and saved[key] not in (choices := get_args(kind)):
            raise UserError(f"{flag} {path} holds --{key.replace('_', '-')} {saved[key]}, which {script} does not take "
                            f"({', '.join(map(str, choices))}); pass another checkpoint.pt.")  # fmt: skip
    if flag != "--resume":
        return checkpoint
    if not {"iteration", "rng"} <= set(checkpoint):
        raise UserError(f"--resume {path} holds no resumable training state; pass a checkpoint.pt saved during training.")
    if os.path.abspath(os.path.dirname(path)) != os.path.abspath(f"runs/{checkpoint['run_name']}"):  # not another run's logs
        raise UserError(f"--resume {path} belongs to runs/{checkpoint['run_name']}/, not to {os.path.dirname(path) or '.'}/; "
                        "resume it from the folder that holds that run (or move the whole run folder there).")  # fmt: skip
    if problem := unloadable_rng(checkpoint["rng"], checkpoint["args"].get("num_envs", 1)):
        raise UserError(f"--resume {path} is inconsistent: its random state {problem}; pass another checkpoint.pt.")
    check_writable(f"runs/{checkpoint['run_name']}", "the run folder", "make it writable to resume the run")
    lock_run(checkpoint["run_name"], keep=False)  # said now, before anything starts; Run.start takes the lock itself
    return checkpoint


def unloadable_rng(rng, num_envs: int) -> Optional[str]:
    """A checkpoint's random state the libraries refuse, tried as Run.restore loads it (issue 46: a traceback, late)."""
    if not isinstance(rng, dict) or len(rng.get("envs", ())) != num_envs:
        return f"holds {len(rng.get('envs', ())) if isinstance(rng, dict) else 'no'} env states for {num_envs} envs"
    for key, load, state in [("python", random.setstate, random.getstate()), ("numpy", np.random.set_state,
                             np.random.get_state()), ("torch", torch.set_rng_state, torch.get_rng_state())]:  # fmt: skip
        try:
            load(rng.get(key))
        except Exception as e:  # noqa: BLE001 - whatever the library says of it, in one line
            return f"{key} does not load ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]})"
        finally:
            load(state)  # put back
    bad = [i for i, g in enumerate(rng["envs"]) if not isinstance(g, np.random.Generator)]
    return f"envs[{bad[0]}] is not a numpy Generator" if bad else None


def script_record(path: str) -> dict:
    """The script that wrote a checkpoint: name, place, hash and source (the tools run it as it was, edited since)."""
    source = Path(path).read_bytes()
    return {"file": os.path.basename(path), "path": os.path.abspath(path), "sha256": hashlib.sha256(source).hexdigest(),
            "source": source}  # fmt: skip


def script_changes(record: dict, now: dict) -> str:
    """How the script `now` differs from the one that wrote a checkpoint: both hashes, and how many lines if known."""
    changes = f"sha256 {record['sha256'][:12]} -> {now['sha256'][:12]}"
    if isinstance(record.get("source"), bytes):
        then, current = (r["source"].decode(errors="replace").splitlines() for r in (record, now))
        blocks = difflib.SequenceMatcher(None, then, current, autojunk=False).get_opcodes()
        n = sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in blocks if tag != "equal")
        changes += f"; {n} line{' differs' if n == 1 else 's differ'}"
    return changes


def checkpoint_script(checkpoint: dict, name: str) -> dict:
    """The record of the script that wrote `checkpoint`; none (older) is refused: a copy's reward would be read wrongly."""
    record = checkpoint.get("script")
    if not (isinstance(record, dict) and {"file", "path", "sha256"} <= record.keys()):
        raise UserError(f"{name} was written by an older version of this script, which did not record the script (and so "
                        "the reward) that wrote it; train it again with this version.")  # fmt: skip
    return record


def check_intact(path: str, name: str, advice: str) -> None:
    """The CRC-32 of each entry of torch.save's zip: torch.load would read a flipped byte silently as another number."""
    try:
        archive = zipfile.ZipFile(path)
    except Exception:  # noqa: BLE001 - not a zip (truncated, foreign): left to torch.load's own error
        return
    with archive, contextlib.suppress(Exception):  # an exception: a header field itself flipped (a length, a compression)
        if archive.testzip() is None:
            return
    raise UserError(f"{name} is damaged: its bytes do not match the checksums saved in it (a bad disk or copy); {advice}.")


RUN_LOCKS: dict[str, filelock.UnixFileLock] = {}  # runs/<run>/run.lock of the run this process trains -> its lock


def lock_run(run_name: str, keep: bool = True) -> None:
    """One process trains a run folder (an flock, never stale); held (keep), a killed writer's *.tmp files are removed."""
    path = os.path.abspath(f"runs/{run_name}/run.lock")
    if path in RUN_LOCKS or not (keep or os.path.exists(path)):
        return
    try:
        (lock := filelock.UnixFileLock(path, timeout=0)).acquire()
    except filelock.Timeout:
        holder = Path(path).read_text(errors="replace").strip() or "?"
        raise UserError(f"runs/{run_name} is being trained by another process (pid {holder}); wait for it to end.") from None
    if not keep:
        return lock.release()
    Path(path).write_text(str(os.getpid()))  # who holds it, for the refusal above (emptied when the run ends)
    RUN_LOCKS[path] = lock
    for tmp in Path(f"runs/{run_name}").glob("**/*.pt.*.tmp"):  # save_checkpoint's, of a writer killed mid-write
        tmp.unlink()
        print(f"removed {tmp}, left half-written by a run that was killed")


def resumed_args(args, checkpoint: dict):
    """The run's own flags; one given that would change them is refused, but a larger --total-timesteps extends the run."""
    args_class, saved, default = type(args), checkpoint["args"], vars(type(args)())
    if changed := [k for k, v in vars(args).items() if k not in ("resume", "total_timesteps")
                   and (k in GIVEN or default[k] != v) and v != saved.get(k, default[k])]:  # fmt: skip
        flags = ", ".join("--" + k.replace("_", "-") for k in changed)
        raise UserError(f"--resume continues a run with its own flags; drop {flags} (or start a new run).")
    total = saved["total_timesteps"]
    if ("total_timesteps" in GIVEN or args.total_timesteps != default["total_timesteps"]) and args.total_timesteps != total:
        if args.total_timesteps < checkpoint["global_step"]:
            raise UserError(f"--total-timesteps {args.total_timesteps} is below the step the run reached, "
                            f"{checkpoint['global_step']}; pass a larger value to extend it.")  # fmt: skip
        total = args.total_timesteps
        print(f"note: the run is extended from {saved['total_timesteps']} to {total} steps")
    return args_class(**{"episodes": "fixed", **saved, "resume": args.resume, "total_timesteps": total})  # older: fixed


# --- The reward model's CLIP: weights, prompts and cost ---------------------------------------
def load_clip(args, device: torch.device) -> tuple[nn.Module, object]:
    """The open_clip model and tokenizer of --clip-model/--clip-pretrained/--clip-checkpoint, or one sentence why not."""
    import huggingface_hub.constants as hub
    import open_clip

    name = Path(args.clip_model).stem  # an architecture, or a config file such as the tiny test model in tests/
    pretrained = args.clip_checkpoint or (None if args.clip_pretrained == "none" else args.clip_pretrained)
    cached = fetch_clip_weights(args)  # says what it fetches; a download that cannot happen fails here, in seconds
    offline, hub.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE or cached  # cached weights: no hub requests
    logging.disable(logging.ERROR)  # open_clip logs multi-line errors: we say it in one sentence
    try:  # a config file is checked before (check_clip_args); whatever open_clip still refuses is said below
        if args.clip_model.endswith(".json"):
            open_clip.add_model_config(args.clip_model)
        model = open_clip.create_model(name, pretrained=pretrained, device=device, cache_dir=args.clip_cache_dir)
    except Exception as e:  # noqa: BLE001 - whatever open_clip raised, the fixes are these
        detail = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
        raise UserError(f"could not build {name} with {pretrained or 'random'} weights ({detail}); check --clip-model (a "
                        "name or a config file), --clip-pretrained and --clip-checkpoint.") from None  # fmt: skip
    finally:
        logging.disable(logging.NOTSET)
        hub.HF_HUB_OFFLINE = offline
    if pretrained is None:
        print(f"note: {name} has random weights (--clip-pretrained none): its rewards are meaningless outside tests")
    return model.eval(), open_clip.get_tokenizer(name)


def fetch_clip_weights(args) -> bool:
    """Download the --clip-pretrained weights into the cache unless there, saying so first; True when cached."""
    import huggingface_hub
    import huggingface_hub.constants as hub
    import open_clip

    name, cache = Path(args.clip_model).stem, args.clip_cache_dir
    cfg = open_clip.get_pretrained_cfg(name, args.clip_pretrained)
    if args.clip_checkpoint is not None or not cfg:
        return False  # a weights file, random weights, or a tag that create_model refuses
    offline, hub.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE, True
    try:
        with contextlib.suppress(Exception):  # not in the cache: fetched below
            open_clip.download_pretrained(cfg, cache_dir=cache)  # offline: from the cache, or an error at once
            return True
    finally:
        hub.HF_HUB_OFFLINE = offline
    params = clip_parameters(args.clip_model)
    size = f" ({params / 1e6:,.0f}M parameters, about {params * 4 / 1e9:.1f} GB as float32)" if params else ""
    print(f"fetching the {name}/{args.clip_pretrained} CLIP weights{size} from {hub.ENDPOINT} into "
          f"{cache or 'the Hugging Face cache'}", flush=True)  # fmt: skip
    why, reached = "HF_HUB_OFFLINE is set and they are not in the cache", False
    try:  # the hub's own client, once: open_clip's download retries a network that is down for a minute (46 s here)
        if not offline:
            huggingface_hub.get_session().head(hub.ENDPOINT, timeout=5)
            reached = True
            open_clip.download_pretrained(cfg, cache_dir=cache)
            return True
    except Exception as e:  # noqa: BLE001 - a name, a connection or a proxy that fails: said in seconds; then same fixes
        first = (str(e).splitlines() or [type(e).__name__])[0]
        why = first[:160] if reached else f"{hub.ENDPOINT} cannot be reached: {first}"
    raise UserError(f"could not download the {name}/{args.clip_pretrained} CLIP weights ({why}); check the network "
                    "connection, point --clip-cache-dir at a folder that holds them, or pass a weights file with "
                    "--clip-checkpoint.")  # fmt: skip


def warn_long_prompts(tokenizer, args) -> None:
    """CLIP reads a prompt's first tokens only (77 with its start and end marks): say so when one is cut."""
    if not hasattr(tokenizer, "encode"):  # open_clip's own tokenizer; a Hugging Face one is not checked
        return
    used = ["goal"] + ["baseline"] * (args.alpha > 0 and args.reward_family == "projection")
    for flag in used + ["negatives"] * (args.reward_family == "softmax"):
        for prompt in getattr(args, flag) or ():
            tokens, read = len(tokenizer.encode(prompt)) + 2, tokenizer.context_length
            if tokens > read:
                shown = prompt if len(prompt) <= 60 else prompt[:57] + "..."
                print(f"note: --{flag} {shown!r} is {tokens} tokens, and CLIP reads its first {read}: the rest is cut")


def check_reward_memory(reward_model: nn.Module, args, frame_shape: tuple[int, int, int]) -> None:
    """On a GPU, measured before training: each replica's peak memory scoring a chunk (on CPU the progress line's time left
    says the reward model's cost within seconds)."""
    if reward_model.device.type != "cuda":
        return
    for device in (devices := [device for _, device in reward_model.replicas]):
        torch.cuda.reset_peak_memory_stats(device)
    try:
        reward_model(np.zeros((args.reward_batch_size * len(devices), *frame_shape), dtype=np.uint8))  # a chunk each
    except torch.cuda.OutOfMemoryError:  # before the run folder: refused as a flag would be
        raise UserError(f"the reward model runs out of GPU memory scoring --reward-batch-size {args.reward_batch_size} "
                        "frames at once on each device; lower --reward-batch-size.") from None  # fmt: skip
    for device in devices:
        peak, total = torch.cuda.max_memory_allocated(device), torch.cuda.get_device_properties(device).total_memory
        print(f"memory: the reward model on {device} peaks at {peak / 2**30:.1f} GiB of {total / 2**30:.0f} GiB while "
              f"scoring --reward-batch-size {args.reward_batch_size} frames ({args.clip_dtype} image tower)")  # fmt: skip


# --- The envs: frames with the step, workers that end with the run ----------------------------
def make_vector_env(vector_env: type, env_fns: list, autoreset_mode, frames: bool = False) -> gym.vector.VectorEnv:
    """The training envs (`frames`: with infos["frames"]); env processes ignore Ctrl-C and SIGTERM and end with the run."""
    if vector_env is gym.vector.AsyncVectorEnv and sys.platform == "linux":
        env_fns = [functools.partial(die_with_parent, fn, os.getpid()) for fn in env_fns]
    handlers = {signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        envs = vector_env(env_fns, autoreset_mode=autoreset_mode)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    return FramesInInfo(envs) if frames else envs


class FrameSpace(gym.spaces.Box):
    """uint8 frames with bounds as views: gymnasium's Box holds four frame-sized arrays per env (gigabytes for many)."""

    def __init__(self, shape: tuple, dtype=np.uint8):  # float64: the states --renderer warp draws, unbounded
        super().__init__(*((0, 255) if dtype == np.uint8 else (-np.inf, np.inf)), (1,), dtype)
        self._shape = tuple(shape)
        self.low, self.high = np.broadcast_to(self.low[0], shape), np.broadcast_to(self.high[0], shape)
        self.bounded_below = self.bounded_above = np.broadcast_to(dtype == np.uint8, shape)


gym.vector.utils.batch_space.register(FrameSpace, lambda space, n=1: FrameSpace((n, *space.shape), space.dtype))


def frame_problem(env: gym.Env, frame, shape: Optional[tuple] = None) -> Optional[str]:
    """What is wrong with a frame `env` rendered (not a uint8 (H, W, 3) array of `shape`), or None: cheap when right."""
    if isinstance(frame, np.ndarray) and frame.dtype == np.uint8 and frame.ndim == 3 and frame.shape[-1] == 3:
        if shape is None or frame.shape == tuple(shape):
            return None
    what = "None" if frame is None else f"a {type(frame).__name__}"
    floats = isinstance(frame, np.ndarray) and frame.dtype.kind == "f"
    if isinstance(frame, np.ndarray):
        what = f"a {frame.dtype} array of shape {frame.shape}"
        what += f" (values {np.nanmin(frame):g} to {np.nanmax(frame):g})" if floats and frame.size else ""
    needed = f"uint8 frames of shape {tuple(shape) if shape else '(height, width, 3)'}"
    hint = ", e.g. (frame * 255).astype(np.uint8)" if floats else ""
    name = env.spec.id if env.spec else type(env.unwrapped).__name__  # said only when wrong: nothing per step
    return f"{name} rendered {what}, but the reward model needs {needed}; make its render() return those{hint}"


class FramesInInfo(gym.vector.VectorWrapper):
    """The vector side of FrameAfterStep: the envs' observations, their frames in infos["frames"], seconds rendering."""

    def __init__(self, envs: gym.vector.VectorEnv):
        super().__init__(envs)
        self.render_s = 0.0  # seconds of the steps' round trips spent rendering
        self.single_observation_space, self.observation_space = envs.single_observation_space[0], envs.observation_space[0]

    def reset(self, **kwargs):
        (obs, _), info = self.env.reset(**kwargs)
        return obs, info

    def step(self, actions):
        (obs, frames), rewards, terminations, truncations, info = self.env.step(actions)
        if "bad_frame" in info:  # said here, not raised in the env worker: gymnasium would add its traceback
            raise RunError(next(problem for problem in info["bad_frame"] if problem) + ".")
        render_s = info["render_s"].sum() if isinstance(self.env, gym.vector.SyncVectorEnv) else info["render_s"].max()
        self.render_s += float(render_s)
        return obs, rewards, terminations, truncations, {**info, "frames": frames}

    def __getattr__(self, name: str):  # call, get_attr, set_attr: the wrapped vector env's
        return getattr(self.env, name)


def mujoco_warning(message: str) -> None:
    """MuJoCo's warnings (e.g. a NaN action: "the simulation is unstable"): the first of each process on stdout."""
    if not getattr(mujoco_warning, "said", False):
        mujoco_warning.said = True
        print(f"warning: MuJoCo: {message.strip()} (its later warnings in this process are not shown)", flush=True)


def import_mujoco():
    """MuJoCo on headless EGL unless MUJOCO_GL says otherwise, warnings on stdout; a missing backend: one sentence, exit 2."""
    backend = os.environ.setdefault("MUJOCO_GL", "egl")
    if backend in ("egl", "osmesa"):
        os.environ.setdefault("PYOPENGL_PLATFORM", backend)
    try:
        import gymnasium.envs.mujoco  # noqa: F401  (makes gym.envs.mujoco, home of the stock XML, reachable)
        import mujoco
    except (ImportError, AttributeError, OSError, RuntimeError) as e:  # osmesa without its library: PyOpenGL's GL is None
        library = {"egl": "libegl1", "osmesa": "libosmesa6", "glfw": "libglfw3 and a display"}.get(backend)
        fix = f"install {library} (e.g. apt install {library.split()[0]}) or " if library else ""
        print(f"error: MuJoCo could not start its OpenGL backend MUJOCO_GL={backend} ({type(e).__name__}: "
              f"{(str(e).splitlines() or [''])[0][:120]}); {fix}use MUJOCO_GL={'osmesa' if backend == 'egl' else 'egl'}.",
              file=sys.stderr)  # fmt: skip
        sys.exit(2)
    mujoco.set_mju_user_warning(mujoco_warning)
    return mujoco


def die_with_parent(env_fn: Callable, parent: int) -> gym.Env:
    """An env worker ends with the training process (PR_SET_PDEATHSIG): a SIGKILLed run left each printing a traceback."""
    if os.getpid() != parent:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the training process ended before the prctl
            os._exit(0)
    return env_fn()


def close_envs(envs: gym.vector.VectorEnv, clean: bool = True) -> None:
    """A clean close only after a normal end with no call pending (`clean`), else every worker killed: gymnasium's waits."""
    processes = getattr(base := envs.unwrapped, "processes", None)
    if processes is None:  # envs in process: nothing to wait for
        return envs.close()
    interrupted = None
    if clean and base._state == gym.vector.async_vector_env.AsyncState.DEFAULT and all(p.exitcode is None for p in processes):
        try:
            return envs.close()
        except (EOFError, OSError):  # a worker died while it was told to close
            pass
        except BaseException as e:  # a Ctrl-C while waiting for the workers: kill them, then end as asked
            interrupted = e
    for process in processes:
        process.kill()
        process.join()
    for pipe in filter(None, base.parent_pipes):
        pipe.close()
    base.closed = True  # gymnasium's own close would wait on the dead pipes again
    if interrupted is not None:
        raise interrupted


# --- The run around the loop: folder, progress, episodes, NaN guard, checkpoints, videos ---------------
def set_torch_threads(args, device: torch.device) -> torch.device:
    """One torch thread on CPU unless asked otherwise: measured 8-12x faster for these small networks on a shared CPU."""
    if args.torch_threads or (args.torch_threads is None and device.type == "cpu"):
        torch.set_num_threads(args.torch_threads or 1)
    return device


def run_flags(args, evaluate_as_trained: str) -> tuple[object, Optional[dict]]:
    """The run's flags and checkpoint (None: new): --resume's own; `evaluate_as_trained` as trained unless given."""
    checkpoint = None if args.resume is None else read_checkpoint(args.resume, type(args))
    args = args if checkpoint is None else resumed_args(args, checkpoint)
    if args.evaluate is not None:
        checkpoint, default = read_checkpoint(args.evaluate, type(args), "--evaluate"), vars(type(args)())
        for key in evaluate_as_trained.split():
            if key in checkpoint["args"] and key in default and getattr(args, key) == default[key] and key not in GIVEN:
                setattr(args, key, checkpoint["args"][key])
    return args, checkpoint


class Run:
    """The run around each script's loop: seeds, folder, TensorBoard, W&B, progress, NaN guard, checkpoints, videos."""

    def __init__(self, args, checkpoint: Optional[dict] = None):
        self.checkpoint = checkpoint  # of --resume (the run to continue) or --evaluate (the policy to roll out)
        self.args, self.script = args, os.path.basename(sys.modules[type(args).__module__].__file__)
        self.source = script_record(sys.modules[type(args).__module__].__file__)  # in every checkpoint: who wrote it
        mid = (args.total_timesteps // args.num_envs) % args.episode_length * args.num_envs  # fixed-length: all in flight
        if mid and args.save_model and args.evaluate is None and args.episodes == "fixed":  # no resumable state (see finish)
            print(f"note: --total-timesteps {args.total_timesteps} ends {mid} steps into an episode: checkpoint.pt keeps the "
                  f"last episode end's state; the final networks: checkpoints/step-{args.total_timesteps}.pt")  # fmt: skip
        self.name = (checkpoint or {}).get("run_name", f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}")
        for seed in (random.seed, np.random.seed, torch.manual_seed):
            seed(args.seed)
        torch.backends.cudnn.deterministic = args.torch_deterministic
        self.device = set_torch_threads(args, torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu"))
        if args.reward == "clip":  # a download that cannot happen fails here, in seconds, before the envs start
            fetch_clip_weights(args)
        self.timing = dict.fromkeys(["env", "render", "reward_model", "reward_wait", "learning"], 0.0)
        self.start_iteration = self.checkpoint["iteration"] if args.resume is not None else 0
        self.last_iteration, self.iteration = args.total_timesteps // args.num_envs - 1, self.start_iteration - 1
        self.last_save = self.start_iteration * args.num_envs  # the step of the last checkpoint
        self.stop, self.stopping, self.periodic = {"requested": False}, False, False
        self.dones = np.ones(args.num_envs, dtype=bool)  # as they stay when no step is left
        self.writer = self.envs = self.scorer = None

    def check_fits(self, envs: gym.vector.VectorEnv, learner: dict) -> None:
        """--resume, --evaluate: the checkpoint's entries load into `learner` (None: unused) and are finite."""
        flag, path = ("--resume", self.args.resume) if self.args.resume is not None else ("--evaluate", self.args.evaluate)
        for key, fresh in learner.items():
            if fresh is None or (flag == "--evaluate" and key not in self.checkpoint):  # --evaluate: the networks it holds
                continue
            if key not in self.checkpoint:
                raise UserError(f"{flag} {path} was written by an older version of this script (it has no {key}); start "
                                "a new run, or resume it with the version that wrote it.")  # fmt: skip
            if problem := misfit(self.checkpoint[key], fresh):
                raise UserError(f"{flag} {path} does not fit the networks of this run: its {key} {problem}; pass a "
                                f"checkpoint.pt that {self.script} wrote with these flags.")  # fmt: skip
            if not all_finite(self.checkpoint[key]):  # a NaN policy would roll out (argmax 0) or train on, exit 0
                raise UserError(f"{flag} {path}: its {key} holds NaN or infinite weights, so it cannot act or learn; pass a "
                                "checkpoint saved before its run diverged (runs/<run>/checkpoints/step-<N>.pt).")  # fmt: skip

    @contextlib.contextmanager
    def closing(self, envs: gym.vector.VectorEnv, scorer: Optional[ThreadPoolExecutor] = None):
        """Every exit (a dead env worker: named) drops `scorer`'s queue, closes TensorBoard and the envs, frees the run."""
        self.envs, self.scorer, clean = envs, scorer, False
        try:
            yield
            clean = True  # a normal end (a first Ctrl-C's too): the workers close their envs; any other exit kills them
        except (EOFError, ConnectionError):  # a pipe to an env worker broke: which one died, and how?
            processes, deadline = getattr(envs.unwrapped, "processes", []), time.monotonic() + 2.0
            while not (dead := [p for p in processes if p.exitcode is not None]) and processes and time.monotonic() < deadline:
                time.sleep(0.02)  # the pipe breaks as the worker ends: its exit code follows within moments
            if not dead:
                raise
            code = dead[0].exitcode
            how = f"killed by {signal.Signals(-code).name}" if -code in set(signal.Signals) else f"exited with code {code}"
            resume = f"runs/{self.name}/checkpoint.pt"
            resume = f"; continue from its last checkpoint with --resume {resume}" if os.path.exists(resume) else ""
            raise RunError(f"env worker {processes.index(dead[0])} (pid {dead[0].pid}) died ({how}){resume}.") from None
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if "wakeup" in self.stop:  # install_stop_handlers' signal counting: the wakeup fd it replaced
                signal.set_wakeup_fd(self.stop["wakeup"])
            try:
                if self.scorer is not None:  # the chunk being scored ends in the background, the queued ones never start
                    self.scorer.shutdown(wait=False, cancel_futures=True)
                if self.writer is not None:
                    self.writer.close()  # may fail (a full disk): the envs are closed all the same
            finally:
                close_envs(envs, clean)
                for path, lock in RUN_LOCKS.items():  # free for a --resume; run.lock stays (a waiter may hold it open), empty
                    with contextlib.suppress(OSError):  # the folder removed meanwhile: nothing to empty
                        os.truncate(path, 0)
                    lock.release()
                RUN_LOCKS.clear()

    def start(self, networks: dict, rb, reward_model, frame_shape: tuple, success: Optional[Callable]) -> None:
        """Before the first step: disk and reward model cost said, run folder, W&B, TensorBoard, episodes, progress, signal."""
        args = self.args
        check_checkpoint_disk(args, networks, rb)  # before the run folder: a refused run leaves none
        if reward_model is not None:
            check_reward_memory(reward_model, args, frame_shape)
        if self.checkpoint is None:
            self.name = make_run_folder(self.name)
        lock_run(self.name)
        if args.track:  # as CleanRL: W&B mirrors the TensorBoard logs, with the flags as config and the script's code
            import wandb  # its own folder is ./wandb, as CleanRL's: inside runs/<run> it would sync copies of itself

            resumed = {"id": self.checkpoint.get("wandb_id"), "resume": "allow"} if self.checkpoint else {}
            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True, config=vars(args),
                       name=self.name, save_code=True, **(resumed if resumed.get("id") else {}))  # fmt: skip
        from torch.utils.tensorboard import SummaryWriter  # here: half a second to import, which a refused flag needs not

        threading.excepthook = lambda hook: (  # a full disk in TensorBoard's writer thread: add_scalar or close says it
            None if type(hook.thread).__name__ == "_AsyncWriterThread" and isinstance(hook.exc_value, OSError)
            else threading.__excepthook__(hook)
        )  # fmt: skip
        start_step = self.start_iteration * args.num_envs  # purge_step: drops a crash's logs after it
        self.writer = SummaryWriter(f"runs/{self.name}", purge_step=start_step if self.checkpoint else None)
        if self.checkpoint is None:
            table = "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items())
            self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
        prompts = f", goal={args.goal}, baseline={args.baseline}, alpha={args.alpha}" if args.reward == "clip" else ""
        resumed = f", resumed at step {self.checkpoint['global_step']}" if self.checkpoint else ""
        print(f"run: runs/{self.name} on {self.device}, reward: {args.reward}{prompts}{resumed}")
        self.sums = {"length": np.zeros(args.num_envs), **(self.checkpoint["episodes"]["sums"] if self.checkpoint else {})}
        self.success = success  # success(episode): an ended episode's charts/gt_success (None: not logged)
        self.finite, self.finite_steps = None, math.inf  # the NaN guard's last finite networks (snapshot)
        self.progress = Progress(args.total_timesteps, start_step, args.reward == "clip", max(10, args.num_envs))
        self.stop = install_stop_handlers()

    def restore(self, learner: dict, envs: gym.vector.VectorEnv, rb, recent: deque) -> np.ndarray:
        """A resumed run as saved: learner, buffer, random streams, recent returns; the envs' reset starts its episodes."""
        for name, module in learner.items():
            if torch.is_tensor(module):  # e.g. SAC's log entropy coefficient
                module.data.copy_(self.checkpoint[name])
            elif module is not None:  # e.g. no entropy-coefficient optimiser without --autotune
                module.load_state_dict(self.checkpoint[name])
        if self.checkpoint["replay_buffer"] is not None:
            rb.load_state_dict(self.checkpoint["replay_buffer"])
            self.checkpoint["replay_buffer"] = None  # frees the loaded copy (counted by the memory check)
        envs.set_attr("np_random", self.checkpoint["rng"]["envs"])
        random.setstate(self.checkpoint["rng"]["python"])
        np.random.set_state(self.checkpoint["rng"]["numpy"])
        torch.set_rng_state(self.checkpoint["rng"]["torch"])
        if self.checkpoint["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(self.checkpoint["rng"]["cuda"])
        for v in self.sums.values() if self.args.episodes == "stock" else ():  # episodes in flight restart: sums dropped
            v[:] = 0
        recent.extend(self.checkpoint["episodes"]["recent"])
        return envs.reset(options={"reset_mask": np.ones(self.args.num_envs, dtype=bool)})[0]

    def iterations(self):
        for self.iteration in range(self.start_iteration, self.last_iteration + 1):
            yield self.iteration
            self.progress.update((self.iteration + 1) * self.args.num_envs)

    @contextlib.contextmanager
    def timer(self, part: str):
        start = time.perf_counter()
        yield
        self.timing[part] = self.timing.get(part, 0.0) + time.perf_counter() - start

    def check_rewards(self, rewards: np.ndarray, step: int, networks: Callable[[], dict]) -> None:
        """The NaN guard's first line: a NaN or inf reward stops the run (exit 1) before it poisons the buffer."""
        if not np.all(np.isfinite(rewards)):
            hint = "; on a GPU, --clip-dtype bfloat16 has float32's range" if self.args.reward == "clip" else ""
            n, first = self.args.num_envs, int(np.flatnonzero(~np.isfinite(rewards))[0])
            at = step - (len(rewards) // n - 1 - first // n) * n  # step-major rows: env i of step t is row t * n + i
            bad = f"{np.sum(~np.isfinite(rewards))} of {len(rewards)} frames, the first at step {at} (env {first % n})"
            self.nonfinite(f"the {self.args.reward} reward is not finite for {bad}", networks(), hint)

    def snapshot(self, networks: Callable[[], dict], gradient_steps: int) -> None:
        """The NaN guard, before a training phase: a finite copy of the networks, about every 100 gradient steps."""
        if self.finite_steps >= 100:
            copied = copy.deepcopy(networks())
            if all_finite(copied):  # the last update of a phase has no loss that checks it: check the copy
                self.finite, self.finite_steps = copied, 0
        self.finite_steps += gradient_steps

    def nonfinite(self, what: str, networks: Optional[dict] = None, hint: str = "") -> None:
        """A NaN or inf: the last finite networks saved beside (never over) checkpoint.pt; the run stops (exit code 1)."""
        networks = networks if networks is not None else self.finite
        saved = "the networks were not finite already when training started"
        if networks is not None:
            path, checkpoint = f"runs/{self.name}/nonfinite_networks.pt", f"runs/{self.name}/checkpoint.pt"
            save_checkpoint(path, {**networks, "args": asdict(self.args), "run_name": self.name})
            kept = f" and the last resumable checkpoint {checkpoint} is kept" if os.path.exists(checkpoint) else ""
            saved = f"finite networks from before it were saved to {path}{kept}"
        raise NonFiniteError(f"{what}; {saved}{hint}.")

    def log_losses(self, step: int, losses: dict, finite: torch.Tensor, flags: str) -> None:
        """After a training phase: a NaN or inf loss stops the run; losses, SPS and times logged every 10th phase."""
        if not finite:
            values = ", ".join(f"{name} {torch.as_tensor(value).item()}" for name, value in losses.items())
            self.nonfinite(f"a loss ({values}) is not finite in the training phase at step {step}",
                           hint=f"; lower {flags} or check the rewards")  # fmt: skip
        if self.iteration % (10 * self.args.train_frequency) == 0:
            scalars = {(n if "/" in n else f"losses/{n}"): torch.as_tensor(v).item() for n, v in losses.items()}
            scalars["charts/SPS"] = int((step - self.progress.start_step) / max(time.time() - self.progress.start, 1e-9))
            scalars.update({f"time/{part}_s": seconds for part, seconds in self.times().items()})
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)

    def log_episodes(self, batch: dict, step: int, rewards: np.ndarray, clip_rewards: np.ndarray, components=()) -> list[dict]:
        """A scored batch (step-major rows, last step `step`) added to the episodes' sums: the ended ones, logged in order."""
        args, steps = self.args, len(rewards) // self.args.num_envs
        gt = batch["gt"].reshape(steps, args.num_envs, -1)
        sums = {"return": rewards, "gt_return": gt[..., 0], "clip_return": clip_rewards}
        sums.update({f"gt/{name}": gt[..., 2 + c] for c, name in enumerate(components)})
        sums = {k: np.reshape(v, (steps, args.num_envs)) for k, v in sums.items()}
        ended, dones = [], batch["dones"].reshape(steps, args.num_envs)
        for t in range(steps):
            self.sums["length"] += 1
            for k, v in sums.items():
                self.sums.setdefault(k, np.zeros(args.num_envs))[:] += v[t]
            self.sums["success"] = np.array(gt[t, :, 1], dtype=float)  # latched by the env, cleared at its reset
            for i in np.flatnonzero(dones[t]):
                ended.append({"t": t, "env": i, **{k: float(v[i]) for k, v in self.sums.items()}})
                for v in self.sums.values():
                    v[i] = 0
        for ep in ended:
            ended_at = step - (steps - 1 - ep["t"]) * args.num_envs
            self.progress.returns.append((ep["gt_return"], ep["clip_return"]))
            if args.log_episodes:
                print(f"global_step={ended_at}, episodic_return={ep['return']:.2f}, gt_return={ep['gt_return']:.1f}")
            scalars = {"charts/episodic_return": ep["return"], "charts/episodic_length": ep["length"]}
            scalars.update({"charts/gt_return": ep["gt_return"], **{n: ep[n] for n in ep if n.startswith("gt/")}})
            if self.success is not None:
                scalars["charts/gt_success"] = self.success(ep)
            if args.reward == "clip":
                scalars["charts/clip_return"] = ep["clip_return"]
                scalars["charts/clip_reward_mean"] = ep["clip_return"] / ep["length"]
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, ended_at)
        return ended

    def times(self) -> dict:
        """Seconds in each part of the loop; the envs' rendering (inside their step) apart from the step."""
        render = getattr(self.envs, "render_s", 0.0)
        return {**self.timing, "env": self.timing["env"] - render, "render": render}

    def video(self, evaluation: Callable[[int], list[dict]]) -> None:
        """--capture-video, every --video-frequency steps and at the end: an episode of `evaluation` as MP4, returns logged."""
        args, step = self.args, (self.iteration + 1) * self.args.num_envs
        new_period = (step - args.num_envs) // args.video_frequency != step // args.video_frequency
        if not (args.capture_video and (new_period or self.iteration == self.last_iteration)):
            return
        result = evaluation(1)[0]
        save_video(result["frames"], f"videos/{self.name}/step-{step}.mp4", result["fps"])
        self.writer.add_scalar("eval/gt_return", result["gt_return"], step)
        if math.isfinite(result["clip_return"]):
            self.writer.add_scalar("eval/clip_return", result["clip_return"], step)

    def checkpoint_due(self, dones: np.ndarray) -> bool:
        """A checkpoint after this step? Where episodes end: periodic and last with --save-model, and on a stop signal."""
        args, self.dones = self.args, dones
        self.stopping = self.stop["requested"]  # read once: a signal arriving later is handled at the next step
        boundary = dones.all() or args.episodes == "stock"
        period = (self.iteration + 1) * args.num_envs // args.checkpoint_frequency
        self.periodic = args.save_model and period > self.last_save // args.checkpoint_frequency
        fixed_end = args.episodes == "fixed" and self.last_iteration - self.iteration < args.episode_length
        last = args.save_model and (self.iteration == self.last_iteration or fixed_end)
        return boundary and (self.stopping or self.periodic or last)

    def save(self, learner: dict, envs, rb, networks: Callable[[], dict], recent, clip_return: float, **state) -> bool:
        """checkpoint.pt (what --resume reads), when periodic the paper's step-<N>.pt too; True on a stop signal (ends)."""
        args, step = self.args, (self.iteration + 1) * self.args.num_envs
        state.update(run_name=self.name, iteration=self.iteration + 1, global_step=step, args=asdict(args))
        # every random stream, which a resumed run continues
        state["rng"] = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                        "envs": list(envs.get_attr("np_random"))}  # fmt: skip
        state.update(episodes={"sums": copy.deepcopy(self.sums), "recent": list(recent)})
        state.update(clip_return=clip_return, replay_buffer=rb.state_dict() if args.save_buffer else None, script=self.source)
        state.update(wandb_id=getattr(getattr(sys.modules.get("wandb"), "run", None), "id", None))
        modules = {k: m.detach() if torch.is_tensor(m) else m.state_dict() for k, m in learner.items() if m is not None}
        save_checkpoint(f"runs/{self.name}/checkpoint.pt", {**modules, **state})
        if self.periodic:
            save_step_checkpoint(self.name, step, networks(), args, clip_return, self.source)
        without = "" if args.save_buffer else " (without the replay buffer: pass --save-buffer for an exact resume)"
        print(f"checkpoint saved at step {step}: runs/{self.name}/checkpoint.pt{without}")
        self.last_save = step
        if self.stopping:
            print(f"stopped; continue with: python {self.script} --resume runs/{self.name}/checkpoint.pt")
        return self.stopping

    def finish(self, networks: Callable[[], dict], clip_return: float, evaluation: Callable[[int], list[dict]]) -> None:
        """Where the time went; with --save-model the final networks (mid-episode: a step-<N>.pt) and their evaluation."""
        args, step = self.args, (self.iteration + 1) * self.args.num_envs
        self.progress.update(step, final=True)
        elapsed, steps = time.time() - self.progress.start, step - self.progress.start_step
        times = ", ".join(f"{part} {seconds:.2f} s" for part, seconds in self.times().items())
        print(f"done: {steps} steps in {elapsed:.0f} s ({int(steps / max(elapsed, 1e-9))} SPS); time in {times}")
        if args.track and "wandb" in sys.modules:  # wandb.finish: a no-op without a run
            sys.modules["wandb"].finish()
        if not args.save_model or self.stop["requested"]:
            return
        final = f"runs/{self.name}/checkpoint.pt"
        if args.episodes == "fixed" and not self.dones.all():
            save_step_checkpoint(self.name, step, networks(), args, clip_return, self.source)
            final = f"runs/{self.name}/checkpoints/step-{step}.pt"
        for i, result in enumerate(evaluation(args.eval_episodes)):
            print(f"eval episode {i}: {returns_text(result)}")
            self.writer.add_scalar("eval/gt_return", result["gt_return"], step)
        print(f"roll the policy out with: python {self.script} --evaluate {final}")


class Progress:
    """One progress line in tqdm's format: redrawn in place on a terminal, else printed every `interval` seconds (a tqdm
    bar redraws with a carriage return in a log file too: a run's log would be one line)."""

    def __init__(self, total_steps: int, start_step: int, clip: bool, recent: int, interval: float = 10.0):
        self.total, self.start_step, self.clip, self.tty = total_steps, start_step, clip, sys.stdout.isatty()
        self.interval, self.start = 0.5 if self.tty else interval, time.time()
        self.last, self.printed = self.start, None  # printed: the step of the last line in a log, not repeated at the end
        self.returns = deque(maxlen=recent)  # (gt_return, clip_return) of the last episodes

    def update(self, step: int, final: bool = False) -> None:
        now = time.time()
        if (not final and now - self.last < self.interval) or (final and not self.tty and self.printed == step):
            return
        elapsed, line = now - self.start, "step {n}/{total} ({percentage:.0f}%) | {rate_noinv_fmt} | elapsed {elapsed}"
        rate, left = (None, "00:00") if step >= self.total else (None if elapsed >= 5 else 0, "{remaining}")  # 0: "?" for 5 s
        line = tqdm.format_meter(step, self.total, elapsed, rate=rate, initial=self.start_step, unit=" steps",
                                 bar_format=f"{line} | left {left}")  # fmt: skip
        if self.returns:
            gt_return, clip_return = np.mean(self.returns, axis=0)
            line += f" | last {len(self.returns)} episodes: gt_return {gt_return:.1f}"
            line += f", clip_return {clip_return:.2f}" if self.clip else ""
        print(("\r\x1b[K" if self.tty else "") + line, end="\r" if self.tty and not final else "\n", flush=True)
        self.last, self.printed = now, step


STOP_PIPE: list[int] = []  # (read, write): Python's C signal handler writes a byte to it per delivery (made once)


def install_stop_handlers() -> dict:
    """First Ctrl-C or SIGTERM: checkpoint, exit; second: quit. Counted on the wakeup fd (two in one C call: one handler)."""
    if not STOP_PIPE:
        STOP_PIPE.extend(os.pipe())
        for fd in STOP_PIPE:
            os.set_blocking(fd, False)
    with contextlib.suppress(BlockingIOError):
        os.read(STOP_PIPE[0], 1024)  # signals of an earlier run in this process
    stop = {"requested": False, "wakeup": signal.set_wakeup_fd(STOP_PIPE[1], warn_on_full_buffer=False)}

    def handler(signum: int, frame) -> None:
        delivered = b""
        with contextlib.suppress(BlockingIOError):
            delivered = os.read(STOP_PIPE[0], 1024)
        if stop["requested"] or sum(byte in (signal.SIGINT, signal.SIGTERM) for byte in delivered) > 1:
            raise KeyboardInterrupt
        stop["requested"] = True
        print(f"\n{signal.Signals(signum).name} received: checkpoint after the current episodes (again: quit now)", flush=True)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stop


def make_run_folder(run_name: str) -> str:
    """Create runs/<run_name>/ exclusively: two runs started in the same second get different folders."""
    for name in [run_name, *(f"{run_name}-{i}" for i in range(1, 1000))]:
        with contextlib.suppress(FileExistsError):
            os.makedirs(f"runs/{name}")
            return name
    raise UserError(f"runs/{run_name} and 999 variants of it exist already; remove old runs or change --exp-name.")


def save_step_checkpoint(run_name: str, step: int, networks: dict, args, clip_return: float, source: dict) -> None:
    """runs/<run>/checkpoints/step-<N>.pt, all kept: the networks and CLIP return (`success_eval.py best` picks one)."""
    os.makedirs(f"runs/{run_name}/checkpoints", exist_ok=True)
    state = {"args": asdict(args), "run_name": run_name, "global_step": step, "clip_return": clip_return, "script": source}
    save_checkpoint(f"runs/{run_name}/checkpoints/step-{step}.pt", {**networks, **state})


def misfit(saved, fresh) -> Optional[str]:
    """What keeps `saved` from loading into `fresh` (a module, optimiser or tensor; others take anything), or None."""
    if torch.is_tensor(fresh):
        shape = tuple(saved.shape) if torch.is_tensor(saved) else type(saved).__name__
        return None if shape == tuple(fresh.shape) else f"is {shape}, not {tuple(fresh.shape)}"
    try:
        if isinstance(fresh, (nn.Module, torch.optim.Optimizer)):
            fresh.load_state_dict(saved)
    except Exception as e:  # noqa: BLE001 - whatever torch refuses it for, its first line (a module's: after a header)
        lines = str(e).split(":\n", 1)[-1].strip().splitlines()
        return f"does not load ({type(e).__name__}: {(lines or [''])[0].strip().rstrip('.')[:200]})"
    return None


def all_finite(state) -> bool:
    if isinstance(state, (dict, list, tuple)):
        return all(map(all_finite, state.values() if isinstance(state, dict) else state))
    return not (torch.is_tensor(state) and state.is_floating_point()) or bool(torch.isfinite(state).all())


# --- Files written whole: checkpoints, videos -------------------------------------------------
def save_checkpoint(path: str, state: dict) -> None:
    """Atomic and durable: a crash, power cut or full disk mid-write never replaces a good checkpoint with half of one."""
    folder, tmp = os.path.dirname(path) or ".", f"{path}.{os.urandom(6).hex()}.tmp"  # its own temp file per write
    try:
        with open(tmp, "xb") as f:  # the mode any new file gets (mkstemp's 0600 stayed on the renamed checkpoint)
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the rename makes it the checkpoint
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):  # not made at all (a read-only folder)
            os.unlink(tmp)
        cause = e if isinstance(e, OSError) else e.__cause__ or e.__context__  # torch wraps a full disk in a RuntimeError
        if isinstance(e, (OSError, RuntimeError)):  # the machine's failure, not the input's: exit code 1 (see cli)
            why = getattr(cause, "strerror", None) or str(e).splitlines()[0][:120]
            raise OSError(f"could not write {path} ({why}); the previous file there is intact.") from None
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    os.fsync(dir_fd)  # the rename itself survives a power cut
    os.close(dir_fd)


def save_video(frames: list[np.ndarray], path: str, fps: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    imageio.mimwrite(path, frames, fps=fps, macro_block_size=8)
    if (wandb := sys.modules.get("wandb")) is not None and wandb.run is not None:  # --track: the videos go to W&B too
        wandb.log({f"videos/{Path(path).stem}": wandb.Video(path, format="mp4")})


@torch.no_grad()
def evaluate(policy: Callable, eval_envs: gym.vector.VectorEnv, reward_model, episodes: int, seed: int) -> list[dict]:
    """Episodes of `policy` in a one-env vector env: frames (checked as training's), frame rate, gt and CLIP returns."""
    results, env = [], eval_envs.envs[0]
    for episode in range(episodes):
        obs, _ = eval_envs.reset(seed=seed + episode)
        frames = [eval_envs.call("render")[0]]
        if problem := frame_problem(env, frames[0]):
            raise RunError(problem + ".")
        gt_return, done = 0.0, False
        while not done:  # fixed length: --episode-length steps; stock: until the env terminates or truncates
            obs, gt_rewards, terminations, truncations, _ = eval_envs.step(policy(obs))
            done, gt_return = bool(terminations[0] or truncations[0]), gt_return + float(gt_rewards[0])
            frames.append(eval_envs.call("render")[0])
            if problem := frame_problem(env, frames[-1], frames[0].shape):  # one shape: one video, one batch for CLIP
                raise RunError(problem + ".")
        # the reset frame scores no transition: the reward of step t is the score of frame t + 1
        clip_return = float(reward_model(np.stack(frames[1:])).sum()) if reward_model is not None else math.nan
        results.append(dict(frames=frames, gt_return=gt_return, clip_return=clip_return, fps=eval_envs.metadata["render_fps"]))
    return results


def save_episodes(results: list[dict], run_name: str) -> None:
    """--evaluate: MP4 and PNGs per episode, replacing an earlier evaluation only once complete (hidden folder first)."""
    os.makedirs(f"videos/{run_name}", exist_ok=True)
    partial = tempfile.mkdtemp(prefix=".eval-partial-", dir=f"videos/{run_name}")
    try:
        for i, result in enumerate(results):
            save_video(result["frames"], f"{partial}/eval-episode-{i}.mp4", result["fps"])
            os.makedirs(f"{partial}/eval-episode-{i}")
            for t, frame in enumerate(result["frames"]):
                imageio.imwrite(f"{partial}/eval-episode-{i}/frame-{t:04d}.png", frame)
        stale = sorted(Path(f"videos/{run_name}").glob("eval-episode-*"))
        for path in stale:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        for name in sorted(os.listdir(partial)):
            os.rename(f"{partial}/{name}", f"videos/{run_name}/{name}")
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    if stale:
        print(f"replaced the earlier evaluation in videos/{run_name}/")
    for i, result in enumerate(results):
        print(f"eval episode {i}: {returns_text(result)} -> videos/{run_name}/eval-episode-{i}.mp4")


def returns_text(result: dict) -> str:
    clip = f"clip_return={result['clip_return']:.2f} " if math.isfinite(result["clip_return"]) else ""
    return f"{clip}gt_return={result['gt_return']:.1f}"
