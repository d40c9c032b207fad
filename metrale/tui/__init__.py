"""The terminal dashboard `met serve --tui` shows, drawn from the telemetry event bus."""
