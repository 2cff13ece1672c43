"""The textured humanoid's look (vlmrm_sac_humanoid.py --realistic), drawn once into the PNGs beside this file.

The script reads the PNGs; this file is how they were made (procedural: no photographs), and
tests/test_humanoid_env.py checks that the committed PNGs are what it draws. After changing the look:

    python assets/make_textures.py
"""

from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import torch
import torch.nn.functional as F

# MuJoCo's skybox faces, measured: face pixel (a, b) in [-1, 1] looks along the world direction whose
# components are (a, b, 1)[|i| - 1] * sign(i) for the indices i below (x forward of the humanoid, z up, b
# grows downwards)
SKYBOX_AXES = dict(right=(3, 1, -2), left=(-3, -1, -2), back=(-1, 3, -2), front=(1, -3, -2), up=(1, -2, 3), down=(1, 2, -3))


def fractal_noise(rng: np.random.Generator, size: int, cells: int, octaves: int) -> np.ndarray:
    """Seamless smooth noise in [0, 1]: octaves of a random grid, bicubically upsampled from a 3x3 tiling (no
    seams)."""
    out = 0
    for o in range(octaves):
        grid = torch.from_numpy(rng.random((1, 1, cells * 2**o, cells * 2**o))).repeat(1, 1, 3, 3)
        up = F.interpolate(grid, scale_factor=size / (cells * 2**o), mode="bicubic")[0, 0, size:-size, size:-size]
        out = out + 0.5**o * up
    return ((out - out.min()) / (out.max() - out.min())).numpy()


def scene_textures() -> dict[str, np.ndarray]:
    """The paper's look: a blue sky with white clouds, dark grey slate tiles, light brushed
    metal."""
    # slate: per-tile shade, layered grain, dark grout; mean grey ~54/255 as the paper's
    rng = np.random.default_rng(1234)
    shade = 0.19 + 0.06 * rng.random((2, 2)).repeat(128, 0).repeat(128, 1)
    # pixels to the grout
    edge = np.minimum(*[np.minimum(c % 128, 127 - c % 128) for c in np.mgrid[0:256, 0:256]])
    grey = np.where(edge < 2, 0.08, shade * (0.75 + 0.5 * fractal_noise(rng, 256, 8, 4)))
    images = {"slate": np.repeat(grey[..., None], 3, -1)}  # neutral grey, as the paper's frame
    rng = np.random.default_rng(99)  # metal: fine streaks along one direction
    streaks = 0.6 * fractal_noise(rng, 128, 4, 5).mean(1, keepdims=True) + 0.4 * rng.random((128, 1))
    images["metal"] = np.broadcast_to((0.72 + 0.16 * streaks)[..., None], (128, 128, 3))
    clouds = torch.from_numpy(fractal_noise(np.random.default_rng(4321), 1024, 6, 6))[None, None].float()
    a, b = np.meshgrid(*[(np.arange(256) + 0.5) / 256 * 2 - 1] * 2)
    for face, axes in SKYBOX_AXES.items():
        d = np.stack([np.sign(i) * (a, b, np.ones_like(a))[abs(i) - 1] for i in axes], -1)
        d /= np.linalg.norm(d, axis=-1, keepdims=True)
        up = d[..., 2]
        elevation = np.arcsin(np.clip(up, -1, 1))
        # saturated blue, lighter at the horizon; below it (past the floor's edge) the horizon's blue goes on:
        # no haze band
        t = np.clip(elevation / 0.6, 0, 1)[..., None]
        sky = (1 - t) * np.array([0.04, 0.58, 0.88]) + t * np.array([0.04, 0.40, 0.82])
        # clouds (grey undersides): noise at (azimuth, elevation), one scale on both, the seam behind the
        # camera, thinning up
        grid = torch.from_numpy(np.stack([np.arctan2(-d[..., 1], -d[..., 0]) / np.pi, elevation / np.pi - 1], -1))
        c = F.grid_sample(clouds, grid[None].float(), padding_mode="reflection", align_corners=False)[0, 0].numpy()
        density = (np.clip((c - 0.6) / 0.08, 0, 1) * np.clip(1.3 - 1.3 * up, 0, 1) * (up > -0.02))[..., None]
        images[face] = sky * (1 - density) + density * (0.78 + 0.22 * np.clip((c - 0.6) / 0.2, 0, 1))[..., None]
    return images


def main(folder: Path = Path(__file__).parent) -> None:
    for name, image in scene_textures().items():
        imageio.imwrite(folder / f"{name}.png", (np.clip(image, 0, 1) * 255).astype(np.uint8), format="png")


if __name__ == "__main__":
    main()
