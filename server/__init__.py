"""pagedserve's OpenAI-compatible HTTP server."""
from importlib.metadata import PackageNotFoundError, version as _dist_version

try:
    __version__ = _dist_version("pagedserve")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.1.0"

__all__ = ["__version__", "create_app"]


def __getattr__(name):  # fastapi loads only when the app is asked for
    if name == "create_app":
        from server.app import create_app
        return create_app
    raise AttributeError(name)
