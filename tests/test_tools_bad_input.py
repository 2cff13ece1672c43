"""The evaluation tools under bad input (issue 24): every subcommand of success_eval.py and epic_eval.py answers a
missing, empty, truncated, hand-edited or unwritable file with one sentence naming it (and the line), before any
expensive work: no traceback, nothing half-written, no process left behind, exit code 2.

Each case runs in process (fast: the sentence and the untouched files); a few run as a user types them, in a real
process, to check the path to `error: <sentence>` and exit code 2 (and, where `unshare` lets us, on a read-only
file system: root ignores folder permissions, but not a read-only mount)."""

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import pytest
import torch
import tyro
from conftest import ROOT, TINY_CLIP, assert_clean_error

import epic_eval
import success_eval as se
import vlmrm_dqn_classic as dqn
import vlmrm_sac_humanoid as sac
from vlmrm_utils import UserError, script_record

READ_ONLY = "/proc/self/out"  # a folder no one can create, root included (in process; see the unshare cases below)
HEADER = "episode,video,seed,steps,clip_return,gt_return,gt_success\n"
ROWS = "".join(f"{i},episode-00{i}.mp4,{10001 + i},30,-3.5,{30 - 10 * i}.0,{int(i != 1)}\n" for i in range(3))


# ---------------------------------------------------------------------------------------------- good files, by hand
def cartpole_args(**changes) -> dict:
    flags = dict(clip_model=TINY_CLIP, clip_pretrained="none", episodes="fixed", episode_length=30)
    return dataclasses.asdict(dqn.Args(**{**flags, **changes}))


def write_rollouts(folder: Path) -> None:
    """A rollout folder as `rollout` writes it (CartPole, judged by the ground truth)."""
    (folder / "videos").mkdir(parents=True)
    for i in range(3):
        (folder / "videos" / f"episode-00{i}.mp4").write_bytes(b"")
    (folder / "episodes.csv").write_text(HEADER + ROWS)
    policy = {"checkpoint": "c.pt", "script": "vlmrm_dqn_classic.py", "mode": "stochastic", "seed": 10001, "episodes": 3}
    (folder / "policy.json").write_text(json.dumps({**policy, "args": cartpole_args()}, indent=2))


