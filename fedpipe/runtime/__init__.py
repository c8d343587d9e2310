"""fedpipe.runtime."""
