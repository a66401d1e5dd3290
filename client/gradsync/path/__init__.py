"""The gradient path: buckets, their uploads (direct or sharded) and the averages coming back."""
