"""Where our RL loops spend their time: pyinstrument (Python) and torch.profiler (ops) over the real `main`.

    python benchmarks/profile_loops.py sac            # our SAC, Hopper-v5, ground-truth reward, no rendering
    python benchmarks/profile_loops.py dqn            # our DQN, CartPole-v1, ground-truth reward
    python benchmarks/profile_loops.py sac --torch    # torch.profiler op table instead (self CPU time)

Runs the unmodified script's `main` with a short schedule and prints the functions with the most self time
(pyinstrument's flat view), then the hottest call paths. Needs `pip install -r requirements-bench.txt`.
"""

import argparse
import contextlib
import io
import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, pin_threads, table  # noqa: E402


def build(which: str, steps: int, env_id: str | None = None):
    if which == "sac":
        import vlmrm_sac_humanoid as ours

        args = ours.Args(env_id=env_id or "Hopper-v5", reward="gt", num_envs=4, total_timesteps=steps, learning_starts=steps // 4,
                         train_frequency=100, gradient_steps=100, batch_size=512, buffer_size=100_000)
    else:
        import vlmrm_dqn_classic as ours

        args = ours.Args(env_id="CartPole-v1", reward="gt", total_timesteps=steps, learning_starts=steps // 4)
    return ours, args


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("which", choices=["sac", "dqn"])
    p.add_argument("--steps", type=int, default=None, help="env steps (default: sac 1600, dqn 8000)")
    p.add_argument("--torch", action="store_true", help="torch.profiler op table instead of pyinstrument")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--env-id", default=None, help="SAC only: the MuJoCo task (default Hopper-v5)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    a = p.parse_args()
    pin_threads(a.threads)
    print(f"machine: {machine()}")
    ours, args = build(a.which, a.steps or (1600 if a.which == "sac" else 8000), a.env_id)
    os.chdir(tempfile.mkdtemp(prefix="bench_prof_"))
    out = io.StringIO()
    if a.torch:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof, contextlib.redirect_stdout(out):
            ours.main(args)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top))
        total = sum(e.self_cpu_time_total for e in prof.key_averages())
        top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:3]
        print(f"summary: torch ops, {a.which}: " + ", ".join(f"{e.key} {e.self_cpu_time_total / total * 100:.0f}%" for e in top)
              + " of op self time")
        return
    from pyinstrument import Profiler

    profiler = Profiler(interval=0.0005)
    with contextlib.redirect_stdout(out):
        profiler.start()
        ours.main(args)
        profiler.stop()
    print([l for l in out.getvalue().splitlines() if l.startswith("done:")][-1])
    session = profiler.last_session
    flat: dict[str, float] = {}

    def walk(frame, parent_key):
        key = f"{frame.function} ({os.path.basename(frame.file_path or '?')}:{frame.line_no})"
        if not frame.function.startswith("["):  # synthetic "[self]" frames: already in their parent's total_self_time
            flat[key] = flat.get(key, 0.0) + frame.total_self_time
        for child in frame.children:
            walk(child, key)

    root = session.root_frame()
    walk(root, "root")
    total = root.time
    rows = [[f"{t:.2f}", f"{t / total * 100:.1f}%", k] for k, t in sorted(flat.items(), key=lambda kv: -kv[1])[: a.top]]
    print(table(["self s", "share", "function (file:line)"], rows))
    print(profiler.output_text(show_all=False, short_mode=True)[:6000])
    top = sorted(flat.items(), key=lambda kv: -kv[1])[:3]
    print(f"summary: {a.which} loop, top self time: " + ", ".join(f"{k.split(' ')[0]} {t / total * 100:.0f}%" for k, t in top))


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    main()
