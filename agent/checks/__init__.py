"""One module per check, each built with exactly what it uses (an event sink,
the progress tracker's small interface, the patch registry, the config):
gradients, updates, training config, weight and batch fingerprints, gradient
flow, memory. They import core and watch, never the runtime."""