def write_checkpoint(path: Path, script=dqn, clip_return=None, **changes) -> None:
    """The networks are never reached by the refused cases: `best` and `rollout` check the flags first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if script is dqn:
        state = {"q_network": {}, "args": cartpole_args(**changes)}
    else:
        args = dict(env_id="Humanoid-v5", clip_model=TINY_CLIP, clip_pretrained="none", render_size=64)
        state = {"actor": {}, "args": dataclasses.asdict(sac.Args(**{**args, **changes}))}
    state["script"] = script_record((dqn if script is dqn else sac).__file__)  # the training script that wrote it
    torch.save(state if clip_return is None else {**state, "clip_return": clip_return}, path)


def write_dataset(folder: Path) -> None:
    """An epic_eval dataset of 4 CartPole frames with ground-truth labels."""
    (folder / "frames").mkdir(parents=True)
    lines = ["frame,env_id,episode,step,x,x_dot,theta,theta_dot,gt"]
    for i in range(4):
        imageio.imwrite(folder / "frames" / f"00000{i}.png", np.full((8, 8, 3), 60 * i, dtype=np.uint8))
        lines.append(f"00000{i}.png,CartPole-v1,0,{i + 1},0.0,0.0,0.0,0.0,{i % 2}")
    (folder / "states.csv").write_text("\n".join(lines) + "\n")


EPIC = "model,family,alpha,epic,epic_low,epic_high\nRN50/openai,projection,0.0,0.5,0.4,0.6\n"
SUCCESS = "model,alpha,seed,n,successes\nRN50/openai,0.0,1,10,4\n"
SUCCESS_OF_R = "model,alpha,seed,n,successes,rollouts\nRN50/openai,0.0,1,3,2,r\n"  # as `report` writes it


@pytest.fixture
def files(tmp_path, monkeypatch) -> Path:
    """Good files of every format in a temporary working folder: each case breaks one."""
    monkeypatch.chdir(tmp_path)
    write_rollouts(tmp_path / "r")
    write_checkpoint(tmp_path / "runs" / "a" / "checkpoint.pt", clip_return=-10.0)
    write_checkpoint(tmp_path / "runs" / "b" / "checkpoint.pt", clip_return=-12.0)
    write_dataset(tmp_path / "ds")
    (tmp_path / "epic.csv").write_text(EPIC)
    (tmp_path / "success.csv").write_text(SUCCESS)
    (tmp_path / "a_file").write_text("x")
    return tmp_path


# ---------------------------------------------------------------------------------------------- the table
def replace(path: str, old: str, new: str):
    def edit(root: Path) -> None:
        text = (root / path).read_text()
        assert old in text, (path, old)
        (root / path).write_text(text.replace(old, new, 1))

    return edit


def write(path: str, data):
    def edit(root: Path) -> None:
        (root / path).write_bytes(data if isinstance(data, bytes) else data.encode())

    return edit


def both(*edits):
    return lambda root: [edit(root) for edit in edits]


def nan_weights(path: str):
    def edit(root: Path) -> None:
        checkpoint = torch.load(root / path, weights_only=False)
        torch.save({**checkpoint, "q_network": {"network.0.weight": torch.full((2, 4), float("nan"))}}, root / path)

    return edit


NO_GT = replace("r/episodes.csv", ",1\n", ",\n")  # then every gt_success must be blank: see the label cases
BLANK_GT = write("r/episodes.csv", HEADER + ROWS.replace(",1\n", ",\n").replace(",0\n", ",\n"))
LABELS = "frame,label,time\nepisode-000.mp4,1,t\n"
REPORT = ["success_eval.py", "report", "--rollouts", "r", "--out", "out/success"]
BEST = ["success_eval.py", "best", "--runs", "runs"]
STUDY = ["success_eval.py", "study", "--epic", "epic.csv", "--success", "success.csv", "--model-params", "RN50=1e8"]
STUDY += ["--out", "out/study"]
SCORE = ["epic_eval.py", "score", "--dataset", "ds", "--labels", "gt", "--clip-models", TINY_CLIP, "--clip-pretrained", "none"]
ROLLOUT = ["success_eval.py", "rollout", "--checkpoint", "runs/a/checkpoint.pt", "--no-clip-return"]

CASES = {  # id: (command, the edit that breaks a good file, words the one sentence must hold)
    # episodes.csv, read by report, label (and the episode page)
    "episodes-0-bytes": (REPORT, write("r/episodes.csv", ""), ["r/episodes.csv is empty"]),
    "episodes-header-only": (REPORT, write("r/episodes.csv", HEADER), ["r/episodes.csv lists no episodes"]),
    "episodes-short-row": (REPORT, replace("r/episodes.csv", "-3.5,10.0,", "-3.5,"), ["line 4 has 6 fields", "has 7"]),
    "episodes-long-row": (REPORT, replace("r/episodes.csv", ",30.0,1\n", ",30.0,1,extra\n"), ["line 2 has 8 fields"]),
    "episodes-word-for-number": (REPORT, replace("r/episodes.csv", ",30,-3.5,30.0", ",ten,-3.5,30.0"), ["line 2", "steps"]),
    "episodes-unicode-digit": (REPORT, replace("r/episodes.csv", ",30,-3.5,30.0", ",\u00b30,-3.5,30.0"), ["line 2", "steps"]),
    "episodes-nan-return": (REPORT, replace("r/episodes.csv", "30.0,1", "nan,1"), ["line 2", "gt_return 'nan'"]),
    "episodes-odd-success": (REPORT, replace("r/episodes.csv", "30.0,1", "30.0,yes"), ["line 2", "gt_success 'yes'"]),
    "episodes-mixed-gt": (REPORT, NO_GT, ["ground-truth success on some lines"]),
    "episodes-binary": (REPORT, write("r/episodes.csv", (HEADER + ROWS).encode() + b"\xff\xfe\n"), ["line 5", "not UTF-8"]),
    "episodes-missing": (REPORT, lambda root: os.remove(root / "r/episodes.csv"), ["r is not a folder written by"]),
    # the same episode, folder or file twice would count twice (issue 32: 100,000 copies of a row gave a rate of 1.0)
    "episodes-same-video-twice": (
        REPORT,
        replace("r/episodes.csv", "\n1,", "\n0,episode-000.mp4,10001,30,-3.5,30.0,1\n1,"),
        ["r/episodes.csv lists episode-000.mp4 more than once (lines 2 and 3)", "count twice"],
    ),
    "report-same-folder-twice": (REPORT[:4] + ["r/"] + REPORT[4:], None, ["--rollouts r/ is the same folder as r"]),
    "report-same-folder-via-a-link": (
        REPORT[:4] + ["r-link"] + REPORT[4:],
        lambda root: os.symlink("r", root / "r-link"),
        ["--rollouts r-link is the same folder as r"],
    ),
    # policy.json
    "policy-empty-object": (REPORT, write("r/policy.json", "{}"), ["r/policy.json has no 'mode'"]),
    "policy-truncated": (REPORT, write("r/policy.json", '{"mode": "stochastic",\n "args": {'), ["policy.json line 2", "JSON"]),
    "policy-0-bytes": (REPORT, write("r/policy.json", ""), ["r/policy.json line 1 is not valid JSON"]),
    "policy-env-id-number": (REPORT, replace("r/policy.json", '"CartPole-v1"', "5"), ["args.env_id is 5"]),
    "policy-a-list": (REPORT, write("r/policy.json", "[1, 2]"), ["r/policy.json has no 'mode'"]),
    "policy-goal-not-strings": (
        REPORT,
        replace("r/policy.json", '"goal": null', '"goal": [1, null]'),
        ["args.goal is [1, None]"],
    ),
    # labels.csv verdicts the page never writes (human-judged episodes)
    "labels-banana": (REPORT, both(BLANK_GT, write("r/labels.csv", LABELS + "episode-001.mp4,banana,t\n")), ["'banana'"]),
    "labels-two": (REPORT, both(BLANK_GT, write("r/labels.csv", LABELS + "episode-002.mp4,2,t\n")), ["label '2'", "line 3"]),
    # report's outputs
    "report-out-csv-a-folder": (
        REPORT[:-1] + ["folder"],
        lambda root: (root / "folder.csv").mkdir(),
        ["folder.csv exists and is not a regular file"],
    ),
    "report-out-read-only": (REPORT[:-1] + [READ_ONLY], None, ["cannot write to --out", "not a writable folder"]),
    "report-out-under-a-file": (REPORT[:-1] + ["a_file/success"], None, ["a_file is a file"]),
    # rollout
    "rollout-out-read-only": (ROLLOUT + ["--out", READ_ONLY], None, ["cannot write to --out", "not a writable folder"]),
    "rollout-out-under-a-file": (ROLLOUT + ["--out", "a_file/r"], None, ["a_file is a file"]),
    "rollout-out-a-full-file": (ROLLOUT + ["--out", "a_file"], None, ["--out a_file already exists and is not empty"]),
    "rollout-checkpoint-a-folder": (ROLLOUT[:3] + ["runs/a"], None, ["runs/a is a folder"]),
    "rollout-checkpoint-empty-dict": (ROLLOUT, lambda root: torch.save({}, root / "runs/a/checkpoint.pt"), ["no policy"]),
    "rollout-checkpoint-text": (ROLLOUT, write("runs/a/checkpoint.pt", "hello"), ["could not be read"]),
    "rollout-nan-weights": (ROLLOUT, nan_weights("runs/a/checkpoint.pt"), ["its q_network holds NaN or infinite weights"]),
    "rollout-out-a-link-to-an-empty-folder": (  # was refused only after every episode had run
        ROLLOUT + ["--out", "link"],
        lambda root: ((root / "empty").mkdir(), os.symlink("empty", root / "link")),
        ["--out link is a symbolic link (to empty)"],
    ),
    "rollout-out-a-dangling-link": (
        ROLLOUT + ["--out", "link"],
        lambda root: os.symlink("nowhere", root / "link"),
        ["--out link is a symbolic link (to nowhere)"],
    ),
    # best
    "best-none": (BEST[:-1] + ["nothing"], None, ["no checkpoint"]),
    "best-episodes-0": (BEST + ["--episodes", "0"], None, ["--episodes must be a positive integer"]),
    "best-no-clip-return": (BEST, lambda root: write_checkpoint(root / "runs/b/checkpoint.pt"), ["records no training-time"]),
    "best-nan-clip-return": (
        BEST,
        lambda root: [write_checkpoint(root / f"runs/{r}/checkpoint.pt", clip_return=float("nan")) for r in "ab"],
        ["no checkpoint has a training-time CLIP return"],
    ),  # noqa: E501
    "best-random-weights-two-seeds": (
        BEST,
        lambda root: write_checkpoint(root / "runs/b/checkpoint.pt", clip_return=-1.0, seed=2),
        ["random CLIP weights", "seed (1, 2)", "--by rollouts"],
    ),
    "best-nan-weights": (BEST, nan_weights("runs/b/checkpoint.pt"), ["runs/b/checkpoint.pt: its q_network holds NaN"]),
    "best-gt-run": (BEST, lambda root: write_checkpoint(root / "runs/a/checkpoint.pt", reward="gt"), ["--reward gt"]),
    # study
    "study-epic-0-bytes": (STUDY, write("epic.csv", ""), ["--epic epic.csv is empty"]),
    "study-epic-nan": (STUDY, replace("epic.csv", ",0.5,", ",nan,"), ["--epic epic.csv line 2", "epic 'nan'"]),
    "study-epic-inf": (STUDY, replace("epic.csv", ",0.5,", ",inf,"), ["line 2", "epic 'inf'"]),
    "study-epic-above-1": (STUDY, replace("epic.csv", ",0.5,", ",7,"), ["line 2", "epic '7'"]),
    "study-epic-word-bound": (STUDY, replace("epic.csv", ",0.4,", ",low,"), ["line 2", "epic_low 'low'"]),
    "study-epic-short-row": (STUDY, replace("epic.csv", ",0.4,0.6\n", "\n"), ["epic.csv line 2 has 4 fields"]),
    "study-epic-no-column": (STUDY, write("epic.csv", "model,alpha\nRN50/openai,0\n"), ["lacks the column epic"]),
    "study-epic-binary": (STUDY, write("epic.csv", b"\x89PNG\r\n\x1a\n"), ["epic.csv line 1 is not UTF-8"]),
    "study-success-word": (STUDY, replace("success.csv", ",10,4", ",ten,4"), ["--success success.csv line 2", "n 'ten'"]),
    "study-success-above-n": (STUDY, replace("success.csv", ",10,4", ",10,11"), ["line 2", "successes '11'"]),
    "study-success-alpha-word": (STUDY, replace("success.csv", ",0.0,1,", ",a,1,"), ["line 2", "alpha 'a'"]),
    "study-success-unicode-digit": (STUDY, replace("success.csv", ",10,4", ",\u00b2,4"), ["line 2", "n '\u00b2'"]),
    "study-success-400-digits": (STUDY, replace("success.csv", ",10,4", "," + "9" * 400 + ",4"), ["line 2", "n '999"]),
    "study-same-success-file-twice": (
        STUDY[:5] + ["success.csv"] + STUDY[5:],
        None,
        ["--success success.csv is the same file as success.csv"],
    ),
    # issue 41: one rollouts folder in two rows counts its episodes twice (n=6 from 3 episodes)
    "study-success-row-copied": (
        STUDY,
        write("success.csv", SUCCESS_OF_R + SUCCESS_OF_R.splitlines(keepends=True)[1]),
        ["--success success.csv line 3 and --success success.csv line 2 both count the rollouts r"],
    ),
    "study-two-reports-of-one-folder": (
        STUDY[:6] + ["again.csv"] + STUDY[6:],
        both(write("success.csv", SUCCESS_OF_R), write("again.csv", SUCCESS_OF_R.replace(",r\n", ",./r/\n"))),
        ["--success again.csv line 2 and --success success.csv line 2 both count the rollouts ./r/"],
    ),
    # issue 46: a copy of a rollouts folder (or a second rollout of one checkpoint and seed) holds the same episodes
    "report-a-copy-of-a-rollouts-folder": (
        REPORT[:4] + ["copy"] + REPORT[4:],
        lambda root: shutil.copytree(root / "r", root / "copy"),
        ["--rollouts copy and --rollouts r hold the same episodes", "copy/videos/episode-000.mp4 is r/videos/episode-000"],
    ),
    "study-reports-of-a-rollouts-folder-and-its-copy": (
        STUDY[:6] + ["again.csv"] + STUDY[6:],
        both(
            lambda root: shutil.copytree(root / "r", root / "copy"),
            write("success.csv", SUCCESS_OF_R),
            write("again.csv", SUCCESS_OF_R.replace(",r\n", ",copy\n")),
        ),
        ["--success again.csv line 2 and --success success.csv line 2 hold the same episodes", "count twice"],
    ),
    "study-same-epic-file-via-a-link": (
        STUDY[:3] + ["epic.csv", "epic-link.csv"] + STUDY[4:],
        lambda root: os.symlink("epic.csv", root / "epic-link.csv"),
        ["--epic epic-link.csv is the same file as epic.csv"],
    ),
    **{
        f"study-model-params-{count}": (
            [f"RN50={count}" if arg == "RN50=1e8" else arg for arg in STUDY],
            None,
            [f"--model-params 'RN50={count}'", "a count of at least 1"],
        )
        for count in ("nan", "inf", "1e400", "0", "-5")  # nan, inf: tracebacks; 0, -5: a broken log axis
    },
    "study-missing": (STUDY[:3] + ["nope.csv"] + STUDY[5:], None, ["--epic nope.csv: no such file"]),
    "study-out-png-a-folder": (
        STUDY[:-1] + ["folder"],
        lambda root: (root / "folder.png").mkdir(),
        ["folder.png exists and is not a regular file"],
    ),
    "study-out-read-only": (STUDY[:-1] + [READ_ONLY], None, ["cannot write to --out", "not a writable folder"]),
    # epic_eval: states.csv, the output folder
    "states-short-row": (SCORE, replace("ds/states.csv", ",0.0,0.0,1\n", ",0.0,1\n"), ["states.csv line 3 has 8 fields"]),
    "states-0-bytes": (SCORE, write("ds/states.csv", ""), ["ds/states.csv is empty"]),
    "states-binary": (SCORE, write("ds/states.csv", b"frame,env_id\n\x00\xff\n"), ["states.csv line 2 is not UTF-8"]),
    "states-a-folder": (
        SCORE,
        lambda root: (os.remove(root / "ds/states.csv"), os.mkdir(root / "ds/states.csv")),
        ["has no states.csv"],
    ),
    "score-runs-a-file": (
        SCORE,
        lambda root: (shutil.rmtree(root / "runs"), (root / "runs").write_text("x")),
        ["runs is a file"],
    ),
    "collect-out-read-only": (["epic_eval.py", "collect", "--out", READ_ONLY], None, ["not a writable folder"]),
    "collect-out-a-link-to-an-empty-folder": (  # was refused only after every frame had been collected
        ["epic_eval.py", "collect", "--out", "link"],
        lambda root: ((root / "empty").mkdir(), os.symlink("empty", root / "link")),
        ["--out link is a symbolic link (to empty)"],
    ),
    "collect-out-a-dangling-link": (
        ["epic_eval.py", "collect", "--out", "link"],
        lambda root: os.symlink("nowhere", root / "link"),
        ["--out link is a symbolic link (to nowhere)"],
    ),
    # issue 41: --out under a link that resolves nowhere was `[Errno 17] File exists`
    "rollout-out-under-a-symlink-loop": (
        ROLLOUT + ["--out", "loop/rollouts"],
        lambda root: os.symlink("loop", root / "loop"),
        ["cannot write to --out", "loop is a symbolic link to loop, which loops"],
    ),
    "collect-out-under-a-dangling-link": (
        ["epic_eval.py", "collect", "--out", "link/ds"],
        lambda root: os.symlink("nowhere", root / "link"),
        ["cannot write to --out", "link is a symbolic link to nowhere, which points to nothing"],
    ),
    # the label pages' --port (a 21-line OverflowError)
    "label-port-above-65535": (
        ["success_eval.py", "label", "--rollouts", "r", "--port", "99999"],
        None,
        ["--port 99999 is not a port number (0 to 65535"],
    ),
    "label-port-negative": (["epic_eval.py", "label", "--dataset", "ds", "--port", "-1"], None, ["--port -1 is not a port"]),
}


def snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under root, hidden ones included, with its content hash: nothing added, changed or left."""
    found = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        found[key] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "folder"
    return found


