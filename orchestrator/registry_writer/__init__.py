"""A turn's registry transaction (`FinishRequest`, `write_finish`) and the process that runs it on
SQLite (`RegistryWriter`; worker.py says why)."""

from orchestrator.registry_writer.client import RegistryWriter, RegistryWriterError
from orchestrator.registry_writer.finish import DriverFinish, FinishRequest, write_finish

__all__ = ["DriverFinish", "FinishRequest", "RegistryWriter", "RegistryWriterError", "write_finish"]
