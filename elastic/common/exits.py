"""Exit codes that carry meaning between workers, agents and the launcher (no heavy imports)."""

EXIT_FAILURE = 1
"""A node gave up (restart budget spent, the run was stopped, etcd unreachable); the summary says why."""
EXIT_CONFIG = 2
"""A worker that cannot run this config (a config error, another config's checkpoint in the run dir):
restarting cannot help, so its agent stops the run with the worker's line."""
EXIT_RECOVERY_FAILED = 86
"""A worker leaves with this code when in-process recovery cannot continue (the agent restarts the epoch)."""
EXIT_NUMERICS = 87
"""A worker that stops because of bad numerics (NaN/Inf, loss spike), after reporting it: roll back."""
EXIT_CHECKPOINT = 88
"""Checkpoint saves kept failing (checkpoint.max_consecutive_failures, on_save_failure: stop): the worker's
code, and the launcher's when the run was stopped for it."""
EXIT_SCREEN_FAILED = 92
"""The node failed the screen its first worker ran: it leaves before its first step, the agent excludes it."""
EXIT_EXCLUDED = 93
"""Do not requeue: the node is on the run's exclusion list."""

RUN_STOP_CODES = {"checkpoint": EXIT_CHECKPOINT}
"""Failure kinds whose stop of the run the launcher exits with a code of its own instead of
EXIT_FAILURE, so that a script can tell a full disk from a spent restart budget."""
