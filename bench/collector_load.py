"""Load on a real standalone collector: how many ranks one process watches.

    python bench/collector_load.py --ranks 1000,10000,100000
    python bench/collector_load.py --ranks 64 --mode direct      # every rank posts its own heartbeat

Per N, a fresh `rankwatch collector serve` is started as a subprocess and fed
real wire-format messages over HTTP by simulated nodes (8 ranks each):

- relay mode (default): what `rankwatch run --collector URL` sends, one
  NodeReport per node per interval (the collector's NodeReply.interval: 1 s up
  to 2,000 ranks, 2 s to 10,000, 5 s to 50,000, 10 s beyond), each carrying the
  node's view and its 8 ranks' heartbeats with their new step records (compact
  rows; every NodeReply.step_stride-th step, as the relays forward them once
  the job makes more than 20,000 records a second), collective counters and
  host memory;
- direct mode: one Heartbeat per rank per second (agents without a relay).

Every rank takes one optimizer step per --step-time seconds, in lock-step (a
DDP job). Before measuring, each rank sends a long history of step records
(--history, bounded to 2M records per run). Then --measure seconds of steady
load, then one rank freezes: the others enter the next collective and wait
(their sequence number moves one ahead), nobody progresses, every node keeps
reporting. The bench polls /v1/status until a hang verdict names the frozen
rank.

Printed per N: offered and accepted request rates (and heartbeats per second),
p50/p99 request latency seen by the clients, errors, the collector's CPU (from
/proc, share of one core over the measured window) and RSS (current and peak),
the collector's tick time, and the time from the last progress to the hang
verdict (deadline: hang timeout + 5 s).

Messages (--messages): `recorded` (default) replays the node reports a real
8-rank job's relay sent (bench/data/node_reports.json.gz, made by
bench/record_node_reports.py: every check on, GPU-flavour step values through
the device double), with rank and step rewritten; each node's report merges
its ranks' recorded beats since its last report and samples them with the
relay's own code (`merge_beats`, `StepSampler`). `synthetic` is the older
hand-built message (compact rows, counters, memory only).

Start (--start): `cold` (default) starts every node within one second, each
at the relay's real initial cadence for the world size and with its first
report at a random offset within it, backing off as a relay does (jittered,
Retry-After as a floor) on a failure, a 503 or a 5-s timeout; the time until
the collector has seen every rank is printed. The measured window starts
--settle seconds after that (default two cadences; --settle 90 at 100,000
ranks measures past the relays' longest backoff and the start-up seal). `spread` is the older warm-up
(histories at ~1,000 nodes a second, then fixed slots).

The load generator is one asyncio process on kept-alive connections with
pre-encoded bodies (identities encoded once per rank; the per-tick part once
per tick, shared by every node, as every rank of a DDP job is at the same
step). Its own CPU is printed too: on a 2-core machine it shares the machine
with the collector, and what it can offer is said in the output. Its
garbage collection is kept out of the figures (`generator_gc`: its full
collections paused every relay at once), and its event loop's worst lag
over the measured window is printed: a request in flight during such a lag
is measured that much slower, whatever the collector did.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import gzip
import json
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from rankwatch import wire

FIXTURE = Path(__file__).resolve().parent / "data" / "node_reports.json.gz"
RELAY_TIMEOUT = 5.0  # a relay's request timeout (Relay.flush)
GENERATOR_BOUND_CPU = 0.85  # of the generator's one core: above it, the row measures the generator
TOKEN = "bench-token"
RUN_ID = "bench"
RANKS_PER_NODE = 8
COLUMNS = json.dumps(list(wire.STEP_COLUMNS), separators=(",", ":"))
_FP_COLUMN = wire.STEP_COLUMNS.index("batch_fp")
_FP_SENTINEL = 9_007_199_254_000_000  # below 2**53, far from any recorded value
_SENT_AT = 99_999_999_999.0  # a beat's sent_at in the cached tails, set when it is sent
_SENT_SENTINEL = b'"sent_at":%s' % json.dumps(_SENT_AT).encode()
_SEQ = 987_654_321_987  # a beat's sequence number in the cached tails, set when it is sent
_SEQ_SENTINEL = b'"seq":%d' % _SEQ


# ---------------------------------------------------------------------------------------
# The collector under test
# ---------------------------------------------------------------------------------------


class CollectorProcess:
    def __init__(self, data_dir: Path, hang_timeout: float, server: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "rankwatch.cli", "collector", "serve", "--port", str(self.port),
               "--data-dir", str(data_dir), "--token", TOKEN, "--hang-timeout", str(hang_timeout),
               "--on-hang", "wait", "--server", server]
        self.log = open(data_dir.parent / "collector.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("collector exited at start")
                time.sleep(0.1)
        raise RuntimeError("collector did not start")

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mib(self) -> tuple[float, float]:
        rss = peak = 0.0
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) / 1024
                elif line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) / 1024
        return rss, peak

    def status(self) -> dict[str, Any]:
        request = urllib.request.Request(self.url + "/v1/status", headers={"Authorization": f"Bearer {TOKEN}"})
        for attempt in range(3):
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    return json.loads(response.read())
            except OSError:
                if attempt == 2:
                    raise
        return {}

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# ---------------------------------------------------------------------------------------
# The simulated job
# ---------------------------------------------------------------------------------------


class Job:
    """Every rank at the same step (a DDP job); encodes the shared parts."""

    def __init__(self, ranks: int, step_time: float, first_step: int, culprit: int):
        self.ranks = ranks
        self.step_time = step_time
        self.started = time.time()
        self.first_step = first_step
        self.culprit = culprit
        self.frozen_at: Optional[float] = None  # wall time of the last progress (the freeze)
        self.frozen_step: Optional[int] = None
        self._tails: dict[tuple, bytes] = {}
        self.identity = [self._identity(r) for r in range(ranks)]

    def _identity(self, rank: int) -> bytes:
        node = rank // RANKS_PER_NODE
        return json.dumps({"run_id": RUN_ID, "rank": rank, "local_rank": rank % RANKS_PER_NODE,
                           "world_size": self.ranks, "node_rank": node, "host": f"node-{node:05d}",
                           "pid": 10_000 + rank % 50_000, "attempt": 0}, separators=(",", ":")).encode()

    def progress_at(self, step: int) -> float:
        """When a rank that has completed ``step`` steps last progressed: the
        end of its last step, so never after a beat sent while it runs the
        next (every rank alike)."""
        return self.started + (step - self.first_step) * self.step_time

    def step_at(self, now: float) -> int:
        if self.frozen_step is not None:
            return self.frozen_step
        return self.first_step + int((now - self.started) / self.step_time)

    def freeze(self) -> None:
        # Now every rank but the culprit enters the next collective (its phase
        # changes): that is the job's last progress, after every beat it sent
        # before, as a live agent dates it. Dated at the step's start instead,
        # beats the ranks sent during that step, before they entered, read as
        # their state during the stall.
        now = time.time()
        self.frozen_step = self.step_at(now)
        self.frozen_at = now

    def rows(self, first: int, last: int, stride: int = 1) -> str:
        """Step records first..last-1 (every rank alike: own time, loss, grad norm, RSS); with a
        stride, every stride-th step, as a node relay forwards them when the collector asks."""
        out = []
        for s in range(first, last):
            if s % stride:
                continue
            start = self.started + (s - self.first_step) * self.step_time
            end = start + self.step_time
            loss = 2.0 + 1.0 / (1 + s % 1000)
            out.append(f"[{s},{start:.3f},{end:.3f},1,{0.8 * self.step_time:.4f},{0.01 * self.step_time:.4f},"
                       f"{loss:.5f},{1.5 + 0.001 * (s % 7):.5f},0,1,{1_500_000_000 + 4096 * (s % 3)},null,null,null,null,1234567,0.001]")
        return ",".join(out)

    def tail(self, since: int, step: int, culprit: bool, history: int = 0, stride: int = 1) -> bytes:
        """Everything of a heartbeat after its identity, for ranks at ``step``
        whose last report carried steps below ``since``."""
        key = (since, step, culprit, history, self.frozen_step is not None, stride, int(time.time()))
        cached = self._tails.get(key)
        if cached is not None:
            return cached
        if len(self._tails) > 256:
            self._tails.clear()
        now = time.time()
        frozen = self.frozen_step is not None
        # Three collectives per step (DDP buckets); at the hang every rank but
        # the culprit has enqueued the next one and waits in it.
        enqueued = 3 * step + (1 if frozen and not culprit else 0)
        completed = 3 * step
        phase = ("forward" if culprit else "backward") if frozen else "forward"
        last_progress = self.frozen_at if frozen else now
        first = max(self.first_step, since if not history else step - history)
        rows = self.rows(first, step, stride)
        text = (f',"sent_at":{now:.3f},"seq":{step},"step":{step},"forwards":{step},"phase":"{phase}",'
                f'"phase_since":{last_progress:.3f},"last_progress_at":{last_progress:.3f},'
                f'"collectives_enqueued":{{"0":{enqueued}}},"collectives_completed":{{"0":{completed}}},'
                f'"host_memory":{{"MemTotal":270000000000,"MemAvailable":200000000000,"RSS":1500000000}}'
                + (f',"step_columns":{COLUMNS},"step_rows":[{rows}]' if rows else "") + '}')
        cached = self._tails[key] = text.encode()
        return cached


class Recorded:
    """The node reports a real job's relay sent (FIXTURE), replayed for any
    rank and step. Each recorded beat is a rank's state at one step; a node's
    report for steps (since, step] merges the beats of those steps, shifted
    (steps, times, sequence numbers) to where the simulated job is, through
    the relay's own `StepSampler` and `merge_beats`."""

    def __init__(self, path: Path = FIXTURE):
        with gzip.open(path, "rt") as f:
            data = json.load(f)
        reports = [json.loads(r) for r in data["reports"]]
        full = [r for r in reports if len(r["heartbeats"]) == RANKS_PER_NODE
                and all(hb.get("step_rows") for hb in r["heartbeats"])
                and not any(e.get("kind") == "exit" for hb in r["heartbeats"] for e in hb.get("events") or [])]
        whole = [r for r in reports if len(r["heartbeats"]) == RANKS_PER_NODE
                 and not any(e.get("kind") == "exit" for hb in r["heartbeats"] for e in hb.get("events") or [])]
        facts = [r for r in whole if all(hb.get("events") for hb in r["heartbeats"])]
        # The first steps' beats: the job's facts (train_config events), sent once.
        self.startup = {hb["identity"]["local_rank"]: hb for hb in (facts or full)[0]["heartbeats"]}
        startup_step = self.startup[0]["step"]
        self.steady = [{hb["identity"]["local_rank"]: hb for hb in r["heartbeats"]} for r in full
                       if r["heartbeats"][0]["step"] > startup_step]
        self.steps = [beats[0]["step"] for beats in self.steady]
        enq = [int(beats[0]["collectives_enqueued"]["0"]) for beats in self.steady]
        self.seq_per_step = max(1, round((enq[-1] - enq[0]) / max(1, self.steps[-1] - self.steps[0])))
        self.meta = data.get("meta", {})
        self.sizes = sorted(len(r) for r, ok in zip(data["reports"], reports) if ok in full)
        from rankwatch.node.relay import StepSampler

        self.samplers = {local: StepSampler() for local in range(RANKS_PER_NODE)}
        self._cache: dict[tuple, bytes] = {}
        self._beats: dict[tuple, dict[str, Any]] = {}

    def beat_at(self, local: int, step: int, job: "Job", startup: bool = False) -> dict[str, Any]:
        """The recorded beat of ``local`` that stands for ``step``, shifted there
        (shared: never changed by its users; `merge_beats` makes new dicts)."""
        key = (local, step, startup)
        beat = self._beats.get(key)
        if beat is None:
            if len(self._beats) > 4096:
                self._beats.clear()
            beat = self._beats[key] = self._shifted(local, step, job, startup)
        return beat

    def _shifted(self, local: int, step: int, job: "Job", startup: bool) -> dict[str, Any]:
        if startup:
            # A node's first report at a later step: the steady beat of that step
            # (its sequence numbers follow the job's), plus the start-up facts.
            # Shifting the start-up beat's own marks would put the init
            # collectives' numbers at a later step: a mismatch the job never had.
            beat = self._shifted(local, step, job, False)
            facts = json.loads(json.dumps(self.startup[local].get("events") or []))
            dt = job.progress_at(step) - self.startup[local]["last_progress_at"]
            for event in facts:
                event["step"], event["at"] = step, event["at"] + dt
            return {**beat, "events": facts + list(beat.get("events") or [])}
        k = step % len(self.steady)
        beat = json.loads(json.dumps(self.steady[k][local]))
        offset = step - beat["step"]
        dt = job.progress_at(step) - beat["last_progress_at"]
        beat.pop("identity", None)
        beat.pop("version", None)
        beat["step"] += offset
        beat["forwards"] = beat.get("forwards", 0) + offset
        # A heartbeat's sequence number only grows in a live agent; the
        # recording's would wrap with its steps (k = step % len), and the
        # collector drops a beat older than one it has as stale (`tail` sets
        # the one sent, from the time).
        beat["seq"] = step + 1
        for key in ("sent_at", "phase_since", "last_progress_at"):
            if isinstance(beat.get(key), (int, float)):
                beat[key] += dt
        for row in beat.get("step_rows") or []:
            row[0] += offset
            row[1] += dt
            row[2] += dt
        for mark in beat.get("marks") or []:
            mark["step"] += offset
            mark["seqs"] = {pg: v + offset * self.seq_per_step for pg, v in mark["seqs"].items()}
        for fp in beat.get("fingerprints") or []:
            fp["step"] += offset
        for event in beat.get("events") or []:
            event["step"] = event.get("step", 0) + offset if event.get("step") is not None else None
            event["at"] = event["at"] + dt
        for key in ("collectives_enqueued", "collectives_completed"):
            if key in beat:
                beat[key] = {pg: v + offset * self.seq_per_step for pg, v in beat[key].items()}
        return beat

    def tail(self, rank: int, since: Optional[int], step: int, job: "Job", culprit: bool, stride: int) -> bytes:
        """A rank's merged beat for steps (since, step], after its identity:
        its node-local rank's recording, each step's input-batch fingerprint
        made the rank's own (replicas of one recording would otherwise feed
        identical batches: a duplicate_data incident the job never had)."""
        local = rank % RANKS_PER_NODE
        text, fps = self._local_tail(local, since, step, job, culprit, stride)
        # Sent now, whatever the cache: a hung job's agents go on beating (a
        # stale time would read as a heartbeat thread gone silent).
        now = time.time()
        text = text.replace(_SENT_SENTINEL, b'"sent_at":%.3f' % now, 1)
        # A live agent's beat counter grows with every beat, whatever the step
        # (a hung job's too): a report that reaches the collector after a newer
        # one of its node (its request timed out, then was taken in) is stale,
        # as it would be. Milliseconds of the job stand in for the count.
        text = text.replace(_SEQ_SENTINEL, b'"seq":%d' % (1 + int(1000 * max(0.0, now - job.started))), 1)
        for i, fp in enumerate(fps):
            text = text.replace(b"%d" % (_FP_SENTINEL + i), b"%d" % ((fp * 1_000_003 + rank) % wire.MAX_COUNT), 1)
        return text

    def _local_tail(self, local: int, since: Optional[int], step: int, job: "Job", culprit: bool,
                    stride: int) -> tuple[bytes, list[int]]:
        frozen = job.frozen_step is not None
        key = (local, since, step, culprit and frozen, frozen, stride)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        if len(self._cache) > 8192:
            self._cache.clear()
        from rankwatch.node.relay import merge_beats

        sampler = self.samplers[local]
        sampler.stride = stride
        merged = None
        first = step if since is None else since + 1
        for s in range(max(first, step - 63), step + 1):  # at most 64 steps per report (a 64-s cadence)
            beat = self.beat_at(local, s, job, startup=since is None and s == first)
            merged = merge_beats(merged, sampler.sample(local, beat))
        merged = dict(merged if merged is not None else self.beat_at(local, step, job))  # changed below
        if since is not None and since >= step:  # no new step (frozen): the state alone
            for key_ in ("step_rows", "marks", "events", "fingerprints"):
                merged.pop(key_, None)
        if frozen:
            # The hang: nobody progresses; every rank but the culprit has
            # enqueued the next collective and waits in it.
            merged["last_progress_at"] = merged["phase_since"] = job.frozen_at
            merged["phase"] = "forward" if culprit else "backward"
            if not culprit:
                merged["collectives_enqueued"] = {pg: v + 1 for pg, v in
                                                  (merged.get("collectives_enqueued") or {"0": 0}).items()}
        merged["sent_at"] = _SENT_AT
        merged["seq"] = _SEQ
        fps: list[int] = []  # the recorded batch fingerprints, each replaced by a sentinel `tail` rewrites
        rows = merged.get("step_rows") or []
        if rows and merged.get("step_columns") == list(wire.STEP_COLUMNS):
            merged["step_rows"] = rows = [list(row) for row in rows]  # the shared beats stay as they are
            for row in rows:
                if isinstance(row[_FP_COLUMN], int):
                    fps.append(row[_FP_COLUMN])
                    row[_FP_COLUMN] = _FP_SENTINEL + len(fps) - 1
        text = json.dumps(merged, separators=(",", ":"), allow_nan=False)
        cached = self._cache[key] = (("," + text[1:]).encode(), fps)
        return cached


