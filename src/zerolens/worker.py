"""`python -m zerolens.worker`: one rank of a run, under torchrun, deepspeed or SLURM (zerolens.run.worker)."""
from zerolens.run.worker import run_as_script

if __name__ == "__main__":
    run_as_script()
