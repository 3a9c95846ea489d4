"""HTTP and websocket transport (filled by the service issue)."""
