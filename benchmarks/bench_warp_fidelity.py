"""How close MuJoCo Warp's ray tracer (--renderer warp) draws the textured humanoid to the paper's EGL "high" frames,
in pixels and in the rewards of three CLIPs, next to EGL "fast" against "high".

    python benchmarks/bench_warp_fidelity.py                                # 300 states at 224 px, 100 at 480 px
    python benchmarks/bench_warp_fidelity.py --states 40 --states-480 10    # a quick look

States: seeded random-action rollouts of the textured Humanoid-v5 (episodes of 40 steps, every 4th step's qpos: standing,
toppling, lying) plus the pose probe's 13 poses (reward_shape.py's POSES, set with its set_pose). Each renderer draws the
same qpos, in a fresh process: EGL high and fast (the training script's make_env, set_state then render), warp (the
training script's warp_renderer) at supersampling 1, 2, 3 without shadows (--render-quality fast) and, at 2, as
shipped with --render-quality high ("shadows": shadow rays cut at the light's plane as MuJoCo's OpenGL shadow map cuts
them, light fraction 0 in shadow); `--uncut-shadows-at N` adds MuJoCo Warp's own shadows (rays not cut) for comparison.

Pixels: mean absolute difference to high per channel (0-255), over the frame and per region; the regions come from
MuJoCo's segmentation render (EGL, same camera and state): floor = the floor geom, body = any other geom, sky = no geom.
CLIPs (`--clips`): the tiny test model and ViT-B-32 with random weights, the small humanoid CLIP trained here
(experiments/humanoid_clip.py; `CONFIG.json=WEIGHTS.pt`), each scoring the training script's default sentences (alpha
0, the reward model of make_reward_model): Pearson and Spearman correlation of each renderer's rewards with high's over
all states. Pose probe: for 3 sentences and each CLIP, the top pose of the 13 with each renderer's frames vs with high's.
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import REPO, Clock, load, machine, main_or_worker, run_worker, table  # noqa: E402

TINY = str(REPO / "tests" / "vlmrm-tiny-test.json")
HUMANOID_CLIP = str(REPO / "experiments" / "humanoid-clip.json")
SENTENCES = ["a humanoid robot kneeling", "a humanoid robot lying on its back", "a humanoid robot with both arms raised"]


def states(episodes: int, seed: int = 0):
    """qpos (N, nq): `episodes` seeded random-action rollouts, every 4th of 40 steps, then the pose probe's poses."""
    import numpy as np

    import reward_shape
    import vlmrm_sac_humanoid as ours

    env = ours.make_env("Humanoid-v5", seed, 0, 100, 64, "fast", True)()
    rng, out = np.random.default_rng(seed), []
    for e in range(episodes):
        env.reset(seed=seed + e)
        for step in range(40):
            env.step(rng.uniform(-0.4, 0.4, env.action_space.shape).astype(np.float32))
            if step % 4 == 3:
                out.append(env.unwrapped.data.qpos.copy())
    for torso, joints in reward_shape.POSES.values():
        reward_shape.set_pose(env, torso, joints)
        out.append(env.unwrapped.data.qpos.copy())
    env.close()
    return np.stack(out)


def worker(c: dict) -> dict:
    """Draw the states of c["states"] with one renderer; save the frames (and, for EGL high, the segmentation)."""
    import numpy as np

    import vlmrm_sac_humanoid as ours

    qpos, size, frames, seg = np.load(c["states"]), c["size"], [], None
    start = time.perf_counter()
    if c["renderer"] == "egl":
        env = ours.make_env("Humanoid-v5", 0, 0, 100, size, c["quality"], True)()
        env.reset(seed=0)
        base = env.unwrapped
        zero = np.zeros(base.model.nv)
        for q in qpos:
            base.set_state(q, zero)
            frames.append(env.render())
        seconds = time.perf_counter() - start
        if c["quality"] == "high":
            import mujoco

            seg_renderer, cam = mujoco.Renderer(base.model, size, size), mujoco.MjvCamera()
            seg_renderer.enable_segmentation_rendering()
            cam.distance, cam.elevation, cam.azimuth = (ours.HUMANOID_CAMERA[k] for k in ("distance", "elevation", "azimuth"))
            cam.lookat[:] = ours.HUMANOID_CAMERA["lookat"]
            seg = []
            for q in qpos:
                base.set_state(q, zero)
                seg_renderer.update_scene(base.data, cam)
                seg.append(seg_renderer.render()[..., 0])
            floor = base.model.geom("floor").id
            seg = np.where(np.stack(seg) < 0, 0, np.where(np.stack(seg) == floor, 1, 2)).astype(np.uint8)  # sky, floor, body
        env.close()
    else:
        import torch

        if c["shadows"] == "uncut":  # MuJoCo Warp's own shadow rays (this worker process only)
            import vlmrm_warp

            vlmrm_warp.cut_shadow_rays_at_the_light = lambda model: None
        # --render-quality high: shadow rays (a shadowed point gets none of the light); fast: none
        quality = "high" if c["shadows"] else "fast"
        renderer = ours.warp_renderer(True, size, c["supersample"], c["worlds"], torch.device("cpu"), quality=quality)
        renderer.draw(qpos[:1])  # the kernel: compiled once per machine, then loaded from Warp's cache
        start = time.perf_counter()
        frames = [f.numpy() for f in renderer.draw(qpos).split(1)]
        seconds = time.perf_counter() - start
        frames = [f[0] for f in frames]
    np.save(c["out"], np.stack(frames))
    if seg is not None:
        np.save(c["out"].replace(".npy", "_seg.npy"), seg)
    return dict(ms=seconds / len(qpos) * 1000)


