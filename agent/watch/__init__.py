"""What the agent follows in the training loop: step progress, collectives,
the models being trained, the data loaders, FSDP2, Join. Built on core only;
the checks above read what these see."""
