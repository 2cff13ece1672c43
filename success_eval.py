"""VLM-RM success rates, as the paper measured them: rollouts of a trained policy, judged by the ground truth
(CartPole, MountainCar) or by a person (Humanoid), with a Wilson interval; the best checkpoint; the model-size study.

    # 1. 100 stochastic episodes of a checkpoint (env and flags come from the checkpoint): MP4s + episodes.csv
    python success_eval.py rollout --checkpoint runs/<run>/checkpoint.pt
    # 2. Humanoid: judge each episode at http://127.0.0.1:8765 (keys: 1 success, 0 failure, s skip, Backspace back)
    python success_eval.py label --rollouts runs/<run>/rollouts-checkpoint-stochastic
    # 3. success rate per policy with a Wilson 95% interval -> runs/success.csv, runs/success.md
    python success_eval.py report --rollouts runs/*/rollouts-*
    # 4. the checkpoint with the highest mean CLIP return on evaluation rollouts, among runs of one configuration
    python success_eval.py best --runs runs
    # 5. EPIC distance and success rate against CLIP model size, one line per alpha -> runs/study.csv, runs/study.png
    python success_eval.py study --epic runs/*/epic.csv --success runs/success.csv
"""

import csv
import errno
import glob
import hashlib
import io
import json
import logging
import math
import os
import shutil
import signal
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame draws off-screen: no display needed

import gymnasium as gym
import imageio.v2 as imageio
import numpy as np
import torch
import tyro

# One source of truth: the environments, networks and reward model are those of the training script that wrote the
# checkpoint (vlmrm_tools.import_script: vlmrm_dqn_classic.py, vlmrm_sac_humanoid.py or a copy of either).
from epic_eval import ClipArgs, model_label
from label_server import SKIP, VIDEOS, make_label_server, read_labels, serve
from vlmrm_dqn_classic import MOUNTAINCAR_GOAL
from vlmrm_tools import (
    check_new_folder,
    check_output_file,
    drop_partial_folder,
    import_script,
    new_partial_folder,
    publish_folder,
    read_csv,
    read_json,
    write_atomic,
)
from vlmrm_utils import (
    UserError,
    all_finite,
    check_clip_args,
    check_intact,
    cli,
)

CARTPOLE_THETA, CARTPOLE_X = 12 * 2 * math.pi / 360, 2.4  # Gymnasium's CartPole limits: "upright"


@dataclass
class Rollout:
    """Roll a checkpoint out: one MP4 per episode plus episodes.csv (CLIP return, ground-truth return and success).
    The env and all its flags are the checkpoint's own: none can be given here."""

    checkpoint: str
    """a checkpoint.pt of vlmrm_dqn_classic.py or vlmrm_sac_humanoid.py"""
    episodes: int = 100
    """number of episodes (the paper judged 100)"""
    deterministic: bool = False
    """if toggled, greedy/mean actions; default: stochastic, as the paper's rollouts (SAC samples its policy, DQN is
    epsilon-greedy with the run's final --end-e, as Stable-Baselines3's predict(deterministic=False))"""
    out: Optional[str] = None
    """new folder for the rollouts (default: <checkpoint folder>/rollouts-<checkpoint name>-<stochastic|deterministic>)"""
    seed: Optional[int] = None
    """seed of episode 0 (episode i: seed + i); default: the run's seed + 10000, as the scripts' own evaluation"""
    clip_return: bool = True
    """compute each episode's CLIP return with the run's reward model (needs its weights); off: left blank"""
    clip_cache_dir: Optional[str] = None
    """where the CLIP weights are cached on this machine (default: the run's own setting)"""
    cuda: bool = True
    """if toggled, CUDA (when available) runs the policy and the reward model"""


@dataclass
class Label:
    """Judge the episodes of a rollout folder in the browser (127.0.0.1 only); every verdict is saved as given."""

    rollouts: str
    """a folder written by `rollout`"""
    port: int = 8765
    """port on 127.0.0.1 (0 = any free port)"""
    task: Optional[str] = None
    """the question above each video (default: the run's goal prompt)"""


@dataclass
class Report:
    """Success rate of each policy with a Wilson 95% interval; a table across policies as CSV and Markdown."""

    rollouts: tuple[str, ...]
    """folders written by `rollout`"""
    judge: Literal["auto", "gt", "labels"] = "auto"
    """auto: the ground truth where the env has one (CartPole, MountainCar), else your labels; gt; labels"""
    out: str = "runs/success"
    """writes <out>.csv and <out>.md"""


@dataclass
class Best:
    """Among runs of one configuration and their saved steps, the checkpoint with the highest CLIP return: by default
    the training-time CLIP return each checkpoint records (the paper's criterion), or on new evaluation rollouts."""

    checkpoints: tuple[str, ...] = ()
    """checkpoint files (default: every runs/<run>/checkpoints/step-<N>.pt under --runs, and each run's checkpoint.pt)"""
    runs: str = "runs"
    """folder searched for checkpoints when none are given"""
    by: Literal["training", "rollouts"] = "training"
    """training: the training-time CLIP return stored in each checkpoint (mean of the run's last 100 episodes when it was
    saved, as the paper chose); rollouts: the mean CLIP return of --episodes new evaluation rollouts of each"""
    episodes: int = 10
    """--by rollouts: evaluation episodes per checkpoint"""
    deterministic: bool = False
    """if toggled, greedy/mean actions (default: stochastic, as `rollout`)"""
    seed: Optional[int] = None
    """seed of episode 0; default: each run's seed + 10000"""
    clip_cache_dir: Optional[str] = None
    """where the CLIP weights are cached on this machine"""
    cuda: bool = True
    """if toggled, CUDA (when available) runs the policies and the reward model"""


