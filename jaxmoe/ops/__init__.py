"""Low-level numerics under the model: microscaling (MX) formats, and which mesh axes
a value varies over inside `shard_map`."""
