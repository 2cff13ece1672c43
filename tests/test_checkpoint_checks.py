"""Issue 41: a checkpoint is read with the script that wrote it and refused, in one sentence before anything starts, when
it does not fit (another script or version, other shapes, an older format, NaN weights)."""

import shutil
import sys

import pytest
import torch
from conftest import ROOT, TINY_CLIP, assert_refused, only_run

import epic_eval
import success_eval
import vlmrm_dqn_classic as classic
import vlmrm_tools
import vlmrm_utils

RUN = dict(reward="gt", episodes="fixed", episode_length=50, learning_starts=50, save_model=True, save_buffer=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    """One tiny DQN CartPole run with its buffer saved, shared by the tests (each copies it)."""
    folder = tmp_path_factory.mktemp("trained")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        classic.main(classic.Args(**RUN, total_timesteps=100, checkpoint_frequency=100, eval_episodes=1))
    return str(folder / "runs")


@pytest.fixture
def run(trained, in_tmp):
    shutil.copytree(trained, in_tmp / "runs")
    return only_run(in_tmp)


def edit(path, change) -> dict:
    checkpoint = torch.load(path, weights_only=False)
    change(checkpoint)
    torch.save(checkpoint, path)
    return checkpoint


def forget():
    """The copies' modules, as in a new process (the tools load a script again)."""
    for name in [name for name in sys.modules if name.startswith(("my_reward", "mine"))]:
        del sys.modules[name]


@pytest.fixture
def forget_copies():
    yield
    forget()  # the copy's module goes with the test


def test_a_copied_scripts_checkpoint_is_used_with_its_own_script_or_refused(in_tmp, forget_copies):
    copy = in_tmp / "my_reward.py"
    copy.write_text((ROOT / "vlmrm_dqn_classic.py").read_text() + "\nMY_REWARD = 10  # the user's own reward\n")
    mine = vlmrm_tools.import_script({"script": vlmrm_utils.script_record(str(copy))}, "my_reward.py")
    mine.main(mine.Args(**dict(RUN, save_buffer=False), total_timesteps=100, checkpoint_frequency=100, eval_episodes=1))
    checkpoint = str(only_run(in_tmp) / "checkpoint.pt")
    assert torch.load(checkpoint, weights_only=False)["script"]["file"] == "my_reward.py"
    # the original script refuses the copy's checkpoint, naming the copy; the tools roll it out with the copy's code
    for flag in ("--evaluate", "--resume"):
        assert_refused(classic, [flag, checkpoint], "my_reward.py", "vlmrm_dqn_classic.py")
    _, script, _ = success_eval.load_checkpoint(checkpoint)
    assert script.MY_REWARD == 10 and script is mine
    epic_eval.check_collect_args(epic_eval.Collect(policy=checkpoint, out=str(in_tmp / "states")))
    runs = [("a.pt", {}, classic, classic.Args(reward="clip")), ("b.pt", {}, mine, mine.Args(reward="clip"))]
    with pytest.raises(vlmrm_utils.UserError, match="b.pt was written by my_reward.py and a.pt by vlmrm_dqn_classic.py"):
        success_eval.check_like_with_like(runs)  # `best`: returns under two rewards do not compare


def train_copy(folder, text: str):
    """A copy of the DQN script (`text` added to it) in `folder`, and its checkpoint.pt of a 100-step run there."""
    copy = folder / "my_reward.py"
    copy.write_text((ROOT / "vlmrm_dqn_classic.py").read_text() + text)
    mine = vlmrm_tools.import_script({"script": vlmrm_utils.script_record(str(copy))}, "my_reward.py")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        mine.main(mine.Args(**dict(RUN, save_buffer=False), total_timesteps=100, checkpoint_frequency=100, eval_episodes=1))
    return copy, mine, only_run(folder) / "checkpoint.pt"


def test_an_edited_copy_resumes_and_evaluates_with_a_note_and_the_tools_use_the_code_it_was_written_by(
    in_tmp, forget_copies, capsys
):
    """Issue 45: fix a bug, add a log line, resume. A checkpoint of its own script edited since is read with one line
    saying so; the tools roll it out with the script as it was, kept in the checkpoint."""
    copy, mine, checkpoint = train_copy(in_tmp, "\nMY_REWARD = 10  # the user's own reward\n")
    step = str(checkpoint.parent / "checkpoints" / "step-100.pt")
    old = vlmrm_utils.script_record(str(copy))["sha256"][:12]
    copy.write_text(copy.read_text().replace("the user's own reward", "reworded") + "MY_REWARD = 20\n")
    new = vlmrm_utils.script_record(str(copy))["sha256"][:12]
    changed = f"note: my_reward.py changed since {checkpoint} was written (sha256 {old} -> {new}; 2 lines differ)"
    capsys.readouterr()
    mine.main(mine.Args(evaluate=str(checkpoint), eval_episodes=1))
    out = capsys.readouterr().out
    assert out.count(changed) == 1 and "--evaluate uses it as it is now" in out, out
    mine.main(mine.Args(resume=str(checkpoint), total_timesteps=200))
    assert f"{changed}: --resume uses it as it is now" in capsys.readouterr().out
    assert torch.load(checkpoint, weights_only=False)["script"]["sha256"][:12] == new  # the resumed run's script
    # the tools: step-100.pt was written before the edit, so with MY_REWARD = 10, from the checkpoint's own copy
    forget()
    _, script, _ = success_eval.load_checkpoint(step)
    out = capsys.readouterr().out
    assert script.MY_REWARD == 10 and script.__file__ == str(copy) and script.__name__ == "my_reward"
    assert f"note: my_reward.py changed since {step} was written (sha256 {old} -> {new}; 2 lines differ)" in out
    assert "using the script as it was, kept in the checkpoint" in out
    assert success_eval.load_checkpoint(step)[1] is script and not capsys.readouterr().out  # loaded once, said once
    _, now, _ = success_eval.load_checkpoint(str(checkpoint))  # written by the edited copy: the file itself
    assert now.MY_REWARD == 20 and now is not script and not capsys.readouterr().out
    # the copy gone: still the checkpoint's own copy; a checkpoint that keeps none (older tools) uses the edited file
    forget()
    copy.rename(in_tmp / "elsewhere.py")
    assert success_eval.load_checkpoint(step)[1].MY_REWARD == 10
    assert f"note: my_reward.py is no longer at {copy}; using the script as it was" in capsys.readouterr().out
    (in_tmp / "elsewhere.py").rename(copy)
    forget()
    edit(step, lambda c: c["script"].pop("source"))
    assert epic_eval.check_collect_args(epic_eval.Collect(policy=step, out=str(in_tmp / "states")))
    assert f"sha256 {old} -> {new}); using it as it is now" in capsys.readouterr().out
    forget()
    copy.unlink()
    with pytest.raises(vlmrm_utils.UserError, match=f"written by my_reward.py .*no longer at {copy}"):
        epic_eval.check_collect_args(epic_eval.Collect(policy=step, out=str(in_tmp / "states2")))
    # another script is still refused, in one sentence naming both
    assert_refused(classic, ["--resume", str(checkpoint)], "written by my_reward.py", "vlmrm_dqn_classic.py")


def test_the_same_script_under_a_symlinked_name_reads_its_checkpoints(in_tmp, forget_copies, capsys):
    """Issue 46 item 9: a checkpoint of `mine.py`, a link to the script, is the script's own (it was refused with two
    equal hashes); edited through the link's target, it is read with the note."""
    (in_tmp / "mine.py").symlink_to(ROOT / "vlmrm_dqn_classic.py")
    mine = vlmrm_tools.import_script({"script": vlmrm_utils.script_record(str(in_tmp / "mine.py"))}, "mine.py")
    mine.main(mine.Args(**dict(RUN, save_buffer=False), total_timesteps=100, checkpoint_frequency=100, eval_episodes=1))
    checkpoint = str(only_run(in_tmp) / "checkpoint.pt")
    assert torch.load(checkpoint, weights_only=False)["script"]["file"] == "mine.py"
    classic.main(classic.Args(evaluate=checkpoint, eval_episodes=1))
    assert "note:" not in capsys.readouterr().out
    target = in_tmp / "my_reward.py"
    target.write_text((ROOT / "vlmrm_dqn_classic.py").read_text())
    (in_tmp / "mine.py").unlink()
    (in_tmp / "mine.py").symlink_to(target)
    target.write_text(target.read_text() + "# edited\n")
    edited = vlmrm_tools.import_script({"script": vlmrm_utils.script_record(str(target))}, "my_reward.py")
    edited.main(edited.Args(evaluate=checkpoint, eval_episodes=1))
    assert f"note: my_reward.py changed since {checkpoint} was written" in capsys.readouterr().out


def test_the_tools_find_a_copy_beside_its_run_in_a_renamed_folder(tmp_path, forget_copies, capsys):
    """Issue 46 item 10: exp/ renamed to exp2/: `rollout` loads exp2/my_reward.py, the copy beside the run (it asked to
    put the script back at exp/my_reward.py)."""
    (tmp_path / "exp").mkdir()
    _, mine, checkpoint = train_copy(tmp_path / "exp", "\nMY_REWARD = 10\n")
    forget()
    (tmp_path / "exp").rename(tmp_path / "exp2")
    moved = tmp_path / "exp2" / checkpoint.relative_to(tmp_path / "exp")
    capsys.readouterr()
    _, script, _ = success_eval.load_checkpoint(str(moved))
    assert script.__file__ == str(tmp_path / "exp2" / "my_reward.py") and script.MY_REWARD == 10
    assert not capsys.readouterr().out  # the file itself, unchanged: no note


def test_an_older_or_misfitting_checkpoint_is_one_sentence_before_anything_starts(run):
    path = str(run / "checkpoint.pt")
    saved = torch.load(path, weights_only=False)
    cases = [  # (what changes, flags refused, words of the sentence)
        (lambda c: c.pop("script"), ["--resume", "--evaluate"], ["older version"]),
        (lambda c: c.pop("schedule_steps"), ["--resume"], ["older version", "schedule_steps"]),
        (lambda c: c["q_network"].update({"network.0.weight": torch.zeros(120, 5)}), ["--resume", "--evaluate"],
         ["does not fit", "network.0.weight", "[120, 5]"]),  # torch's load_state_dict says it (torch.Size([120, 5]))
        (lambda c: c["target_network"].pop("network.4.bias"), ["--resume"], ["does not fit", "target_network"]),
        (lambda c: c.update(q_network=[1, 2]), ["--resume", "--evaluate"], ["q_network", "dict-like"]),
        (lambda c: c["optimizer"]["param_groups"].append({"params": []}), ["--resume"], ["optimizer", "parameter groups"]),
        (lambda c: c["args"].update(reward_family="ultra"), ["--resume", "--evaluate"], ["--reward-family ultra"]),
        (lambda c: c["rng"].update(envs=c["rng"]["envs"] * 2), ["--resume"], ["2 env states for 1 envs"]),
        (lambda c: c["rng"].update(torch=torch.zeros(3, dtype=torch.uint8)), ["--resume"], ["random state torch"]),
        (lambda c: c["rng"].update(python="abc"), ["--resume"], ["random state python"]),
        (lambda c: c["rng"].update(envs=[None]), ["--resume"], ["random state envs[0]"]),
        (lambda c: c["q_network"]["network.0.bias"].fill_(float("nan")), ["--evaluate", "--resume"], ["NaN"]),
    ]  # fmt: skip
    for change, flags, words in cases:
        edit(path, change)
        for flag in flags:
            assert_refused(classic, [flag, path], path, *words)
        torch.save(saved, path)
    classic.main(classic.Args(resume=path, total_timesteps=200))  # the file as saved resumes


def test_an_unwritable_run_folder_is_refused_before_its_lock(run, monkeypatch):
    real = vlmrm_utils.os.access
    monkeypatch.setattr(vlmrm_utils.os, "access", lambda p, mode: real(p, mode) and run.name not in str(p))
    assert_refused(classic, ["--resume", str(run / "checkpoint.pt")], "cannot write", str(run))


def test_flags_given_explicitly_disagreeing_with_the_checkpoint_are_refused(run, capsys):
    path = str(run / "checkpoint.pt")
    edit(path, lambda c: c["args"].update(env_id="MountainCar-v0", gamma=0.9))
    for flags, words in [
        (["--evaluate", path, "--env-id", "CartPole-v1"], ["--env-id CartPole-v1", "MountainCar-v0"]),  # the default
        (["--resume", path, "--gamma", "0.99"], ["drop --gamma"]),
    ]:
        with pytest.raises(SystemExit) as exit_code:
            vlmrm_utils.cli(classic.main, classic.Args, flags)
        message = capsys.readouterr().err
        assert exit_code.value.code == 2 and message.count("\n") == 1, message
        assert all(word in message for word in words), message
    assert not vlmrm_utils.GIVEN  # a later call in process is not read as given those flags


def test_a_run_extended_to_mid_episode_keeps_its_resumable_state(run, capsys):
    path = str(run / "checkpoint.pt")
    classic.main(classic.Args(resume=path, total_timesteps=130))
    out = capsys.readouterr().out
    assert "--total-timesteps 130 ends 30 steps into an episode" in out and "checkpoints/step-130.pt" in out
    assert f"--evaluate runs/{run.name}/checkpoints/step-130.pt" in out
    assert torch.load(path, weights_only=False)["global_step"] == 100  # still resumable
    final = torch.load(run / "checkpoints" / "step-130.pt", weights_only=False)
    assert final["global_step"] == 130 and "q_network" in final and final["script"]["file"] == "vlmrm_dqn_classic.py"
    classic.main(classic.Args(evaluate=str(run / "checkpoints" / "step-130.pt"), eval_episodes=1))
    classic.main(classic.Args(resume=path, total_timesteps=200))  # the next extension: from step 100
    assert torch.load(path, weights_only=False)["global_step"] == 200


def test_evaluate_scores_with_the_runs_own_random_weight_clip(in_tmp, capsys):
    """The checks draw no random numbers: a random-weight CLIP (the tests') is drawn from the seed as the run drew it."""
    clip = dict(clip_model=TINY_CLIP, clip_pretrained="none", goal=("a pole",), baseline=("a cart",))
    classic.main(classic.Args(**dict(RUN, reward="clip", save_buffer=False), **clip, total_timesteps=100, eval_episodes=1))
    trained = [line for line in capsys.readouterr().out.splitlines() if line.startswith("eval episode 0:")]
    classic.main(classic.Args(evaluate=str(only_run(in_tmp) / "checkpoint.pt"), eval_episodes=1))
    evaluated = [line for line in capsys.readouterr().out.splitlines() if line.startswith("eval episode 0:")]
    assert "clip_return=" in trained[0] and evaluated[0].startswith(trained[0]), (trained, evaluated)
