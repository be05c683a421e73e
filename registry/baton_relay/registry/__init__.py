"""Baton's registry: the stateless gRPC server that owns the entry state machine in etcd."""

from .config import RegistryConfig, load_config
from .server import Running, start

__all__ = ["RegistryConfig", "Running", "load_config", "start"]
