"""The textured Humanoid-v5 of vlmrm_sac_humanoid.py: identical physics, a realistic look, the paper's fixed camera."""

import importlib.util
import os

import gymnasium as gym
import imageio.v2 as imageio
import mujoco
import numpy as np
import pytest

from vlmrm_sac_humanoid import HUMANOID_CAMERA, TEXTURES, make_env, textured_humanoid_xml

STOCK_XML = os.path.join(os.path.dirname(gym.envs.mujoco.__file__), "assets", "humanoid.xml")
# MjModel fields that only describe the look (textures, materials, colours, lights, names).
VISUAL_PREFIXES = ("tex_", "mat_", "light_", "name_", "names")
VISUAL_FIELDS = {
    "geom_rgba",
    "geom_matid",
    "signature",
    "nbuffer",
    "nnames",
    "nnames_map",
    "npaths",
    "ntex",
    "ntexdata",
    "nmat",
}


def _humanoid(size=96, quality="fast", textured=True, length=1000, camera="paper") -> gym.Env:
    return make_env("Humanoid-v5", 0, 0, length, size, quality, textured, camera)()


def _move_root(env: gym.Env, dx: float = 0.0, dy: float = 0.0) -> None:
    base = env.unwrapped
    qpos, qvel = base.data.qpos.copy(), base.data.qvel.copy()
    qpos[0] += dx
    qpos[1] += dy
    base.set_state(qpos, qvel)


def test_model_physics_fields_identical():
    stock = mujoco.MjModel.from_xml_path(STOCK_XML)
    textured = mujoco.MjModel.from_xml_path(textured_humanoid_xml())
    checked = 0
    for name in dir(stock):
        if name.startswith("_") or name.startswith(VISUAL_PREFIXES) or name in VISUAL_FIELDS:
            continue
        a, b = getattr(stock, name), getattr(textured, name)
        if isinstance(a, np.ndarray):
            assert a.shape == b.shape and np.array_equal(a, b), name
            checked += 1
        elif isinstance(a, (int, float)):
            assert a == b, name
    for name in dir(stock.opt):
        if not name.startswith("_"):
            a = getattr(stock.opt, name)
            if isinstance(a, (int, float, np.ndarray)):
                assert np.array_equal(a, getattr(textured.opt, name)), f"opt.{name}"
    assert checked > 100  # the comparison really covered the model
    # ...while the look did change.
    assert not np.array_equal(stock.mat_specular, textured.mat_specular)
    assert textured.ntex >= 2


def test_the_committed_textures_are_what_make_textures_draws(tmp_path):
    spec = importlib.util.spec_from_file_location("make_textures", TEXTURES / "make_textures.py")
    make_textures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_textures)
    make_textures.main(tmp_path)  # the look drawn now, written as the committed PNGs were
    drawn = sorted(p.name for p in tmp_path.glob("*.png"))
    assert drawn == sorted(p.name for p in TEXTURES.glob("*.png")) and len(drawn) == 8
    for name in drawn:  # pixels, not bytes: another PNG encoder may compress the same pixels otherwise
        assert np.array_equal(imageio.imread(tmp_path / name), imageio.imread(TEXTURES / name)), name


def test_physics_identical_to_stock_humanoid():
    stock = gym.make("Humanoid-v5", terminate_when_unhealthy=False)
    textured = _humanoid()
    obs_s, info_s = stock.reset(seed=0)
    obs_t, info_t = textured.reset(seed=0)
    assert np.array_equal(obs_s, obs_t)
    actions = np.random.default_rng(0).uniform(-0.4, 0.4, size=(300, 17)).astype(np.float32)
    for action in actions:
        obs_s, rew_s, term_s, trunc_s, info_s = stock.step(action)
        obs_t, rew_t, term_t, trunc_t, info_t = textured.step(action)
        assert np.array_equal(obs_s, obs_t)
        assert rew_s == rew_t and term_s == term_t == False and trunc_s == trunc_t  # noqa: E712
        assert info_s.keys() == info_t.keys()
        for key in info_s:
            assert np.array_equal(info_s[key], info_t[key]), key
    assert np.array_equal(stock.unwrapped.data.qpos, textured.unwrapped.data.qpos)
    assert np.array_equal(stock.unwrapped.data.qvel, textured.unwrapped.data.qvel)
    assert textured.unwrapped.data.qpos[2] < 1.0  # it fell, yet was never terminated
    stock.close()
    textured.close()


def test_textured_look_is_sky_and_slate_not_stock():
    frames = {}
    for textured in (True, False):
        env = _humanoid(size=128, textured=textured)
        env.reset(seed=0)
        frames[textured] = env.render().astype(float)
        env.close()
    for frame in frames.values():
        assert frame.shape == (128, 128, 3)
    top = {k: f[:16].reshape(-1, 3).mean(0) for k, f in frames.items()}  # sky above the head
    # Floor rows near the bottom, left and right of the humanoid and its shadow.
    bottom = {k: np.concatenate([f[-20:, :40], f[-20:, -40:]], 1).reshape(-1, 3) for k, f in frames.items()}
    # Sky: clearly blue and bright; stock is a dark slate gradient.
    assert top[True][2] > 150 and top[True][2] - top[True][0] > 40
    assert top[False][2] < 110
    # Floor: stock is a black/white checker (many near-black pixels); slate is an even dark neutral grey.
    lum = {k: b.mean(1) for k, b in bottom.items()}
    assert (lum[False] < 40).mean() > 0.25
    assert (lum[True] < 25).mean() < 0.05 and 35 < lum[True].mean() < 90
    assert np.ptp(bottom[True].mean(0)) < 5  # no blue, green or brown tint


