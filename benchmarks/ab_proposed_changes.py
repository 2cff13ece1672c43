"""A/B test of proposed speed-ups: patched private copies of our scripts against the unpatched ones.

    python benchmarks/ab_proposed_changes.py sac          # SAC update, Hopper-v5, ground-truth reward
    python benchmarks/ab_proposed_changes.py dqn          # DQN loop, CartPole-v1, ground-truth reward
    python benchmarks/ab_proposed_changes.py sac --repeats 5 --steps 4000

Each variant is a copy of the script (from the repository, or VLMRM_BENCH_SCRIPTS) in a temporary folder with
a few exact text replacements; a variant whose text no longer matches is reported as "n/a" (the script has
changed since: re-derive the patch). Variants run in fresh processes, in rounds (baseline, A, B, ... then
again), and the table reports median SPS and median learning time per gradient step, relative to baseline.
The scripts themselves are never modified.
"""

import argparse
import contextlib
import io
import os
import re
import shutil
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SCRIPTS, Clock, emit, load, machine, median, run_worker, table, worker_payload  # noqa: E402

SAC_FILE, DQN_FILE = "vlmrm_sac_humanoid.py", "vlmrm_dqn_classic.py"

# (old text, new text) pairs; each must occur exactly once in the script
SAC_PATCHES = {
    "Normal(validate_args=False)": [(
        "normal = torch.distributions.Normal(mean, log_std.exp())",
        "normal = torch.distributions.Normal(mean, log_std.exp(), validate_args=False)  # no per-call checks (host syncs)",
    )],
    "fused Adam": [
        ("optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=args.q_lr)",
         "optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=args.q_lr, fused=True)"),
        ("optim.Adam(actor.parameters(), lr=args.policy_lr)", "optim.Adam(actor.parameters(), lr=args.policy_lr, fused=True)"),
        ("optim.Adam([log_ent_coef], lr=args.q_lr)", "optim.Adam([log_ent_coef], lr=args.q_lr, fused=True)"),
    ],
    "foreach target update": [(
        """                    for param, target_param in zip(qf1.parameters(), qf1_target.parameters()):
                        target_param.lerp_(param, args.tau)
                    for param, target_param in zip(qf2.parameters(), qf2_target.parameters()):
                        target_param.lerp_(param, args.tau)""",
        """                    torch._foreach_lerp_(target_params, online_params, args.tau)  # one fused op for all tensors""",
    ), (
        "    rb = ReplayBuffer(args.buffer_size, envs.single_observation_space.shape, envs.single_action_space.shape, device)",
        "    rb = ReplayBuffer(args.buffer_size, envs.single_observation_space.shape, envs.single_action_space.shape, device)\n"
        "    online_params = list(qf1.parameters()) + list(qf2.parameters())\n"
        "    target_params = list(qf1_target.parameters()) + list(qf2_target.parameters())",
    )],
    "one torch thread": [(
        "    device = torch.device(\"cuda\" if torch.cuda.is_available() and args.cuda else \"cpu\")\n    make_eval_envs",
        "    device = torch.device(\"cuda\" if torch.cuda.is_available() and args.cuda else \"cpu\")\n"
        "    if device.type == \"cpu\":\n        torch.set_num_threads(1)  # small MLPs: thread sync costs more than it saves\n    make_eval_envs",
    )],
}
SAC_PATCHES["no critic weight grads in actor step"] = [(
    "                min_qf_pi = torch.min(qf1(b_obs, pi), qf2(b_obs, pi))",
    "                qf1.requires_grad_(False), qf2.requires_grad_(False)  # the actor loss needs no critic weight gradients\n"
    "                min_qf_pi = torch.min(qf1(b_obs, pi), qf2(b_obs, pi))\n"
    "                qf1.requires_grad_(True), qf2.requires_grad_(True)",
)]
SAC_PATCHES["in-process envs without rendering"] = [(
    "    envs = gym.vector.AsyncVectorEnv([make_env(args.env_id, args.seed, i,",
    "    # no frames to render (--reward gt): stepping MuJoCo in-process is far cheaper than a round trip to subprocesses\n"
    "    envs = (gym.vector.AsyncVectorEnv if args.reward == \"clip\" else gym.vector.SyncVectorEnv)([make_env(args.env_id, args.seed, i,",
)]
SAC_PATCHES["all of the above but one thread"] = sum((v for k, v in SAC_PATCHES.items() if k != "one torch thread"), [])
SAC_PATCHES["all of the above"] = SAC_PATCHES["all of the above but one thread"] + SAC_PATCHES["one torch thread"]

