"""The ``torchrun.handlers`` entry points: ``etcd3`` (the barrier handler) and ``etcd3-state``.

Kept apart from the handler modules on purpose: torch loads entry points while its
rendezvous package is being imported, so the module it loads must not import that package
at import time (it would see itself half-initialised).
"""

from __future__ import annotations


def _create_barrier(params):
    from elastic.rendezvous.barrier import create_barrier_handler

    return create_barrier_handler(params)


def _create_state(params):
    from elastic.rendezvous.backend import create_etcd3_handler

    return create_etcd3_handler(params)


def handler_factory():
    """``etcd3``: torchrun calls this zero-argument factory and registers the returned creator."""
    return _create_barrier


def state_handler_factory():
    """``etcd3-state``: torch's DynamicRendezvousHandler over one etcd key (small runs)."""
    return _create_state
