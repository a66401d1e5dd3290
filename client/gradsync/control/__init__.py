"""The worker's session with the coordinator: join, checks, state, collectives, heartbeats."""
