"""What stands between the network and the routes: API keys, rate limits, load shedding, the
body-size limit, and the last-resort handler that keeps every failure in the API's shape."""
