"""Chaos testing for the elastic runtime: inject faults into real local runs and check invariants.

* :mod:`chaos.injectors`: the fault catalogue (one registered class per fault kind);
* :mod:`chaos.plan`: fault plans in YAML, explicit or seeded-random (MTBF);
* :mod:`chaos.runner`: runs ``elastic-launch`` and fires a plan into it;
* :mod:`chaos.analysis`: invariants and recovery metrics from a run directory;
* :mod:`chaos.suite`: the standard suite (baseline + one scenario per fault kind);
* :mod:`chaos.report`: JSON, PNG timeline, terminal table;
* :mod:`chaos.cli`: the ``chaos`` command (``run``, ``suite``, ``list``).
"""
