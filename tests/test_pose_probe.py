"""The humanoid pose probe of reward_shape.py (--env-id Humanoid-v5): CPU only, offline.

The poses are checked with MuJoCo itself (geometry, contacts, centre of mass), the frames against the training
script's env, and the ranking and verdict logic with an instrumented encoder that recognises each pose's frame, so
the true ranking is known. The proof that a trained CLIP's reward picks the right pose is tests/test_pose_probe_clip.py.
"""

import io
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import mujoco
import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import ROOT, assert_clean_error, assert_refused, read_csv
from scipy.spatial import ConvexHull

sys.path.insert(0, str(ROOT / "experiments"))
import humanoid_clip  # noqa: E402  (the arms experiment's ground truth: hands above the head, posture)

import reward_shape  # noqa: E402

TINY = str(ROOT / "tests" / "vlmrm-tiny-test.json")
SIZE = 64  # small frames: these tests are about poses and logic, not the render size
# what each pose rests on: these geoms must touch the floor (MuJoCo contacts), and nothing else may carry it
SUPPORTS = {
    "standing": {"right_foot", "left_foot"},
    "arms_raised": {"right_foot", "left_foot"},
    "one_arm_raised": {"right_foot", "left_foot"},
    "arms_out": {"right_foot", "left_foot"},
    "hands_on_hips": {"right_foot", "left_foot"},
    "one_leg_raised": {"left_foot"},
    "bending_over": {"right_foot", "left_foot"},
    "crouching": {"right_foot", "left_foot"},
    "kneeling": {"right_shin1", "left_shin1", "right_foot", "left_foot"},  # knees and feet
    "sitting": {"butt", "right_foot", "left_foot"},
    "splits": {"right_thigh1", "left_thigh1", "right_foot", "left_foot"},
    "lying_on_back": {"head", "butt", "right_foot", "left_foot"},
    "lying_face_down": {"head", "butt", "right_foot", "left_foot"},
}
TOUCH = 0.002  # m: a part this close to the floor touches it (the angles are rounded to 0.1 degree)
SINK = 0.003  # m: how far a body part may be inside the floor or another part (MuJoCo's contacts are soft)
BALANCE = 0.03  # m: how far the centre of mass may lie outside the support polygon (the feet are balls)


@pytest.fixture(scope="module")
def env():
    from vlmrm_sac_humanoid import make_env

    env = make_env("Humanoid-v5", 0, 0, 100, SIZE, "fast", True)()
    env.reset(seed=0)
    yield env
    env.close()


def lowest_point(model, data, geom: int) -> float:
    """Height of a sphere's or capsule's lowest point, from its shape (not from MuJoCo's distance functions)."""
    radius, centre = model.geom_size[geom][0], data.geom_xpos[geom]
    if model.geom_type[geom] == mujoco.mjtGeom.mjGEOM_CAPSULE:  # a segment along the geom's z axis, half length size[1]
        half = data.geom_xmat[geom].reshape(3, 3)[2, 2] * model.geom_size[geom][1]
        return centre[2] - abs(half) - radius
    assert model.geom_type[geom] == mujoco.mjtGeom.mjGEOM_SPHERE
    return centre[2] - radius


def test_the_gallery():
    """The poses the issue asks for, and more; the names --expect accepts."""
    required = {"standing", "kneeling", "arms_raised", "sitting", "lying_on_back", "lying_face_down", "crouching"}
    assert required | {"splits", "one_leg_raised"} <= set(reward_shape.POSES) and len(reward_shape.POSES) >= 10
    assert set(SUPPORTS) == set(reward_shape.POSES), "a new pose needs its supports here"
    assert reward_shape.pose_key(" Lying-on back ") == "lying_on_back"


