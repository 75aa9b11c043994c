"""Submit: the effects (sbatch, scancel, run-directory writes) of submit, resume, consolidate, cancel."""
