"""A measured candidate, not a feature: MuJoCo Warp's shadow rays cut at the light's plane, as MuJoCo's OpenGL draws them.

MuJoCo's OpenGL draws a directional light's shadow map from the light's position, so only geometry on the lit side of
the plane through `pos` (normal `dir`) casts shadows: with the paper's light at 1 m, the legs and feet, not the torso
and arms above it. MuJoCo Warp 4.0 treats a directional light as infinitely far (shadow rays reach 1e8). `install`
wraps the private `mujoco_warp._src.render._make_compute_lighting` (read at the render kernel's first build) so that a
shadow ray from point o stops at dot(o - pos, dir), the distance to that plane. Private API of mujoco-warp 4.0.0; one
light (the model's first), before the first draw of any render context in the process.
"""

import warp as wp


def install(light_pos, light_dir) -> None:
    import mujoco_warp._src.render as render

    pos, normal = wp.constant(wp.vec3(*map(float, light_pos))), wp.constant(wp.vec3(*map(float, light_dir)))
    make = render._make_compute_lighting

    def make_clipped(cast_ray_first_hit):
        @wp.func
        def cast_to_plane(
            geom_type: wp.array[int],
            geom_dataid: wp.array2d[int],
            geom_matid: wp.array2d[int],
            geom_size: wp.array2d[wp.vec3],
            geom_rgba: wp.array2d[wp.vec4],
            flex_vertadr: wp.array[int],
            flex_edge: wp.array[wp.vec2i],
            flex_radius: wp.array[float],
            mat_rgba: wp.array2d[wp.vec4],
            geom_xpos_in: wp.array2d[wp.vec3],
            geom_xmat_in: wp.array2d[wp.mat33],
            flexvert_xpos_in: wp.array2d[wp.vec3],
            bvh_id: wp.uint64,
            group_root: int,
            worldid: int,
            bvh_ngeom: int,
            flex_bvh_ngeom: int,
            enabled_geom_ids: wp.array[int],
            mesh_bvh_id: wp.array[wp.uint64],
            hfield_bvh_id: wp.array[wp.uint64],
            flex_rgba: wp.array[wp.vec4],
            flex_geom_flexid: wp.array[int],
            flex_geom_edgeid: wp.array[int],
            flex_bvh_id: wp.array[wp.uint64],
            flex_group_root: wp.array2d[int],
            ray_origin_world: wp.vec3,
            ray_dir_world: wp.vec3,
            max_dist: float,
            cull_backfaces: bool,
        ):
            # the shadow ray runs along -dir: the light's plane is dot(origin - pos, dir) away
            reach = wp.min(max_dist, wp.dot(ray_origin_world - pos, normal))
            return cast_ray_first_hit(
                geom_type, geom_dataid, geom_matid, geom_size, geom_rgba, flex_vertadr, flex_edge, flex_radius,
                mat_rgba, geom_xpos_in, geom_xmat_in, flexvert_xpos_in, bvh_id, group_root, worldid, bvh_ngeom,
                flex_bvh_ngeom, enabled_geom_ids, mesh_bvh_id, hfield_bvh_id, flex_rgba, flex_geom_flexid,
                flex_geom_edgeid, flex_bvh_id, flex_group_root, ray_origin_world, ray_dir_world, reach, cull_backfaces,
            )  # fmt: skip

        return make(cast_to_plane)

    render._make_compute_lighting = make_clipped
