"""Parallelism applied from outside the model: processes and devices, data and pipeline parallel."""
