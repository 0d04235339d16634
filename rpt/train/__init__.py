"""Training: the loop, optimiser, checkpoints, evaluation and generation."""
