"""predict: a run's memory before it runs: each rank's peak traced on fake tensors (peak.py) and the
field's formulas (formulas.py). May import strategies/ (the registry's step models), measure/, models/."""
