"""Read Python's faulthandler output back into stacks (bundle format)."""

from __future__ import annotations

import re
from typing import Any, Optional

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
MAIN_MARK = "rankwatch-main-thread:"


def parse(text: str, main_ident: Optional[int] = None) -> list[dict[str, Any]]:
    """Threads of the *last* dump in ``text`` (a file may hold several)."""
    if main_ident is None:
        for line in text.splitlines():
            if line.startswith(MAIN_MARK):
                try:
                    main_ident = int(line.split(":", 1)[1].strip(), 0)
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
            current = {"thread_id": ident, "name": "", "daemon": False, "main": ident == main_ident,
                       "current": header.group(1) == "Current thread", "frames": []}
            threads.append(current)
            continue
        frame = _FRAME.match(line)
        if frame and current is not None:
            current["frames"].insert(0, {"file": frame.group(1), "line": int(frame.group(2)),
                                         "name": frame.group(3).strip(), "code": ""})
    if threads and not any(t["main"] for t in threads):
        threads[-1]["main"] = True  # faulthandler lists the oldest thread (usually main) last
    return threads
