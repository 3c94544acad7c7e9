"""The agent's ground floor: what every part stands on and nothing above it.

The device adapter and its test double, deferred reads, the guard that keeps
rankwatch's own faults out of the job (safety), the patch registry, stacks,
the transport to the collector, torch-state probes, the small interfaces the
parts share (ports). Nothing here imports a watch, a check or the runtime."""