@pytest.mark.parametrize("name", list(SUPPORTS))
def test_pose_is_physically_plausible(env, name):
    """Every joint within its range; the lowest part on the floor, nothing sunk into it or into another part; the
    parts the pose rests on all touch the floor; the centre of mass above what it rests on; the arms and the posture
    as the experiment's ground truth judges them."""
    model, data = env.unwrapped.model, env.unwrapped.data
    torso, joints = reward_shape.POSES[name]
    reward_shape.set_pose(env, torso, joints)
    for joint, degrees in joints.items():
        low, high = np.degrees(model.jnt_range[model.joint(joint).id])
        assert low - 1e-9 <= degrees <= high + 1e-9, (joint, degrees)  # radians -> degrees rounds
    floor = model.geom("floor").id
    heights = {model.geom(g).name: lowest_point(model, data, g) for g in range(model.ngeom) if g != floor}
    assert abs(min(heights.values())) < 1e-4, heights  # touches the floor, not above it, not in it
    assert {g for g, z in heights.items() if z < TOUCH} == SUPPORTS[name], heights  # on these parts, all of them

    contacts = [data.contact[i] for i in range(data.ncon)]  # mj_forward ran the collision detection
    on_floor = {model.geom(c.geom1 + c.geom2 - floor).name for c in contacts if floor in (c.geom1, c.geom2)}
    assert on_floor == SUPPORTS[name]
    for c in contacts:  # dist < 0: penetration depth, of the floor and of any two parts that are not parent and child
        assert c.dist > -SINK, (model.geom(c.geom1).name, model.geom(c.geom2).name, c.dist)

    points = np.array([c.pos[:2] for c in contacts if floor in (c.geom1, c.geom2)])
    com = data.subtree_com[model.body("torso").id][:2]
    assert np.allclose(com, 0, atol=1e-9), "centred where the paper's camera looks"
    assert distance_to_hull(com, points) < BALANCE, (name, distance_to_hull(com, points))

    hands = humanoid_clip.hands_above_head(data)
    assert hands == {"arms_raised": 2, "one_arm_raised": 1}.get(name, hands if name.startswith("lying") else 0)
    posture = humanoid_clip.posture(data)
    upright = ("standing", "arms_raised", "one_arm_raised", "arms_out", "hands_on_hips", "one_leg_raised")
    expected = "standing" if name in upright else {"lying_on_back": "back", "lying_face_down": "face_down"}.get(name)
    assert expected is None or posture == expected, (name, posture)


def distance_to_hull(point: np.ndarray, points: np.ndarray) -> float:
    """Horizontal distance from a point to the convex hull of contact points (0 inside; a segment or a point too)."""
    if len(points) >= 3:
        try:
            hull = ConvexHull(points)
            if (hull.equations[:, :2] @ point + hull.equations[:, 2]).max() <= 1e-9:
                return 0.0
        except Exception:  # noqa: BLE001 - collinear points: the segments below
            pass
    best = np.inf
    for a in points:
        for b in points:
            ab = b - a
            t = 0.0 if ab @ ab == 0 else np.clip((point - a) @ ab / (ab @ ab), 0, 1)
            best = min(best, float(np.linalg.norm(point - (a + t * ab))))
    return best


def test_thumbnails_hold_the_whole_body(env):
    """The heat map's thumbnails cut off raised hands (issue 41): every pixel a pose changes in the empty scene is
    inside the thumbnail's crop (the paper's camera; fast quality draws no shadow)."""
    model, data = env.unwrapped.model, env.unwrapped.data
    frames = []
    for name in reward_shape.POSES:
        reward_shape.set_pose(env, *reward_shape.POSES[name])
        frames.append(env.render().astype(int))
    data.qpos[0] = 50.0  # the body out of view
    mujoco.mj_forward(model, data)
    empty = env.render().astype(int)
    top, bottom, left, right = reward_shape.thumbnail_box(SIZE, "paper")
    for name, frame in zip(reward_shape.POSES, frames):
        rows, columns = np.nonzero(np.abs(frame - empty).sum(-1) > 40)
        assert top <= rows.min() and rows.max() < bottom and left <= columns.min() and columns.max() < right, name


def test_frames_are_the_training_scripts():
    """Same pixels as the training script's env at the same size, quality and camera; every pose looks different."""
    from vlmrm_sac_humanoid import make_env

    frames = {}
    for camera, quality in (("paper", "fast"), ("tracking", "fast"), ("paper", "high")):
        frames[camera, quality] = reward_shape.render_poses(SIZE, quality, camera, seed=3)
        assert frames[camera, quality].shape == (len(reward_shape.POSES), SIZE, SIZE, 3)
        assert len({f.tobytes() for f in frames[camera, quality]}) == len(reward_shape.POSES)
    for camera in ("paper", "tracking"):
        env = make_env("Humanoid-v5", 0, 0, 100, SIZE, "fast", True, camera)()
        env.reset(seed=0)
        for (torso, joints), frame in zip(reward_shape.POSES.values(), frames[camera, "fast"]):
            reward_shape.set_pose(env, torso, joints)
            np.testing.assert_array_equal(frame, env.render())
        env.close()
    assert not np.array_equal(frames["paper", "high"], frames["paper", "fast"])  # shadows and reflections
    assert not np.array_equal(frames["tracking", "fast"], frames["paper", "fast"])


