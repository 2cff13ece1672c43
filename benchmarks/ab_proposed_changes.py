"""A/B test of proposed speed-ups: patched private copies of our scripts against the unpatched ones.

    python benchmarks/ab_proposed_changes.py sac          # SAC update, Hopper-v5, ground-truth reward
    python benchmarks/ab_proposed_changes.py sac --env-id Humanoid-v5
    python benchmarks/ab_proposed_changes.py dqn          # DQN loop, CartPole-v1, ground-truth reward
    python benchmarks/ab_proposed_changes.py sac --repeats 5 --steps 4000

Each variant is a copy of the script (from the repository, or VLMRM_BENCH_SCRIPTS) in a temporary folder with
a few exact text replacements; a variant whose text no longer matches is reported as "n/a" (the script has
changed since: re-derive the patch). Variants run in fresh processes, in rounds (baseline, A, B, ... then
again), and the table reports median SPS and median learning time per gradient step, relative to baseline.
The scripts themselves are never modified.
"""

import argparse
import os
import shutil
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SCRIPTS, Clock, emit, load, machine, median, run_main, run_worker, table, worker_payload  # noqa: E402

SAC_FILE, DQN_FILE = "vlmrm_sac_humanoid.py", "vlmrm_dqn_classic.py"

# (old text, new text) pairs; each must occur exactly once in the script.
# Round 1 (Normal(validate_args=False), fused Adam, no critic weight gradients in the actor step, in-process envs
# for --reward gt, one torch thread in the benchmarks) is adopted: results in results/ab_*_t1.txt, patches in git
# history. Round 2, below, holds what was tried next and is NOT adopted, plus the one round-2 change that was
# adopted, undone (results in results/ab_*_round2.txt).
SAC_PATCHES = {
    # the actor loss needs dQ/da only; with cat([s, a]) autograd computes the gradient for every input column
    "split first critic layer (dQ/da only)": [(
        """    def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return self.network(torch.cat([x, a], 1))""",
        """    def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        w, obs_dim = self.network[0].weight, x.shape[1]
        h = F.linear(x, w[:, :obs_dim], self.network[0].bias) + F.linear(a, w[:, obs_dim:])
        return self.network[1:](h)""",
    )],
    "foreach target update": [(
        """                        for param, target_param in zip(qf1.parameters(), qf1_target.parameters()):
                            target_param.lerp_(param, args.tau)
                        for param, target_param in zip(qf2.parameters(), qf2_target.parameters()):
                            target_param.lerp_(param, args.tau)""",
        """                        torch._foreach_lerp_(target_params, online_params, args.tau)""",
    ), (
        "    rb = ReplayBuffer(args.buffer_size, envs.single_observation_space.shape, envs.single_action_space.shape, device)",
        "    rb = ReplayBuffer(args.buffer_size, envs.single_observation_space.shape, envs.single_action_space.shape, device)\n"
        "    online_params = list(qf1.parameters()) + list(qf2.parameters())\n"
        "    target_params = list(qf1_target.parameters()) + list(qf2_target.parameters())",
    )],
}
SAC_PATCHES["both"] = SAC_PATCHES["split first critic layer (dQ/da only)"] + SAC_PATCHES["foreach target update"]

DQN_PATCHES = {
    "greedy action under inference_mode": [(
        """                with torch.no_grad():
                    q_values = q_network(torch.from_numpy(obs).to(device))
                actions = q_values.argmax(dim=1).cpu().numpy()""",
        """                with torch.inference_mode():
                    actions = q_network(torch.from_numpy(obs).to(device)).argmax(dim=1).cpu().numpy()""",
    )],
    "foreach target update (every 500 steps)": [(
        """                    for target_param, q_param in zip(target_network.parameters(), q_network.parameters()):
                        target_param.data.copy_(args.tau * q_param.data + (1.0 - args.tau) * target_param.data)""",
        """                    with torch.no_grad():
                        torch._foreach_lerp_(list(target_network.parameters()), list(q_network.parameters()), args.tau)""",
    )],
}
DQN_PATCHES["both"] = DQN_PATCHES["greedy action under inference_mode"] + DQN_PATCHES["foreach target update (every 500 steps)"]
# adopted in round 2, measured backwards: the previous code wrote every --reward gt step to the buffer at once
DQN_PATCHES["undo: --reward gt transitions one step at a time"] = [(
    "if train_now or num_pending >= args.reward_batch_size or iteration == num_iterations - 1:",
    'if train_now or num_pending >= args.reward_batch_size or args.reward == "gt" or iteration == num_iterations - 1:',
)]


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

        args = ours.Args(env_id=c["env_id"], reward="gt", num_envs=4, total_timesteps=c["steps"], learning_starts=c["steps"] // 3,
                         train_frequency=100, gradient_steps=100, batch_size=512, buffer_size=100_000)
        grad_steps = sum(100 for it in range(c["steps"] // 4) if it * 4 >= c["steps"] // 3 and it % 100 == 0)
    else:
        import vlmrm_dqn_classic as ours

        args = ours.Args(env_id="CartPole-v1", reward="gt", total_timesteps=c["steps"], learning_starts=c["steps"] // 6)
        grad_steps = sum(1 for it in range(c["steps"]) if it >= c["steps"] // 6 and it % 10 == 0)
    assert os.path.dirname(ours.__file__) == c["folder"], ours.__file__
    done = run_main(ours, args)
    return dict(sps=done["sps"], ms_per_grad_step=done["learning"] / grad_steps * 1000)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("which", choices=["sac", "dqn"])
    p.add_argument("--steps", type=int, default=None, help="env steps per run (default: sac 2000, dqn 6000)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads in every run (0: torch's default)")
    p.add_argument("--env-id", default="Hopper-v5", help="SAC only: the MuJoCo task")
    a = p.parse_args()
    clock = Clock()
    print(f"machine: {machine()}")
    file, patches = (SAC_FILE, SAC_PATCHES) if a.which == "sac" else (DQN_FILE, DQN_PATCHES)
    steps = a.steps or (2000 if a.which == "sac" else 6000)
    variants = {"baseline (unpatched)": make_variant(file, [])} | {k: make_variant(file, v) for k, v in patches.items()}
    res = {k: [] for k, f in variants.items() if f}
    for r in range(a.repeats):
        for k in res:
            res[k].append(run_worker(__file__, dict(which=a.which, folder=variants[k], steps=steps, threads=a.threads, env_id=a.env_id)))
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
    print(f"\n{a.repeats} rounds, {steps} env steps per run{', ' + a.env_id if a.which == 'sac' else ''}, torch threads {a.threads or 'default'}; load average at the end {load()}; took {clock}")
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
