"""A diffusers `UNet2DModel` (tiny config) trained as a denoiser with the
library's `DDPMScheduler` (noise added at random timesteps) and its
`EMAModel` (an exponential moving average of the weights), DDP, AdamW with
cosine schedule and warmup from lr 0."""

import torch
from diffusers import DDPMScheduler, UNet2DModel
from diffusers.optimization import get_cosine_schedule_with_warmup
from diffusers.training_utils import EMAModel
from torch.nn.parallel import DistributedDataParallel as DDP

import zoocommon as zc


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = UNet2DModel(sample_size=16, in_channels=1, out_channels=1, layers_per_block=1,
                        block_out_channels=(16, 32), down_block_types=("DownBlock2D", "DownBlock2D"),
                        up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=8)
    ema = EMAModel(model.parameters(), decay=0.999)
    ddp = DDP(model)
    noise_scheduler = DDPMScheduler(num_train_timesteps=100)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=20, num_training_steps=a.steps)
    clean, _ = zc.images(1024, channels=1, size=16, seed=a.seed * 10 + rank)
    for step in range(a.steps):
        x = clean[(step * 8) % 1024:(step * 8) % 1024 + 8]
        noise = torch.randn_like(x)
        t = torch.randint(0, 100, (len(x),))
        pred = ddp(noise_scheduler.add_noise(x, noise, t), t).sample
        torch.nn.functional.mse_loss(pred, noise).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        ema.step(model.parameters())
    zc.done(a.steps)


if __name__ == "__main__":
    main()
