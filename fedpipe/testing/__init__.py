"""fedpipe.testing."""
