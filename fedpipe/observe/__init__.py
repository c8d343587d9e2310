"""Seeing the swarm: what a person looks at instead of reading logs.

Every view is built from plain data (the protocol's ``NodeInfo``, ``JobInfo``,
``JobEvent`` messages and the planner's dataclasses), so the tracker's HTTP
dashboard, ``fedpipe status``, the plots and the Prometheus metrics all show
the same figures, computed in one place:

- :mod:`~fedpipe.observe.source`: the narrow read-only interface the views need
  (the tracker's store satisfies it; :class:`~fedpipe.observe.source.GrpcSource`
  reads a remote tracker);
- :mod:`~fedpipe.observe.views`: step records, plan layouts and the JSON-shaped
  dicts of the HTTP API (no torch, no I/O);
- :mod:`~fedpipe.observe.metrics`: every Prometheus metric, defined once;
- :mod:`~fedpipe.observe.status`: ``rich`` renderings for the terminal;
- :mod:`~fedpipe.observe.plots`: matplotlib pictures (loss and throughput
  curves, a plan);
- :mod:`~fedpipe.observe.browser`: a headless chromium, for tests and screenshots.

The tracker may import :mod:`source`, :mod:`views` and :mod:`metrics`: none of
them imports torch.
"""
