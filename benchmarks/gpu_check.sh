#!/usr/bin/env bash
# The GPU numbers in one call (about 8 minutes on one H100): the reward path against the bare image encoder in float16,
# bfloat16 and float32; rendering of the textured humanoid (sizes, qualities, 1/16/32 envs) and what a frame's parts
# cost; end to end at the paper's settings and at 224 px fast; MuJoCo Warp's ray tracer (--renderer warp: 224 and 480 px,
# 32 and 256 worlds, and end to end at the paper's settings) when mujoco_warp imports; the tests that touch the GPU paths.
#
#   benchmarks/gpu_check.sh            # on the GPU machine, from the repository root; output in $OUT or gpu_check/
#   PART=1 benchmarks/gpu_check.sh     # in two calls: scoring, rendering (250 s of step limits); then PART=2, the rest
#   benchmarks/gpu_check.sh --smoke    # the same steps at toy sizes on any machine (checks this script, measures nothing)
#
# A bare GPU machine with PyTorch may lack this project's other packages and the GL loader libraries: bring them along
# as wheels in .whl/ and Debian packages in .gl/ (both git-ignored; docs/benchmarks.md says how to fetch them).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_check}
mkdir -p "$out"
smoke=${1:-}
if compgen -G ".gl/*.deb" >/dev/null; then
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export MUJOCO_GL=egl PYOPENGL_PLATFORM=egl PYTHONUNBUFFERED=1
start=$SECONDS
step() {  # name, time limit (s), command...: each step's output in $out/<name>.txt, a slow step cannot eat the rest
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s, at ${SECONDS}s)"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt" | grep -E "^(summary|machine|\|)" || echo "($name: no summary)"
}
# on stdout only: the device tool brings back at most 8 files, and with the ray tracer the steps write 8
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
# the ray tracer's steps need warp-lang and mujoco-warp (their wheels in .whl/ too; warp-lang's is 149 MB)
warp=$(python3 -c "import mujoco_warp" 2>/dev/null && echo yes || echo no)
[ "$warp" = yes ] || echo "(mujoco_warp does not import: the ray tracer's steps are skipped)"

if [ "$smoke" = "--smoke" ]; then
  big=tests/vlmrm-tiny-test.json
  step reward_scoring 300 python3 benchmarks/bench_reward_scoring.py --models $big --batch-sizes 4 --frame-sizes 64 --repeats 1
  step render 300 python3 benchmarks/bench_render.py --sizes 64 --qualities fast high --num-envs 1 2 --frames 3 --repeats 1
  step frame_cost 300 python3 benchmarks/bench_frame_cost.py --size 64 --states 3 --repeats 1 --clips $big
  e2e="--clip-models $big --num-envs 2 --total-timesteps 120 --learning-starts 60 --train-frequency 20 --gradient-steps 2"
  e2e="$e2e --batch-size 32 --reward-batch-size 8 --repeats 1"
  step e2e_paper 300 python3 benchmarks/bench_end_to_end.py $e2e --render-size 64 --render-quality high
  step e2e_224_fast 300 python3 benchmarks/bench_end_to_end.py $e2e --render-size 64 --render-quality fast
  if [ "$warp" = yes ]; then
    step render_warp 300 python3 benchmarks/bench_render.py --renderers warp --sizes 64 --num-envs 2 --frames 2 --repeats 1
    step e2e_paper_warp 300 python3 benchmarks/bench_end_to_end.py $e2e --render-size 64 --render-quality high --renderer warp
  fi
  step tests 300 python3 -m pytest -q -x tests/test_reward_overlap.py -k failing_reward_model
else
  part=${PART:-all}  # PART=1: reward scoring, rendering, frame cost; PART=2: the rest (two shorter calls)
  if [ "$part" != 2 ]; then
    step reward_scoring 120 python3 benchmarks/bench_reward_scoring.py --models ViT-bigG-14 --batch-sizes 256 --frame-sizes 480 --repeats 2
    step render 60 python3 benchmarks/bench_render.py --sizes 224 480 --qualities fast high --num-envs 1 32 --frames 30 --repeats 1
    step frame_cost 70 python3 benchmarks/bench_frame_cost.py --size 480 --states 24 --repeats 2 --clips ViT-L-14
  fi
  if [ "$part" != 1 ]; then
    # the paper's settings: ViT-bigG-14, 32 envs, 480 px high, reward batch 256, batch 512, 100 gradient steps every 100
    # vector steps; learning from the 100th vector step, so that two training phases are timed
    e2e="--clip-models ViT-bigG-14 --num-envs 32 --total-timesteps 9600 --learning-starts 3200 --train-frequency 100"
    e2e="$e2e --gradient-steps 100 --batch-size 512 --reward-batch-size 256 --repeats 1"
    step e2e_paper 140 python3 benchmarks/bench_end_to_end.py $e2e --render-size 480 --render-quality high
    step e2e_224_fast 90 python3 benchmarks/bench_end_to_end.py $e2e --render-size 224 --render-quality fast
    if [ "$warp" = yes ]; then
      # one batch of N worlds per frame on the GPU, at the script's default --supersample; the first worker compiles the
      # CUDA kernels (once, then Warp's cache in ~/.cache/warp serves every later process, the end-to-end run's too)
      step render_warp 150 python3 benchmarks/bench_render.py --renderers warp --sizes 224 480 --num-envs 32 256 --frames 10 --repeats 1
      # the paper's settings (as e2e_paper), the frames drawn by the ray tracer on the reward's GPU
      step e2e_paper_warp 120 python3 benchmarks/bench_end_to_end.py $e2e --render-size 480 --render-quality high --renderer warp
    fi
    step tests 80 python3 -m pytest -q -n 8 tests/test_vlm_reward.py tests/test_reward_devices.py tests/test_reward_overlap.py
  fi
fi
echo "=== done in $((SECONDS - start)) s; outputs in $out/"
