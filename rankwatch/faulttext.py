"""Read Python's faulthandler output back into stacks (bundle format)."""

from __future__ import annotations

import re
from typing import Any, Optional

# Bounded numbers: the file is written by the rank (user code), read by the supervisor.
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]{1,16}) \(most recent call first\):")
_FRAME = re.compile(r'^\s+File "(.{0,4096})", line (\d{1,9}) in (.{0,1024})$')
MAX_THREADS = 1024
MAX_FRAMES = 512
MAIN_MARK = "rankwatch-main-thread:"


def parse(text: str, main_ident: Optional[int] = None) -> list[dict[str, Any]]:
    """Threads of the *last* dump in ``text`` (a file may hold several)."""
    if main_ident is None:
        for line in text.splitlines():
            if line.startswith(MAIN_MARK):
                try:
                    main_ident = int(line.split(":", 1)[1].strip()[:20], 0)
                except ValueError:
                    pass
    threads: list[dict[str, Any]] = []
    current: Optional[dict[str, Any]] = None
    for line in text.splitlines():
        header = _THREAD.match(line)
        if header:
            ident = int(header.group(2), 16)
            if threads and any(t["thread_id"] == ident for t in threads):
                threads = []  # a new dump starts: keep only the last one
            if len(threads) >= MAX_THREADS:
                current = None
                continue
            current = {"thread_id": ident, "name": "", "daemon": False, "main": ident == main_ident,
                       "current": header.group(1) == "Current thread", "frames": []}
            threads.append(current)
            continue
        frame = _FRAME.match(line)
        if frame and current is not None and len(current["frames"]) < MAX_FRAMES:
            current["frames"].insert(0, {"file": frame.group(1), "line": int(frame.group(2)),
                                         "name": frame.group(3).strip(), "code": ""})
    if threads and not any(t["main"] for t in threads):
        threads[-1]["main"] = True  # faulthandler lists the oldest thread (usually main) last
    return threads