@dataclass
class Study:
    """The paper's model-size study: EPIC distance and success rate against CLIP parameters, one line per alpha."""

    epic: tuple[str, ...] = ()
    """epic.csv files of `epic_eval.py score` (projection rows are used)"""
    success: tuple[str, ...] = ()
    """success tables (CSV) of `report`; seeds of one model and alpha are pooled"""
    model_params: tuple[str, ...] = ()
    """parameter counts as NAME=COUNT (NAME: the open_clip architecture, e.g. RN50=102e6); default: counted from
    the open_clip config without loading weights"""
    model_configs: tuple[str, ...] = ()
    """open_clip model configs (.json) of custom architectures to count, e.g. tests/vlmrm-tiny-test.json"""
    out: str = "runs/study"
    """writes <out>.csv and <out>.png"""


# ----------------------------------------------------------------------------------------------
# Checkpoints, envs and policies: the training scripts' own
# ----------------------------------------------------------------------------------------------
def load_checkpoint(path: str) -> tuple[dict, object, object]:
    """(checkpoint, the training script's module, its Args as saved), or a one-sentence error."""
    which = "a checkpoint.pt of vlmrm_dqn_classic.py or vlmrm_sac_humanoid.py"
    if os.path.isdir(path):
        raise UserError(f"{path} is a folder; pass {which} in it.")
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such file; pass {which}.")
    check_intact(path, path, f"pass another copy, or {which}")
    try:  # our own files hold RNG states and arrays: weights_only=False, so only roll out checkpoints you trust
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise UserError(f"{path} could not be read ({type(e).__name__}); pass {which}.") from None
    policy_keys = {"q_network", "actor"} & checkpoint.keys() if isinstance(checkpoint, dict) else set()
    if not policy_keys or not isinstance(checkpoint.get("args"), dict):
        raise UserError(f"{path} holds no policy (no 'q_network' or 'actor' with its 'args'); pass {which}.")
    name = "q_network" if "q_network" in checkpoint else "actor"
    if not all_finite(checkpoint[name]):  # it would roll out NaN actions (or argmax 0 every step) with exit 0
        raise UserError(
            f"{path}: its {name} holds NaN or infinite weights, so it cannot act; pass a checkpoint saved before its run "
            "diverged (e.g. runs/<run>/checkpoints/step-<N>.pt)."
        )
    script = import_script(checkpoint, path, path)  # the script that wrote it, as it was: a copy's own reward, env, networks
    known = {f.name for f in fields(script.Args)}
    args = script.Args(**{"episodes": "fixed", **{k: v for k, v in checkpoint["args"].items() if k in known}})
    if name == "actor" and args.episode_length is None:
        args.episode_length = 200 if args.env_id == "MountainCarContinuous-v0" else 100
    return checkpoint, script, args


def make_envs(script, args, seed: int) -> gym.vector.SyncVectorEnv:
    """One env built exactly as the run's training envs: same id, episodes, length and look."""
    if hasattr(script, "QNetwork"):  # vlmrm_dqn_classic.py or a copy of it
        thunk = script.make_env(args.env_id, seed, 0, args.episode_length, args.realistic, args.episodes == "fixed")
    else:
        thunk = script.make_env(
            args.env_id,
            seed,
            0,
            args.episode_length,
            args.render_size,
            args.render_quality,
            args.realistic,
            args.camera,
            args.episodes == "fixed",
            args.renderer,
            args.supersample,
        )
    return gym.vector.SyncVectorEnv([thunk])


