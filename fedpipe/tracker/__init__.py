"""fedpipe.tracker: the swarm's control plane, in three layers (no torch).

- :mod:`.service`: the gRPC servicer; each RPC decodes, calls the domain and
  maps its :mod:`.errors` to status codes (:mod:`.status`, one table).
- the domain, one concern a module, assembled in one order by
  :class:`~.scheduler.Tracker` (which also runs the background loops):
  :mod:`.registry` (nodes: versions, addresses, incarnations, leases),
  :mod:`.links` (link measurement), :mod:`.jobs` (a job's states, the table of
  allowed moves and the one function that moves a job), :mod:`.deploy`
  (planning and loading stages), :mod:`.progress` (the nodes' reports: steps,
  checkpoints, a stage done or failed), :mod:`.recovery` (nodes lost, new
  epochs, the client's absence), :mod:`.rebalance` (drains, joins, slow nodes:
  hand-overs weighed by :mod:`.migration`), :mod:`.replica_groups` (elastic
  replica groups over :mod:`.replicas`), :mod:`.retention` (what nodes keep),
  :mod:`.clients` (client leases), :mod:`.admission` (who may submit what);
  per-job memory in :mod:`.specs`, :mod:`.tallies` and :mod:`.stagetimes`;
  :mod:`.nodes` (the calls made to nodes, behind a protocol).
- :mod:`.store`: the state behind the :class:`~.store.Store` interface
  (SQLite, or in memory).
"""
