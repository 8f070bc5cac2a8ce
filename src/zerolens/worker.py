"""`python -m zerolens.worker`: one rank of a run, under torchrun, deepspeed or SLURM (zerolens.run.worker)."""
import sys

from zerolens.run.worker import main

if __name__ == "__main__":
    sys.exit(main())