def child_processes() -> set[int]:
    """This process's children (an ffmpeg, a server): none may outlive a refused command."""
    children = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == os.getpid():
                children.add(int(entry))
    return children


def run_in_process(argv: list[str]) -> None:
    module = se if argv[0] == "success_eval.py" else epic_eval
    module.main(tyro.cli(module.Commands, args=argv[1:]))


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_sentence_naming_the_file(files, case, monkeypatch):
    argv, edit, words = CASES[case]
    if edit is not None:
        edit(files)
    monkeypatch.setattr(epic_eval, "load_clip", lambda *a: pytest.fail("refused before a model is loaded"))
    monkeypatch.setattr(se, "make_envs", lambda *a: pytest.fail("refused before an env is made"))
    before, children = snapshot(files), child_processes()
    with pytest.raises(UserError) as error:
        run_in_process(argv)
    message = str(error.value)
    assert "\n" not in message and message.endswith("."), message
    for word in words:
        assert word.lower() in message.lower(), (word, message)
    assert snapshot(files) == before  # nothing written, half-written or left hidden
    assert child_processes() == children


def test_the_good_files_pass(files, capsys):
    """The table's files before each edit are good: each case fails for its own edit alone."""
    table = se.report(se.Report(rollouts=("r",), out="out/success"))
    assert (table[0]["n"], table[0]["successes"]) == (3, 2)
    assert se.best(se.Best(runs="runs")) == os.path.join("runs", "a", "checkpoint.pt")
    assert len(se.study(se.Study(epic=("epic.csv",), success=("success.csv",), model_params=("RN50=1e8",), out="o"))) == 2
    assert epic_eval.label_values("ds", "gt")[1].tolist() == [0, 1, 0, 1]