def make_policy(path: str, checkpoint: dict, script, args, envs, deterministic: bool, device: torch.device):
    """obs tensor (1, obs_dim) -> env action array; stochastic unless `deterministic`."""
    name = "q_network" if "q_network" in checkpoint else "actor"
    network = (script.QNetwork(envs) if name == "q_network" else script.Actor(envs)).to(device)
    try:
        network.load_state_dict(checkpoint[name])
    except RuntimeError as e:
        raise UserError(f"{path}: its {name} does not fit {args.env_id} ({str(e).splitlines()[0][:120]}).") from None
    network.eval()
    rng = np.random.default_rng(args.seed)

    def act(obs: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            if name == "q_network":  # SB3's DQN.predict(deterministic=False): epsilon-greedy at the final exploration rate
                if not deterministic and rng.random() < args.end_e:
                    return np.array([rng.integers(envs.single_action_space.n)])
                return network(obs).argmax(dim=1).cpu().numpy()
            sample, _, mean = network.get_action(obs)
            return (mean if deterministic else network.to_env(sample)).cpu().numpy()

    return act


def reward_model_for(script, args, device: torch.device):
    """The run's own CLIP reward (model, prompts, alpha, family), or None for a --reward gt run."""
    return script.make_reward_model(args, device) if args.reward == "clip" else None


def gt_success(env_id: str, states: list) -> Optional[bool]:
    """Ground-truth success of an episode from the states after each step; None where a person judges (Humanoid).

    CartPole: every step upright (|theta| < 12 deg and |x| < 2.4); MountainCar: the flag (x >= 0.45) reached."""
    if env_id == "CartPole-v1":
        return all(abs(s[2]) < CARTPOLE_THETA and abs(s[0]) < CARTPOLE_X for s in states)
    if env_id.startswith("MountainCar"):
        return any(s[0] >= MOUNTAINCAR_GOAL for s in states)
    return None


def run_episode(envs, act, seed: int, device: torch.device) -> tuple[list[np.ndarray], list, float]:
    """(frames: the reset frame then one per step, states after each step, ground-truth return)."""
    obs, _ = envs.reset(seed=seed)
    base = envs.envs[0].unwrapped
    frames, states, gt_return, done = [envs.call("render")[0]], [], 0.0, False
    while not done:  # fixed length: --episode-length steps; stock: until the env terminates or truncates
        obs, rewards, terminations, truncations, _ = envs.step(act(torch.as_tensor(obs, dtype=torch.float32, device=device)))
        done = bool(terminations[0] or truncations[0])
        gt_return += float(rewards[0])
        frames.append(envs.call("render")[0])
        # in the env's own precision: MountainCarContinuous clips x to float32(0.45), below 0.45 as a float64
        states.append(np.array(base.state) if hasattr(base, "state") else None)
    return frames, states, gt_return


def policy_sha256(checkpoint: dict) -> str:
    """The policy's identity: the sha256 of its network's weights, the same in any copy of the checkpoint and in the
    checkpoint.pt and step-<N>.pt of one step, another once training has gone on."""
    digest = hashlib.sha256()
    for key, tensor in checkpoint["q_network" if "q_network" in checkpoint else "actor"].items():
        digest.update(f"{key} {tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().numpy().tobytes())
    return digest.hexdigest()


def clip_return(reward_model, frames: list[np.ndarray]) -> float:
    # the reset frame scores no transition: the reward of step t is the score of the frame after it
    return float(reward_model(np.stack(frames[1:])).sum())


# ----------------------------------------------------------------------------------------------
# rollout
# ----------------------------------------------------------------------------------------------
EPISODE_COLUMNS = ["episode", "video", "seed", "steps", "clip_return", "gt_return", "gt_success"]


def ctrl_c_between_episodes() -> tuple[list, object]:
    """First Ctrl-C: stop before the next episode (raised inside imageio's ffmpeg writer or a finaliser, a
    KeyboardInterrupt can be swallowed, the rollout running on, or leave ffmpeg writing into the removed folder).
    Second: at once. Returns the flag and the handler it replaced."""
    requested = []

    def handler(signum, frame) -> None:
        if requested:
            raise KeyboardInterrupt
        requested.append(True)

    return requested, signal.signal(signal.SIGINT, handler)


def write_video(path: str, frames: list[np.ndarray], fps: int) -> None:
    """An episode's MP4; faststart: the browser can play it before the whole file arrived. On a full disk ffmpeg printed
    five lines of its own and imageio raised "Broken pipe" with ffmpeg's command line (or, failing only as ffmpeg
    closes the file, nothing: imageio does not check its exit status), so ffmpeg is kept quiet and the cause is found
    here, by the space left."""
    try:
        imageio.mimwrite(
            path, frames, fps=fps, macro_block_size=8, ffmpeg_log_level="quiet", ffmpeg_params=["-movflags", "+faststart"]
        )
    except OSError as e:
        if shutil.disk_usage(os.path.dirname(path)).free >= 2**20:
            raise OSError(f"ffmpeg stopped writing {os.path.basename(path)}: {str(e).splitlines()[0]}") from None
    if shutil.disk_usage(os.path.dirname(path)).free < 2**20:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def rollout(args: Rollout) -> str:
    """Writes <out>/{episodes.csv, policy.json, videos/episode-NNN.mp4}; returns the folder."""
    if args.episodes < 1:
        raise UserError(f"--episodes must be a positive integer, got {args.episodes}.")
    checkpoint, script, run = load_checkpoint(args.checkpoint)
    mode = "deterministic" if args.deterministic else "stochastic"
    out = args.out or os.path.join(os.path.dirname(args.checkpoint) or ".", f"rollouts-{Path(args.checkpoint).stem}-{mode}")
    check_new_folder(out, "--out", "rollouts and their labels are never overwritten")
    if args.clip_cache_dir is not None:
        run.clip_cache_dir = args.clip_cache_dir
    use_clip = args.clip_return and run.reward == "clip"
    if use_clip:
        try:  # e.g. a --clip-model config path relative to the folder the run was trained in
            check_clip_args(run)
        except UserError as e:
            raise UserError(
                f"cannot load the run's reward model ({str(e).rstrip('.')}); run from the folder it was trained "
                "in, pass --clip-cache-dir, or pass --no-clip-return."
            ) from None
    seed = run.seed + 10_000 if args.seed is None else args.seed
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    torch.manual_seed(run.seed)  # as the run built it: the same weights, even for a random-weight test model
    reward_model = reward_model_for(script, run, device) if use_clip else None
    torch.manual_seed(seed)
    envs = make_envs(script, run, seed)
    act = make_policy(args.checkpoint, checkpoint, script, run, envs, args.deterministic, device)
    fps = 50 if hasattr(script, "QNetwork") else 30  # the training scripts' video rates
    partial = new_partial_folder(out)  # renamed to --out once complete: a rollout folder is whole or absent
    rows, (ctrl_c, previous_handler) = [], ctrl_c_between_episodes()
    try:
        os.makedirs(os.path.join(partial, "videos"))
        for episode in range(args.episodes):
            if ctrl_c:
                raise KeyboardInterrupt
            frames, states, gt_return = run_episode(envs, act, seed + episode, device)
            video = f"episode-{episode:03d}.mp4"
            write_video(os.path.join(partial, "videos", video), frames, fps)
            success = gt_success(run.env_id, states)
            rows.append(
                {
                    "episode": episode,
                    "video": video,
                    "seed": seed + episode,
                    "steps": len(states),
                    "clip_return": f"{clip_return(reward_model, frames):.6f}" if reward_model is not None else "",
                    "gt_return": f"{gt_return:.6f}",
                    "gt_success": "" if success is None else int(success),
                }
            )
            print(
                f"episode {episode}: steps={len(states)} clip_return={rows[-1]['clip_return'] or '-'} "
                f"gt_return={gt_return:.1f} gt_success={rows[-1]['gt_success'] if success is not None else '- (judge it)'}"
            )
        envs.close()
        with open(os.path.join(partial, "episodes.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=EPISODE_COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        with open(os.path.join(partial, "policy.json"), "w") as f:
            json.dump(
                {
                    "checkpoint": os.path.abspath(args.checkpoint),
                    "script": Path(script.__file__).name,
                    "policy_sha256": policy_sha256(checkpoint),
                    "mode": mode,
                    "seed": seed,
                    "episodes": args.episodes,
                    "args": {k: v for k, v in vars(run).items()},
                },
                f,
                indent=2,
            )
    except BaseException as e:
        envs.close()
        drop_partial_folder(partial)
        if isinstance(e, KeyboardInterrupt):
            raise Stopped(f"stopped by Ctrl-C after {len(rows)} of {args.episodes} episodes; nothing was written to {out}.")
        if isinstance(e, OSError):  # e.g. the disk filled up
            raise UserError(f"could not write the rollouts ({e.strerror or e}); nothing was written to {out}.") from None
        raise
    finally:
        signal.signal(signal.SIGINT, previous_handler)
    publish_folder(partial, out, "--out")
    judged = [r["gt_success"] for r in rows if r["gt_success"] != ""]
    print(
        f"wrote {len(rows)} {mode} episodes of {run.env_id} to {out}"
        + (
            f"; ground truth: {sum(judged)} of {len(judged)} successes"
            if judged
            else f"; judge them with: python success_eval.py label --rollouts {out}"
        )
    )
    return out


class Stopped(KeyboardInterrupt):
    """Ctrl-C during the rollouts: this one line and exit code 130 (utils.cli), nothing half-written."""


def read_rollouts(folder: str) -> tuple[dict, list[dict]]:
    """(policy.json, rows of episodes.csv) of a folder written by `rollout`, each checked: one sentence naming the file
    and line of the first problem (a hand edit gone wrong), never a guess."""
    for name in ("policy.json", "episodes.csv"):
        if not os.path.isfile(os.path.join(folder, name)):
            raise UserError(f"{folder} is not a folder written by `success_eval.py rollout` (it has no {name}).")
    return read_policy(os.path.join(folder, "policy.json")), read_episodes(os.path.join(folder, "episodes.csv"))


def read_policy(path: str) -> dict:
    policy = read_json(path)
    run = policy.get("args") if isinstance(policy, dict) else None
    if not isinstance(run, dict) or policy.get("mode") not in ("stochastic", "deterministic"):
        raise UserError(f"{path} has no 'mode' (stochastic or deterministic) or no run 'args'; write it with `rollout`.")
    types = {"env_id": str, "seed": int, "reward": str, "goal": (list, type(None))}  # what the report and the page read
    if run.get("reward") == "clip":
        types.update(clip_model=str, clip_pretrained=str, alpha=(int, float, type(None)), clip_checkpoint=(str, type(None)))
    for key, kind in types.items():
        value = run.get(key)
        if (
            not isinstance(value, kind)
            or isinstance(value, bool)
            or (key == "reward" and value not in ("clip", "gt"))
            or (key == "goal" and not all(isinstance(g, str) for g in value or []))  # joined into the task's name
        ):
            raise UserError(f"{path}: args.{key} is {value!r}, which `rollout` never writes; roll the checkpoint out again.")
    return policy


def read_episodes(path: str) -> list[dict]:
    rows = read_csv(path, EPISODE_COLUMNS)
    if not rows:
        raise UserError(f"{path} lists no episodes to judge; roll the checkpoint out again with `success_eval.py rollout`.")

    def problem(row: dict) -> Optional[str]:
        for key in ("episode", "seed", "steps"):
            if not is_whole_number(row[key]):
                return f"{key} {row[key]!r} is not a whole number of at least 0"
        for key in ("clip_return", "gt_return"):
            if (row[key] != "" or key == "gt_return") and not is_finite_number(row[key]):
                return f"{key} {row[key]!r} is not a number"
        if row["gt_success"] not in ("", "0", "1"):
            return f"gt_success {row['gt_success']!r} is not 0, 1 or blank"
        return None  # the video names: label_server checks them where they are served

    first_line = {}  # video -> its line: a row copied by hand would count its episode twice
    for line, row in rows:
        reason = problem(row)
        if reason is not None:
            raise UserError(f"{path} line {line}: {reason}; fix that line or roll the checkpoint out again.")
        if first_line.setdefault(row["video"], line) != line:
            raise UserError(
                f"{path} lists {row['video']} more than once (lines {first_line[row['video']]} and {line}), so its episode "
                "would count twice; remove one of them."
            )
    if len({row["gt_success"] == "" for _, row in rows}) > 1:
        raise UserError(f"{path} has a ground-truth success on some lines and none on others; roll the checkpoint out again.")
    return [row for _, row in rows]


def is_whole_number(text: str, most: Optional[int] = None) -> bool:
    """0, 1, 2... in ASCII digits ('²'.isdigit() holds, but int() refuses it), at most `most`."""
    text = text.strip()
    return text.isascii() and text.isdigit() and (most is None or int(text) <= most)


def is_finite_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


# ----------------------------------------------------------------------------------------------
# label: label_server.py's page and server, one episode video at a time
# ----------------------------------------------------------------------------------------------
def make_episode_server(folder: str, port: int, task: Optional[str] = None):
    """label_server's page and server over a rollout folder: its videos, its labels.csv."""
    policy, rows = read_rollouts(folder)
    task = task or " / ".join(policy["args"].get("goal") or [policy["args"]["env_id"]])
    return make_label_server(folder, port, task, [r["video"] for r in rows], VIDEOS)


def label(args: Label) -> None:
    server = make_episode_server(args.rollouts, args.port, args.task)
    videos = [r["video"] for r in read_rollouts(args.rollouts)[1]]
    done = len(read_labels(args.rollouts, set(videos), VIDEOS))
    serve(server, args.rollouts, f"judging {len(videos)} episodes of {args.rollouts} ({done} already judged)")


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------
def wilson(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (good coverage at small n and near 0 or 1); nan for n = 0."""
    if n == 0:
        return float("nan"), float("nan")
    from scipy.stats import binomtest  # here: slow to import, and only the Wilson interval needs it

    ci = binomtest(successes, n).proportion_ci(confidence_level=confidence, method="wilson")
    return min(1.0, max(0.0, float(ci.low))), min(1.0, max(0.0, float(ci.high)))  # a proportion: never past [0, 1]


def run_columns(run_args: dict) -> dict:
    """task, alpha, model, seed of a run, as the tables name them (the model as epic_eval.py score names it)."""
    clip = run_args.get("reward", "clip") == "clip"
    model = "gt"
    if clip:
        model = model_label(ClipArgs(run_args["clip_model"], run_args["clip_pretrained"], run_args.get("clip_checkpoint")))
    return {
        "env_id": run_args["env_id"],
        "task": " | ".join(run_args.get("goal") or []) if clip else "ground truth",
        "alpha": run_args.get("alpha", "") if clip else "",
        "model": model,
        "seed": run_args["seed"],
    }


REPORT_COLUMNS = [
    "env_id",
    "task",
    "alpha",
    "model",
    "seed",
    "mode",
    "judged_by",
    "n",
    "successes",
    "unjudged",
    "success_rate",
    "low",
    "high",
    "mean_clip_return",
    "mean_gt_return",
    "rollouts",
]


def judge_folder(folder: str, judge: str) -> dict:
    policy, rows = read_rollouts(folder)
    has_gt = any(r["gt_success"] != "" for r in rows)
    by = "gt" if judge == "gt" or (judge == "auto" and has_gt) else "labels"
    if by == "gt":
        if not has_gt:
            raise UserError(
                f"{folder} has no ground-truth success ({policy['args']['env_id']} has none); judge it with "
                f"`python success_eval.py label --rollouts {folder}` and use --judge labels."
            )
        verdicts = [int(r["gt_success"]) for r in rows]
    else:
        labels = read_labels(folder, {r["video"] for r in rows}, VIDEOS)
        verdicts = [int(labels[r["video"]]) for r in rows if labels.get(r["video"], SKIP) in ("0", "1")]
    n, k = len(verdicts), sum(verdicts)
    low, high = wilson(k, n)

    def mean(key: str) -> str:  # blank when any episode has none (e.g. no CLIP return for a --reward gt run)
        if not rows or any(r[key] == "" for r in rows):
            return ""
        return f"{np.sum([float(r[key]) / len(rows) for r in rows]):.4f}"  # divided first: a sum can overflow to inf

    return {
        **run_columns(policy["args"]),
        "mode": policy["mode"],
        "judged_by": by,
        "n": n,
        "successes": k,
        "unjudged": len(rows) - n,
        "success_rate": f"{k / n:.4f}" if n else "",
        "low": f"{low:.4f}" if n else "",
        "high": f"{high:.4f}" if n else "",
        "mean_clip_return": mean("clip_return"),
        "mean_gt_return": mean("gt_return"),
        "rollouts": folder,
    }


def check_each_once(paths: tuple[str, ...], flag: str, what: str) -> None:
    """One folder or file given twice (R and R/, a symbolic or hard link to it) would count its episodes twice."""
    seen: dict[tuple[int, int], str] = {}
    for path in filter(os.path.exists, paths):  # a missing one is named by its reader
        status = os.stat(path)
        key = (status.st_dev, status.st_ino)
        if key in seen:
            raise UserError(
                f"{flag} {path} is the same {what} as {seen[key]}, so it would count twice; list each {what} once."
            )
        seen[key] = path


def check_new_episodes(folder: str, where: str, seen: dict) -> None:
    """Refuse episodes of `folder` (named by `where`: a flag, a row) that `seen` holds already: two rollouts of one
    checkpoint with one seed, or a copy of a rollouts folder, hold the same episodes, and would count twice. An episode is
    its policy (the sha256 of its weights; for a folder written before `rollout` recorded it, the checkpoint's path and
    the episode's own numbers), its mode and its env's seed, and for stochastic episodes the rollout's first seed too
    (the policy's random draws run on from episode to episode)."""
    policy, rows = read_rollouts(folder)
    first = policy.get("seed") if policy["mode"] == "stochastic" else None
    for row in rows:
        own = (policy.get("checkpoint"), row["steps"], row["clip_return"], row["gt_return"])
        key = (str(policy.get("policy_sha256", own)), policy["mode"], str(first), row["seed"])
        if key in seen:
            other, video = seen[key]
            raise UserError(
                f"{where} and {other} hold the same episodes ({os.path.join(folder, 'videos', row['video'])} is {video}: "
                f"one policy, {policy['mode']}, seed {row['seed']}), so they would count twice; keep one of the two."
            )
        seen[key] = where, os.path.join(folder, "videos", row["video"])


def report(args: Report) -> list[dict]:
    if not args.rollouts:
        raise UserError("--rollouts needs at least one folder written by `success_eval.py rollout`.")
    check_each_once(args.rollouts, "--rollouts", "folder")
    seen = {}
    for folder in args.rollouts:
        check_new_episodes(folder, f"--rollouts {folder}", seen)
    for ext in (".csv", ".md"):
        check_output_file(args.out + ext, "--out")
    table = [judge_folder(folder, args.judge) for folder in args.rollouts]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=REPORT_COLUMNS)
    writer.writeheader()
    writer.writerows(table)
    write_atomic(args.out + ".csv", lambda f: f.write(text.getvalue().encode()))
    lines = ["| env | task | alpha | model | seed | judged by | success rate (95% Wilson) | n |", "|" + "---|" * 8]
    for row in table:
        rate = "not judged yet"
        if row["n"]:
            rate = f"{float(row['success_rate']):.2f} [{float(row['low']):.2f}, {float(row['high']):.2f}]"
        lines.append(
            f"| {row['env_id']} | {row['task']} | {row['alpha']} | {row['model']} | {row['seed']} | "
            f"{row['judged_by']} | {rate} | {row['n']} |"
        )
    write_atomic(args.out + ".md", lambda f: f.write(("\n".join(lines) + "\n").encode()))
    print("\n".join(lines))
    for row in table:
        if row["unjudged"]:
            print(f"note: {row['unjudged']} episodes of {row['rollouts']} are not judged (unlabelled or skipped): left out")
    print(f"wrote {args.out}.csv and {args.out}.md")
    return table


# ----------------------------------------------------------------------------------------------
# best
# ----------------------------------------------------------------------------------------------
# every flag that changes what a CLIP return means: the reward itself, and what it is summed over (the episode's
# length, the frames CLIP sees); returns of checkpoints that differ in any of them do not compare
LIKE_FLAGS = """env_id reward clip_model clip_pretrained clip_checkpoint goal baseline alpha reward_family negatives
temperature threshold soft antialias episodes episode_length realistic render_size render_quality camera renderer
supersample""".split()


def find_checkpoints(runs: str) -> list[str]:
    """The paper's kept checkpoints: every checkpoints/step-<N>.pt of every run, and each run's checkpoint.pt (its last
    state, e.g. at the end of training between two --checkpoint-frequency steps)."""
    steps = glob.glob(os.path.join(runs, "**", "checkpoints", "step-*.pt"), recursive=True)
    return sorted(steps + glob.glob(os.path.join(runs, "**", "checkpoint.pt"), recursive=True))


def run_and_step(path: str, checkpoint: dict) -> tuple[str, object]:
    """(run folder, step) of a checkpoint: a checkpoint.pt saved at a kept step is the same policy as its step file."""
    folder = os.path.dirname(path)
    return (os.path.dirname(folder) if os.path.basename(folder) == "checkpoints" else folder), checkpoint.get("global_step")


def check_like_with_like(loaded: list[tuple]) -> None:
    """CLIP returns compare only under one reward and one way of summing it (a 20-step episode sums fewer rewards)."""
    first_path, first = loaded[0][0], loaded[0][3]
    if first.reward != "clip":
        raise UserError(f"{first_path} was trained with --reward gt: there is no CLIP return to choose by.")
    for path, _, script, run in loaded[1:]:
        if script is not loaded[0][2]:  # another script, or another version of it: another reward
            raise UserError(
                f"{path} was written by {Path(script.__file__).name} and {first_path} by {Path(loaded[0][2].__file__).name}"
                f"{' (another version)' if script.__file__ == loaded[0][2].__file__ else ''}; CLIP returns compare only "
                "under one reward: pass runs of one script."
            )
        differ = [k for k in LIKE_FLAGS if getattr(run, k, None) != getattr(first, k, None)]
        if differ:
            raise UserError(
                f"{path} differs from {first_path} in {', '.join('--' + k.replace('_', '-') for k in differ)}; "
                "CLIP returns compare only under one reward and episode: pass runs of one configuration."
            )


def training_returns(loaded: list[tuple]) -> dict[str, float]:
    """The training-time CLIP return each checkpoint records; those saved before any episode ended (nan) are left out."""
    returns = {}
    for path, checkpoint, _, _ in loaded:
        value = checkpoint.get("clip_return")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise UserError(
                f"{path} records no training-time CLIP return (saved by an older version); pass --by rollouts to choose "
                "by new evaluation rollouts."
            )
        if math.isfinite(value):
            step = checkpoint.get("global_step", "?")
            print(f"{path}: training-time CLIP return {value:.4f} (mean of the last episodes at step {step})")
            returns[path] = float(value)
        else:
            print(f"{path}: no training-time CLIP return yet (no episode had ended): left out")
    if not returns:
        raise UserError("no checkpoint has a training-time CLIP return yet (each was saved before an episode ended).")
    return returns


def rollout_returns(args: "Best", loaded: list[tuple]) -> dict[str, float]:
    """The mean CLIP return of --episodes new rollouts of each checkpoint, under the runs' one reward model."""
    first = loaded[0][3]
    if args.clip_cache_dir is not None:
        first.clip_cache_dir = args.clip_cache_dir
    check_clip_args(first)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    torch.manual_seed(first.seed)  # as the run built it: the same weights, even for a random-weight test model
    reward_model = reward_model_for(loaded[0][2], first, device)
    means = {}
    for path, checkpoint, script, run in loaded:
        seed = run.seed + 10_000 if args.seed is None else args.seed
        torch.manual_seed(seed)
        envs = make_envs(script, run, seed)
        act = make_policy(path, checkpoint, script, run, envs, args.deterministic, device)
        returns = [clip_return(reward_model, run_episode(envs, act, seed + i, device)[0]) for i in range(args.episodes)]
        envs.close()
        means[path] = float(np.mean(returns))
        print(f"{path}: mean CLIP return {means[path]:.4f} (std {np.std(returns):.4f}) over {args.episodes} episodes")
    return means


def best(args: Best) -> str:
    """Prints each checkpoint's CLIP return (training-time, or on new rollouts) and returns the best path."""
    if args.episodes < 1:
        raise UserError(f"--episodes must be a positive integer, got {args.episodes}.")
    paths = list(args.checkpoints) or find_checkpoints(args.runs)
    if not paths:
        raise UserError(
            f"no checkpoint under {args.runs} (runs/<run>/checkpoints/step-<N>.pt or checkpoint.pt); pass checkpoint "
            "files or train with --save-model."
        )
    loaded = [(path, *load_checkpoint(path)) for path in paths]
    if not args.checkpoints:  # found under --runs: a checkpoint.pt that repeats a kept step is counted once
        kept = {run_and_step(path, c) for path, c, _, _ in loaded if os.path.basename(path) != "checkpoint.pt"}
        loaded = [x for x in loaded if os.path.basename(x[0]) != "checkpoint.pt" or run_and_step(x[0], x[1]) not in kept]
    check_like_with_like(loaded)
    first = loaded[0][3]
    seeds = sorted({run.seed for _, _, _, run in loaded})
    if args.by == "training" and first.clip_pretrained == "none" and not first.clip_checkpoint and len(seeds) > 1:
        raise UserError(  # each run drew its random-weight model from its own seed: one reward per seed
            f"the runs were trained with random CLIP weights (--clip-pretrained none), drawn from each run's seed "
            f"({', '.join(map(str, seeds))}), so their training-time returns are under different rewards; pass "
            "--by rollouts (one reward model for all) or checkpoints of one seed."
        )
    means = training_returns(loaded) if args.by == "training" else rollout_returns(args, loaded)
    chosen = max(means, key=means.get)
    others = sorted((v for p, v in means.items() if p != chosen), reverse=True)
    how = "training-time CLIP return" if args.by == "training" else "mean CLIP return"
    over = (
        "the mean of the run's last episodes when it was saved"
        if args.by == "training"
        else f"over {args.episodes} {'deterministic' if args.deterministic else 'stochastic'} episodes each"
    )
    print(
        f"best: {chosen}: the highest {how}, {means[chosen]:.4f}"
        + (f" (next best {others[0]:.4f})" if others else " (the only checkpoint)")
        + f", {over}"
    )
    return chosen


# ----------------------------------------------------------------------------------------------
# study
# ----------------------------------------------------------------------------------------------
def model_parameters(names: set[str], given: tuple[str, ...], configs: tuple[str, ...]) -> dict[str, float]:
    """Parameter count per architecture: NAME=COUNT entries, else counted on the meta device (no memory, no weights)."""
    params = {}
    for entry in given:
        name, _, count = entry.partition("=")
        params[name] = float(count) if is_finite_number(count) else math.nan
        if not name or not params[name] >= 1:  # nan, inf: a traceback; 0 or below: no point on the log axis
            raise UserError(f"--model-params {entry!r} is not NAME=COUNT with a count of at least 1, e.g. RN50=102e6.")
    missing = sorted(names - params.keys())
    if missing:
        import open_clip

        for config in configs:
            if not os.path.isfile(config):
                raise UserError(f"--model-configs {config}: no such file.")
            open_clip.add_model_config(config)
        for name in missing:
            if name not in open_clip.list_models():
                raise UserError(
                    f"the size of {name} is unknown; pass --model-params {name}=COUNT or --model-configs <its .json>."
                )
            logging.disable(logging.WARNING)  # open_clip's "no pretrained weights": none are wanted here
            try:
                with torch.device("meta"):
                    model = open_clip.create_model(name, pretrained=None, device="meta")
            finally:
                logging.disable(logging.NOTSET)
            params[name] = float(sum(p.numel() for p in model.parameters()))
    return params


def read_csvs(paths: tuple[str, ...], needed: list[str], flag: str, check: dict) -> list[dict]:
    """The rows of the --epic or --success files; `check`: column -> (test of its text, what it must be), each value
    checked so that a hand edit (a word, nan, inf, a count above n) is one sentence naming the file and line."""
    rows, counted, episodes = [], {}, {}
    for path in paths:
        for line, row in read_csv(path, needed, flag):
            folder = row.get("rollouts", "").strip()  # `report` names each row's rollouts folder
            if folder:  # two reports of one folder, or a row copied by hand: its episodes would count twice
                key = (os.stat(folder).st_dev, os.stat(folder).st_ino) if os.path.isdir(folder) else os.path.normpath(folder)
                if key in counted:
                    raise UserError(
                        f"{flag} {path} line {line} and {counted[key]} both count the rollouts {folder}, so its episodes "
                        "would count twice; keep one of the two rows."
                    )
                counted[key] = f"{flag} {path} line {line}"
                if os.path.isfile(os.path.join(folder, "policy.json")):  # a copy of it, or another rollout of one seed
                    check_new_episodes(folder, counted[key], episodes)
            if row.get("family", "projection") != "projection" or row["model"] == "gt":
                continue  # the softmax family has no alpha; a --reward gt run has no CLIP model
            bad = next((column for column, (test, _) in check.items() if not test(row)), None)
            if bad is not None:
                what = check[bad][1]
                raise UserError(f"{flag} {path} line {line}: {bad} {row[bad]!r} is not {what}; fix or remove that line.")
            rows.append(row)
    return rows


def _number(text: str, low: float = -math.inf, high: float = math.inf) -> bool:
    return is_finite_number(text) and low <= float(text) <= high  # nan and inf are never finite


EPIC_CHECKS = {
    "model": (lambda r: r["model"].strip() != "", "a model name"),
    "alpha": (lambda r: _number(r["alpha"], 0, 1), "a number in [0, 1]"),
    "epic": (lambda r: _number(r["epic"], 0, 1), "a finite EPIC distance in [0, 1]"),
    **{  # an interval bound: blank or nan (undefined) or a distance
        bound: (lambda r, b=bound: r.get(b, "") in ("", "nan") or _number(r[b], 0, 1), "blank, nan or a number in [0, 1]")
        for bound in ("epic_low", "epic_high")
    },
}
SUCCESS_CHECKS = {
    "model": (lambda r: r["model"].strip() != "", "a model name"),
    "alpha": (lambda r: _number(r["alpha"], 0, 1), "a number in [0, 1]"),
    # at most 10^12: a count of 400 digits is an object to numpy, and scipy's binomial test fails on it
    "n": (lambda r: is_whole_number(r["n"], 10**12), "a count of episodes (0 to 10^12)"),
    "successes": (lambda r: is_whole_number(r["successes"]) and int(r["successes"]) <= int(r["n"]), "a count of at most n"),
}


def study(args: Study) -> list[dict]:
    if not args.epic and not args.success:
        raise UserError("pass --epic (epic.csv of `epic_eval.py score`) and/or --success (CSV of `success_eval.py report`).")
    for ext in (".csv", ".png"):
        check_output_file(args.out + ext, "--out")
    check_each_once(args.epic, "--epic", "file")
    check_each_once(args.success, "--success", "file")
    epic_rows = read_csvs(args.epic, ["model", "alpha", "epic"], "--epic", EPIC_CHECKS)
    success_rows = read_csvs(args.success, ["model", "alpha", "n", "successes"], "--success", SUCCESS_CHECKS)
    table = []
    for r in epic_rows:
        table.append(
            {
                "metric": "epic",
                "model": r["model"],
                "alpha": float(r["alpha"]),
                "value": float(r["epic"]),
                "low": r.get("epic_low", ""),
                "high": r.get("epic_high", ""),
                "n": r.get("n", ""),
            }
        )
    pooled: dict[tuple, list[int]] = {}
    for r in success_rows:  # seeds of one model and alpha pooled into one proportion
        counts = pooled.setdefault((r["model"], float(r["alpha"])), [0, 0])
        counts[0] += int(r["successes"])
        counts[1] += int(r["n"])
    for (model, alpha), (k, n) in pooled.items():
        if n:
            low, high = wilson(k, n)
            table.append(
                {"metric": "success_rate", "model": model, "alpha": alpha, "value": k / n, "low": low, "high": high, "n": n}
            )
    if not table:
        raise UserError("the --epic and --success files hold no rows to plot.")
    architectures = {row["model"].split("/")[0] for row in table}
    params = model_parameters(architectures, args.model_params, args.model_configs)
    for row in table:
        row["params"] = int(params[row["model"].split("/")[0]])
    table.sort(key=lambda row: (row["metric"], row["alpha"], row["params"]))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=["metric", "model", "params", "alpha", "value", "low", "high", "n"])
    writer.writeheader()
    writer.writerows({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()} for row in table)
    write_atomic(args.out + ".csv", lambda f: f.write(text.getvalue().encode()))
    write_atomic(args.out + ".png", lambda f: plot_study(table, f))
    print(f"wrote {args.out}.csv and {args.out}.png ({len(table)} points, {len(architectures)} models)")
    return table


def plot_study(table: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in ("epic", "success_rate") if any(row["metric"] == m for row in table)]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        rows = [row for row in table if row["metric"] == metric]
        for alpha in sorted({row["alpha"] for row in rows}):
            line = sorted((row for row in rows if row["alpha"] == alpha), key=lambda row: row["params"])
            x, y = [row["params"] for row in line], [row["value"] for row in line]
            ax.plot(x, y, marker="o", label=f"alpha={alpha:g}")
            if all(str(row["low"]) not in ("", "nan") for row in line):  # the Wilson / bootstrap interval
                ax.fill_between(x, [float(row["low"]) for row in line], [float(row["high"]) for row in line], alpha=0.15)
        ax.set_xscale("log")
        ax.set_xlabel("CLIP parameters")
        ax.set_ylabel("EPIC distance to labels (lower is better)" if metric == "epic" else "success rate")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


Commands = Union[
    Annotated[Rollout, tyro.conf.subcommand("rollout")],
    Annotated[Label, tyro.conf.subcommand("label")],
    Annotated[Report, tyro.conf.subcommand("report")],
    Annotated[Best, tyro.conf.subcommand("best")],
    Annotated[Study, tyro.conf.subcommand("study")],
]


def main(args) -> None:
    {Rollout: rollout, Label: label, Report: report, Best: best, Study: study}[type(args)](args)


if __name__ == "__main__":
    cli(main, Commands, interrupted="stopped by Ctrl-C; nothing was written.")
