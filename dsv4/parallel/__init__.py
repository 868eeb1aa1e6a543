"""Parallelism over torch.distributed, applied as passes over a built model (see README: "Serving across
devices"): expert parallelism shared by training and serving (`expert`), and the serving layer the engine
runs on N worker processes (`serving`, `workers`)."""
