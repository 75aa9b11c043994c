"""slurmft: one YAML file to a finished Hugging Face fine-tune on Slurm, preemption included.

The login-side modules (cli, config, render, dispatch, rundir, estimate) never import torch;
only ``slurmft.job`` (the code that runs inside an allocation, consolidation included) does.
"""

__version__ = "0.1.0"
