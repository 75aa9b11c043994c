"""lm-eval's command line as the evaluation job runs it: run as a script by ``eval.python`` (the job imports only
its flag, :data:`ONLY_INCLUDED`).

``python lm_eval_run.py [--only-included] ARGS...`` is ``python -m lm_eval ARGS...`` (lm-eval's own command line:
its arguments, logging, results and samples files), with one difference under ``--only-included``: lm-eval's task
index is built from the ``--include_path`` folder alone, not also from the ~10,000 task files lm-eval ships
(``TaskManager(include_defaults=False)``, its own option, which its command line does not expose). The job passes
it when every task of ``eval.tasks`` is a file of yours; building that index took 20-37 s of each run on a quiet
2-core machine and over a minute on a loaded one, for every model evaluated. Like ``serve_vllm.py`` this file
imports only the standard library and lm-eval, so slurmft need not be installed beside it.
"""

from __future__ import annotations

import runpy
import sys

#: "Every task is a file of the user's: index the include path alone" (slurmft.job.evaluate passes it).
ONLY_INCLUDED = "--only-included"


def _index_only_included() -> None:
    """Every TaskManager lm-eval builds from now on indexes its include path only, unless told otherwise."""
    from lm_eval.tasks import manager

    original = manager.TaskManager.__init__

    def only_included(self, *args, include_defaults: bool = False, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        original(self, *args, include_defaults=include_defaults, **kwargs)

    manager.TaskManager.__init__ = only_included


def main(argv: list[str]) -> None:
    if argv[:1] == [ONLY_INCLUDED]:
        argv = argv[1:]
        _index_only_included()
    sys.argv = ["lm_eval", *argv]
    runpy.run_module("lm_eval", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