# ------------------------------------------------------------------------------------------------
# Ranking and verdict, with an encoder that knows which pose each frame shows
# ------------------------------------------------------------------------------------------------
class PoseEncoder(nn.Module):
    """A CLIP stand-in with a known reward: an image embeds as e_k for the pose k it shows (the nearest reference frame),
    a text as e_k for the pose named in it ("kneeling", "lying on back"), else as e_K (the baseline). At alpha 0 the
    reward is then cos(s, g): 1 for the named pose, 0 for every other."""

    def __init__(self, references: np.ndarray):
        super().__init__()
        self.visual = nn.Module()
        self.visual.image_size = (SIZE, SIZE)  # the frame's own size: the squash changes nothing
        self.visual.image_mean, self.visual.image_std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        self.references = torch.from_numpy(references).permute(0, 3, 1, 2).float().div(255).flatten(1)
        self.names = [name.replace("_", " ") for name in reward_shape.POSES]

    def tokenizer(self, texts: list[str]) -> torch.Tensor:
        return torch.tensor([next((k for k, n in enumerate(self.names) if n in t), len(self.names)) for t in texts])

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        return nn.functional.one_hot(tokens, len(self.names) + 1).float()

    def encode_image(self, x: torch.Tensor) -> torch.Tensor:
        nearest = torch.cdist(x.flatten(1), self.references).argmin(1)
        return nn.functional.one_hot(nearest, len(self.names) + 1).float()


