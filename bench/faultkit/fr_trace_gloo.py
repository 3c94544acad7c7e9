"""torch's Flight Recorder analyzer, with the one fix-up gloo's dumps need.

    python bench/faultkit/fr_trace_gloo.py DUMP_DIR [fr_trace options...]

Runs `torch.distributed.flight_recorder.fr_trace.main` unchanged, with one
change to what its loader returns: gloo (torch 2.13) keys a dump's
`pg_config` by '' while its entries name process group '0', and the
analyzer then stops with `KeyError: ('0', 0)` before analysing anything.
When a dump has exactly that shape (a '' key, and every entry naming one
group that is not in `pg_config`), the key is renamed after the entries'
group; each rename is printed as "[faultbench fix-up] ...". Nothing else is
touched, and the analysis and its verdict are fr_trace's own.

The dumps are the ranks' own pickles (torch's format for fr_trace); they are
unpickled only inside fr_trace's loader, as fr_trace always does.
"""

from __future__ import annotations

import sys

from torch.distributed.flight_recorder import fr_trace
from torch.distributed.flight_recorder.components import loader


def fix_pg_config(dump: dict) -> list[str]:
    """Renames pg_config's '' key after the entries' group; returns what it did."""
    config = dump.get("pg_config") or {}
    named = {str(entry["process_group"][0]) for entry in dump.get("entries") or [] if entry.get("process_group")}
    if "" in config and len(named) == 1:
        group = next(iter(named))
        if group not in config:
            config[group] = config.pop("")
            return [f"rank {dump.get('rank')}: pg_config key '' -> '{group}'"]
    return []


def main(argv: list[str]) -> None:
    read_dump = loader.read_dump

    def read_dump_fixed(prefix: str, filename: str):
        dump = read_dump(prefix, filename)
        for change in fix_pg_config(dump):
            print(f"[faultbench fix-up] {change}", file=sys.stderr, flush=True)
        return dump

    loader.read_dump = read_dump_fixed
    fr_trace.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
