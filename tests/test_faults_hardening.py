"""Hardening against real jobs (heavy: real gloo DDP jobs under `rankwatch run`).

- A secret in an exception message (a Hugging Face token by its shape, the
  value of AWS_SECRET_ACCESS_KEY by value) is in no file of the run dir
  (inside the bundles and the SQLite index too) and in none of rankwatch's
  console lines. The user's own traceback on stderr is the user's output and
  is left as it is.
- `rankwatch analyze` of a run dir changes none of its files (the index
  included) and a corrupt index is a clear message, not a traceback.
- report.json (and `analyze --json`) parse with a strict JSON parser.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import secrets
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from conftest import ddp_script, run_job, worker_env


def _strict(text: str):
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")
    return json.loads(text, parse_constant=refuse)


def _all_bytes(path: Path) -> list[tuple[str, bytes]]:
    """A file's bytes, and for archives every member's (gzip inside tar inside gzip too)."""
    data = path.read_bytes()
    out = [(str(path), data)]
    if path.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            for info in tar:
                member = tar.extractfile(info)
                blob = member.read() if member else b""
                out.append((f"{path}:{info.name}", blob))
                if info.name.endswith(".gz"):
                    out.append((f"{path}:{info.name}:gunzip", gzip.decompress(blob)))
    elif path.name.endswith(".gz"):
        out.append((f"{path}:gunzip", gzip.decompress(data)))
    return out


def _rankwatch_lines(output: str) -> list[str]:
    """rankwatch's own console lines: `[rankwatch] ...` and the summary block."""
    lines, in_summary = [], False
    for line in output.splitlines():
        if line.startswith("[rankwatch]") or line.startswith("rankwatch: run"):
            lines.append(line)
            in_summary = line.startswith("rankwatch: run")
        elif in_summary and line.startswith("  "):
            lines.append(line)
        else:
            in_summary = False
    return lines


def test_secret_in_an_exception_is_in_no_file_and_no_rankwatch_line(tmp_path):
    aws_secret = secrets.token_urlsafe(30)
    hf_tail = secrets.token_hex(17)
    script = ddp_script(tmp_path, "leaky.py", f"""
        import os
        model = DDP(torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(6):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            if step == 3 and dist.get_rank() == 1:
                token = "hf_" + "{hf_tail}"
                raise PermissionError("hub refused " + token + " and the key " + os.environ["AWS_SECRET_ACCESS_KEY"])
        """)
    job = run_job(tmp_path, ["--nproc-per-node", "2", str(script)], env={"AWS_SECRET_ACCESS_KEY": aws_secret})
    assert job.exit_code != 0
    crash = job.only("crash")
    assert crash["ranks"] == [1] and "PermissionError" in crash["summary"]
    assert "<redacted>" in json.dumps(crash)  # the message is kept, the secrets are not
    needles = [aws_secret.encode(), ("hf_" + hf_tail).encode(), hf_tail.encode()]
    files = [p for p in job.run_dir.rglob("*") if p.is_file()]
    assert any(p.name == "collector.sqlite" for p in files)
    assert any(p.name.endswith(".tar.gz") for p in files), "the crash bundle is part of the check"
    for path in files:
        for where, blob in _all_bytes(path):
            for needle in needles:
                assert needle not in blob, f"secret found in {where}"
    ours = "\n".join(_rankwatch_lines(job.output))
    assert "crash" in ours
    for needle in needles:
        assert needle.decode() not in ours, f"secret printed by rankwatch:\n{ours}"
    _strict((job.run_dir / "report.json").read_text())


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _analyze(path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rankwatch.cli", "analyze", str(path), *extra],
                          capture_output=True, text=True, timeout=120, env=worker_env())


def test_analyze_is_read_only_strict_and_survives_a_corrupt_index(tmp_path, train_script):
    job = run_job(tmp_path, ["--nproc-per-node", "2", str(train_script), "--steps", "14",
                             "--fault", "nan", "--fault-rank", "1", "--fault-step", "5"])
    nonfinite = job.only("nonfinite")
    assert nonfinite["ranks"] == [1]
    report_text = (job.run_dir / "report.json").read_text()
    _strict(report_text)
    # _strict refuses bare NaN/Infinity tokens: non-finite numbers are written as strings.
    assert '"NaN"' in report_text  # the origin rank's non-finite loss, kept as a string

    before = _digest(job.run_dir)
    assert "collector.sqlite" in before
    proc = _analyze(job.run_dir, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    offline = _strict(proc.stdout)
    assert [v["kind"] for v in offline["verdicts"]] == [v["kind"] for v in job.verdicts()]
    assert _digest(job.run_dir) == before, "analyze changed the run dir"

    broken = tmp_path / "broken"
    shutil.copytree(job.run_dir, broken)
    for extra in broken.glob("collector.sqlite-*"):
        extra.unlink()
    index = broken / "collector.sqlite"
    index.write_bytes(index.read_bytes()[:100] + b"\xff" * 4096)
    proc = _analyze(broken)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "not a readable rankwatch index" in proc.stderr
    assert proc.returncode in (0, 2)
    for bundle in list(broken.rglob("*.tar.gz")):
        bundle.unlink()
    proc = _analyze(broken)
    assert proc.returncode == 2 and "not a readable rankwatch index" in proc.stderr
    assert "Traceback" not in proc.stderr
