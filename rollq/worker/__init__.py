"""The worker process: consume loop (`loop.Worker`) and its heartbeat."""
