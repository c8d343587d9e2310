"""fedpipe.security."""
