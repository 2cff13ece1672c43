"""MuJoCo Warp as the SAC script's optional renderer (--renderer warp): every env's frame drawn in one batch by its ray
tracer on the reward model's device, the envs sending their states instead of frames. Imported only with that flag: the
default EGL path never loads Warp.

One private function of mujoco-warp is wrapped here, and only here (cut_shadow_rays_at_the_light): MuJoCo's OpenGL draws
a directional light's shadows from the light's plane, MuJoCo Warp from infinitely far, so without the wrap the raised
arms would shade the floor where the paper's frames show none. That function exists in mujoco-warp 4.0.0, pinned in
requirements.txt; another version is refused with --render-quality high (fast casts no shadows and works with any).
"""

import contextlib
import copy
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional

import gymnasium as gym
import numpy as np
import torch

from vlmrm_utils import UserError, check_writable


def check_available(args, device: Optional[torch.device] = None) -> None:
    """--renderer warp's own checks, one sentence each, before the run folder is made: the scene it draws, MuJoCo Warp
    installed (its pinned version for shadows), and Warp's kernel cache writable, with room for a first compile on
    `device` (default: CUDA when there is one). Both failed after the run folder was made, naming neither the cache nor
    WARP_CACHE_PATH: a read-only cache as `[Errno 30] Read-only file system: '.../1.19.0'`, a full disk as LLVM's
    `IO failure on output stream`."""
    for failed, message in [
        (args.env_id != "Humanoid-v5", "--renderer warp draws Humanoid-v5 only; use --renderer egl."),
        (not importlib.util.find_spec("mujoco_warp"), "--renderer warp needs MuJoCo Warp: pip install mujoco-warp."),
        (not 1 <= args.supersample <= 8, f"--supersample must be between 1 and 8, got {args.supersample}."),
    ]:
        if failed:
            raise UserError(message)
    if args.render_quality == "high" and not warp_lighting_hook():
        raise UserError(
            "--renderer warp with --render-quality high needs mujoco-warp 4.0.0 (its shadows are cut at the light's plane "
            "through a private function other versions lack): pip install mujoco-warp==4.0.0, or use --render-quality "
            "fast (no shadows), which works with any version."
        )
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cache = kernel_cache()
    check_writable(cache, "MuJoCo Warp's kernel cache", "set WARP_CACHE_PATH to a writable folder")
    existing = next(folder for folder in [cache, *cache.parents] if folder.exists())
    free = shutil.disk_usage(existing).free
    if not compiled(device) and free < COMPILE_ROOM:
        raise UserError(
            f"MuJoCo Warp's kernel cache {cache}/ has {free / 2**20:.0f} MiB free, and this run compiles its ray tracer "
            f"there (needs {COMPILE_ROOM // 2**20} MiB); free some disk space or set WARP_CACHE_PATH to another folder."
        )


# a first compile for the CPU wrote 1.3 MB to the cache (mujoco-warp 4.0.0, Warp 1.19.0); CUDA's was not measured
COMPILE_ROOM = 64 * 2**20


def kernel_cache() -> Path:
    """Warp's kernel cache folder, as warp.init() resolves it (WARP_CACHE_PATH/<version>, else the user's cache folder
    by the appdirs Warp ships), without initialising Warp: that would start CUDA before the env workers fork."""
    import warp as wp
    from warp._src.thirdparty import appdirs

    if wp.config.kernel_cache_dir:
        return Path(wp.config.kernel_cache_dir)
    if "WARP_CACHE_PATH" in os.environ:
        return Path(os.path.realpath(os.environ["WARP_CACHE_PATH"]), wp.config.version)
    return Path(appdirs.user_cache_dir(appname="warp", appauthor="NVIDIA", version=wp.config.version))


def compiled(device: torch.device) -> bool:
    """Whether Warp's cache holds the ray tracer compiled for `device`: object files for the CPU, cubin or ptx for CUDA."""
    suffixes = (".o",) if device.type == "cpu" else (".cubin", ".ptx")
    return any(path.suffix in suffixes for path in kernel_cache().glob("wp_mujoco_warp._src.render_*/*"))


