"""One SAC gradient step, three ways: as our script writes it, with the twin critics batched, and torch.compile'd.

    python benchmarks/sac_step_variants.py                          # Hopper-v5 and Humanoid-v5 shapes
    python benchmarks/sac_step_variants.py --no-compile --repeats 6 # skip compilation (about 35 s per shape here)

A stand-alone replica of the update in `vlmrm_sac_humanoid.py` (critic loss on the min of two target critics,
actor loss with the critics' weights frozen, fused Adam, Polyak target update), on random data of the real shapes:
batch 512, 256-256 networks, observation/action sizes of Hopper-v5 (11/3) and Humanoid-v5 (348/17). No env, no
replay buffer: only the gradient step, the part that dominates our SAC on CPU, and it runs on the CPU. The variants:

- **script**: two `SoftQNetwork`s, `torch.cat([obs, action])` into `nn.Linear` layers, as in the script.
- **batched critics**: both critics in one module whose weights have a leading dimension of 2; each layer is one
  `torch.baddbmm` for both critics (the "ensemble" formulation of REDQ/SAC-N). Same maths, half the ops.
- **torch.compile**: the script's networks, with the critic update, the actor update and both optimiser steps
  compiled (`torch.compile`, default mode).

Rounds alternate the variants; the table gives the median ms per gradient step and the ratio to "script".
"""

import argparse
import math
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Clock, load, machine, table  # noqa: E402

BATCH, HIDDEN, GAMMA, TAU, ENT_COEF, LR = 512, 256, 0.99, 0.005, 0.2, 3e-4
LOG_STD_MIN, LOG_STD_MAX = -5, 2


