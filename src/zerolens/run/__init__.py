"""run: what happens on the ranks: the settings (config, flags, validate, deepspeed_config), the launcher,
the worker, the one training loop, the run folder, faults. May import report/ and everything below it."""
