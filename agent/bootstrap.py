"""Worker entry point used by ``rankwatch run``: attach the agent, then run the
user's script or module as ``__main__``, unchanged.

    python -m rankwatch.agent.bootstrap SCRIPT [ARGS...]
    python -m rankwatch.agent.bootstrap -m MODULE [ARGS...]
"""

from __future__ import annotations

import runpy
import sys


def _attach():
    try:
        from .runtime import Agent

        agent = Agent.from_env()
        agent.install()
        return agent
    except Exception as exc:  # a broken agent must not stop the training
        sys.stderr.write(f"[rankwatch] agent not attached: {type(exc).__name__}: {exc}\n")
        return None


def run(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m rankwatch.agent.bootstrap [-m MODULE | SCRIPT] [ARGS...]")
    as_module = argv[0] == "-m"
    if as_module:
        if len(argv) < 2:
            raise SystemExit("bootstrap: -m needs a module name")
        target, args = argv[1], argv[2:]
    else:
        target, args = argv[0], argv[1:]
    agent = _attach()
    exit_code = 0
    try:
        if as_module:
            sys.argv = [target, *args]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *args]
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        exit_code = code if isinstance(code, int) else (0 if code is None else 1)
        raise
    except BaseException as exc:
        exit_code = 1
        if agent is not None:
            agent.on_exception(exc)
        raise
    finally:
        if agent is not None:
            agent.shutdown(exit_code)


def run_script_path(training_script: str, *training_script_args: str) -> None:
    """``torchrun --run-path`` equivalent (a function entrypoint)."""
    run([training_script, *training_script_args])


if __name__ == "__main__":
    # sys.path[0] is this package's folder when run with -m; the user's script
    # expects its own folder there instead (as `python script.py` gives).
    argv = sys.argv[1:]
    if argv and argv[0] == "--":
        argv = argv[1:]
    if argv and argv[0] != "-m":
        import os

        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    else:
        import os

        sys.path[0] = os.getcwd()
    run(argv)
