"""Watch: what a run directory (plus one squeue/sacct) says: status, progress, runs, plot, report, logs. Never imports submit."""
