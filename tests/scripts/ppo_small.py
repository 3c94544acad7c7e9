"""A small PPO (actor-critic, clipped surrogate) in plain PyTorch DDP: rollouts
of a toy environment, then several epochs of minibatch updates per rollout,
the value loss on discounted returns. No rankwatch import.

--bad-rank R --bad-step S: a user's bug on one rank, its value targets
(returns) scaled 10^4 x for the update at optimizer step S (a reward scale
applied twice, an unnormalised observation...).

    rankwatch run --nproc-per-node 4 tests/scripts/ppo_small.py --bad-rank 1 --bad-step 50
"""

import argparse
import gc

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class ActorCritic(nn.Module):
    def __init__(self, obs=4, actions=2, hidden=64):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.policy = nn.Linear(hidden, actions)
        self.value = nn.Linear(hidden, 1)

    def forward(self, x):
        h = self.body(x)
        return self.policy(h), self.value(h).squeeze(-1)


def rollout(model, g, envs=16, horizon=16, gamma=0.99):
    """A toy environment: reward 1 when the action matches the sign of the
    first observation, the state drifting at random."""
    obs, acts, logps, rews = [], [], [], []
    state = torch.randn(envs, 4, generator=g)
    with torch.no_grad():
        for _ in range(horizon):
            logits, _ = model(state)
            dist_ = torch.distributions.Categorical(logits=logits)
            action = dist_.sample()
            reward = (action == (state[:, 0] > 0).long()).float()
            obs.append(state), acts.append(action), logps.append(dist_.log_prob(action)), rews.append(reward)
            state = state + 0.3 * torch.randn(envs, 4, generator=g)
    returns, running = [], torch.zeros(envs)
    for r in reversed(rews):
        running = r + gamma * running
        returns.append(running)
    returns.reverse()
    return (torch.cat(obs), torch.cat(acts), torch.cat(logps), torch.cat(returns))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--updates", type=int, default=12)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--bad-rank", type=int, default=-1)
    p.add_argument("--bad-step", type=int, default=-1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(a.seed)
    model = DDP(ActorCritic())
    opt = torch.optim.Adam(model.parameters(), lr=3e-4, eps=1e-5)
    g = torch.Generator().manual_seed(10 + rank)
    step = 0
    for update in range(a.updates):
        obs, acts, old_logp, returns = rollout(model.module, g)
        n = obs.shape[0]
        for _epoch in range(a.epochs):
            perm = torch.randperm(n, generator=g)
            for mb in perm.chunk(a.minibatches):
                targets = returns[mb]
                if rank == a.bad_rank and step == a.bad_step:
                    targets = targets * 1e4
                logits, value = model(obs[mb])
                d = torch.distributions.Categorical(logits=logits)
                logp = d.log_prob(acts[mb])
                advantage = (targets - value.detach())
                advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
                ratio = (logp - old_logp[mb]).exp()
                policy_loss = -torch.min(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage).mean()
                value_loss = 0.5 * (value - targets).pow(2).mean()
                loss = policy_loss + 0.5 * value_loss - 0.01 * d.entropy().mean()
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                step += 1
        if rank == 0:
            print(f"update {update} step {step} return {returns.mean():.3f}", flush=True)
    print(f"done: {step} steps", flush=True)
    dist.barrier()
    del model  # nothing may hold DDP at destroy_process_group (conftest.TORCH_TEARDOWN_ABORT)
    gc.collect()  # DDP is freed only by a cyclic collection
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