def test_paper_scene_colours_region_by_region():
    # the paper's scene, measured at its camera, 480x480, MuJoCo's default shadows and reflections, initial state:
    # the floor and the sky must match, not only the mean (a tinted floor and a pale sky can offset on average)
    env = _humanoid(size=480, quality="high")
    env.reset(seed=0)
    frame = env.render().astype(float)
    env.close()
    regions = {
        "floor (bottom 30%)": (frame[-144:], [64, 64, 64]),
        "sky (top 40%)": (frame[:192], [44, 147, 208]),
        "mean frame": (frame, [58, 99, 124]),
    }
    off = {}
    for name, (pixels, paper) in regions.items():
        mean = pixels.reshape(-1, 3).mean(0)
        print(f"{name} (R, G, B) = ({mean[0]:.1f}, {mean[1]:.1f}, {mean[2]:.1f}), the paper's {tuple(paper)}")
        if np.any(np.abs(mean - paper) > 15):
            off[name] = mean.round(1).tolist()
    assert not off, f"more than 15 off the paper's frame in some channel: {off}"
    # no haze band at the horizon: left of the humanoid, the rows go from sky blue (B - R > 120) straight to grey floor
    blue = frame[:, :80].mean(1) @ [-1, 0, 1]
    assert ((blue > 20) & (blue < 120)).sum() <= 2, blue.round()


def test_camera_is_fixed_in_the_world():
    env = _humanoid(size=96)
    env.reset(seed=0)
    assert env.unwrapped.mujoco_renderer.viewer is None  # created lazily by the first render()
    start = env.render().astype(float)
    viewer = env.unwrapped.mujoco_renderer.viewer
    assert viewer.cam.type == mujoco.mjtCamera.mjCAMERA_FREE
    assert viewer.cam.distance == HUMANOID_CAMERA["distance"]
    assert viewer.cam.azimuth == HUMANOID_CAMERA["azimuth"]

    # Empty scene: humanoid moved far behind the camera. Its difference to a frame is the humanoid.
    _move_root(env, dx=50.0)
    empty = env.render().astype(float)
    _move_root(env, dx=-50.0)

    def column_of_humanoid(frame: np.ndarray) -> float:
        mask = np.abs(frame - empty).max(-1) > 40
        assert mask.sum() > 50
        return float(np.nonzero(mask)[1].mean())

    col0 = column_of_humanoid(start)
    _move_root(env, dy=1.0)  # one metre sideways
    moved = env.render().astype(float)
    assert abs(column_of_humanoid(moved) - col0) > 10
    # The floor and sky far from the body did not move with it (a tracking camera would shift them).
    corners = (slice(0, 12), slice(-12, None)), (slice(-12, None), slice(0, 12))
    for rows, cols in corners:
        assert np.abs(moved[rows, cols] - start[rows, cols]).max() < 3

    # After a random rollout (falls, drifts), the background is still where it was.
    _move_root(env, dy=-1.0)
    for _ in range(80):
        env.step(env.action_space.sample())
    later = env.render().astype(float)
    for rows, cols in corners:
        assert np.abs(later[rows, cols] - start[rows, cols]).max() < 3
    env.close()


def test_tracking_camera_follows_the_torso():
    def body_column(frame: np.ndarray) -> float:  # the light-grey body against the dark floor (lower half)
        low = frame[48:].astype(float)
        mask = (low.min(-1) > 110) & (low.max(-1) - low.min(-1) < 40)
        assert mask.sum() > 20
        return float(np.nonzero(mask)[1].mean())

    columns = {}
    for camera in ("paper", "tracking"):
        env = _humanoid(length=100, camera=camera)
        env.reset(seed=0)
        start = body_column(env.render())
        _move_root(env, dy=1.0)  # one metre sideways
        columns[camera] = start, body_column(env.render())
        env.close()
    assert abs(columns["paper"][1] - columns["paper"][0]) > 10  # the fixed camera sees it walk across the picture
    assert abs(columns["tracking"][1] - columns["tracking"][0]) < 3  # the tracking camera keeps it in the middle
    assert abs(columns["tracking"][0] - columns["paper"][0]) < 3  # same view at the start


@pytest.mark.parametrize("size", [64, 112])
def test_render_quality_fast_and_high(size):
    frames = {}
    for quality in ("fast", "high"):
        env = _humanoid(size=size, quality=quality)
        env.reset(seed=0)
        frames[quality] = env.render()
        scene = env.unwrapped.mujoco_renderer.viewer.scn
        shadows = scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW]
        assert shadows == (quality == "high")
        assert env.render().shape == (size, size, 3)  # later calls too
        env.close()
    for frame in frames.values():
        assert frame.shape == (size, size, 3) and frame.dtype == np.uint8
    assert np.abs(frames["fast"].astype(float) - frames["high"].astype(float)).mean() > 1.0


@pytest.mark.parametrize("env_id", ["Humanoid-v5", "Hopper-v5"])
def test_fixed_length_episodes_never_terminate(env_id):
    env = make_env(env_id, 0, 0, 60, 48, "fast", True)()  # random actions topple both within 60 steps
    env.reset(seed=1)
    assert env.render().shape == (48, 48, 3)
    for t in range(60):
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        assert not terminated and truncated == (t == 59)
    assert not env.unwrapped.is_healthy  # it fell, yet was never terminated
    env.close()


def test_action_space_is_seeded():
    a = _humanoid(size=32)
    b = _humanoid(size=32)
    assert np.array_equal(a.action_space.sample(), b.action_space.sample())
    a.close()
    b.close()