NO_CUDA_DRIVER = "Could not find or load the NVIDIA CUDA driver"
SAID = {}  # this process: whether Warp found no CUDA driver, and whether the CPU drawing was said


def init_warp():
    """Warp, initialised (once per process; later calls return it): no banner nor a line per compiled module, and on a
    machine without a CUDA driver not its `Warp CUDA warning: Could not find or load the NVIDIA CUDA driver...` on every
    run (WarpRenderer says it once, in our words). The warning is written by Warp's C code to the process's stderr: it
    is caught there for the length of warp.init() and the rest written back."""
    import warp as wp

    wp.config.log_level = wp.LOG_WARNING
    if "no_driver" in SAID:
        return wp
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            wp.init()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            lines = caught.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if NO_CUDA_DRIVER not in line))
    SAID["no_driver"] = any(NO_CUDA_DRIVER in line for line in lines)
    return wp


def warp_lighting_hook():
    """The private function of mujoco-warp 4.0.0 that cut_shadow_rays_at_the_light wraps, or None (another version)."""
    from mujoco_warp._src import render

    return getattr(render, "_make_compute_lighting", None)


SHADOW_LIGHT = []  # the light (pos, dir) whose plane cuts this process's shadow rays: compiled into the kernel


def cut_shadow_rays_at_the_light(model) -> None:
    """Shadows as in the paper's frames: MuJoCo's OpenGL draws a directional light's shadow map from the light's
    position, so only what lies between a point and the plane through the light (normal: its direction) shades it;
    with the paper's light at z = 1 m, the legs and feet, not the torso and raised arms. MuJoCo Warp treats the light
    as infinitely far; this stops its shadow rays at that plane, for the model's first light (the scene has one), by
    wrapping mujoco-warp 4.0.0's private _make_compute_lighting, which a render context calls to build its kernel at
    its first draw. Once per process, before the first draw."""
    import warp as wp
    from mujoco_warp._src import render

    n = model.light_dir[0] / np.linalg.norm(model.light_dir[0])
    light = (tuple(model.light_pos[0].tolist()), tuple(n.tolist()))
    if SHADOW_LIGHT:
        if SHADOW_LIGHT[0] != light:
            raise UserError(f"MuJoCo Warp's shadows are cut at one light per process: {SHADOW_LIGHT[0]}, not {light}.")
        return
    if warp_lighting_hook() is None:
        raise UserError("MuJoCo Warp's shadows need mujoco-warp 4.0.0: pip install mujoco-warp==4.0.0.")
    SHADOW_LIGHT.append(light)
    pos, normal, make = wp.constant(wp.vec3(*light[0])), wp.constant(wp.vec3(*light[1])), render._make_compute_lighting

    def make_cut(cast_ray_first_hit):
        @wp.func
        def cast_to_the_light(
            geom_type: wp.array[int], geom_dataid: wp.array2d[int], geom_matid: wp.array2d[int],
            geom_size: wp.array2d[wp.vec3], geom_rgba: wp.array2d[wp.vec4], flex_vertadr: wp.array[int],
            flex_edge: wp.array[wp.vec2i], flex_radius: wp.array[float], mat_rgba: wp.array2d[wp.vec4],
            geom_xpos_in: wp.array2d[wp.vec3], geom_xmat_in: wp.array2d[wp.mat33], flexvert_xpos_in: wp.array2d[wp.vec3],
            bvh_id: wp.uint64, group_root: int, worldid: int, bvh_ngeom: int, flex_bvh_ngeom: int,
            enabled_geom_ids: wp.array[int], mesh_bvh_id: wp.array[wp.uint64], hfield_bvh_id: wp.array[wp.uint64],
            flex_rgba: wp.array[wp.vec4], flex_geom_flexid: wp.array[int], flex_geom_edgeid: wp.array[int],
            flex_bvh_id: wp.array[wp.uint64], flex_group_root: wp.array2d[int], ray_origin_world: wp.vec3,
            ray_dir_world: wp.vec3, max_dist: float, cull_backfaces: bool,
        ):  # fmt: skip
            # the shadow ray runs against the light's direction: the light's plane is dot(origin - pos, dir) away
            reach = wp.min(max_dist, wp.dot(ray_origin_world - pos, normal))
            return cast_ray_first_hit(
                geom_type, geom_dataid, geom_matid, geom_size, geom_rgba, flex_vertadr, flex_edge, flex_radius,
                mat_rgba, geom_xpos_in, geom_xmat_in, flexvert_xpos_in, bvh_id, group_root, worldid, bvh_ngeom,
                flex_bvh_ngeom, enabled_geom_ids, mesh_bvh_id, hfield_bvh_id, flex_rgba, flex_geom_flexid,
                flex_geom_edgeid, flex_bvh_id, flex_group_root, ray_origin_world, ray_dir_world, reach, cull_backfaces,
            )  # fmt: skip

        return make(cast_to_the_light)

    render._make_compute_lighting = make_cut


