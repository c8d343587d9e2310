"""fedpipe.client."""
