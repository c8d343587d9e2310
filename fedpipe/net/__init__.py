"""fedpipe.net."""