def free_cameras(spec, camera: dict, body: str):
    """The model of `spec` with a MuJoCo free camera (distance, lookat, elevation, azimuth in degrees) as two model
    cameras: "paper", fixed at its pose, and "tracking", at the same offset from `body`'s centre of mass (MuJoCo's
    trackcom mode), as a free camera whose look-at point follows it. MuJoCo's convention: forward = (cos el cos az,
    cos el sin az, sin el), the camera `distance` behind the look-at point, its x axis level."""
    import mujoco

    el, az = np.radians(camera["elevation"]), np.radians(camera["azimuth"])
    forward = np.array([np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)])
    right = np.cross(forward, [0.0, 0.0, 1.0]) / np.linalg.norm(np.cross(forward, [0.0, 0.0, 1.0]))
    pose = dict(xyaxes=np.concatenate([right, np.cross(right, forward)]), fovy=spec.visual.global_.fovy)
    spec.worldbody.add_camera(name="paper", pos=np.asarray(camera["lookat"]) - camera["distance"] * forward, **pose)
    data = mujoco.MjData(model := spec.compile())
    mujoco.mj_forward(model, data)  # at qpos0, where trackcom measures its offset (`body` is not rotated there)
    com = data.subtree_com[model.body(body).id] - data.xpos[model.body(body).id]
    trackcom = mujoco.mjtCamLight.mjCAMLIGHT_TRACKCOM
    spec.body(body).add_camera(name="tracking", mode=trackcom, pos=com - camera["distance"] * forward, **pose)
    return spec.compile()


