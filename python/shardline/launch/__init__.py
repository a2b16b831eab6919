"""``shardline run``: the launcher, its node agent for elastic jobs, and the worker processes.

- ``config``: what a launch is (``LaunchConfig``), the job's secret, each worker's environment.
- ``launcher``: ``launch(config)``: one node's workers, watched, restarted, stopped together.
- ``agent``: one node of an elastic job (``--nnodes MIN:MAX``).
- ``workers``: one attempt: start, watch and stop a node's worker processes.
"""

from __future__ import annotations

from shardline.launch.config import (
    DEFAULT_GRACE_PERIOD_S,
    LaunchConfig,
    free_port,
    resolve_secret,
    worker_env,
)
from shardline.launch.launcher import launch

__all__ = [
    "DEFAULT_GRACE_PERIOD_S",
    "LaunchConfig",
    "free_port",
    "launch",
    "resolve_secret",
    "worker_env",
]
