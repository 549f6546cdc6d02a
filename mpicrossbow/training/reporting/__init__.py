"""What a run tells: rank 0's console and metrics.h5, TensorBoard, the timeline, and the run's result."""
