"""Where the model runs on a mesh: the mesh and its rules tables (`sharding`), the
layouts, expert-parallel dispatchers, pipeline stages (and interleaved 1F1B in
lockstep), context parallelism, and ddp's gradient reduction into ZeRO-1 shards."""
