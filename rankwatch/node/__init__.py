"""The node side: what runs next to the workers on each node.

- `launcher`: `rankwatch run` (torchrun's options, the bootstrap in every worker);
- `supervisor`: worker exits, stacks from outside, abort;
- `relay`: the node's heartbeats, batched to a standalone collector;
- `blackbox`: a rank's memory-mapped last words, read after a silent death.
"""
