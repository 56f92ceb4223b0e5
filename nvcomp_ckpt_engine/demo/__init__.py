"""A small DeepSpeed training job that shows the checkpoint engine surviving a failure.

- `python -m nvcomp_ckpt_engine.demo ...` is one rank of the job (see `train.py`); the scripts in
  `launch_scripts/` start it with torchrun, the `deepspeed` launcher, mpirun or Slurm.
- `python -m nvcomp_ckpt_engine.demo.compare REFERENCE JOB` checks that a job that was killed and
  resumed logged the same losses as an uninterrupted run.

The package is an example and a test bed, not part of the engine's API: nothing in the engine
imports it.
"""