DQN_PATCHES = {
    "fused Adam": [("optim.Adam(q_network.parameters(), lr=args.learning_rate)",
                    "optim.Adam(q_network.parameters(), lr=args.learning_rate, fused=True)")],
    "foreach target update (every 500 steps)": [(
        """            if iteration % args.target_network_frequency == 0:
                for target_param, q_param in zip(target_network.parameters(), q_network.parameters()):
                    target_param.data.copy_(args.tau * q_param.data + (1.0 - args.tau) * target_param.data)""",
        """            if iteration % args.target_network_frequency == 0:
                with torch.no_grad():
                    torch._foreach_lerp_(list(target_network.parameters()), list(q_network.parameters()), args.tau)""",
    )],
    "one torch thread": [(
        "    device = torch.device(\"cuda\" if torch.cuda.is_available() and args.cuda else \"cpu\")\n\n    if args.evaluate",
        "    device = torch.device(\"cuda\" if torch.cuda.is_available() and args.cuda else \"cpu\")\n"
        "    if device.type == \"cpu\":\n        torch.set_num_threads(1)  # small MLPs: thread sync costs more than it saves\n\n    if args.evaluate",
    )],
    "greedy action without autograd bookkeeping": [(
        """            with torch.no_grad():
                q_values = q_network(torch.from_numpy(obs).to(device))
            actions = q_values.argmax(dim=1).cpu().numpy()""",
        """            with torch.inference_mode():
                actions = q_network(torch.from_numpy(obs).to(device)).argmax(dim=1).cpu().numpy()""",
    )],
}
DQN_PATCHES["all of the above but one thread"] = sum((v for k, v in DQN_PATCHES.items() if k != "one torch thread"), [])
del DQN_PATCHES["foreach target update (every 500 steps)"]  # kept in "all": alone it is below the noise
DQN_PATCHES["all of the above"] = DQN_PATCHES["all of the above but one thread"] + DQN_PATCHES["one torch thread"]


def make_variant(file: str, patches: list[tuple[str, str]]) -> str | None:
    """A temp folder holding both scripts, `file` patched; None when a patch no longer applies."""
    folder = tempfile.mkdtemp(prefix="bench_variant_")
    for name in (SAC_FILE, DQN_FILE):
        shutil.copy(SCRIPTS / name, folder)
    path = os.path.join(folder, file)
    text = open(path).read()
    for old, new in patches:
        if text.count(old) != 1:
            return None
        text = text.replace(old, new)
    open(path, "w").write(text)
    return folder


def worker(c: dict) -> dict:
    sys.path.insert(0, c["folder"])
    os.chdir(tempfile.mkdtemp(prefix="bench_ab_"))
    if c["which"] == "sac":
        import vlmrm_sac_humanoid as ours

        args = ours.Args(env_id="Hopper-v5", reward="gt", num_envs=4, total_timesteps=c["steps"], learning_starts=c["steps"] // 3,
                         train_frequency=100, gradient_steps=100, batch_size=512, buffer_size=100_000)
        grad_steps = sum(100 for it in range(c["steps"] // 4) if it * 4 >= c["steps"] // 3 and it % 100 == 0)
    else:
        import vlmrm_dqn_classic as ours

        args = ours.Args(env_id="CartPole-v1", reward="gt", total_timesteps=c["steps"], learning_starts=c["steps"] // 6)
        grad_steps = sum(1 for it in range(c["steps"]) if it >= c["steps"] // 6 and it % 10 == 0)
    assert os.path.dirname(ours.__file__) == c["folder"], ours.__file__
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ours.main(args)
    done = [l for l in out.getvalue().splitlines() if l.startswith("done:")][-1]
    learning = float(re.search(r"learning ([\d.]+) s", done).group(1))
    return dict(sps=int(re.search(r"\((\d+) SPS\)", done).group(1)), ms_per_grad_step=learning / grad_steps * 1000)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("which", choices=["sac", "dqn"])
    p.add_argument("--steps", type=int, default=None, help="env steps per run (default: sac 2000, dqn 6000)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads in every run (0: torch's default)")
    a = p.parse_args()
    clock = Clock()
    print(f"machine: {machine()}")
    file, patches = (SAC_FILE, SAC_PATCHES) if a.which == "sac" else (DQN_FILE, DQN_PATCHES)
    steps = a.steps or (2000 if a.which == "sac" else 6000)
    if a.threads == 1:  # the harness already runs everything on one thread: the thread patch changes nothing
        patches = {k: v for k, v in patches.items() if "one torch thread" not in k and k != "all of the above"}
    variants = {"baseline (unpatched)": make_variant(file, [])} | {k: make_variant(file, v) for k, v in patches.items()}
    res = {k: [] for k, f in variants.items() if f}
    for r in range(a.repeats):
        for k in res:
            res[k].append(run_worker(__file__, dict(which=a.which, folder=variants[k], steps=steps, threads=a.threads)))
        print(f"  round {r + 1}/{a.repeats} done (load {load()})", flush=True)
    base_sps = median([x["sps"] for x in res["baseline (unpatched)"]])
    base_ms = median([x["ms_per_grad_step"] for x in res["baseline (unpatched)"]])
    rows, gains = [], []
    for k in variants:
        if k not in res:
            rows.append([k, "n/a (patch no longer applies)", "", "", ""])
            continue
        sps, ms = median([x["sps"] for x in res[k]]), median([x["ms_per_grad_step"] for x in res[k]])
        rows.append([k, f"{sps:.0f}", f"{sps / base_sps:.2f}x", f"{ms:.2f}", f"{base_ms / ms:.2f}x"])
        if k != "baseline (unpatched)":
            gains.append((k, sps / base_sps, base_ms / ms))
    print()
    print(table(["variant", "SPS", "SPS vs baseline", "ms / gradient step", "gradient step speed-up"], rows))
    print(f"\n{a.repeats} rounds, {steps} env steps per run, torch threads {a.threads or 'default'}; load average at the end {load()}; took {clock}")
    best = max(gains, key=lambda g: g[1])
    print(f"summary: {a.which} proposed changes: " + ", ".join(f"{k} {s:.2f}x SPS ({g:.2f}x per gradient step)" for k, s, g in gains)
          + f"; best: {best[0]}")


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    payload = worker_payload()
    if payload is None:
        main()
    else:
        emit(worker(payload))
