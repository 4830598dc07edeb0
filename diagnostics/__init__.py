"""Node burn-in screening (``diag``): checks, thresholds, verdicts, JSON report.

Layout:

* :mod:`diagnostics.readers` -- the :class:`~diagnostics.readers.HardwareReader`
  seam: NVML (GPUs), sysfs (InfiniBand), and a YAML injection overlay used by
  tests and by the chaos module (``ELASTIC_DIAG_INJECT``).
* :mod:`diagnostics.checks` -- one registered check per module: ``gpu``,
  ``nvlink``, ``ib``, ``gemm``, ``membw``, ``collective`` (alias ``nccl``),
  ``disk``, ``etcd``.
* :mod:`diagnostics.thresholds` -- typed warn / fail levels, per GPU model.
* :mod:`diagnostics.report` -- results, overall verdict, table and JSON.
* :mod:`diagnostics.preflight` -- ``run_screen`` and ``exclude_if_failed`` for
  the node agent.
* :mod:`diagnostics.cli` -- the ``diag`` command.
"""
