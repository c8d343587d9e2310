"""fedpipe.node."""