def clip_reward(spec: str, goal: str | None = None):
    """The training script's reward model of a CLIP given as a name (random weights) or CONFIG.json=WEIGHTS.pt."""
    import torch

    import vlmrm_sac_humanoid as ours

    config, _, weights = spec.partition("=")
    default_goal, baseline = ours.DEFAULT_PROMPTS["Humanoid-v5"]  # the training script's default sentences
    args = ours.Args(clip_model=config, clip_pretrained="none", clip_checkpoint=weights or None, reward_batch_size=16)
    args.goal, args.baseline, args.alpha = (goal or default_goal,), (baseline,), 0.0
    torch.manual_seed(0)
    return ours.make_reward_model(args, torch.device("cpu"))


def main() -> None:
    import numpy as np
    import torch
    from scipy.stats import pearsonr, spearmanr

    import reward_shape

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--states", type=int, default=300, help="random-rollout states at 224 px (the 13 poses come on top)")
    p.add_argument("--states-480", type=int, default=100, help="of those, the first N at 480 px (the CPU's time)")
    p.add_argument("--supersample", nargs="*", type=int, default=[1, 2, 3], help="warp's rays per pixel per axis")
    p.add_argument("--shadows-at", type=int, default=2, help="also warp with shadows (as shipped) at this supersampling")
    p.add_argument("--uncut-shadows-at", type=int, default=0, help="... with MuJoCo Warp's own shadows (0: no)")
    p.add_argument("--clips", nargs="+", default=[TINY, "ViT-B-32", f"{HUMANOID_CLIP}=/tmp/humanoid-clip.pt"],
                   help="a name (random weights) or CONFIG.json=WEIGHTS.pt (experiments/humanoid_clip.py)")  # fmt: skip
    p.add_argument("--picture", default=str(REPO / "docs" / "humanoid_warp_vs_egl.png"), help="EGL high | warp | diff")
    a = p.parse_args()
    clock, tmp = Clock(), tempfile.mkdtemp(prefix="bench_warp_fidelity_")
    print(f"machine: {machine()}, MUJOCO_GL={os.environ['MUJOCO_GL']}")
    print("command: python benchmarks/bench_warp_fidelity.py " + " ".join(sys.argv[1:]))
    missing = [s for s in a.clips if "=" in s and not os.path.exists(s.partition("=")[2])]
    if missing:
        sys.exit(f"error: no weights for {missing[0]}: train them with experiments/humanoid_clip.py (~5 CPU-minutes).")
    qpos = states(a.states // 10)
    poses = len(reward_shape.POSES)
    renderers = [("EGL high", dict(renderer="egl", quality="high")), ("EGL fast", dict(renderer="egl", quality="fast"))]
    renderers += [(f"warp ss{s}", dict(renderer="warp", supersample=s, shadows=False)) for s in a.supersample]
    if a.uncut_shadows_at:
        uncut = dict(renderer="warp", supersample=a.uncut_shadows_at, shadows="uncut")
        renderers.append((f"warp ss{a.uncut_shadows_at} uncut shadows", uncut))
    if a.shadows_at:
        renderers.append((f"warp ss{a.shadows_at} shadows", dict(renderer="warp", supersample=a.shadows_at, shadows=True)))
    clips = {s: clip_reward(s) for s in a.clips}
    torch.set_num_threads(1)
    rows, corr_rows, probe_rows, ms, picture, corr, ok = [], [], [], {}, {}, {}, {}
    for size, n in ((224, len(qpos)), (480, min(a.states_480, len(qpos) - poses) + poses)):
        chosen = np.concatenate([qpos[: n - poses], qpos[-poses:]])  # the poses always
        np.save(path := f"{tmp}/states_{size}.npy", chosen)
        frames = {}
        for name, c in renderers:
            out = f"{tmp}/{size}_{name.replace(' ', '_')}.npy"
            ms[size, name] = run_worker(__file__, dict(c, size=size, states=path, out=out, worlds=16))["ms"]
            frames[name] = np.load(out)
            print(f"  {size} px {name}: {len(chosen)} frames, {ms[size, name]:.0f} ms/frame (load {load()})", flush=True)
        seg = np.load(f"{tmp}/{size}_EGL_high_seg.npy")
        high = frames["EGL high"].astype(np.float32)
        rewards = {s: {k: m(f) for k, f in frames.items()} for s, m in clips.items()}
        for name in frames:
            if name == "EGL high":
                continue
            diff = np.abs(frames[name].astype(np.float32) - high).mean(-1)
            regions = [diff[seg == r].mean() for r in (1, 0, 2)]  # floor, sky, body
            rows.append(
                [size, name, len(chosen), f"{ms[size, name]:.0f}", f"{diff.mean():.2f}"] + [f"{x:.2f}" for x in regions]
            )
            for s in a.clips:
                r, h = rewards[s][name], rewards[s]["EGL high"]
                corr[size, name, s] = pearsonr(r, h)[0], spearmanr(r, h)[0]
            corr_rows.append([size, name] + [f"{x:.3f}" for s in a.clips for x in corr[size, name, s]])
            picture[size, name] = frames[name]
        picture[size, "EGL high"] = frames["EGL high"]
        # the pose probe: the top pose of each sentence, per CLIP, with each renderer's frames of the 13 poses
        for s in a.clips:
            for sentence in SENTENCES:
                model = clip_reward(s, sentence)
                top = {k: list(reward_shape.POSES)[int(np.argmax(model(f[-poses:])))] for k, f in frames.items()}
                label = os.path.basename(s.partition("=")[0]).replace(".json", "")
                probe_rows.append([size, label, sentence, top["EGL high"]] + [top[k] for k, _ in renderers[1:]])
    print()
    print(table(["px", "renderer vs EGL high", "states", "ms/frame", "mean abs diff", "floor", "sky", "body"], rows))
    labels = [os.path.basename(s.partition("=")[0]).replace(".json", "") for s in a.clips]
    print()
    print(table(["px", "renderer vs EGL high"] + [f"{x} {c}" for x in labels for c in ("Pearson", "Spearman")], corr_rows))
    print()
    print(table(["px", "CLIP", "sentence", "top pose, EGL high"] + [k for k, _ in renderers[1:]], probe_rows))
    print(
        f"\npixels: mean |difference| per channel, 0-255, over all pixels of all states and per region (MuJoCo's "
        f"segmentation render); ms/frame: this machine's CPU (load average at the end {load()}), drawing only; took {clock}"
    )
    if a.picture:  # three states at 480 px: standing, a random-rollout state, a pose
        import imageio.v2 as imageio

        best = renderers[-1][0]  # the shipped renderer (--render-quality high) unless --shadows-at 0
        n480 = len(picture[480, "EGL high"])
        idx = [n480 - poses, 7, n480 - poses + 8]
        high, warp = picture[480, "EGL high"][idx], picture[480, best][idx]
        diff = np.clip(np.abs(high.astype(int) - warp.astype(int)) * 4, 0, 255).astype(np.uint8)
        rows_img = [np.concatenate([h, w, d], 1) for h, w, d in zip(high, warp, diff)]
        imageio.imwrite(a.picture, np.concatenate(rows_img, 0)[::2, ::2])
        print(f"picture: {a.picture} (rows: 3 states; columns: EGL high | {best} | abs diff x4; halved to 240 px)")
    for size, name, s in corr:  # the bar: warp agrees with high at least as well as fast does, for every CLIP
        if name.startswith("warp"):
            ok[name] = ok.get(name, True) and all(x >= y for x, y in zip(corr[size, name, s], corr[size, "EGL fast", s]))
    top = [r[3:] for r in probe_rows]
    same = {n: sum(t[0] == t[i] for t in top) for i, (n, _) in enumerate(renderers[1:], 1)}
    print(
        "summary: Pearson and Spearman with EGL high >= EGL fast's for every CLIP at both sizes: "
        + ", ".join(f"{n} {'yes' if v else 'no'}" for n, v in ok.items())
        + f"; pose probe's top pose as with high, of {len(top)}: "
        + ", ".join(f"{n} {v}" for n, v in same.items())
    )


if __name__ == "__main__":
    main_or_worker(main, worker)
