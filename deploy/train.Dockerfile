# syntax=docker/dockerfile:1
# An example training image: a PyTorch CUDA base with rankwatch added, its torch untouched.
# Build from the repository root (replace the base with your own image, same steps):
#   docker build -f deploy/train.Dockerfile -t registry.example.com/ml/train:2.7.1-cuda12.8 .
ARG BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1
COPY pyproject.toml README.md /tmp/rankwatch-src/
COPY rankwatch /tmp/rankwatch-src/rankwatch
COPY agent /tmp/rankwatch-src/agent
COPY collector /tmp/rankwatch-src/collector
# The constraint pins the base image's torch, so pip can never replace it (a CUDA build) with
# another one; the "stacks" extra adds py-spy for native stacks of a frozen rank. From a package
# index: pip install -c /tmp/torch.txt "rankwatch[stacks]==0.1.0".
RUN python -c "from importlib.metadata import version; print('torch==' + version('torch'))" > /tmp/torch.txt \
    && pip install --no-cache-dir -c /tmp/torch.txt "/tmp/rankwatch-src[stacks]" \
    && python -c "import torch, rankwatch.agent; print(torch.__version__, torch.version.cuda)" \
    && rm -rf /tmp/rankwatch-src /tmp/torch.txt \
    && useradd --uid 10002 --create-home --shell /bin/bash trainer
WORKDIR /workspace
# The chart's default job.script.
COPY --chown=10002:10002 examples/train.py /workspace/train.py
USER 10002:10002
CMD ["rankwatch", "run", "/workspace/train.py"]
