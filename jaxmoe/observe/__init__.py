"""What a run reports while it trains: the log and progress line, metric sinks
(TensorBoard, W&B), throughput and MFU, the gerrymandering checks, plots."""
