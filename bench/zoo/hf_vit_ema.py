"""Hugging Face `ViTForImageClassification` (tiny config: patch embedding,
LayerNorm, attention) with an EMA of its weights
(`torch.optim.swa_utils.AveragedModel` with an EMA multi-average), DDP,
AdamW with weight decay off for norms and biases, warmup then cosine. timm's
ViT needs torchvision (PyPI's torch build, see docs/zoo.md)."""

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from transformers import ViTConfig, ViTForImageClassification, get_cosine_schedule_with_warmup

import zoocommon as zc


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=64,
                                                num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                                num_labels=10))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))
    ddp = DDP(model)
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3)
    sched = get_cosine_schedule_with_warmup(opt, 30, a.steps)
    x_all, y_all = zc.images(2048, size=16, seed=a.seed * 10 + rank)
    for step in range(a.steps):
        i = (step * 16) % 2048
        loss = ddp(pixel_values=x_all[i:i + 16], labels=y_all[i:i + 16]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        ema.update_parameters(model)
    zc.done(a.steps)


if __name__ == "__main__":
    main()
