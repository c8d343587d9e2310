"""fedpipe.tracker."""
