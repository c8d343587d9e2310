"""Training runtime: schedules, the stage loop, optimizer specs."""
