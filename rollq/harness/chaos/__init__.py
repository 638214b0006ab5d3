"""`rollq chaos`: the runners (`run` for the queue, `weights`, `episodes`), the trainer processes
they kill and restart, and the checkers that count what came back."""
