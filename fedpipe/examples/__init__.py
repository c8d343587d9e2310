"""fedpipe.examples."""