def node_prefix(job: Job, node: int) -> tuple[bytes, list[int]]:
    ranks = list(range(node * RANKS_PER_NODE, min(job.ranks, (node + 1) * RANKS_PER_NODE)))
    workers = [{"local_rank": r % RANKS_PER_NODE, "rank": r, "pid": 10_000 + r % 50_000} for r in ranks]
    view = json.dumps({"run_id": RUN_ID, "host": f"node-{node:05d}", "node_rank": node, "world_size": job.ranks,
                       "sent_at": time.time(), "hang_timeout": None, "on_hang": "wait", "workers": workers,
                       "launcher_pid": 100 + node}, separators=(",", ":"))
    return view.encode(), ranks


def request_bytes(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: collector\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


class Stats:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.sent = self.ok = self.errors = self.heartbeats = 0
        self.error_samples: list[str] = []
        self.error_kinds: collections.Counter = collections.Counter()  # "HTTP 503", "TimeoutError", ...
        self.recording = False

    def record(self, latency: float, ok: bool, beats: int, why: str = "", shed: bool = False) -> None:
        if not self.recording:
            return
        self.sent += 1
        self.shed = getattr(self, "shed", 0) + (1 if shed else 0)
        if ok:
            self.ok += 1
            self.heartbeats += beats
            self.latencies.append(latency)
        else:
            self.errors += 1
            self.error_kinds[why.split(":", 1)[0] or "?"] += 1
            if len(self.error_samples) < 5:
                self.error_samples.append(why)


async def _exchange(reader, writer, data: bytes, timeout: float, heads: Optional[dict] = None) -> tuple[int, bytes]:
    """One request on a kept-alive connection; ``heads`` gets Retry-After and
    Connection when given."""
    writer.write(data)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n"):
        lower = line.lower()
        if lower[:15] == b"content-length:":
            length = int(line[15:])
        elif heads is not None and lower[:12] == b"retry-after:":
            heads["retry_after"] = line[12:].strip().decode()
        elif heads is not None and lower[:11] == b"connection:":
            heads["connection"] = line[11:].strip().decode().lower()
    body = await asyncio.wait_for(reader.readexactly(length), timeout) if length else b""
    return status, body


class Simulator:
    def __init__(self, url: str, job: Job, mode: str, history: int):
        host, port = url.rsplit("/", 1)[-1].split(":")
        self.host, self.port = host, int(port)
        self.job = job
        self.mode = mode
        self.history = history
        self.stats = Stats()
        self.interval = 1.0
        self.stride = 1  # NodeReply.step_stride: the records a relay forwards at scale
        self.nodes = (job.ranks + RANKS_PER_NODE - 1) // RANKS_PER_NODE
        self.epoch = time.time()
        self.stop = False
        self.warm = 0  # nodes that sent their history (cold start: whose first report was taken)
        self.started_nodes = 0
        self.bytes_sent = 0
        self.max_body = 0
        self.last_ok: dict[int, float] = {}
        self.hang_timeout = 15.0

    async def relay(self, node: int, recorded: "Recorded", start: float) -> None:
        """One node's relay from a cold start, as rankwatch/node/relay.py
        does it: the initial cadence for the world size, the first report at
        a random offset within it, the collector's cadence once it answers
        (in the relay's phase: `until_next_slot`),
        exponential backoff with jitter on a failure, a 503 or a timeout
        (Retry-After as a floor), the node's data kept and merged meanwhile."""
        from rankwatch.agent.core.transport import backoff_delay
        from rankwatch.node.relay import backoff_cap, initial_interval, until_next_slot

        job = self.job
        rng = random.Random(node)
        view, ranks = node_prefix(job, node)
        interval = initial_interval(1.0, job.ranks, self.hang_timeout)
        conn = None
        last_step: Optional[int] = None
        failures, retry_after = 0, None
        await asyncio.sleep(start)
        self.started_nodes += 1
        wait = interval * rng.random()
        while not self.stop:
            await asyncio.sleep(wait)
            if self.stop:
                break
            began = time.time()
            step = job.step_at(began)
            beats = b",".join(b'{"version":1,"identity":' + job.identity[r]
                              + recorded.tail(r, last_step, step, job, r == job.culprit, self.stride)
                              for r in ranks)
            body = b'{"version":1,"sent_at":%.3f,"node":' % began + view + b',"heartbeats":[' + beats + b"]}"
            self.bytes_sent += len(body)
            heads: dict[str, str] = {}
            ok = False
            try:
                if conn is None:
                    conn = await asyncio.open_connection(self.host, self.port)
                status, reply = await _exchange(*conn, request_bytes("/v1/node-report", body), RELAY_TIMEOUT, heads)
                ok = status == 200
                if heads.get("connection") == "close":
                    conn[1].close()
                    conn = None
                if ok:
                    answer = json.loads(reply)
                    hint, stride = answer.get("interval"), answer.get("step_stride")
                    if isinstance(hint, (int, float)) and 0.2 <= hint <= 60:
                        interval = max(1.0, float(hint))
                    self.stride = stride if isinstance(stride, int) and stride >= 1 else 1
                self.stats.record(time.time() - began, ok, len(ranks), f"HTTP {status}: {reply[:120]!r}",
                                  shed=status == 503)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
                self.stats.record(time.time() - began, False, 0, f"{type(exc).__name__}: {exc}")
                if conn is not None:
                    conn[1].close()
                conn = None
            self.max_body = max(self.max_body, len(body))
            if ok:
                if last_step is None:
                    self.warm += 1
                self.last_ok[node] = time.time()
                last_step, failures, retry_after = step, 0, None
                wait = until_next_slot(interval, time.time() - began)  # the relay's phase kept
            else:
                failures += 1
                ra = heads.get("retry_after")
                retry_after = float(ra) if ra and ra.isdigit() else None
                wait = backoff_delay(failures, interval, backoff_cap(interval), rng)
                if retry_after is not None:
                    wait = max(wait, retry_after * (1.0 + 0.5 * rng.random()))
        if conn is not None:
            conn[1].close()

    async def node(self, node: int, phase: float) -> None:
        job = self.job
        view, ranks = node_prefix(job, node)
        conn = None
        last_step = None  # the first report carries the history
        await asyncio.sleep(phase)
        while not self.stop:
            began = time.time()
            step = job.step_at(began)
            since = last_step if last_step is not None else step
            history = self.history if last_step is None else 0
            try:
                if conn is None:
                    conn = await asyncio.open_connection(self.host, self.port)
                if self.mode == "relay":
                    beats = b",".join(b'{"version":1,"identity":' + job.identity[r]
                                      + job.tail(since, step, r == job.culprit, history, self.stride) for r in ranks)
                    body = (b'{"version":1,"sent_at":%.3f,"node":' % began + view + b',"heartbeats":[' + beats
                            + b"]}")
                    status, reply = await _exchange(*conn, request_bytes("/v1/node-report", body), 30)
                    ok = status == 200
                    if ok and (b'"interval":' in reply or b'"step_stride":' in reply):
                        answer = json.loads(reply)
                        hint, stride = answer.get("interval"), answer.get("step_stride")
                        if isinstance(hint, (int, float)):
                            self.interval = max(1.0, float(hint))
                        self.stride = stride if isinstance(stride, int) and stride >= 1 else 1
                    self.stats.record(time.time() - began, ok, len(ranks), f"HTTP {status}: {reply[:200]!r}")
                else:
                    for r in ranks:
                        t0 = time.time()
                        body = b'{"version":1,"identity":' + job.identity[r] + job.tail(since, step, r == job.culprit,
                                                                                       history)
                        status, reply = await _exchange(*conn, request_bytes("/v1/heartbeat", body), 30)
                        self.stats.record(time.time() - t0, status == 200, 1, f"HTTP {status}: {reply[:200]!r}")
                if last_step is None:
                    self.warm += 1
                last_step = step
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
                self.stats.record(time.time() - began, False, 0, f"{type(exc).__name__}: {exc}")
                if conn is not None:
                    conn[1].close()
                conn = None
                await asyncio.sleep(1.0)
            # Next report in this node's slot: the nodes' reports spread evenly
            # over the interval (independent relay timers), whatever the start-up spread.
            slot = self.interval * node / self.nodes
            wait = (slot - (time.time() - self.epoch)) % self.interval
            await asyncio.sleep(wait if wait > 0.05 * self.interval else wait + self.interval)
        if conn is not None:
            conn[1].close()


async def _loop_lag(running: Callable[[], bool], every: float = 0.01) -> float:
    """The generator's own event-loop lag while ``running()``: the longest
    that a timer of ``every`` seconds fired late. A request in flight then
    is measured that much slower, whatever the collector did."""
    worst = 0.0
    while running():
        began = time.perf_counter()
        await asyncio.sleep(every)
        worst = max(worst, time.perf_counter() - began - every)
    return worst


async def _until_all_seen(collector: CollectorProcess, loop, ranks: int, began: float,
                          deadline_s: float, tasks: list) -> dict[str, Any]:
    """Polls the collector until it has seen every rank: the cold start's figure."""
    seen, out = 0, {"all_seen_s": None}
    while time.time() - began < deadline_s:
        broken = [t for t in tasks if t.done() and t.exception() is not None]
        if broken:
            raise RuntimeError(f"a simulated relay failed: {broken[0].exception()!r}") from broken[0].exception()
        await asyncio.sleep(0.5)
        try:
            status = await loop.run_in_executor(None, collector.status)
        except OSError:
            continue
        seen = status.get("runs", {}).get(RUN_ID, {}).get("ranks_seen") or 0
        if seen >= ranks:
            out["all_seen_s"] = time.time() - began
            break
    out["seen_at_deadline"] = seen
    return out


async def run_load(url: str, job: Job, mode: str, history: int, measure: float, hang_timeout: float,
                   collector: CollectorProcess, start: str = "spread",
                   recorded: Optional["Recorded"] = None, outage: float = 0.0,
                   settle: Optional[float] = None) -> dict[str, Any]:
    sim = Simulator(url, job, mode, history)
    nodes = (job.ranks + RANKS_PER_NODE - 1) // RANKS_PER_NODE
    # The collector's cadence at this size (same rule as the service).
    from rankwatch.collector.service import node_report_interval

    sim.interval = (node_report_interval(job.ranks, hang_timeout) or 1.0) if mode == "relay" else 1.0
    sim.hang_timeout = hang_timeout
    loop = asyncio.get_running_loop()
    cold = {}
    if start == "cold" and mode == "relay":
        # Every relay starts within one second (a job's launchers start together).
        recorded = recorded or Recorded()
        import rankwatch.agent.core.transport  # noqa: F401  (imported before the clock starts: it imports torch)
        import rankwatch.node.relay  # noqa: F401

        rng = random.Random(job.ranks)
        began = time.time()
        tasks = [loop.create_task(sim.relay(n, recorded, rng.random())) for n in range(nodes)]
        cold = await _until_all_seen(collector, loop, job.ranks, began, deadline_s=max(60.0, 6 * sim.interval),
                                     tasks=tasks)
        await asyncio.sleep(2 * sim.interval if settle is None else settle)
    else:
        # Start-up spread so the histories arrive at about 1,000 nodes a second.
        spread = max(sim.interval, nodes / 1000)
        tasks = [loop.create_task(sim.node(n, spread * n / nodes)) for n in range(nodes)]
        # Warm up: every node connected and its history sent, and one more interval.
        deadline = time.time() + 300
        while sim.warm < nodes and time.time() < deadline:
            await asyncio.sleep(0.2)
        await asyncio.sleep(2 * sim.interval)
    bytes0 = sim.bytes_sent
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    cpu0, t0 = collector.cpu_seconds(), time.time()
    sim.stats.recording = True
    lag = loop.create_task(_loop_lag(lambda: sim.stats.recording))
    await asyncio.sleep(measure)
    sim.stats.recording = False
    cpu1, t1 = collector.cpu_seconds(), time.time()
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    lag_max_s = await lag
    rss, peak = collector.rss_mib()
    try:
        status = await loop.run_in_executor(None, collector.status)
    except OSError:  # an overloaded collector: the row says so instead of the bench failing
        status = {"status_unavailable": True}
    stats = sim.stats
    elapsed = t1 - t0
    lat = sorted(stats.latencies)
    result = {
        "ranks": job.ranks, "nodes": nodes, "mode": mode, "interval_s": sim.interval, "start": start,
        "messages": "recorded" if (start == "cold" and mode == "relay") else "synthetic",
        "all_seen_s": cold.get("all_seen_s"), "seen_at_deadline": cold.get("seen_at_deadline"),
        "shed": getattr(stats, "shed", 0), "sent_mb_per_s": (sim.bytes_sent - bytes0) / elapsed / 1e6,
        "offered_per_s": (nodes if mode == "relay" else job.ranks) / sim.interval,
        "sent_per_s": stats.sent / elapsed, "accepted_per_s": stats.ok / elapsed,
        "heartbeats_per_s": stats.heartbeats / elapsed, "errors": stats.errors,
        "error_samples": stats.error_samples, "error_kinds": dict(stats.error_kinds),
        "p50_ms": 1000 * lat[len(lat) // 2] if lat else None,
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None,
        "collector_cpu": (cpu1 - cpu0) / elapsed, "collector_rss_mib": rss, "collector_peak_rss_mib": peak,
        "generator_cpu": ((usage1.ru_utime + usage1.ru_stime) - (usage0.ru_utime + usage0.ru_stime)) / elapsed,
        "tick_s": status.get("tick_seconds"), "tick_max_s": status.get("tick_seconds_max"),
        "tick_p50_s": status.get("tick_seconds_p50"), "tick_p99_s": status.get("tick_seconds_p99"),
        "ranks_seen": status.get("runs", {}).get(RUN_ID, {}).get("ranks_seen"),
        "verdicts_before_hang": [v["kind"] for v in status.get("runs", {}).get(RUN_ID, {}).get("verdicts", [])],
        "index_degraded": status.get("index_degraded"),
        "generator_lag_max_ms": 1000 * lag_max_s,
        "status_unavailable": bool(status.get("status_unavailable")),
    }
    if outage and start == "cold" and mode == "relay":
        # The collector stops answering (SIGSTOP: connections stay open, requests
        # time out) for ``outage`` seconds, then resumes; every relay must come back.
        sim.max_body = 0
        collector.proc.send_signal(signal.SIGSTOP)
        await asyncio.sleep(outage)
        collector.proc.send_signal(signal.SIGCONT)
        resumed = time.time()
        deadline = resumed + 180
        while time.time() < deadline and sum(1 for t in sim.last_ok.values() if t > resumed) < nodes:
            await asyncio.sleep(0.5)
        back = sum(1 for t in sim.last_ok.values() if t > resumed)
        result.update(outage_s=outage, recovered_nodes=back,
                      all_back_after_s=(max(sim.last_ok.values()) - resumed) if back == nodes else None,
                      largest_report_bytes_in_outage=sim.max_body)
        await asyncio.sleep(2 * sim.interval)
    # The hang: one rank stops; everyone else waits in the next collective.
    job.freeze()
    frozen_at = job.frozen_at
    verdict = None
    deadline = time.time() + hang_timeout + 90
    while time.time() < deadline and verdict is None:
        await asyncio.sleep(0.5)
        try:
            status = await loop.run_in_executor(None, collector.status)
        except OSError:
            continue
        result.setdefault("first_status_after_s", time.time() - frozen_at)
        for v in status.get("runs", {}).get(RUN_ID, {}).get("verdicts", []):
            if v["kind"] == "hang":
                verdict = v
                result["hang_verdict_after_s"] = time.time() - frozen_at
                result["hang_ranks"] = v["ranks"][:10]
                result["hang_ranks_total"] = len(v["ranks"])
                result["hang_summary"] = v.get("summary", "")[:300]  # why those ranks: the rule that named them
                break
    if verdict is None:
        result["hang_verdict_after_s"] = None
    result["hang_deadline_s"] = hang_timeout + 5
    # One asyncio thread offers the load: near a full core it cannot offer more,
    # and its own loop lag counts in the latencies. Such a row measures the generator.
    result["generator_bound"] = result["generator_cpu"] >= GENERATOR_BOUND_CPU
    sim.stop = True
    for task in tasks:
        task.cancel()
    failed = [r for r in await asyncio.gather(*tasks, return_exceptions=True)
              if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
    result["generator_failures"] = [f"{type(e).__name__}: {e}" for e in failed[:3]]
    return result


@contextlib.contextmanager
def generator_gc() -> Iterator[None]:
    """The generator's garbage collection kept out of the figures. One
    process plays every relay, and at 100,000 ranks it holds millions of
    objects (the recorded messages, 12,500 relays' connections and tasks):
    Python's automatic full collection paused it 0.33-0.53 s every ~12 s,
    and every request in flight meanwhile was measured that much slower,
    and every relay due meanwhile sent at once when it resumed (a burst of
    twice the cadence's load that recurred every cadence). Real relays are
    separate processes whose pauses do not line up. So, much as the collector
    does past GC_MANUAL_RANKS: what exists at the start is frozen (never
    scanned again), the young generations stay automatic, full collections
    are off until the run ends (up to Python 3.13; 3.14's incremental
    collector has no such pauses and ignores the third threshold). The
    generator's loop lag is measured and reported (``generator_lag_max_ms``)."""
    thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    gc.set_threshold(thresholds[0], thresholds[1], 1 << 30)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if not frozen:  # a freeze made before (a collector in this process) is not undone
            gc.unfreeze()


def bench_one(ranks: int, args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix=f"rankwatch-load-{ranks}-"))
    collector = CollectorProcess(folder / "data", args.hang_timeout, args.server)
    try:
        history = args.history if args.history is not None else min(256, 2_000_000 // ranks)
        start = getattr(args, "start", "cold")
        cold = start == "cold" and args.mode == "relay"
        job = Job(ranks, args.step_time, first_step=0 if cold else 100_000,
                  culprit=random.Random(ranks).randrange(ranks))
        with generator_gc():
            result = asyncio.run(run_load(collector.url, job, args.mode, history, args.measure, args.hang_timeout,
                                          collector, start=start, outage=getattr(args, "outage", 0.0),
                                          settle=getattr(args, "settle", None)))
        result["settle_s"] = getattr(args, "settle", None)
        result["history_steps"] = history
        result["culprit"] = job.culprit
        result["hang_named"] = result.get("hang_ranks") == [job.culprit]
        return result
    finally:
        collector.stop()
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            print(f"kept {folder}", file=sys.stderr)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="1000,10000,100000", help="comma-separated rank counts")
    parser.add_argument("--mode", choices=("relay", "direct"), default="relay")
    parser.add_argument("--server", choices=("aiohttp", "stdlib"), default="aiohttp")
    parser.add_argument("--outage", type=float, default=0.0,
                        help="seconds the collector stops answering (SIGSTOP) after the steady state, before the hang")
    parser.add_argument("--start", choices=("cold", "spread"), default="cold",
                        help="cold: every relay starts within a second with recorded messages (relay mode)")
    parser.add_argument("--measure", type=float, default=30.0, help="seconds of steady load measured")
    parser.add_argument("--settle", type=float, default=None,
                        help="cold start: seconds from every rank seen to the measured window (default two "
                             "cadences; the relays' longest backoff and the start-up seal need about 90 s at 100,000 ranks)")
    parser.add_argument("--step-time", type=float, default=1.0, help="seconds per optimizer step of every rank")
    parser.add_argument("--history", type=int, default=None,
                        help="step records per rank sent before measuring (default min(256, 2M / ranks))")
    parser.add_argument("--hang-timeout", type=float, default=15.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object per N")
    parser.add_argument("--keep", action="store_true", help="keep the collector's data dir and log")
    args = parser.parse_args(argv)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    except (ValueError, OSError):
        pass
    rows = []
    for n in [int(x) for x in args.ranks.split(",") if x]:
        result = bench_one(n, args)
        rows.append(result)
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            print(_line(result), flush=True)
    if not args.json:
        print(_table(rows))
    return 0 if all(r.get("hang_named") for r in rows) else 1


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _line(r: dict[str, Any]) -> str:
    return (("GENERATOR-BOUND (the figures measure the load generator, not the collector): "
             if r.get("generator_bound") else "")
            + f"N={r['ranks']}: {r['mode']} every {r['interval_s']:g}s, {r.get('start')} start, "
            f"{r.get('messages')} messages, every rank seen after {_fmt(r.get('all_seen_s'), '.1f')} s, offered {r['offered_per_s']:.0f}/s, "
            f"sent {r['sent_per_s']:.0f}/s, accepted {r['accepted_per_s']:.0f}/s "
            f"({r['heartbeats_per_s']:.0f} heartbeats/s), p50 {_fmt(r['p50_ms'], '.1f')} ms, "
            f"p99 {_fmt(r['p99_ms'], '.1f')} ms, errors {r['errors']} (503 {r.get('shed', 0)}), collector CPU {r['collector_cpu']:.2f} core, "
            f"RSS {r['collector_rss_mib']:.0f} MiB (peak {r['collector_peak_rss_mib']:.0f}), "
            f"tick p50 {_fmt(r.get('tick_p50_s'), '.3f')} p99 {_fmt(r.get('tick_p99_s'), '.3f')} s "
            f"(max {_fmt(r['tick_max_s'], '.3f')}), generator CPU "
            f"{r['generator_cpu']:.2f} core (loop lag max {_fmt(r.get('generator_lag_max_ms'), '.0f')} ms), "
            f"hang verdict after {_fmt(r['hang_verdict_after_s'], '.1f')} s "
            f"(deadline {r['hang_deadline_s']:g}), ranks {r.get('hang_ranks')} of {r.get('hang_ranks_total')} "
            f"(culprit {r['culprit']}): {r.get('hang_summary')!r}"
            + (f", outage {r['outage_s']:g} s: {r['recovered_nodes']} nodes back, all after "
               f"{_fmt(r['all_back_after_s'], '.1f')} s, largest report {r['largest_report_bytes_in_outage']} B"
               if r.get("outage_s") else "")
            + (f", errors by kind {r.get('error_kinds')}, error samples {r['error_samples']}" if r["errors"] else ""))


def _table(rows: list[dict[str, Any]]) -> str:
    head = ("| ranks | mode, cadence | all seen s | offered/s | accepted/s | heartbeats/s | p50 ms | p99 ms | errors "
            "| collector CPU | generator CPU | RSS MiB (peak) | tick p50 / p99 s (max) | hang verdict s (deadline) "
            "| culprit named |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['ranks']:,}{' (generator-bound)' if r.get('generator_bound') else ''} "
            f"| {r['mode']}, {r['interval_s']:g} s | {_fmt(r.get('all_seen_s'), '.1f')} "
            f"| {r['offered_per_s']:,.0f} "
            f"| {r['accepted_per_s']:,.0f} | {r['heartbeats_per_s']:,.0f} | {_fmt(r['p50_ms'], '.1f')} "
            f"| {_fmt(r['p99_ms'], '.1f')} | {r['errors']} | {r['collector_cpu']:.2f} | {r['generator_cpu']:.2f} "
            f"| {r['collector_rss_mib']:.0f} ({r['collector_peak_rss_mib']:.0f}) "
            f"| {_fmt(r.get('tick_p50_s'), '.3f')} / {_fmt(r.get('tick_p99_s'), '.3f')} ({_fmt(r['tick_max_s'], '.3f')}) "
            f"| {_fmt(r['hang_verdict_after_s'], '.1f')} ({r['hang_deadline_s']:g}) | {r['hang_named']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
