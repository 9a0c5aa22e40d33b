"""The training engine: the loop, its data, losses, optimisers, checkpoints and run records."""