def test_returns_near_the_float_limit_average_without_overflow(files):
    """Finite returns whose sum overflows: the mean was inf in the report's table."""
    (files / "r/episodes.csv").write_text(HEADER + ROWS.replace("-3.5", "1.7e308").replace(",30.0,1", ",-1.7e308,1"))
    row = se.report(se.Report(rollouts=("r",), out="out/success"))[0]
    assert float(row["mean_clip_return"]) == pytest.approx(1.7e308)
    assert float(row["mean_gt_return"]) == pytest.approx((-1.7e308 + 20 + 10) / 3)


def test_wilson_lower_bound_of_no_success_is_exactly_0(files):
    (files / "success.csv").write_text("model,alpha,seed,n,successes\nRN50/openai,0.0,1,3,0\nRN50/openai,0.5,1,3,3\n")
    table = se.study(se.Study(success=("success.csv",), model_params=("RN50=1e8",), out="study"))
    bounds = [(0.0, pytest.approx(0.5615, abs=1e-4)), (pytest.approx(0.4385, abs=1e-4), 1.0)]
    assert [(row["low"], row["high"]) for row in table] == bounds
    assert (files / "study.csv").read_text().splitlines()[1].split(",")[5] == "0"  # not 5.55112e-17


# ---------------------------------------------------------------------------------------------- real processes
def run_tool(argv: list[str], cwd: Path, prefix: tuple = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [*prefix, sys.executable, str(ROOT / argv[0]), *argv[1:]]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def left_running(root: Path) -> list[str]:
    """Command lines of processes that still name this test's folder."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                line = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(root) in line and int(entry) != os.getpid():
            found.append(line)
    return found


@pytest.mark.parametrize(
    "case, argv",
    [  # `label` on an empty episodes.csv used to serve "judging 0 episodes" forever
        ("episodes-header-only", ["success_eval.py", "label", "--rollouts", "r", "--port", "0"]),
        ("episodes-0-bytes", ["success_eval.py", "label", "--rollouts", "r", "--port", "0"]),
        ("episodes-short-row", REPORT),
        ("study-epic-nan", STUDY),
        ("states-short-row", SCORE),
    ],
)
def test_bad_input_in_a_real_process_is_exit_2(files, case, argv):
    CASES[case][1](files)
    before = snapshot(files)
    result = run_tool(argv, files)
    assert_clean_error(result, *CASES[case][2])
    assert result.returncode == 2
    assert snapshot(files) == before and not left_running(files)


def can_mount_read_only() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not can_mount_read_only(), reason="needs `unshare -rm` (a private mount namespace) for a read-only tmpfs")
@pytest.mark.parametrize(
    "argv, words",
    [
        (ROLLOUT + ["--out", "ro/r"], ["--out", "ro is not a writable folder"]),
        (REPORT[:-1] + ["ro/success"], ["--out", "ro is not a writable folder"]),
        (STUDY[:-1] + ["ro/study"], ["--out", "ro is not a writable folder"]),
        (["epic_eval.py", "collect", "--num-frames", "2", "--out", "ro/ds"], ["--out", "ro is not a writable folder"]),
    ],
)
def test_read_only_outputs_are_refused_up_front(files, argv, words):
    """On a read-only file system (a tmpfs mounted read-only in a private mount namespace: root cannot write it)."""
    (files / "ro").mkdir()
    script = f'mount -t tmpfs -o ro tmpfs {files / "ro"} && exec "$@"'
    result = run_tool(argv, files, ("unshare", "-rm", "sh", "-c", script, "sh"))
    assert_clean_error(result, *words)
    assert result.returncode == 2 and not left_running(files)


@pytest.mark.skipif(not can_mount_read_only(), reason="needs `unshare -rm` (a private mount namespace) for a read-only tmpfs")
def test_score_with_a_read_only_runs_folder_is_refused_before_scoring(files):
    """epic_eval.py score used to fail after all the scoring, losing it: now before any model is loaded."""
    (files / "runs").mkdir(exist_ok=True)
    script = f'mount -t tmpfs -o ro tmpfs {files / "runs"} && exec "$@"'
    result = run_tool(SCORE, files, ("unshare", "-rm", "sh", "-c", script, "sh"))
    assert_clean_error(result, "cannot write to the output folder", "not a writable folder")
    assert "embedded" not in result.stdout  # no model was run


@pytest.mark.skipif(not can_mount_read_only(), reason="needs `unshare -rm` (a private mount namespace) for a small tmpfs")
def test_a_full_disk_during_a_rollout_video_is_one_sentence(files):
    """ffmpeg writes the videos: on a full disk it printed its own five lines, and imageio's error was 'Broken pipe'
    with ffmpeg's whole command line, not the cause. Here a tmpfs filled to the last byte before the rollout starts."""
    checkpoint = crafted(files)
    (files / "full").mkdir()
    full = files / "full"
    fill = f"mount -t tmpfs -o size=64k tmpfs {full} && (head -c 1M /dev/zero > {full}/filler 2>/dev/null; true)"
    argv = ["success_eval.py", "rollout", "--checkpoint", checkpoint, "--episodes", "2", "--no-clip-return", "--no-cuda"]
    result = run_tool([*argv, "--out", "full/r"], files, ("unshare", "-rm", "sh", "-c", fill + ' && exec "$@"', "sh"))
    assert_clean_error(result, "could not write the rollouts", "no space left on device", "nothing was written to full/r")
    assert result.returncode == 2 and not left_running(files)


def test_ffmpeg_failing_with_disk_space_left_is_one_sentence(files, monkeypatch):
    """Any other ffmpeg failure (killed, a codec missing): imageio's first line, not its command line."""

    def broken(*args, **kwargs):
        raise OSError("[Errno 32] Broken pipe\n\nFFMPEG COMMAND:\n/usr/bin/ffmpeg -y -f rawvideo ...\n\nFFMPEG STDERR:\n")

    monkeypatch.setattr(se.imageio, "mimwrite", broken)
    with pytest.raises(UserError) as error:
        se.rollout(se.Rollout(checkpoint=crafted(files), episodes=2, clip_return=False, out="r4", cuda=False))
    assert str(error.value) == (
        "could not write the rollouts (ffmpeg stopped writing episode-000.mp4: [Errno 32] Broken pipe); "
        "nothing was written to r4."
    )
    assert not (files / "r4").exists() and not [p for p in os.listdir(files) if ".partial-" in p]


# ---------------------------------------------------------------------------------------------- what is accepted
def test_an_empty_file_as_out_is_replaced_by_the_folder(files):
    (files / "made-by-mktemp").write_bytes(b"")
    out = se.rollout(se.Rollout(checkpoint=crafted(files), episodes=1, clip_return=False, out="made-by-mktemp", cuda=False))
    assert sorted(os.listdir(out)) == ["episodes.csv", "policy.json", "videos"]
    (files / "empty-ds").write_bytes(b"")
    epic_eval.collect(epic_eval.Collect(out="empty-ds", num_frames=2))
    assert sorted(os.listdir(files / "empty-ds")) == ["frames", "states.csv"]


def crafted(root: Path) -> str:
    """A real CartPole Q-network (random weights) with the run's flags."""
    envs = se.make_envs(dqn, dqn.Args(), 0)
    q_network = dqn.QNetwork(envs)
    envs.close()
    state = {"q_network": q_network.state_dict(), "args": cartpole_args(episode_length=5)}
    torch.save({**state, "script": script_record(dqn.__file__)}, root / "q.pt")
    return str(root / "q.pt")


def test_stale_partial_folders_of_a_killed_rollout_are_removed(files):
    """Issue 46: a live writer's folder in another pid namespace (a container, another node on a shared disk: its pid
    does not run here) was removed as a killed run's; the writer's lock, not its pid, says whether it still writes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    write = "import sys, time, vlmrm_tools; print(vlmrm_tools.new_partial_folder(sys.argv[1]), flush=True); time.sleep(300)"
    killed = subprocess.Popen([sys.executable, "-c", write, "r2"], cwd=files, stdout=subprocess.PIPE, text=True, env=env)
    stale = Path(killed.stdout.readline().strip())
    killed.kill()  # SIGKILL mid-write: its folder and lock file stay, the lock goes with it
    killed.wait()
    (stale / "videos").mkdir()
    alive = files / f".other.partial-{killed.pid}-456"  # its pid runs nowhere here, but its writer holds the lock
    hold = "import sys, time, filelock; held = filelock.UnixFileLock(sys.argv[1]); held.acquire(); print(); time.sleep(99)"
    elsewhere = subprocess.Popen([sys.executable, "-u", "-c", hold, f"{alive}.lock"], stdout=subprocess.PIPE, text=True)
    try:
        elsewhere.stdout.readline()
        alive.mkdir()
        se.rollout(se.Rollout(checkpoint=crafted(files), episodes=1, clip_return=False, out="r2", cuda=False))
        assert not stale.exists() and not Path(f"{stale}.lock").exists() and alive.exists()
        assert sorted(p for p in os.listdir(files) if ".partial-" in p) == [alive.name, f"{alive.name}.lock"]
    finally:
        elsewhere.kill()
        elsewhere.wait()
    shutil.rmtree(alive)


def test_ctrl_c_of_a_rollout_is_one_line_and_leaves_nothing(files):
    """SIGINT once the first episode is written: one line on stderr, exit 130, no .partial folder, no --out."""
    import signal

    checkpoint = crafted(files)
    command = [sys.executable, str(ROOT / "success_eval.py"), "rollout", "--checkpoint", checkpoint]
    command += ["--episodes", "1000", "--no-clip-return", "--out", "r3", "--no-cuda"]

    def as_from_a_terminal() -> None:  # the test runner's SIGINT may be ignored or blocked: a child inherits both
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    proc = subprocess.Popen(command, cwd=files, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=as_from_a_terminal)  # fmt: skip
    for line in proc.stdout:
        if line.startswith("episode 1:"):
            proc.send_signal(signal.SIGINT)
            break
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        runner = f"runner's SIGINT {signal.getsignal(signal.SIGINT)}, blocked {signal.pthread_sigmask(signal.SIG_BLOCK, [])}"
        raise AssertionError(f"still running 60 s after Ctrl-C ({runner}); stderr: {proc.communicate()[1][-2000:]}") from None
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().startswith("stopped by Ctrl-C after") and len(err.strip().splitlines()) == 1, err
    assert not (files / "r3").exists() and not [p for p in os.listdir(files) if ".partial-" in p]
    assert not left_running(files)


def test_the_training_scripts_do_not_import_scipy():
    """scipy is the tools' (Wilson, Pearson, Spearman, ROC AUC); a copied training script needs only its own imports."""
    code = "import sys, vlmrm_dqn_classic, vlmrm_sac_humanoid; print(sorted(m for m in sys.modules if m.startswith('scipy')))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr
