"""What a running server tells about itself: typed events, their bus, the Prometheus metrics."""