class SoftQNetwork(nn.Module):  # as in the script
    def __init__(self, obs_dim: int, action_dim: int):
        super().__init__()
        self.network = nn.Sequential(nn.Linear(obs_dim + action_dim, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                                     nn.Linear(HIDDEN, 1))

    def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return self.network(torch.cat([x, a], 1))


class BatchedSoftQNetworks(nn.Module):
    """n critics in one module: weights (n, in, out), one batched product per layer; forward returns (n, batch)."""

    def __init__(self, obs_dim: int, action_dim: int, n: int = 2):
        super().__init__()
        self.n = n
        sizes = [obs_dim + action_dim, HIDDEN, HIDDEN, 1]
        self.weights, self.biases = nn.ParameterList(), nn.ParameterList()
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            bound = 1 / math.sqrt(fan_in)  # nn.Linear's default initialisation
            self.weights.append(nn.Parameter(torch.empty(n, fan_in, fan_out).uniform_(-bound, bound)))
            self.biases.append(nn.Parameter(torch.empty(n, 1, fan_out).uniform_(-bound, bound)))

    def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        h = torch.cat([x, a], 1).expand(self.n, -1, -1)
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            h = torch.baddbmm(b, h, w)
            if i < len(self.weights) - 1:
                h = torch.relu(h)
        return h.squeeze(-1)


class Actor(nn.Module):  # as in the script, action scale 1
    def __init__(self, obs_dim: int, action_dim: int):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(obs_dim, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU())
        self.fc_mean, self.fc_logstd = nn.Linear(HIDDEN, action_dim), nn.Linear(HIDDEN, action_dim)

    def get_action(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (torch.tanh(self.fc_logstd(h)) + 1)
        normal = torch.distributions.Normal(self.fc_mean(h), log_std.exp(), validate_args=False)
        x_t = normal.rsample()
        y_t = torch.tanh(x_t)
        log_prob = normal.log_prob(x_t) - torch.log(1 - y_t.pow(2) + 1e-6)
        return y_t, log_prob.sum(1, keepdim=True)


def batch(obs_dim: int, action_dim: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(BATCH, obs_dim), torch.rand(BATCH, action_dim) * 2 - 1, torch.randn(BATCH), torch.randn(BATCH, obs_dim),
            torch.zeros(BATCH))


def script_step(obs_dim: int, action_dim: int, compiled: bool = False):
    """The script's gradient step; with compiled, its two updates and optimiser steps go through torch.compile."""
    actor = Actor(obs_dim, action_dim)
    qf1, qf2, qf1_target, qf2_target = (SoftQNetwork(obs_dim, action_dim) for _ in range(4))
    qf1_target.load_state_dict(qf1.state_dict())
    qf2_target.load_state_dict(qf2.state_dict())
    # fused Adam is not traceable by torch.compile; the compiled variant gets the default (foreach) Adam, compiled
    q_optimizer = torch.optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=LR, fused=not compiled)
    actor_optimizer = torch.optim.Adam(actor.parameters(), lr=LR, fused=not compiled)
    b_obs, b_actions, b_rewards, b_next_obs, b_terminations = batch(obs_dim, action_dim)

    def critic_update() -> None:
        with torch.no_grad():
            next_actions, next_log_pi = actor.get_action(b_next_obs)
            min_qf_next_target = torch.min(qf1_target(b_next_obs, next_actions), qf2_target(b_next_obs, next_actions)) - ENT_COEF * next_log_pi
            next_q_value = b_rewards + (1 - b_terminations) * GAMMA * min_qf_next_target.view(-1)
        qf_loss = F.mse_loss(qf1(b_obs, b_actions).view(-1), next_q_value) + F.mse_loss(qf2(b_obs, b_actions).view(-1), next_q_value)
        q_optimizer.zero_grad()
        qf_loss.backward()

    def actor_update() -> None:
        qf1.requires_grad_(False)
        qf2.requires_grad_(False)
        pi, log_pi = actor.get_action(b_obs)
        min_qf_pi = torch.min(qf1(b_obs, pi), qf2(b_obs, pi))
        qf1.requires_grad_(True)
        qf2.requires_grad_(True)
        actor_loss = (ENT_COEF * log_pi - min_qf_pi).mean()
        actor_optimizer.zero_grad()
        actor_loss.backward()

    q_step, actor_step = q_optimizer.step, actor_optimizer.step
    if compiled:
        critic_update, actor_update = torch.compile(critic_update), torch.compile(actor_update)
        q_step, actor_step = torch.compile(q_step), torch.compile(actor_step)

    def step() -> None:
        critic_update()
        q_step()
        actor_update()
        actor_step()
        with torch.no_grad():
            for param, target_param in zip(qf1.parameters(), qf1_target.parameters()):
                target_param.lerp_(param, TAU)
            for param, target_param in zip(qf2.parameters(), qf2_target.parameters()):
                target_param.lerp_(param, TAU)

    return step


def batched_step(obs_dim: int, action_dim: int):
    """The same update with both critics (and both targets) as one BatchedSoftQNetworks each."""
    actor = Actor(obs_dim, action_dim)
    qf, qf_target = BatchedSoftQNetworks(obs_dim, action_dim), BatchedSoftQNetworks(obs_dim, action_dim)
    qf_target.load_state_dict(qf.state_dict())
    q_optimizer = torch.optim.Adam(qf.parameters(), lr=LR, fused=True)
    actor_optimizer = torch.optim.Adam(actor.parameters(), lr=LR, fused=True)
    online, target = list(qf.parameters()), list(qf_target.parameters())
    b_obs, b_actions, b_rewards, b_next_obs, b_terminations = batch(obs_dim, action_dim)

    def step() -> None:
        with torch.no_grad():
            next_actions, next_log_pi = actor.get_action(b_next_obs)
            min_qf_next_target = qf_target(b_next_obs, next_actions).min(0).values - ENT_COEF * next_log_pi.view(-1)
            next_q_value = b_rewards + (1 - b_terminations) * GAMMA * min_qf_next_target
        qf_loss = ((qf(b_obs, b_actions) - next_q_value) ** 2).mean(1).sum()  # = the sum of the two critics' MSE
        q_optimizer.zero_grad()
        qf_loss.backward()
        q_optimizer.step()
        qf.requires_grad_(False)
        pi, log_pi = actor.get_action(b_obs)
        min_qf_pi = qf(b_obs, pi).min(0).values
        qf.requires_grad_(True)
        actor_loss = (ENT_COEF * log_pi.view(-1) - min_qf_pi).mean()
        actor_optimizer.zero_grad()
        actor_loss.backward()
        actor_optimizer.step()
        with torch.no_grad():
            for param, target_param in zip(online, target):
                target_param.lerp_(param, TAU)

    return step


def ms_per_step(step, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=4, help="rounds (each variant once per round)")
    p.add_argument("--steps", type=int, default=60, help="gradient steps per measurement")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    clock = Clock()
    print(f"machine: {machine()}")
    shapes = {"Hopper-v5": (11, 3), "Humanoid-v5": (348, 17)}
    rows, gains = [], []
    for task, (obs_dim, action_dim) in shapes.items():
        variants = {"script": script_step(obs_dim, action_dim), "batched critics": batched_step(obs_dim, action_dim)}
        if not a.no_compile:
            variants["torch.compile"] = script_step(obs_dim, action_dim, compiled=True)
        warmup = {}
        for name, step in variants.items():  # first calls: allocation, and compilation for torch.compile
            t0 = time.perf_counter()
            for _ in range(5):
                step()
            warmup[name] = time.perf_counter() - t0
        res = {name: [] for name in variants}
        for r in range(a.repeats):
            for name, step in variants.items():
                res[name].append(ms_per_step(step, a.steps))
            print(f"  {task} round {r + 1}/{a.repeats} (load {load()})", flush=True)
        base = statistics.median(res["script"])
        for name in variants:
            ms = statistics.median(res[name])
            rows.append([task, name, f"{ms:.2f}", f"{base / ms:.2f}x", f"{min(res[name]):.2f} / {max(res[name]):.2f}", f"{warmup[name]:.1f}"])
            if name != "script":
                gains.append(f"{name} {base / ms:.2f}x on {task}")
    print()
    print(table(["shapes", "variant", "ms / gradient step (median)", "speed-up vs script", "min / max ms", "first 5 steps, s"], rows))
    print(f"\nbatch {BATCH}, {a.repeats} rounds of {a.steps} gradient steps, torch threads {a.threads or 'default'}; "
          f"load average at the end {load()}; took {clock}")
    print("summary: one SAC gradient step vs the script's form: " + ", ".join(gains))


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    main()
