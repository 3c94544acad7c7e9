"""rankwatch's own frames are recognised by the installed package's real
location, not by a folder name: a user's code in a folder called "rankwatch"
(a fresh clone of this repository) keeps its source line."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import rankwatch
from rankwatch.agent.watch import collectives
from rankwatch.agent.core.stacks import OWN_DIRS, is_own_file
from rankwatch.collector.analyses import common


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_own_dirs_are_the_installed_package():
    package = str(Path(rankwatch.__file__).resolve().parent) + os.sep
    assert package in OWN_DIRS
    assert is_own_file(collectives.__file__)
    assert is_own_file(common.__file__)
    assert common.is_machinery(collectives.__file__)
    assert common.is_machinery(str(Path(rankwatch.__file__).resolve()))


def test_user_folder_named_rankwatch_is_user_code(tmp_path):
    user = tmp_path / "rankwatch" / "examples" / "train.py"
    assert not is_own_file(str(user))
    assert not common.is_machinery(str(user))
    frames = [
        {"file": "/usr/lib/python3.11/runpy.py", "line": 88, "name": "_run_code", "code": ""},
        {"file": str(user), "line": 94, "name": "main", "code": "loss = model(x).sum()"},
        {"file": str(Path(collectives.__file__)), "line": 120, "name": "collective", "code": ""},
        {"file": "/x/site-packages/torch/distributed/distributed_c10d.py", "line": 10, "name": "all_reduce"},
    ]
    text = common.where(frames)
    assert text.startswith("train.py:94 in main (loss = model(x).sum())"), text


def test_installed_elsewhere_is_still_machinery():
    # Stacks from another host: rankwatch installed in that host's site-packages.
    assert common.is_machinery("/opt/venv/lib/python3.11/site-packages/rankwatch/agent/runtime.py")


def test_collective_call_site_in_a_folder_named_rankwatch(tmp_path):
    folder = tmp_path / "rankwatch"
    folder.mkdir()
    script = folder / "user_train.py"
    script.write_text("def step(tracker):\n    return tracker._enter('all_reduce', None)\n")
    module = _load(script, "user_train_in_rankwatch_folder")
    call = module.step(collectives.CollectiveTracker())
    assert call["callsite"] == f"{script}:2 in step", call