@pytest.fixture
def pose_clip(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    references = reward_shape.render_poses(SIZE, "fast", "paper", seed=1)
    encoder = PoseEncoder(references)
    monkeypatch.setattr(reward_shape, "load_clip", lambda spec, device: (encoder, encoder.tokenizer))
    return encoder


def probe_args(**kwargs) -> "reward_shape.Args":
    defaults = dict(env_id="Humanoid-v5", clip_models=("RN50",), clip_pretrained=("none",), cuda=False, exp_name="test")
    defaults.update(render_size=SIZE, render_quality="fast", goal=("a humanoid robot kneeling",), alphas=(0.0, 1.0))
    return reward_shape.Args(**{**defaults, **kwargs})


def test_ranking_csv_and_verdicts(pose_clip, capsys):
    args = probe_args(
        prompts=("a robot crouching low",),
        expect=("a humanoid robot kneeling=kneeling", "A robot  crouching low=sitting"),  # as CLIP reads it: case, spaces
        save_frames=True,
    )
    run_dir = reward_shape.main(args)
    names = list(reward_shape.POSES)
    rows = read_csv(run_dir / "poses.csv")
    assert [r["pose"] for r in rows] == names
    columns = ["a humanoid robot kneeling @ alpha=0", "a humanoid robot kneeling @ alpha=1"]
    columns += ["a robot crouching low @ alpha=0", "a robot crouching low @ alpha=1"]
    assert list(rows[0])[1:] == columns
    for row in rows:  # alpha 0: cos(s, g), exactly 1 for the named pose and 0 for the others
        assert float(row[columns[0]]) == pytest.approx(float(row["pose"] == "kneeling"), abs=1e-6)
        assert float(row[columns[2]]) == pytest.approx(float(row["pose"] == "crouching"), abs=1e-6)
        assert float(row[columns[1]]) <= float(rows[names.index("kneeling")][columns[1]])  # alpha 1 still ranks it first

    out = capsys.readouterr().out
    verdicts = (run_dir / "verdict.txt").read_text().splitlines()
    assert "\n".join(f"  {line}" for line in verdicts) in out.split("verdict (--expect):\n")[1]  # printed as written
    assert verdicts[0] == (
        'kneeling ranks 1st of 13 poses for "a humanoid robot kneeling" at alpha=0 '
        "(margin 1 over standing, 100% of the spread over poses)"
    )
    assert verdicts[1].startswith('kneeling ranks 1st of 13 poses for "a humanoid robot kneeling" at alpha=1 (margin ')
    assert verdicts[2] == (
        'sitting ranks 2nd of 13 poses for "a robot crouching low" at alpha=0: NOT first; crouching scores 1 more '
        "(100% of the spread over poses)"
    )
    assert len(verdicts) == 4 and "NOT first" in verdicts[3]
    assert "1. kneeling 1.0000" in out and "1. crouching 1.0000" in out

    import imageio.v3 as iio

    image = iio.imread(run_dir / "poses.png")
    assert image.shape[0] > 900 and image.shape[1] > 600 and image[..., :3].std() > 30, "a blank or tiny heat map"
    frames = sorted((run_dir / "frames").glob("*.png"))
    assert [f.name for f in frames] == [f"{i:02d}_{name}.png" for i, name in enumerate(names)]
    np.testing.assert_array_equal(iio.imread(frames[names.index("kneeling")]), pose_clip_reference(pose_clip, "kneeling"))


def pose_clip_reference(encoder: PoseEncoder, name: str) -> np.ndarray:
    k = list(reward_shape.POSES).index(name)
    return (encoder.references[k].view(3, SIZE, SIZE).permute(1, 2, 0) * 255).round().byte().numpy()


def test_ties_and_the_softmax_family(pose_clip):
    """A binary softmax reward ties: a pose that ties for first is said to be not first on its own."""
    args = probe_args(
        reward_families=("projection", "softmax"),
        negatives=("a humanoid robot standing",),
        alphas=(0.0,),
        expect=("a humanoid robot kneeling=kneeling",),
        temperature=1.0,
        threshold=0.4,
    )
    run_dir = reward_shape.main(args)
    verdicts = (run_dir / "verdict.txt").read_text().splitlines()
    assert verdicts[0].startswith("kneeling ranks 1st of 13 poses")
    # p(kneeling) = 1 / (1 + e^-1) = 0.73 for the kneeling frame, 1/2 for the 11 frames that are neither: all above 0.4
    assert verdicts[1] == (
        'kneeling ties for 1st of 13 poses with 11 other(s) for "a humanoid robot kneeling" at softmax: NOT first on its own'
    )


# ------------------------------------------------------------------------------------------------
# The command line
# ------------------------------------------------------------------------------------------------
def test_cli_tiny_model(monkeypatch, in_tmp, capsys):
    """As a user types it, with the tiny random CLIP: the files, one verdict line per prompt and alpha, exit 0."""
    argv = f"--env-id Humanoid-v5 --clip-models {TINY} --clip-pretrained none --render-size {SIZE} --alphas 0 0.5 --no-cuda"
    expect = ["--expect", "a humanoid robot kneeling=kneeling", "a robot on its knees=lying on back"]
    monkeypatch.setattr(sys, "argv", ["reward_shape.py", *argv.split(), "--prompts", "a robot on its knees", *expect])
    runpy.run_path(str(ROOT / "reward_shape.py"), run_name="__main__")  # a refusal or crash would raise SystemExit
    out = capsys.readouterr().out
    (run_dir,) = Path("runs").iterdir()
    assert {p.name for p in run_dir.iterdir()} == {"poses.csv", "poses.png", "verdict.txt"}
    assert len(read_csv(run_dir / "poses.csv")) == 13 and len(read_csv(run_dir / "poses.csv")[0]) == 1 + 2 * 2
    lines = (run_dir / "verdict.txt").read_text().splitlines()
    assert len(lines) == 4 and all(" of 13 poses for " in line for line in lines), lines
    assert sum(line.startswith("kneeling ") for line in lines) == 2 and lines[2].startswith("lying_on_back ")
    assert f"rendered 13 Humanoid-v5 poses at {SIZE} px (high quality, paper camera)" in out


def test_the_heat_maps_header_fits_the_figure(monkeypatch):
    """Issue 46: the header line ran past the figure's edge and was cut ("... paper camera; baseline: a humano")."""
    figures = []
    monkeypatch.setattr(reward_shape.plt, "close", figures.append)
    args = reward_shape.Args(env_id="Humanoid-v5", renderer="warp", goal=("a humanoid robot kneeling",),
                             baseline=("a humanoid robot",))  # fmt: skip
    rewards = np.linspace(0, 1, len(reward_shape.POSES))
    columns = [reward_shape.Column("ViT-bigG-14/laion2b_s39b_b160k", 0, f"alpha={a}", rewards) for a in args.alphas]
    reward_shape.plot_poses(io.BytesIO(), np.zeros((13, SIZE, SIZE, 3), np.uint8), columns, {}, args)
    (fig,) = figures
    renderer = fig.canvas.get_renderer()
    for text in [*fig.texts, *fig.axes[0].texts]:
        box = text.get_window_extent(renderer)
        assert 0 <= box.x0 and box.x1 <= fig.bbox.x1 and box.y1 <= fig.bbox.y1, text.get_text()
    assert "baseline: a humanoid robot" in " ".join(fig.texts[0].get_text().split())


@pytest.fixture
def nothing_expensive(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(reward_shape, "render_poses", lambda *a: pytest.fail("refused before any frame is rendered"))
    monkeypatch.setattr(reward_shape, "load_clip", lambda *a: pytest.fail("refused before any model is loaded"))


HUMANOID = ["--env-id", "Humanoid-v5"]


@pytest.mark.parametrize(
    "argv, words",
    [
        ([*HUMANOID, "--expect", "kneeling"], ['--expect takes "PROMPT=POSE"', 'got "kneeling"']),
        ([*HUMANOID, "--expect", "a humanoid robot kneeling="], ['--expect takes "PROMPT=POSE"']),
        ([*HUMANOID, "--expect", "a humanoid robot kneeling=lotus"], ["lotus is not a pose here", "kneeling, sitting"]),
        ([*HUMANOID, "--expect", "a robot=kneeling"], ['"a robot" is not probed', "--goal or --prompts"]),
        (
            [*HUMANOID, "--expect", "a humanoid robot kneeling=kneeling", "a humanoid robot kneeling=sitting"],
            ['names the prompt "a humanoid robot kneeling" twice'],
        ),
        ([*HUMANOID, "--prompts", " "], ["--prompts needs non-empty sentences"]),
        ([*HUMANOID, "--prompts", "A humanoid robot"], ['--prompts "A humanoid robot" is the --baseline']),
        ([*HUMANOID, "--prompts", "a robot", "a  Robot"], ['--prompts "a  Robot" is already probed']),
        ([*HUMANOID, "--prompts", "a humanoid robot kneeling"], ["is already probed (as --goal"]),
        (
            [*HUMANOID, "--reward-families", "softmax", "--prompts", "a humanoid robot standing"],
            ["is one of the --negatives"],
        ),
        ([*HUMANOID, "--render-size", "8"], ["--render-size must be between 16 and 2048 pixels, got 8"]),
        ([*HUMANOID, "--goal", " "], ['e.g. --goal "a humanoid robot kneeling"']),  # not CartPole's goal
        ([*HUMANOID, "--prompts", "a", "robot", "kneeling"], ["--prompts got 3 one-word prompts", "a robot kneeling"]),
        (  # 200 prompts: 115 s, 3.1 GB and a heat map 62,537 px wide; refused before rendering
            [*HUMANOID, "--prompts", *(f"a robot in pose {i}" for i in range(200))],
            ["--prompts", "1,005 columns", "at most 100"],
        ),
        ([*HUMANOID, "--realistic"], ["--realistic only changes MountainCar"]),
        ([*HUMANOID, "--num-points", "0"], ["--num-points is for the envs whose state axis is swept", "13 poses"]),
        (["--env-id", "CartPole-v1", "--prompts", "a pole"], ["--prompts and --expect are for the Humanoid-v5 pose probe"]),
        (["--expect", "a pole=upright"], ["--prompts and --expect are for the Humanoid-v5 pose probe"]),
    ],
)
def test_bad_input_is_one_sentence_before_any_work(nothing_expensive, argv, words):
    assert_refused(reward_shape, argv, *words)


def test_a_read_only_runs_folder_is_refused_before_rendering(nothing_expensive, monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # root ignores permissions: as a read-only mount
    assert_refused(reward_shape, HUMANOID, "cannot write to", "runs/")


@pytest.mark.skipif(
    not shutil.which("unshare") or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode,
    reason="needs `unshare -rm` (a private mount namespace) for a small tmpfs",
)
def test_a_full_disk_is_one_sentence_naming_the_file_and_leaves_no_half_run(tmp_path):
    """A 96 KiB tmpfs fills up while the run's files are written: it was [Errno 28] without a file name, poses.csv
    without poses.png, and with --save-frames an "Exception ignored" traceback from imageio."""
    (tmp_path / "disk").mkdir()
    mount = 'mount -t tmpfs -o size=96k tmpfs "$0" && cd "$0" && { "$@"; rc=$?; echo "left: [$(ls -A runs)]"; exit $rc; }'
    argv = [sys.executable, str(ROOT / "reward_shape.py"), "--env-id", "Humanoid-v5", "--clip-models", TINY]
    argv += ["--clip-pretrained", "none", "--render-size", str(SIZE), "--render-quality", "fast", "--save-frames"]
    result = subprocess.run(["unshare", "-rm", "sh", "-c", mount, str(tmp_path / "disk"), *argv],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 1, result.stdout[-1000:] + result.stderr[-3000:]  # the machine's failure: exit 1
    assert_clean_error(result, "could not write runs/Humanoid-v5__", "No space left on device", "nothing was written")
    assert "left: []" in result.stdout, result.stdout[-1000:]  # no run folder, no hidden partial one