class WarpRenderer:
    """Draws MuJoCo states in batches with MuJoCo Warp's ray tracer (compute kernels: every SM of a CUDA device, or
    Warp's CPU device), the frames staying on `device` for the reward model (no host copy on CUDA).

        renderer = WarpRenderer(model, "paper", size=224, supersample=2, worlds=32, device=torch.device("cuda"))
        frames = renderer.draw(qpos)  # (N, nq) numpy or torch -> uint8 torch (N, size, size, 3) on `device`

    `model`: the scene with `camera` as a model camera (the ray tracer draws model cameras only); a copy with the Newton
    solver goes to the device (put_model refuses Gymnasium's PGS; the drawing needs kinematics only). Each pixel
    averages `supersample` x `supersample` rays on a grid (MuJoCo Warp's samples_per_pixel, summed in float): as
    drawing at size * supersample and averaging the blocks; without it the floor's tiles show moire. `worlds`: states
    drawn per launch (a render context for N worlds is expensive to make: one per process); N states are drawn in
    blocks of `worlds`. `shadows`: shadow rays towards each light that casts shadows, cut at the light's plane as
    MuJoCo's OpenGL cuts them (cut_shadow_rays_at_the_light); a shadowed point gets none of that light, as there."""

    def __init__(self, model, camera: str, size: int, supersample: int, worlds: int, device, shadows: bool = True):
        import mujoco

        wp = init_warp()
        import mujoco_warp as mjw

        self.wp, self.mjw, self.worlds, self.size = wp, mjw, worlds, size
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        cpu = self.device.type == "cpu"
        self.wp_device = "cpu" if cpu else str(self.device)
        # said once per process; a first compile for the CPU took 9 s on a quiet 2-core machine (4 s in this constructor,
        # 5 s at the first draw), then Warp's cache serves it
        why = "; this machine has no CUDA driver" if cpu and SAID["no_driver"] else ""
        if not compiled(self.device):
            print(f"compiling MuJoCo Warp's ray tracer kernels for {self.wp_device} (once per machine: ~10 s on a CPU{why})")
        elif why and not SAID.get("said"):
            print("MuJoCo Warp draws on the CPU (this machine has no CUDA driver)")
        SAID["said"] = True
        if shadows:
            cut_shadow_rays_at_the_light(model)
        model = copy.deepcopy(model)
        model.opt.solver = mujoco.mjtSolver.mjSOL_NEWTON
        data = mujoco.MjData(model)
        mujoco.mj_forward(model, data)
        with wp.ScopedDevice(self.wp_device):
            self.model = mjw.put_model(model)
            self.data = mjw.put_data(model, data, nworld=worlds)
            self.context = mjw.create_render_context(
                model, worlds, (size, size), render_rgb=True, render_depth=False, render_seg=False, use_textures=True,
                use_shadows=shadows, shadow_light_fraction=0.0, render_skybox=True, samples_per_pixel=supersample,
                cam_active=[camera],
            )  # fmt: skip
        self.qpos = wp.to_torch(self.data.qpos)  # (worlds, nq) float32, shared with the device's data

    def draw(self, qpos) -> torch.Tensor:
        """uint8 frames (N, size, size, 3) of the states' qpos (N, nq), on the renderer's device."""
        qpos = torch.as_tensor(qpos, dtype=torch.float32).to(self.device)
        wp, mjw, frames = self.wp, self.mjw, []
        # on CUDA the kernels run on torch's current stream: ordered with the reward model's work, no synchronisation
        cuda = self.device.type == "cuda"
        stream = wp.ScopedStream(wp.stream_from_torch(torch.cuda.current_stream(self.device))) if cuda else None
        with wp.ScopedDevice(self.wp_device), stream or contextlib.nullcontext():
            for block in qpos.split(self.worlds):
                self.qpos[: len(block)] = block
                mjw.kinematics(self.model, self.data)
                mjw.com_pos(self.model, self.data)  # the centre of mass a tracking camera follows
                mjw.camlight(self.model, self.data)
                mjw.refit_bvh(self.model, self.data, self.context)
                mjw.render(self.model, self.data, self.context)
                # rgb_data: a uint32 per pixel, blue in its lowest byte (little endian: B, G, R, A), rows top down
                pixels = wp.to_torch(self.context.rgb_data)[: len(block)].view(torch.uint8)
                frames.append(pixels.view(len(block), self.size, self.size, 4)[..., [2, 1, 0]])  # a copy, RGB
        return torch.cat(frames) if len(frames) > 1 else frames[0]


class WarpFrames(gym.Wrapper):
    """A MuJoCo env drawn by MuJoCo Warp: `state()` is what a frame is drawn from (qpos), which training envs return
    with each step in place of a frame (FrameAfterStep) for the trainer to draw every env's at once; `render()` draws
    this env's own frame (evaluation, videos, the tools) with `renderer()`, the script's 1-world WarpRenderer of its
    scene, camera and device, made on first use."""

    def __init__(self, env: gym.Env, renderer: Callable):
        super().__init__(env)
        self.make_renderer, self.renderer = renderer, None
        self.state_shape = (env.unwrapped.model.nq,)  # FrameAfterStep: an env with a state_shape returns its state

    def state(self) -> np.ndarray:
        return self.env.unwrapped.data.qpos.copy()

    def render(self) -> np.ndarray:
        if self.renderer is None:
            self.renderer = self.make_renderer()
        return self.renderer.draw(self.state()[None])[0].cpu().numpy()
