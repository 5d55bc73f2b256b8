"""Where the model runs on a mesh: the layouts, expert-parallel dispatchers, pipeline
stages, and ddp's gradient reduction into ZeRO-1 shards."""
