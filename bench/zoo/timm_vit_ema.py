"""timm's VisionTransformer (`vit_tiny_patch16_224` narrowed and shortened:
LayerNorm, stochastic depth) trained as timm's own train.py does: Mixup and
CutMix with soft-target cross-entropy, `create_optimizer_v2` (AdamW, weight
decay off for norms, biases and position embeddings), `CosineLRScheduler`
with warmup stepped per update, gradient clipping by timm's
`dispatch_clip_grad`, and `ModelEmaV3` (an EMA of the weights). DDP. Runs
on PyPI's torch build (the zoo's vision venv, docs/zoo.md)."""

import timm
import torch
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from timm.utils import ModelEmaV3, dispatch_clip_grad
from torch.nn.parallel import DistributedDataParallel as DDP

import zoocommon as zc


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4, embed_dim=96,
                              depth=4, num_heads=3, num_classes=10, drop_path_rate=0.1)
    ema = ModelEmaV3(model, decay=0.998)
    ddp = DDP(model)
    opt = create_optimizer_v2(model, opt="adamw", lr=1e-3, weight_decay=0.05)
    sched = CosineLRScheduler(opt, t_initial=a.steps, warmup_t=min(30, a.steps // 4), warmup_lr_init=1e-6, t_in_epochs=False)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=10)
    loss_fn = SoftTargetCrossEntropy()
    x_all, y_all = zc.images(1024, size=32, seed=a.seed * 10 + rank)
    for step in range(a.steps):
        i = (step * 16) % 1024
        x, y = mixup(x_all[i:i + 16], y_all[i:i + 16])
        loss = loss_fn(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        dispatch_clip_grad(model.parameters(), value=1.0, mode="norm")
        opt.step()
        sched.step_update(num_updates=step + 1)
        ema.update(model, step=step)
    zc.done(a.steps)


if __name__ == "__main__":
    main()
