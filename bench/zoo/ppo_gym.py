"""PPO on gymnasium's CartPole: rollouts without gradients (`torch.no_grad`,
the policy in eval mode), then bursts of minibatch updates over the rollout
(clipped objective, value loss, entropy bonus, gradient clipping); DDP,
Adam. Steps are optimizer steps."""

import gymnasium as gym
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zoocommon as zc

ROLLOUT, EPOCHS, MINIBATCH = 256, 4, 64


class ActorCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.pi = nn.Linear(64, 2)
        self.v = nn.Linear(64, 1)

    def forward(self, obs):
        h = self.body(obs)
        return self.pi(h), self.v(h).squeeze(-1)


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = ActorCritic()
    ddp = DDP(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-4, eps=1e-5)
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=a.seed * 100 + rank)
    steps = 0
    while steps < a.steps:
        model.eval()
        buf = {"obs": [], "act": [], "logp": [], "rew": [], "done": [], "val": []}
        with torch.no_grad():
            for _ in range(ROLLOUT):
                o = torch.as_tensor(obs, dtype=torch.float32)
                logits, value = model(o)
                dist_ = torch.distributions.Categorical(logits=logits)
                act = dist_.sample()
                obs, rew, term, trunc, _ = env.step(int(act))
                for k, v in (("obs", o), ("act", act), ("logp", dist_.log_prob(act)), ("rew", rew),
                             ("done", term or trunc), ("val", value)):
                    buf[k].append(v)
                if term or trunc:
                    obs, _ = env.reset()
        rew = torch.tensor(buf["rew"], dtype=torch.float32)
        done = torch.tensor(buf["done"], dtype=torch.float32)
        val = torch.stack(buf["val"])
        ret, running = torch.zeros_like(rew), 0.0
        for t in reversed(range(ROLLOUT)):
            running = rew[t] + 0.99 * running * (1 - done[t])
            ret[t] = running
        adv = ret - val
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        o, act, old = torch.stack(buf["obs"]), torch.stack(buf["act"]), torch.stack(buf["logp"])
        model.train()
        for _ in range(EPOCHS):
            for idx in torch.randperm(ROLLOUT).split(MINIBATCH):
                if steps >= a.steps:
                    break
                logits, value = ddp(o[idx])
                d = torch.distributions.Categorical(logits=logits)
                ratio = (d.log_prob(act[idx]) - old[idx]).exp()
                pg = -torch.min(ratio * adv[idx], ratio.clamp(0.8, 1.2) * adv[idx]).mean()
                loss = pg + 0.5 * (value - ret[idx]).pow(2).mean() - 0.01 * d.entropy().mean()
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                steps += 1
    zc.done(steps)


if __name__ == "__main__":
    main()
