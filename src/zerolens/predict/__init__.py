"""predict: a run's memory before it runs: each rank's peak traced on fake tensors (peak.py; without a GPU
as the GPU would run it, without_gpu.py; carried to larger micro-batches where it scales,
micro_batches.py), the caching allocator's model (allocator.py) and the field's formulas (formulas.py).
May import strategies/ (the registry's step models), measure/, models/."""
