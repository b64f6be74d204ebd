"""guard_trio: the imperative shell of inference-guard on trio and h11."""

__all__ = ("__version__",)

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("inference-guard")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
