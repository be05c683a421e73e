"""The edge: the gRPC services and the session stream, interceptors, health, metrics,
TLS, settings and startup. Imports everything below it."""
