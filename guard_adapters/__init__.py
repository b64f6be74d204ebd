"""guard_adapters: the edges between the outside world's formats and guard_core's values.

Sans-IO where possible: parsers and builders take and return bytes, text and values; transports
are parameters supplied by the runtime (guard_trio). Nothing here reads the clock.
"""

__all__ = ()
