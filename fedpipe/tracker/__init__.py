"""fedpipe.tracker: the swarm's control plane, in three layers (no torch).

- :mod:`.service`: the gRPC servicer; each RPC decodes, calls the domain and
  maps its :mod:`.errors` to status codes.
- the domain: :mod:`.registry` (nodes: versions, addresses, incarnations,
  leases), :mod:`.jobs` (the job life cycle), :mod:`.links` (link
  measurement), :mod:`.scheduler` (:class:`~.scheduler.Tracker`, which
  assembles them and runs the background loops), :mod:`.nodes` (the calls
  made to nodes, behind a protocol).
- :mod:`.store`: the state behind the :class:`~.store.Store` interface
  (SQLite, or in memory).
"""
