"""Where the model runs on a mesh: the mesh and its rules tables (`sharding`), the
layouts, expert-parallel dispatchers, pipeline stages, context parallelism, and ddp's
gradient reduction into ZeRO-1 shards."""
