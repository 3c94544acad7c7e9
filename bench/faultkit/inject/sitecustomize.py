"""faultbench's door into every Python process of a benchmark job.

The benchmark puts this folder first on PYTHONPATH; Python's `site` module
imports `sitecustomize` at start-up in every interpreter that inherits the
environment: torchrun and its workers, `rankwatch run` and its workers, Ray's
driver and worker processes. Nothing happens unless FAULTBENCH_KIND is set,
and even then only torch imports are watched (faultbench_injector), so
processes that never import torch are untouched.

A sitecustomize that was already on the path (a distribution's own) is still
run: this one imports it after its own setup.
"""

import os
import sys


def _chain_next_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if os.environ.get("FAULTBENCH_KIND"):
    try:
        import faultbench_injector

        faultbench_injector.install()
    except Exception as exc:  # never stop an interpreter from starting
        sys.stderr.write(f"[faultbench] injector not installed: {exc!r}\n")

_chain_next_sitecustomize()
