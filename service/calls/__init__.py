"""The domain: programs, executables, futures, and the calls that make them.

``Calls`` is the entry the routes use; ``FutureStore``, ``ProgramStore`` and
``Executor`` hold what a call leaves behind. Tenancy (``tenants``, ``quotas``,
``scheduler``), batching, draining and warming live beside them. Nothing here
knows HTTP.
"""
